"""Run configuration of ``privkit run``: the TOML schema, its validation, and the resolved form.

A config is validated completely (every method's trainer config included) before anything is
written, so a bad value is one line naming the field and the value found.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from privkit.config import Engine, StrictModel, apply_overrides, load_toml
from privkit.data import DATASETS, FederationConfig
from privkit.errors import PrivkitError
from privkit.files import one_line as _one_line

SCHEMA_VERSION = 1
"""Version of the run directory's ``config.resolved.json`` and ``status.json``."""
STAGES = ("train", "account", "audit")
"""The stages run per method, in order (the report is assembled after all methods)."""
ACCOUNTANTS = ("basic", "advanced", "rdp", "pld")
"""The accountants a run config may name (those of :class:`accountants.Ledger`)."""
Accountant = Literal["basic", "advanced", "rdp", "pld"]
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


# the audit layer's executors (attacks.executor.EXECUTORS, a test keeps them equal), named here so
# that options are checked without importing the audit layer
EXECUTORS = ("serial", "process", "ray")


def check_executor(name: str, option: str = "executor") -> None:
    """Refuse an unknown executor, or Ray when it is not installed, before any work starts."""
    from importlib.util import find_spec

    if name not in EXECUTORS:
        raise PrivkitError(f"{option} must be one of {', '.join(EXECUTORS)}; found {name!r}")
    if name == "ray" and find_spec("ray") is None:
        raise PrivkitError(
            f"{option} ray needs Ray, which is not installed; found none "
            '(pip install "privkit-ml[ray]")'
        )


class MethodEntry(StrictModel):
    """One method of a run: a registered trainer, its config overrides, and an optional label."""

    name: str
    label: str | None = None
    quick: bool = False
    seed: int | None = None
    overrides: dict[str, Any] = Field(default_factory=dict)
    engine: Engine | None = Field(
        default=None, description="where this method's federation runs (default: the run's engine)"
    )

    @property
    def key(self) -> str:
        return self.label or self.name


class ControlSettings(StrictModel):
    """Audit controls (:mod:`privkit.audit.controls`): broken twins of a DP-SGD method of the run."""

    enabled: bool = True
    method: str | None = Field(
        default=None,
        description="label of the dpsgd method to twin (default: "
        "the run's first dpsgd method, else dpsgd's own config)",
    )
    black_box_epochs: Annotated[int, Field(ge=1)] = 20
    canaries: Annotated[int, Field(ge=10)] = 1000


class MechanismControlSettings(StrictModel):
    """Mechanism controls (:func:`privkit.audit.mechanism_audit.audit_mechanisms`): every method of
    the run with a formal guarantee is trained twice more with white-box probes at its DP mechanisms,
    as it is accounted (the correct twin) and with half its noise (the noise-halved twin)."""

    enabled: bool = True
    canaries: Annotated[int, Field(ge=10)] = Field(
        default=1000, description="canaries per probe set"
    )
    clients: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] = Field(
        default_factory=lambda: [0], description="the clients whose mechanisms take probes"
    )
    confidence: Annotated[float, Field(gt=0, lt=1)] = Field(
        default=0.95,
        description="family-wise confidence of each method's verdict (Bonferroni over "
        "its probe sets)",
    )


class AuditSettings(StrictModel):
    """Membership/attribute-inference audits run on every method's released model(s).

    Unset options take the audit layer's defaults (``privkit.audit.audit_run``).
    """

    enabled: bool = True
    controls: ControlSettings = Field(default_factory=ControlSettings)
    mechanism_controls: MechanismControlSettings = Field(default_factory=MechanismControlSettings)
    attacks: list[str] | None = None
    shadows: Annotated[int, Field(ge=2)] = 8
    executor: Literal[EXECUTORS] = "serial"  # type: ignore[valid-type]  # the names in the tuple
    workers: Annotated[int, Field(ge=1)] | None = None
    seed: int | None = None
    n_audit: Annotated[int, Field(ge=10)] | None = None
    alpha: Annotated[float, Field(gt=0, lt=1)] | None = None
    shadow_iterations: Annotated[int, Field(ge=1)] | None = None

    @field_validator("shadows")
    @classmethod
    def _even(cls, v: int) -> int:
        # each audited record is IN for exactly half of the shadow runs
        if v % 2:
            raise ValueError(f"shadows must be an even number >= 2; found {v}")
        return v

    def options(self) -> dict[str, Any]:
        """Keyword options for ``privkit.audit.audit_run`` that this config sets."""
        keys = ("workers", "n_audit", "alpha", "shadow_iterations")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


