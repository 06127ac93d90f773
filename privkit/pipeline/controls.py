"""The run's audit controls as a pipeline step: which DP method is twinned, the resumable stage,
and ``audit-controls/controls.json`` (:mod:`privkit.audit.controls` does the work).

The step is keyed by a hash of what it depends on (federation, the twinned method's trainer config,
delta, audit seed, control settings) and recorded under ``controls`` in ``status.json``; a re-run
with the same hash skips it. It runs beside the methods (in the worker pool when ``workers > 1``);
its failure is recorded and reported like a method stage's, the methods go on.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from privkit.errors import PrivkitError
from privkit.files import atomic_write_json
from privkit.pipeline.config import ResolvedMethod, ResolvedRun
from privkit.pipeline.federation import run_federation
from privkit.pipeline.state import Status, _hash
from privkit.pipeline.steps import StepPlan

CONTROLS_DIR = "audit-controls"
STAGE = "controls"


def controls_enabled(run: ResolvedRun) -> bool:
    audit = run.config.audit
    return audit.enabled and audit.controls.enabled


def control_target(run: ResolvedRun) -> ResolvedMethod:
    """The DP-SGD method the controls twin: ``audit.controls.method`` (a dpsgd method's label), else
    the run's first dpsgd method, else dpsgd's quick config when every method of the run is quick
    (its defaults otherwise). Returned under the key ``audit-controls`` (the step's folder)."""
    from privkit.trainers import get_trainer

    want = run.config.audit.controls.method
    dpsgd = [m for m in run.methods if m.method == "dpsgd"]
    if want is not None:
        match = [m for m in dpsgd if m.key == want]
        if not match:
            raise PrivkitError(
                f"audit.controls.method must be the label of a dpsgd method of the run "
                f"({', '.join(m.key for m in dpsgd) or 'none'}); found {want!r}"
            )
        base = match[0]
    elif dpsgd:
        base = dpsgd[0]
    else:
        spec = get_trainer("dpsgd")
        quick = all(m.quick for m in run.methods)
        return ResolvedMethod(
            key=CONTROLS_DIR,
            method="dpsgd",
            seed=run.config.seed,
            quick=quick,
            overrides={},
            trainer=spec.quick_config() if quick else spec.defaults(),
            summary="dpsgd (not in the run: its own config)",
            formal_dp=True,
        )
    return ResolvedMethod(
        key=CONTROLS_DIR,
        method="dpsgd",
        seed=base.seed,
        quick=base.quick,
        overrides=dict(base.overrides),
        trainer=dict(base.trainer),
        summary=f"twins of {base.key}",
        formal_dp=True,
    )


def controls_hash(run: ResolvedRun, target: ResolvedMethod) -> str:
    cfg = run.config
    return _hash(
        {
            "trainer": target.trainer,
            "federation": cfg.federation.model_dump(mode="json"),
            "delta": cfg.delta,
            "seed": audit_seed(run),
            "controls": cfg.audit.controls.model_dump(mode="json"),
        }
    )


def audit_seed(run: ResolvedRun) -> int:
    """The run's audit seed: ``audit.seed``, else the run's seed."""
    cfg = run.config
    return cfg.seed if cfg.audit.seed is None else cfg.audit.seed


def controls_stage(run: ResolvedRun, target: ResolvedMethod, root: Path, progress: bool) -> None:
    """Train and audit the twins; write ``audit-controls/controls.json``."""
    from privkit.audit.controls import run_controls

    settings = run.config.audit.controls
    dp_label = settings.method or next((m.key for m in run.methods if m.method == "dpsgd"), "dpsgd")
    record = run_controls(
        run_federation(root),
        target.trainer,
        delta=run.config.delta,
        seed=audit_seed(run),
        method=dp_label,
        black_box_epochs=settings.black_box_epochs,
        white_box_canaries=settings.canaries,
        black_box_canaries=settings.canaries,
        progress=progress,
    )
    record["twinned_method_in_run"] = any(m.key == dp_label for m in run.methods)
    (root / CONTROLS_DIR).mkdir(parents=True, exist_ok=True)
    atomic_write_json(root / CONTROLS_DIR / "controls.json", record)


class ControlsPlan(StepPlan):
    """The controls step (a :class:`~privkit.pipeline.steps.StepPlan` in ``status.json``'s ``controls``)."""

    def __init__(self, run: ResolvedRun, root: Path, status: Status, say: Callable[[str], None]):
        target = control_target(run)  # validated before any training starts
        mdir = root / CONTROLS_DIR
        super().__init__(
            run,
            target,
            mdir=mdir,
            status=status,
            slot=("controls",),
            digest=controls_hash(run, target),
            stage=STAGE,
            output=mdir / "controls.json",
            title="audit controls",
            name=CONTROLS_DIR,
            log=mdir / "errors.log",
            say=say,
            disabled=None if controls_enabled(run) else "audit controls disabled in config",
        )
