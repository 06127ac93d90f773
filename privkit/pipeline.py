"""One-command pipeline: train -> account -> audit -> report, for every method of a run config.

``privkit run CONFIG.toml`` writes ``<out>/<name>/``::

    config.resolved.json   the validated config, every method's full trainer config
    federation.json        the split shared by every method and every audit
    dataset.json           its summary (sizes, client x class counts)
    status.json            per method and stage: done / failed (with the error) / skipped
    <method>/              a run directory (config.json, federation.json, checkpoints, ledger.json,
                           metrics.json, train.json, privacy.json, audit.json)
    report.json / report.html / report.md

Every stage is keyed by a hash of what it depends on (method, trainer config, seed, federation;
plus delta/accountant for accounting and the audit settings for audits). Re-running skips stages
that are complete for the same hash, so an interrupted run resumes where it stopped. A failing
stage is recorded with its error and the other methods go on. Files are written atomically (a
method's training output goes to a staging folder renamed into place), so nothing completed
earlier is lost or left half-written.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from typing_extensions import Annotated

from privkit.config import StrictModel, apply_overrides, load_toml
from privkit.data import DATASETS, FederationConfig
from privkit.errors import PrivkitError
from privkit.jsonutil import json_default

SCHEMA_VERSION = 1
STAGES = ("train", "account", "audit")
ACCOUNTANTS = ("basic", "advanced", "rdp", "pld")
Accountant = Literal["basic", "advanced", "rdp", "pld"]
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


# ---------------------------------------------------------------------------------- config
class MethodEntry(StrictModel):
    """One method of a run: a registered trainer, its config overrides, and an optional label."""

    name: str
    label: str | None = None
    quick: bool = False
    seed: int | None = None
    overrides: dict[str, Any] = Field(default_factory=dict)

    @property
    def key(self) -> str:
        return self.label or self.name


class AuditSettings(StrictModel):
    """Membership/attribute-inference audits run on every method's released model(s).

    Unset options take the audit layer's defaults (``attacks.audit_run``).
    """

    enabled: bool = True
    attacks: list[str] | None = None
    shadows: Annotated[int, Field(ge=2)] = 8
    executor: Literal["serial", "process", "ray"] = "serial"
    workers: Annotated[int, Field(ge=1)] | None = None
    seed: int | None = None
    n_audit: Annotated[int, Field(ge=10)] | None = None
    alpha: Annotated[float, Field(gt=0, lt=1)] | None = None
    shadow_iterations: Annotated[int, Field(ge=1)] | None = None
    canaries: Annotated[int, Field(ge=2)] | None = None

    @field_validator("shadows")
    @classmethod
    def _even(cls, v: int) -> int:
        # each audited record is IN for exactly half of the shadow runs
        if v % 2:
            raise ValueError(f"shadows must be an even number >= 2; found {v}")
        return v

    def options(self) -> dict[str, Any]:
        """Keyword options for ``attacks.audit_run`` that this config sets."""
        keys = ("workers", "n_audit", "alpha", "shadow_iterations", "canaries")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


class ReportSettings(StrictModel):
    title: str = "privkit privacy report"
    reduced: list[str] = Field(default_factory=list,
                               description="what this config scales down from the papers")
    formats: list[Literal["json", "html", "md"]] = Field(default_factory=lambda: ["json", "html", "md"])


class RunConfig(StrictModel):
    """A pipeline run (the TOML file)."""

    name: str
    seed: int = 0
    delta: Annotated[float, Field(gt=0, lt=1)] = 1e-5
    accountant: Literal["best", "basic", "advanced", "rdp", "pld"] = "best"
    accountants: Annotated[list[Accountant], Field(min_length=1)] = Field(
        default_factory=lambda: list(ACCOUNTANTS), description="computed per client")
    pld_grid: Annotated[float, Field(gt=0, le=0.1)] | None = Field(
        default=None, description="PLD value discretisation (default: the accountant's 1e-4)")
    curve_accountant: Accountant = "rdp"
    workers: Annotated[int, Field(ge=1)] = Field(
        default=1, description="methods run in parallel in this many local processes")
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
    def _unique_keys(self) -> "RunConfig":
        keys = [m.key for m in self.methods]
        dup = sorted({k for k in keys if keys.count(k) > 1})
        if dup:
            raise ValueError(f"methods must have unique names (set `label` to run one method twice); "
                             f"found duplicates {dup}")
        for k in keys:
            if not _NAME.match(k):
                raise ValueError(f"method label must be letters, digits, '.', '_' or '-'; found {k!r}")
        return self


@dataclass
class ResolvedMethod:
    """A method entry with its full, validated trainer config."""

    key: str
    method: str
    seed: int
    quick: bool
    overrides: dict
    trainer: dict
    summary: str = ""
    paper: str | None = None
    formal_dp: bool = True

    def to_dict(self) -> dict:
        return {"key": self.key, "method": self.method, "seed": self.seed, "quick": self.quick,
                "overrides": self.overrides, "trainer": self.trainer, "summary": self.summary,
                "paper": self.paper, "formal_dp": self.formal_dp}


@dataclass
class ResolvedRun:
    config: RunConfig
    methods: list[ResolvedMethod]
    source: str | None = None
    overrides: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, "source": self.source, "overrides": self.overrides,
                **self.config.model_dump(mode="json"),
                "resolved_methods": [m.to_dict() for m in self.methods]}


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, ValidationError):
        parts = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "config"
            parts.append(f"{loc}: {err['msg']} (found {err.get('input')!r})")
        return "; ".join(parts)
    return " ".join(str(exc).split()) or type(exc).__name__


def resolve_config(data: dict, *, source: str | None = None,
                   overrides: list[str] | None = None) -> ResolvedRun:
    """Validate a run config completely (every method's trainer config included).

    Raises
    ------
    PrivkitError
        One line naming the bad field and the value found; nothing has been written yet.
    """
    from privkit.trainers import get_trainer, make_config

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
        base = spec.quick_config() if entry.quick else spec.defaults()
        try:
            trainer = make_config(entry.name, {**base, **entry.overrides}).model_dump(mode="json")
        except ValidationError as exc:
            raise PrivkitError(f"invalid run config: methods[{i}] ({entry.key}) trainer config: "
                               f"{_one_line(exc)}") from None
        methods.append(ResolvedMethod(key=entry.key, method=entry.name,
                                      seed=cfg.seed if entry.seed is None else entry.seed,
                                      quick=entry.quick, overrides=dict(entry.overrides),
                                      trainer=trainer, summary=spec.summary, paper=spec.paper,
                                      formal_dp=spec.formal_dp))
    _check_attacks(cfg.audit)
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
        raise PrivkitError(f"federation.{field_name} must be one of {', '.join(sorted(DATASETS))} "
                           f"or a path to a .npz file; found {name!r}")


def _check_attacks(audit: AuditSettings) -> None:
    """Attack names are checked against the audit layer's registry, when it exposes one."""
    if not audit.enabled or audit.attacks is None:
        return
    try:
        import attacks
    except ImportError:  # pragma: no cover - attacks ships in this distribution
        return
    known = getattr(attacks, "ATTACKS", None) or getattr(attacks, "MEMBERSHIP_ATTACKS", None)
    if not known:
        return
    known = set(known) | set(getattr(attacks, "ATTRIBUTE_ATTACKS", ()) or ())
    bad = [a for a in audit.attacks if a not in known]
    if bad:
        raise PrivkitError(f"audit.attacks must be among {', '.join(sorted(known))}; found {bad}")


def load_run_config(path: str | Path, overrides: list[str] | None = None) -> ResolvedRun:
    """Read and fully validate a run config TOML file (with ``--set`` overrides)."""
    return resolve_config(load_toml(path), source=str(path), overrides=overrides)


# ---------------------------------------------------------------------------------- hashing
def _hash(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def stage_hashes(run: ResolvedRun, m: ResolvedMethod) -> dict[str, str]:
    """What each stage of ``m`` depends on; a changed hash re-runs that stage (and later ones)."""
    cfg = run.config
    train = _hash({"method": m.method, "trainer": m.trainer, "seed": m.seed,
                   "federation": cfg.federation.model_dump(mode="json")})
    account = _hash({"train": train, "delta": cfg.delta, "accountant": cfg.accountant,
                     "accountants": cfg.accountants, "pld_grid": cfg.pld_grid,
                     "curve": cfg.curve_accountant})
    audit = _hash({"train": train, "delta": cfg.delta, "attacks": cfg.audit.attacks,
                   "shadows": cfg.audit.shadows, "options": {
                       k: v for k, v in cfg.audit.options().items() if k != "workers"},
                   "seed": cfg.seed if cfg.audit.seed is None else cfg.audit.seed,
                   "enabled": cfg.audit.enabled})
    return {"train": train, "account": account, "audit": audit}


# ---------------------------------------------------------------------------------- files
def atomic_write_json(path: Path, obj: Any) -> Path:
    """Write JSON through a temporary file and a rename (never a half-written file)."""
    from reports import atomic_write_text

    return atomic_write_text(path, json.dumps(obj, indent=2, default=json_default))


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text())


class Status:
    """``status.json``: per method and stage, state + hash + error + seconds (written atomically)."""

    def __init__(self, path: Path, name: str):
        self.path = path
        self.unreadable: str | None = None
        self.data: dict = {"schema_version": SCHEMA_VERSION, "name": name, "methods": {}}
        if path.is_file():
            try:
                old = _read_json(path)
                if old.get("schema_version") == SCHEMA_VERSION:
                    self.data["methods"] = old.get("methods", {})
                    self.data["report"] = old.get("report")
            except (json.JSONDecodeError, OSError) as exc:
                # unreadable: every stage is re-run (earlier files stay on disk); the run says so
                self.unreadable = f"{path} unreadable ({type(exc).__name__}); re-running every stage"

    def stage(self, key: str, stage: str) -> dict:
        return self.data["methods"].get(key, {}).get("stages", {}).get(stage, {})

    def is_done(self, key: str, stage: str, digest: str) -> bool:
        s = self.stage(key, stage)
        return s.get("state") == "done" and s.get("hash") == digest

    def set(self, key: str, method: str, stage: str, state: str, digest: str | None,
            error: str | None = None, seconds: float | None = None) -> None:
        entry = self.data["methods"].setdefault(key, {"method": method, "stages": {}})
        entry["method"] = method
        entry["stages"][stage] = {"state": state, "hash": digest, "error": error,
                                  "seconds": None if seconds is None else round(seconds, 3),
                                  "updated": _now()}
        self.save()

    def save(self) -> None:
        self.data["updated"] = _now()
        atomic_write_json(self.path, self.data)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# ---------------------------------------------------------------------------------- stages
def _train_stage(run: ResolvedRun, m: ResolvedMethod, federation, mdir: Path, progress: bool) -> None:
    """Train into a staging folder, then rename it into place (old results kept until then)."""
    from privkit.trainers import train

    staging = mdir.parent / f".staging-{m.key}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        result = train(m.method, federation, m.trainer, seed=m.seed, progress=progress)
        atomic_write_json(staging / "config.json", {
            "schema_version": SCHEMA_VERSION, "method": m.method, "seed": m.seed,
            "federation": run.config.federation.model_dump(mode="json"), "trainer": m.trainer})
        federation.save(staging / "federation.json")
        result.save(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    old = mdir.parent / f".old-{m.key}"
    shutil.rmtree(old, ignore_errors=True)
    if mdir.exists():
        mdir.rename(old)
    staging.rename(mdir)
    shutil.rmtree(old, ignore_errors=True)


def _claim_from(claims: dict) -> dict | None:
    """The paper's claim, keeping scalar entries only (the full record stays in train.json)."""
    if not claims:
        return None
    out = {k: v for k, v in claims.items()
           if v is None or isinstance(v, (int, float, str, bool))}
    if "epsilon" not in out and out.get("target_epsilon") is not None:
        out["epsilon"] = out["target_epsilon"]
    for k in ("epsilon", "delta"):  # only numbers are comparable with privkit's values
        v = out.get(k)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            out.pop(k, None)
    return out


def account_method(mdir: Path, delta: float, accountant: str = "best",
                   accountants: list[str] | None = None, pld_grid: float | None = None,
                   curve_accountant: str = "rdp") -> dict:
    """Ledger summary of a trained run directory at ``delta`` (what ``privacy.json`` holds).

    Parameters
    ----------
    accountant : headline accountant (``best`` = the minimum over ``accountants``).
    accountants : accountants computed per client (default: basic, advanced, rdp, pld).
    pld_grid : PLD value discretisation interval (coarser is faster and still an upper bound).
    curve_accountant : accountant of the epsilon-over-rounds curve (worst client at the end).
    """
    from accountants import Ledger

    accountants = list(accountants or ACCOUNTANTS)
    ledger = Ledger.load(mdir / "ledger.json")
    if pld_grid is not None:
        ledger.value_discretization_interval = pld_grid
    meta = _read_json(mdir / "train.json")
    summary = ledger.summary(delta, accountants=accountants)
    clients, worst, who = summary["clients"], summary["worst"], summary["worst_client"]
    errors = dict(summary["not_applicable"])
    head = accountant if accountant in worst else "best"
    over_rounds: list[tuple[float, float]] = []
    curve_kind = curve_accountant if curve_accountant in worst else head
    try:
        over_rounds = [(float(r), float(e)) for r, e in ledger.epsilon_over_rounds(
            delta, curve_kind, client=who.get(head))]
    except ValueError as exc:
        errors["epsilon_over_rounds"] = str(exc)
    claim = _claim_from(meta.get("claims") or {})
    at_claim = None
    cd = claim.get("delta") if claim else None
    if isinstance(cd, (int, float)) and 0 < cd < 1:
        try:
            at_claim = (summary if cd == delta else ledger.summary(cd, accountants=accountants))["worst"].get(head)
        except ValueError as exc:
            errors["claim_delta"] = str(exc)
    neighbouring = sorted({r for r in summary["neighbouring"].values() if r})
    return {"schema_version": SCHEMA_VERSION, "delta": delta, "accountant": head,
            "accountants": accountants + ["best"], "pld_grid": ledger.value_discretization_interval,
            "curve_accountant": curve_kind,
            "summary": {"clients": clients, "worst": worst, "worst_client": who},
            "neighbouring": neighbouring, "labels": ledger.labels(),
            "epsilon_over_rounds": over_rounds, "claim": claim,
            "epsilon_at_claim_delta": at_claim, "errors": errors}


def _account_stage(run: ResolvedRun, m: ResolvedMethod, mdir: Path) -> None:
    cfg = run.config
    privacy = account_method(mdir, cfg.delta, cfg.accountant, accountants=cfg.accountants,
                             pld_grid=cfg.pld_grid, curve_accountant=cfg.curve_accountant)
    atomic_write_json(mdir / "privacy.json", privacy)


def _audit_stage(run: ResolvedRun, m: ResolvedMethod, mdir: Path, progress: bool) -> None:
    cfg = run.config
    seed = cfg.seed if cfg.audit.seed is None else cfg.audit.seed
    # bounds and verdict at the report's delta, so they compare with the headline epsilon
    run_audit(mdir, attacks=cfg.audit.attacks, shadows=cfg.audit.shadows,
              executor=cfg.audit.executor, seed=seed, progress=progress, delta=cfg.delta,
              **cfg.audit.options())


def run_audit(run_dir: Path, *, attacks: list[str] | None, shadows: int, executor: str, seed: int,
              progress: bool, **options: Any) -> dict:
    """Call the audit layer (``attacks.audit_run``), which writes ``audit.json``."""
    try:
        from attacks import audit_run
    except ImportError as exc:
        raise PrivkitError(f"the audit layer is not available: {exc}") from exc
    return audit_run(run_dir, attacks=attacks, shadows=shadows, executor=executor, seed=seed,
                     progress=progress, **options)


# ---------------------------------------------------------------------------------- orchestration
Log = Callable[[str], None]


@dataclass
class RunOutcome:
    root: Path
    report: Any
    paths: dict[str, Path]
    failures: list[str]
    seconds: float


def run_pipeline(run: ResolvedRun, out: str | Path = "runs", *, progress: bool = False,
                 log: Log | None = None, command: str | None = None) -> RunOutcome:
    """Run every method of ``run`` (train -> account -> audit) and write the report.

    Stages already complete for the same config are skipped. A failing stage is recorded in
    ``status.json`` and the report; later stages of that method are skipped, other methods go on.
    With ``workers > 1`` methods run in parallel local processes (one torch thread each);
    ``status.json`` is written by this process only.
    """
    from privkit.data import build_federation
    from reports import atomic_write_text, write_report

    say = log or (lambda msg: None)
    t_start = time.perf_counter()
    cfg = run.config
    try:  # part of validation: a missing local dataset is an error before anything is written
        federation = build_federation(cfg.federation)
    except (ValueError, FileNotFoundError) as exc:
        raise PrivkitError(f"federation: {_one_line(exc)}") from exc
    root = Path(out) / cfg.name
    root.mkdir(parents=True, exist_ok=True)
    atomic_write_json(root / "config.resolved.json", run.to_dict())
    atomic_write_text(root / "federation.json", json.dumps(federation.to_dict()))
    atomic_write_json(root / "dataset.json", federation.summary())
    status = Status(root / "status.json", cfg.name)
    if status.unreadable:
        say(status.unreadable)
    # forget methods no longer in the config (their folders stay on disk)
    status.data["methods"] = {k: v for k, v in status.data["methods"].items()
                              if k in {m.key for m in run.methods}}
    status.save()
    plans = [_MethodPlan(run, m, root, status, say=_prefixed(say, i, len(run.methods)))
             for i, m in enumerate(run.methods, 1)]
    if cfg.workers > 1 and len(plans) > 1:
        _run_parallel(plans, cfg.workers)
    else:
        _FEDERATIONS[str(root / "federation.json")] = federation
        for plan in plans:
            while (stage := plan.next_stage()) is not None:
                plan.record(stage, _execute(run, plan.m, stage, str(root), progress))
    failures = [f for plan in plans for f in plan.failures]
    report = build_report(root, command=command, wall_seconds=time.perf_counter() - t_start)
    paths = write_report(report, root, formats=cfg.report.formats)
    status.data["report"] = {"state": "done", "updated": _now(),
                             "files": {k: str(p.name) for k, p in paths.items()}}
    status.save()
    return RunOutcome(root=root, report=report, paths=paths, failures=failures,
                      seconds=time.perf_counter() - t_start)


def _prefixed(say: Log, i: int, n: int) -> Log:
    return lambda msg: say(f"[{i}/{n}] {msg}")


class _MethodPlan:
    """Which stage of one method runs next (skipping completed ones) and what came of it."""

    def __init__(self, run: ResolvedRun, m: ResolvedMethod, root: Path, status: Status, say: Log):
        self.run, self.m, self.status, self.say = run, m, status, say
        self.mdir = root / m.key
        self.hashes = stage_hashes(run, m)
        self.todo = list(STAGES)
        self.blocked: str | None = None
        self.failures: list[str] = []
        self.required = {"train": self.mdir / "train.json", "account": self.mdir / "privacy.json",
                         "audit": self.mdir / "audit.json"}

    def next_stage(self) -> str | None:
        m = self.m
        while self.todo:
            stage = self.todo.pop(0)
            digest = self.hashes[stage]
            if self.blocked is not None:
                self.status.set(m.key, m.method, stage, "skipped", digest,
                                error=f"{self.blocked} failed")
            elif stage == "audit" and not self.run.config.audit.enabled:
                self.status.set(m.key, m.method, stage, "skipped", digest,
                                error="audits disabled in config")
            elif self.status.is_done(m.key, stage, digest) and self.required[stage].is_file():
                self.say(f"{m.key}: {stage} already done, skipped")
            else:
                self.say(f"{m.key}: {stage} ...")
                return stage
        return None

    def record(self, stage: str, outcome: tuple[str | None, str, float]) -> None:
        error, trace, seconds = outcome
        m = self.m
        if error is None:
            self.status.set(m.key, m.method, stage, "done", self.hashes[stage], seconds=seconds)
            self.say(f"{m.key}: {stage} done in {seconds:.1f} s")
            return
        self.status.set(m.key, m.method, stage, "failed", self.hashes[stage], error=error,
                        seconds=seconds)
        self.mdir.mkdir(parents=True, exist_ok=True)
        with open(self.mdir / "errors.log", "a") as fh:
            fh.write(f"--- {_now()} {stage}\n{trace}\n")
        self.say(f"{m.key}: {stage} FAILED: {error}")
        self.failures.append(f"{m.key}/{stage}: {error}")
        self.blocked = stage


_FEDERATIONS: dict[str, Any] = {}  # per process: the run's federation, loaded once


def _execute(run: ResolvedRun, m: ResolvedMethod, stage: str, root: str,
             progress: bool) -> tuple[str | None, str, float]:
    """Run one stage; returns (error or None, traceback, seconds). KeyboardInterrupt propagates."""
    from privkit.data import Federation

    t0 = time.perf_counter()
    mdir = Path(root) / m.key
    try:
        if stage == "train":
            path = str(Path(root) / "federation.json")
            if path not in _FEDERATIONS:
                _FEDERATIONS[path] = Federation.load(path)
            _train_stage(run, m, _FEDERATIONS[path], mdir, progress)
        elif stage == "account":
            _account_stage(run, m, mdir)
        else:
            _audit_stage(run, m, mdir, progress)
    except Exception as exc:  # recorded; the other methods go on
        return f"{type(exc).__name__}: {_one_line(exc)}", traceback.format_exc(), \
            time.perf_counter() - t0
    return None, "", time.perf_counter() - t0


def _execute_in_worker(args: tuple) -> tuple[str | None, str, float]:
    import torch

    torch.set_num_threads(1)  # the workers share the cores between them
    return _execute(*args, progress=False)


def _run_parallel(plans: list[_MethodPlan], workers: int) -> None:
    """Run stages of different methods in ``workers`` processes; a method's stages stay in order."""
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from multiprocessing import get_context

    waiting = list(plans)
    running: dict = {}
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        while waiting or running:
            while waiting and len(running) < workers:
                plan = waiting.pop(0)
                stage = plan.next_stage()
                if stage is not None:
                    args = (plan.run, plan.m, stage, str(plan.mdir.parent))
                    running[pool.submit(_execute_in_worker, args)] = (plan, stage)
            if not running:
                continue
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in done:
                plan, stage = running.pop(fut)
                try:
                    outcome = fut.result()
                except Exception as exc:  # a crashed worker process fails that stage only
                    outcome = (f"{type(exc).__name__}: {_one_line(exc)}", traceback.format_exc(), 0.0)
                plan.record(stage, outcome)
                waiting.insert(0, plan)  # continue this method first (its files are warm)


# ---------------------------------------------------------------------------------- report
_WARNING_RULES: list[tuple[str, tuple[str, ...]]] = [
    ("delta_ge_1_over_n", ("1/n",)),
    ("classic_gaussian_eps_ge_1", ("classic gaussian", "classic formula", "classic mechanism")),
    ("data_dependent_scaling", ("data-dependent", "normalis", "normaliz", "feature scal",
                                "scaled by", "max norm")),
    ("adaptive_noise", ("adaptive", "adapted", "adapts")),
    ("sampling_mismatch", ("sampling", "sample rate", "sampled", "poisson", "shuffl",
                           "partition")),
    ("no_formal_dp", ("no formal privacy", "no privacy guarantee", "no formal dp",
                      "not differentially private")),
]


def classify_warning(text: str) -> str:
    """Map a trainer's free-text warning to a report warning code (``other`` if none fits)."""
    low = text.lower()
    for code, needles in _WARNING_RULES:
        if any(n in low for n in needles):
            return code
    return "other"


def _package_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("privkit", "torch", "numpy", "scipy", "dp-accounting", "opacus", "scikit-learn",
                "pydantic", "matplotlib", "jinja2"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            continue
    return out


def _hardware() -> dict[str, Any]:
    hw: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                          "cpus": os.cpu_count()}
    try:
        import torch

        hw["torch_threads"] = torch.get_num_threads()
        hw["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    except Exception:  # pragma: no cover - torch is a hard dependency
        pass
    return hw


def _neighbouring_text(relations: set[str]) -> str:
    words = {"add_remove": "add/remove one record (add_remove)",
             "replace_one": "replace one record (replace_one)"}
    if not relations:
        return "add/remove one record (add_remove) unless a method's ledger says otherwise"
    return "; ".join(words.get(r, r) for r in sorted(relations)) + (
        " (per method, as recorded in its ledger)" if len(relations) > 1 else "")


def _method_report(key: str, info: dict, st: dict, mdir: Path):
    """Build one :class:`reports.MethodReport` from a method's run directory and status.

    A file that cannot be read becomes a warning on that method; the report is still written.
    """
    from reports import MethodReport, ReportWarning, StageStatus, Verdict

    stages = {s: StageStatus(state=(st.get(s) or {}).get("state", "pending"),
                             error=(st.get(s) or {}).get("error"),
                             seconds=(st.get(s) or {}).get("seconds")) for s in STAGES}
    parts: dict[str, Any] = {"utility": None, "privacy": None, "audit": None}
    warnings: list = []
    readers = (("train", "metrics.json", "utility", _read_utility),
               ("account", "privacy.json", "privacy", _read_privacy),
               ("audit", "audit.json", "audit", _read_audit))
    for stage, fname, part, reader in readers:
        path = mdir / fname
        # with a status file, only results of completed stages; without one, whatever exists
        if not path.is_file() or (st and stages[stage].state != "done"):
            continue
        try:
            parts[part] = reader(mdir, info, warnings)
        except Exception as exc:  # a damaged file must not cost the whole report
            warnings.append(ReportWarning(code="other", source="report",
                                          message=f"{fname} could not be read: {_one_line(exc)}"))
    audit = parts["audit"]
    verdict = audit.verdict if audit is not None else None
    if verdict is None and not info.get("formal_dp", True):
        verdict = Verdict(status="no-formal-guarantee", message="the method makes no formal DP claim")
    return MethodReport(name=key, method=info.get("method", key), summary=info.get("summary", ""),
                        paper=info.get("paper"), formal_dp=info.get("formal_dp", True),
                        seed=info.get("seed", 0), config=info.get("trainer", {}),
                        quick=info.get("quick", False), utility=parts["utility"],
                        privacy=parts["privacy"], audit=audit, verdict=verdict,
                        warnings=warnings, stages=stages)


def _read_utility(mdir: Path, info: dict, warnings: list):
    from reports import ReportWarning, Utility

    met = _read_json(mdir / "metrics.json")
    meta = _read_json(mdir / "train.json")
    warnings += [ReportWarning(code=classify_warning(w), message=w, source="trainer")
                 for w in meta.get("warnings", [])]
    return Utility(test_accuracy=_num(met.get("test_accuracy")),
                   client_accuracy=[_num(a) for a in met.get("client_accuracy", [])],
                   rounds=[r for r in met.get("rounds", []) if "round" in r])


def _read_privacy(mdir: Path, info: dict, warnings: list):
    from reports import PrivacyAccounting, ReportWarning

    p = _read_json(mdir / "privacy.json")
    s = p["summary"]
    claim = p.get("claim") or {}
    cd = claim.get("delta")
    n_min = info.get("min_client_size")
    if isinstance(cd, (int, float)) and n_min and cd >= 1.0 / n_min and not any(
            w.code == "delta_ge_1_over_n" for w in warnings):
        warnings.append(ReportWarning(
            code="delta_ge_1_over_n", source="pipeline",
            message=f"the paper's delta = {cd:.3g} >= 1/n = {1.0 / n_min:.3g} (smallest client, "
                    f"n = {n_min}): such a guarantee allows publishing a record in the clear"))
    return PrivacyAccounting(
        delta=p["delta"], accountants=p.get("accountants") or list(s.get("worst", {})),
        primary_accountant=p.get("accountant", "best"), worst=s.get("worst", {}),
        clients=s.get("clients", {}), epsilon_over_rounds=p.get("epsilon_over_rounds", []),
        neighbouring=p.get("neighbouring", []), labels=p.get("labels", []),
        claim=p.get("claim"), epsilon_at_claim_delta=p.get("epsilon_at_claim_delta"),
        errors=p.get("errors", {}))


def _read_audit(mdir: Path, info: dict, warnings: list):
    from reports import AuditSummary, ReportWarning

    a = _read_json(mdir / "audit.json")
    known = {"attacks", "attribute", "accounted_epsilon", "delta", "shadows", "verdict",
             "schema_version", "method"}

    def clean(entries: dict | None) -> dict:  # tracebacks stay in audit.json, not the report
        return {k: {f: v for f, v in e.items() if f != "traceback"} for k, e in (entries or {}).items()}

    audit = AuditSummary(attacks=clean(a.get("attacks")), attribute=clean(a.get("attribute")),
                         accounted_epsilon=_num(a.get("accounted_epsilon")), delta=a.get("delta"),
                         shadows=a.get("shadows"), verdict=a.get("verdict"),
                         extra={k: v for k, v in a.items() if k not in known})
    for name, res in audit.attacks.items():
        if res.error:
            warnings.append(ReportWarning(code="other", source="audit",
                                          message=f"attack {name} failed: {res.error}"))
    if a.get("shadow_error"):
        warnings.append(ReportWarning(code="other", source="audit",
                                      message=f"shadow training failed: {a['shadow_error']}"))
    return audit


def _num(x: Any) -> float | None:
    if x is None:
        return None
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def build_report(root: str | Path, *, command: str | None = None,
                 wall_seconds: float | None = None):
    """Assemble a :class:`reports.PrivacyReport` from a pipeline run directory (files only)."""
    import privkit
    from reports import DatasetSummary, PrivacyReport, ReportWarning, RunMetadata, ThreatModel

    root = Path(root)
    cfg_path = root / "config.resolved.json"
    if not cfg_path.is_file():
        raise PrivkitError(f"not a pipeline run directory: {cfg_path} not found")
    resolved = _read_json(cfg_path)
    status = _read_json(root / "status.json") if (root / "status.json").is_file() else {}
    dataset = None
    if (root / "dataset.json").is_file():
        d = _read_json(root / "dataset.json")
        dataset = DatasetSummary(
            dataset=d["dataset"], public_dataset=d.get("public_dataset"),
            num_classes=d["num_classes"], partition=d["partition"], alpha=d.get("alpha"),
            seed=d.get("seed", 0), sizes=d.get("sizes", {}),
            client_sizes=[c["size"] for c in d.get("clients", [])],
            class_counts=[c["class_counts"] for c in d.get("clients", [])])
    n_min = dataset.min_client_size if dataset else None
    methods = []
    for rm in resolved.get("resolved_methods", []):
        info = {**rm, "min_client_size": n_min}
        st = (status.get("methods", {}).get(rm["key"]) or {}).get("stages", {})
        methods.append(_method_report(rm["key"], info, st, root / rm["key"]))
    delta = resolved["delta"]
    warnings = []
    if n_min and delta >= 1.0 / n_min:
        warnings.append(ReportWarning(
            code="delta_ge_1_over_n", source="pipeline",
            message=f"delta = {delta:g} >= 1/n = {1.0 / n_min:.3g} for the smallest client "
                    f"(n = {n_min}): the guarantee would allow publishing a record in the clear"))
    relations = {r for m in methods if m.privacy for r in m.privacy.neighbouring}
    confidences = {a.confidence for m in methods if m.audit for a in m.audit.attacks.values()
                   if a.confidence is not None}
    audit_cfg = resolved.get("audit", {})
    seed = resolved.get("seed", 0)
    audit_notes: list[str] = []
    for m in methods:  # the audit layer states its design in every audit.json
        for k, v in ((m.audit.extra.get("assumptions") or {}) if m.audit else {}).items():
            label = {"audit_points": "Audit points", "shadows": "Shadow models",
                     "bound": "Empirical bounds"}.get(k, k)
            note = f"{label}: {v}."
            if k in ("audit_points", "shadows", "bound") and note not in audit_notes:
                audit_notes.append(note)
    threat = ThreatModel(
        neighbouring=_neighbouring_text(relations), delta=delta,
        accountants=[*resolved.get("accountants", ACCOUNTANTS), "best"],
        primary_accountant=resolved.get("accountant", "best"),
        shadows=audit_cfg.get("shadows") if audit_cfg.get("enabled", True) else None,
        confidence=confidences.pop() if len(confidences) == 1 else None,
        assumptions=[
            "Every epsilon is per client and record-level: the worst client's guarantee is the "
            "headline; client-level (user-level) privacy is not claimed.",
            "The server, the public/auxiliary data and the test set are not private; only the "
            "clients' records are protected.",
            "Accounted epsilons are upper bounds from the mechanisms recorded in each method's "
            "ledger; empirical epsilons are statistical lower bounds from the audits.",
            "Audits attack the released model(s) only, with the shadow models trained by the same "
            "recipe on records disjoint from the target's.",
            *audit_notes,
            *([f"PLD accountant on a value grid of {resolved['pld_grid']:g} (coarser than the "
               "default 1e-4: faster, still a pessimistic upper bound)."]
              if resolved.get("pld_grid") else []),
            f"Epsilon over rounds: {resolved.get('curve_accountant', 'rdp')} accountant, for the "
            "client with the largest final epsilon.",
        ])
    meta = RunMetadata(
        name=resolved["name"], created=_now(), privkit_version=privkit.__version__,
        command=command, config=resolved,
        seeds={"run": seed, "federation": resolved.get("federation", {}).get("seed", 0),
               "audit": audit_cfg.get("seed") if audit_cfg.get("seed") is not None else seed,
               **{f"method:{m['key']}": m["seed"] for m in resolved.get("resolved_methods", [])}},
        package_versions=_package_versions(), hardware=_hardware(),
        reduced=list(resolved.get("report", {}).get("reduced", [])),
        wall_seconds=wall_seconds)
    return PrivacyReport(title=resolved.get("report", {}).get("title", "privkit privacy report"),
                         metadata=meta, threat_model=threat, dataset=dataset, methods=methods,
                         warnings=warnings)


def rerender(root: str | Path, *, rebuild: bool = False, formats: list[str] | None = None):
    """``privkit report``: re-render ``report.json`` (or rebuild it from the run directories)."""
    from reports import FORMATS, load_report, write_report

    root = Path(root)
    if not root.is_dir():
        raise PrivkitError(f"run directory not found: {root}")
    if rebuild or not (root / "report.json").is_file():
        report = build_report(root)
        formats = list(formats or FORMATS)
        if "json" not in formats:
            formats.append("json")
    else:
        report = load_report(root / "report.json")
        formats = [f for f in (formats or FORMATS) if f != "json"]
    return report, write_report(report, root, formats=formats)


def bundled_config(name: str) -> Path:
    """Path of a config shipped with privkit (``quickstart`` or ``full``)."""
    path = Path(__file__).parent / "configs" / f"{name}.toml"
    if not path.is_file():
        raise PrivkitError(f"bundled config must be quickstart or full; found {name!r}")
    return path