class ReportSettings(StrictModel):
    """``[report]`` of a run config: the title, what was scaled down, the formats written."""

    title: str = "privkit privacy report"
    reduced: list[str] = Field(
        default_factory=list, description="what this config scales down from the papers"
    )
    formats: list[Literal["json", "html", "md"]] = Field(
        default_factory=lambda: ["json", "html", "md"]  # type: ignore[arg-type]  # the Literals
    )


class RunConfig(StrictModel):
    """A pipeline run (the TOML file)."""

    name: str
    seed: int = 0
    delta: Annotated[float, Field(gt=0, lt=1)] = 1e-5
    accountant: Literal["best", "basic", "advanced", "rdp", "pld"] = "best"
    accountants: Annotated[list[Accountant], Field(min_length=1)] = Field(
        default_factory=lambda: list(ACCOUNTANTS),  # type: ignore[arg-type]  # the Literals
        description="computed per client",
    )
    pld_grid: Annotated[float, Field(gt=0, le=0.1)] | None = Field(
        default=None, description="PLD value discretisation (default: the accountant's 1e-4)"
    )
    curve_accountant: Accountant = "rdp"
    workers: Annotated[int, Field(ge=1)] = Field(
        default=1, description="methods run in parallel in this many local processes"
    )
    reproducible_noise: bool = Field(
        default=False,
        description="derive every method's DP noise from its seed (stamped 'not for release')",
    )
    engine: Engine = Field(
        default="inprocess",
        description="where the federated methods run: privkit's "
        "in-process federation or Flower's simulation engine (privkit.flower_engine.engine)",
    )
    federation: FederationConfig = Field(default_factory=FederationConfig)
    methods: Annotated[list[MethodEntry], Field(min_length=1)]
    audit: AuditSettings = Field(default_factory=AuditSettings)
    report: ReportSettings = Field(default_factory=ReportSettings)

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"name must be letters, digits, '.', '_' or '-'; found {v!r}")
        return v

    @model_validator(mode="after")
    def _unique_keys(self) -> RunConfig:
        keys = [m.key for m in self.methods]
        dup = sorted({k for k in keys if keys.count(k) > 1})
        if dup:
            raise ValueError(
                f"methods must have unique names (set `label` to run one method twice); "
                f"found duplicates {dup}"
            )
        for k in keys:
            if not _NAME.match(k):
                raise ValueError(
                    f"method label must be letters, digits, '.', '_' or '-'; found {k!r}"
                )
        return self


@dataclass
class ResolvedMethod:
    """A method entry with its full, validated trainer config.

    Parameters
    ----------
    key : str
        The entry's name in the run (its label, else its method name); its subdirectory of the run.
    method : str
        The registered method that trains it.
    seed : int
        The entry's seed (its own, else the run's).
    quick : bool
        Whether the trainer config starts from the method's CPU-sized ``quick`` settings.
    overrides : dict
        The trainer config keys the run config sets, as given.
    trainer : dict
        The full, validated trainer config (JSON-able).
    summary : str
        The method's one-line summary (from the registry).
    paper : str or None
        The method's paper, where it has one.
    formal_dp : bool
        Whether the method has a formal (epsilon, delta) guarantee.
    level : str
        What its per-client epsilon protects: ``"record"`` (one record) or ``"client"`` (the
        client's whole data), from the registry.
    engine : str
        Where its federation runs: ``"inprocess"`` or ``"flower"``.
    """

    key: str
    method: str
    seed: int
    quick: bool
    overrides: dict
    trainer: dict
    summary: str = ""
    paper: str | None = None
    formal_dp: bool = True
    level: str = "record"
    engine: str = "inprocess"

    def to_dict(self) -> dict:
        return {
            "key": self.key,
            "method": self.method,
            "seed": self.seed,
            "quick": self.quick,
            "overrides": self.overrides,
            "trainer": self.trainer,
            "summary": self.summary,
            "paper": self.paper,
            "formal_dp": self.formal_dp,
            "level": self.level,
            "engine": self.engine,
        }


@dataclass
class ResolvedRun:
    """A validated run config with every method's full trainer config resolved.

    Parameters
    ----------
    config : RunConfig
        The validated run config.
    methods : list of ResolvedMethod
        Each method entry, resolved, in the config's order.
    source : str or None
        Where the config was read from (a file path), if anywhere.
    overrides : list of str
        The ``key=value`` overrides applied to the config, in order.
    """

    config: RunConfig
    methods: list[ResolvedMethod]
    source: str | None = None
    overrides: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "source": self.source,
            "overrides": self.overrides,
            **self.config.model_dump(mode="json"),
            "resolved_methods": [m.to_dict() for m in self.methods],
        }


