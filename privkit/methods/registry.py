"""The method registry: one entry per method, holding its config model, its metadata and its forms.

A :class:`TrainerSpec` names each form of the method by a dotted path: the single run
(``"privkit.trainers.dpsgd:train_dpsgd"``), the batched form that trains many runs at once
(``"privkit.batched.many_dpsgd:train_dpsgd_runs"``) and the Flower port
(``"privkit.flower_engine.apps:DpFedPort"``). Each is imported only when it is read, so that
listing methods and validating configs never load torch, opacus or Flower; no other table is keyed
by a method's name. A function defined elsewhere (a test's toy trainer, a plug-in) is registered
directly with :func:`register_trainer`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from privkit.errors import PrivkitError
from privkit.methods.base import TrainerConfig

if TYPE_CHECKING:  # pragma: no cover
    from privkit.methods.contract import TrainResult

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
    batched : str or None
        ``"module:function"`` of the method's batched form ``fn(method, federations, configs,
        seeds, fast) -> results`` (:func:`privkit.batched.many.train_many` calls it), or None where
        its runs train one after the other.
    batched_references_only : bool
        Whether the batched form batches an audit's reference runs only, every other run being
        its single run trained alone (FLiP, centralised training): a single run then gains
        nothing from it, and ``privkit train`` keeps the loop
        (:func:`privkit.batched.many.trains_batched_alone`).
    flower : str or None
        ``"module:Class"`` of the method's Flower port (:class:`privkit.flower_engine.apps.Port`),
        or None where the method does not run on the Flower engine.
    """

    name: str
    config_cls: type[TrainerConfig]
    target: str | TrainerFn
    summary: str
    paper: str | None = None
    formal_dp: bool = True
    quick: dict = field(default_factory=dict)
    level: str = "record"
    batched: str | None = None
    batched_references_only: bool = False
    flower: str | None = None

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise PrivkitError(f"level must be one of {', '.join(LEVELS)}; found {self.level!r}")

    @property
    def fn(self) -> TrainerFn:
        """The training function (importing its module, and torch with it, on first use)."""
        if callable(self.target):
            return self.target
        return _load(self.target)

    @property
    def batched_fn(self) -> Callable:
        """The batched form (its module imported on first use); :attr:`batched` must be set."""
        if self.batched is None:
            raise PrivkitError(f"method {self.name} has no batched form; found batched=None")
        return _load(self.batched)

    @property
    def flower_port(self) -> type:
        """The Flower port class (its module imported on first use); :attr:`flower` must be set."""
        if self.flower is None:
            raise PrivkitError(f"method {self.name} does not run on Flower; found flower=None")
        return _load(self.flower)

    def defaults(self) -> dict:
        return self.config_cls().model_dump()

    def quick_config(self) -> dict:
        """Defaults with the ``quick`` overrides: a CPU-sized run (seconds) used by the demo and CI."""
        return self.config_cls.model_validate({**self.defaults(), **self.quick}).model_dump()


def _load(path: str):
    """The object named by ``"package.module:name"`` (importing the module)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


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
    batched: str | None = None,
    batched_references_only: bool = False,
    flower: str | None = None,
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
    batched : str, optional
        ``"module:function"`` of the method's batched form (:attr:`TrainerSpec.batched`).
    batched_references_only : bool
        Whether that form batches an audit's reference runs only
        (:attr:`TrainerSpec.batched_references_only`).
    flower : str, optional
        ``"module:Class"`` of the method's Flower port (:attr:`TrainerSpec.flower`).

    Returns
    -------
    TrainerSpec
        The registered entry.
    """
    if name in REGISTRY:
        raise PrivkitError(f"trainer {name!r} registered twice")
    spec = TrainerSpec(
        name,
        config_cls,
        target,
        summary,
        paper=paper,
        formal_dp=formal_dp,
        quick=dict(quick or {}),
        level=level,
        batched=batched,
        batched_references_only=batched_references_only,
        flower=flower,
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
