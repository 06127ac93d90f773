"""The method registry: each name maps to its config model, its metadata and where its trainer lives.

A :class:`TrainerSpec` names its training function by a dotted path
(``"privkit.trainers.dpsgd:train_dpsgd"``) and imports it only when :attr:`TrainerSpec.fn` is read,
so that listing methods and validating configs never load torch or opacus. A function defined
elsewhere (a test's toy trainer, a plug-in) is registered directly with :func:`register_trainer`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from privkit.errors import PrivkitError
from privkit.methods.base import TrainerConfig

if TYPE_CHECKING:  # pragma: no cover
    from privkit.trainers.base import TrainResult

TrainerFn = Callable[..., "TrainResult"]


@dataclass(frozen=True)
class TrainerSpec:
    """A registered method: its config model, its trainer, and what it promises.

    ``target`` is the trainer ``fn(federation, config, seed, progress=False) -> TrainResult`` itself
    or its dotted path ``"package.module:function"``; ``quick`` holds config overrides for a
    CPU-sized run on the embedded data (the demo and CI use it).

    Parameters
    ----------
    name : str
        The method's registry name (``"dp-fedavg"``).
    config_cls : type[TrainerConfig]
        The method's config model.
    target : str or callable
        The trainer ``fn(federation, config, seed, progress=False) -> TrainResult``, or its dotted
        path ``"package.module:function"`` (imported on first use).

    summary : str
        One line saying what the method does (``privkit train --list`` prints it).
    paper : str or None
        The paper the method comes from, where there is one.
    formal_dp : bool
        Whether the method has a formal (epsilon, delta) guarantee, i.e. its ledger bounds its epsilon.
    quick : dict
        Config overrides for a CPU-sized run on the embedded data (the demo and CI use them).
    level : {"record", "client"}
        What one unit of the ledger's per-client epsilon protects: ``"record"`` (one record of
        that client: record-level DP, every method but ``dp-fedavg-client``) or ``"client"`` (that
        client's whole data: client-level, user-level DP).
    """

    name: str
    config_cls: type[TrainerConfig]
    target: str | TrainerFn
    summary: str
    paper: str | None = None
    formal_dp: bool = True
    quick: dict = field(default_factory=dict)
    level: str = "record"

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise PrivkitError(f"level must be one of {', '.join(LEVELS)}; found {self.level!r}")

    @property
    def fn(self) -> TrainerFn:
        """The training function (importing its module, and torch with it, on first use)."""
        if callable(self.target):
            return self.target
        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)

    def defaults(self) -> dict:
        return self.config_cls().model_dump()

    def quick_config(self) -> dict:
        """Defaults with the ``quick`` overrides: a CPU-sized run (seconds) used by the demo and CI."""
        return self.config_cls.model_validate({**self.defaults(), **self.quick}).model_dump()


LEVELS = ("record", "client")
"""The units a method's per-client epsilon can protect (:attr:`TrainerSpec.level`)."""

REGISTRY: dict[str, TrainerSpec] = {}
"""Every registered method by name (``privkit train --list`` prints it)."""


def declare(
    name: str,
    config_cls: type[TrainerConfig],
    target: str | TrainerFn,
    summary: str,
    *,
    paper: str | None = None,
    formal_dp: bool = True,
    quick: dict | None = None,
    level: str = "record",
) -> TrainerSpec:
    """Register method ``name``; ``target`` is its trainer or the trainer's ``"module:function"``.

    Parameters
    ----------
    name : str
        The method's registry name; registering a name twice is an error.
    config_cls : type[TrainerConfig]
        The method's config model.
    target : str or callable
        The trainer itself or its ``"package.module:function"`` path.
    summary : str
        One line saying what the method does (``privkit train --list`` prints it).
    paper : str or None
        The paper the method comes from, where there is one.
    formal_dp : bool
        Whether the method has a formal (epsilon, delta) guarantee, i.e. its ledger bounds its epsilon.
    quick : dict, optional
        Config overrides for a CPU-sized run on the embedded data (the demo and CI use them).
    level : {"record", "client"}
        What the ledger's per-client epsilon protects: one record or the client's whole data.

    Returns
    -------
    TrainerSpec
        The registered entry.
    """
    if name in REGISTRY:
        raise PrivkitError(f"trainer {name!r} registered twice")
    spec = TrainerSpec(
        name, config_cls, target, summary, paper, formal_dp, dict(quick or {}), level
    )
    REGISTRY[name] = spec
    return REGISTRY[name]


def register_trainer(
    name: str,
    config_cls: type[TrainerConfig],
    summary: str,
    *,
    paper: str | None = None,
    formal_dp: bool = True,
    quick: dict | None = None,
    level: str = "record",
) -> Callable[[TrainerFn], TrainerFn]:
    """Decorator registering ``fn(federation, config, seed, progress=False) -> TrainResult`` as is.

    Parameters
    ----------
    name : str
        The method's registry name; registering a name twice is an error.
    config_cls : type[TrainerConfig]
        The method's config model.
    summary : str
        One line saying what the method does (``privkit train --list`` prints it).
    paper : str or None
        The paper the method comes from, where there is one.
    formal_dp : bool
        Whether the method has a formal (epsilon, delta) guarantee, i.e. its ledger bounds its epsilon.
    quick : dict, optional
        Config overrides for a CPU-sized run on the embedded data (the demo and CI use them).
    level : {"record", "client"}
        What the ledger's per-client epsilon protects: one record or the client's whole data.

    Returns
    -------
    callable
        The decorator; it returns the decorated function unchanged.
    """

    def deco(fn: TrainerFn) -> TrainerFn:
        declare(
            name,
            config_cls,
            fn,
            summary,
            paper=paper,
            formal_dp=formal_dp,
            quick=quick,
            level=level,
        )
        return fn

    return deco