def resolve_config(
    data: dict, *, source: str | None = None, overrides: list[str] | None = None
) -> ResolvedRun:
    """Validate a run config completely (every method's trainer config included).

    Raises
    ------
    PrivkitError
        One line naming the bad field and the value found; nothing has been written yet.

    Parameters
    ----------
    data : dict
        The run config as read from its TOML file.
    source : str, optional
        Where ``data`` was read from; recorded in the result.
    overrides : list of str, optional
        ``dotted.key=value`` overrides applied to ``data`` before validation.

    Returns
    -------
    ResolvedRun
    """
    from privkit.flower_engine.engine import (
        check_engine,  # Flower-free: the name and the extra only
    )
    from privkit.methods import get_trainer, make_config  # torch-free: refusing a value stays fast

    overrides = list(overrides or [])
    data = apply_overrides(data, overrides)
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as exc:
        raise PrivkitError(f"invalid run config: {_one_line(exc)}") from None
    _check_dataset(cfg.federation)
    methods = []
    for i, entry in enumerate(cfg.methods):
        spec = get_trainer(entry.name)  # unknown method: error listing the registered ones
        engine = entry.engine or cfg.engine
        check_engine(engine, entry.name)
        base = spec.quick_config() if entry.quick else spec.defaults()
        try:
            noise = (
                {"reproducible_noise": True} if cfg.reproducible_noise else {}
            )  # default: release mode
            trainer = make_config(entry.name, {**base, **entry.overrides, **noise}).model_dump(
                mode="json"
            )
        except ValidationError as exc:
            raise PrivkitError(
                f"invalid run config: methods[{i}] ({entry.key}) trainer config: {_one_line(exc)}"
            ) from None
        methods.append(
            ResolvedMethod(
                key=entry.key,
                method=entry.name,
                seed=cfg.seed if entry.seed is None else entry.seed,
                quick=entry.quick,
                overrides=dict(entry.overrides),
                trainer=trainer,
                summary=spec.summary,
                paper=spec.paper,
                formal_dp=spec.formal_dp,
                level=spec.level,
                engine=engine,
            )
        )
    _check_attacks(cfg.audit)
    if cfg.audit.enabled:
        check_executor(cfg.audit.executor, "audit.executor")
    want = cfg.audit.controls.method
    if want is not None and want not in {m.key for m in methods if m.method == "dpsgd"}:
        raise PrivkitError(
            f"audit.controls.method must be the label of a dpsgd method of the run; found {want!r}"
        )
    _check_probed_clients(cfg)
    return ResolvedRun(config=cfg, methods=methods, source=source, overrides=overrides)


def _check_dataset(fed: FederationConfig) -> None:
    for field_name in ("dataset", "public_dataset"):
        name = getattr(fed, field_name)
        if name is None or name in DATASETS:
            continue
        if name.endswith(".npz"):
            if not Path(name).expanduser().is_file():
                raise PrivkitError(f"federation.{field_name}: file not found; found {name!r}")
            continue
        raise PrivkitError(
            f"federation.{field_name} must be one of {', '.join(sorted(DATASETS))} "
            f"or a path to a .npz file; found {name!r}"
        )


def _check_probed_clients(cfg: RunConfig) -> None:
    """The probed clients must be clients of the federation (ids 0 .. clients - 1)."""
    clients = cfg.audit.mechanism_controls.clients
    bad = [c for c in clients if c >= cfg.federation.clients]
    if bad and cfg.audit.enabled and cfg.audit.mechanism_controls.enabled:
        raise PrivkitError(
            f"audit.mechanism_controls.clients must be client ids below "
            f"federation.clients = {cfg.federation.clients}; found {bad}"
        )


def _check_attacks(audit: AuditSettings) -> None:
    """Attack names are checked against the run audit's registry (:data:`privkit.audit.ATTACKS`)."""
    if not audit.enabled or audit.attacks is None:
        return
    from privkit.audit.names import ATTACKS  # names only: the audit layer loads when it runs

    known = set(ATTACKS)
    bad = [a for a in audit.attacks if a not in known]
    if bad:
        raise PrivkitError(f"audit.attacks must be among {', '.join(sorted(known))}; found {bad}")


def load_run_config(path: str | Path, overrides: list[str] | None = None) -> ResolvedRun:
    """Read and fully validate a run config TOML file (with ``--set`` overrides)."""
    return resolve_config(load_toml(path), source=str(path), overrides=overrides)


def bundled_config(name: str) -> Path:
    """Path of a config shipped with privkit (``quickstart`` or ``full``)."""
    path = Path(__file__).parent.parent / "configs" / f"{name}.toml"
    if not path.is_file():
        raise PrivkitError(f"bundled config must be quickstart or full; found {name!r}")
    return path
