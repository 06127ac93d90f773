"""``run_pipeline``: every method of a run, stage by stage (resuming), then the report."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from privkit.errors import PrivkitError
from privkit.files import (
    append_log,
    intact,
    run_lock,
    storage_errors,
    tidy_after_crash,
    write_json,
    write_text,
)
from privkit.files import now as _now
from privkit.files import one_line as _one_line
from privkit.pipeline.config import STAGES, ResolvedMethod, ResolvedRun
from privkit.pipeline.controls import ControlsPlan
from privkit.pipeline.federation import FEDERATIONS as _FEDERATIONS
from privkit.pipeline.mechanism_controls import MechanismControlsPlan
from privkit.pipeline.report import build_report
from privkit.pipeline.stages import execute as _execute
from privkit.pipeline.state import Status, stage_hashes
from privkit.pipeline.steps import StepPlan
from privkit.pipeline.workers import run_parallel as _run_parallel

Log = Callable[[str], None]


@dataclass
class RunOutcome:
    """What :func:`run_pipeline` wrote: the run directory, the report and the paths of its files.

    Parameters
    ----------
    root : pathlib.Path
        The run directory.
    report : reports.PrivacyReport
        The report written.
    paths : dict of str to pathlib.Path
        Each written report file by format.
    failures : list of str
        One ``"method/stage: error"`` line per failed stage (empty when every stage succeeded).
    seconds : float
        The run's wall-clock time.
    """

    root: Path
    report: Any
    paths: dict[str, Path]
    failures: list[str]
    seconds: float


def run_pipeline(
    run: ResolvedRun,
    out: str | Path = "runs",
    *,
    progress: bool = False,
    log: Log | None = None,
    command: str | None = None,
) -> RunOutcome:
    """Run every method of ``run`` (train -> account -> audit), the audit controls and every
    formal-DP method's mechanism controls, and write the report.

    Stages already complete for the same config are skipped. A failing stage is recorded in
    ``status.json`` and the report; later stages of that method are skipped, other methods go on.
    With ``workers > 1`` methods run in parallel local processes (one torch thread each);
    ``status.json`` is written by this process only.

    Parameters
    ----------
    run : ResolvedRun
        The validated run config (:func:`privkit.pipeline.resolve_config`).
    out : str or pathlib.Path
        Parent directory of the run directory, which is ``out / run.config.name``.
    progress : bool
        Show training progress.
    log : callable, optional
        Receives one line per step taken (``print`` for the CLI); silent by default.
    command : str, optional
        The command line that started the run, recorded in the report.

    Returns
    -------
    RunOutcome
    """
    from privkit.data import build_federation

    say = log or (lambda msg: None)
    t_start = time.perf_counter()
    cfg = run.config
    try:  # part of validation: a missing local dataset is an error before anything is written
        federation = build_federation(cfg.federation)
    except (ValueError, FileNotFoundError) as exc:
        raise PrivkitError(f"federation: {_one_line(exc)}") from exc
    root = Path(out) / cfg.name
    with storage_errors(root):
        root.mkdir(parents=True, exist_ok=True)
    with run_lock(root, say):  # one run per directory; released by the kernel if this one dies
        return _run_locked(
            run, federation, root, progress=progress, say=say, command=command, t_start=t_start
        )


def _run_locked(
    run: ResolvedRun,
    federation,
    root: Path,
    *,
    progress: bool,
    say: Log,
    command: str | None,
    t_start: float,
) -> RunOutcome:
    from reports import write_report

    cfg = run.config
    tidy_after_crash(root)  # left by a writer killed mid-file; never read
    write_json(root / "config.resolved.json", run.to_dict())
    write_text(root / "federation.json", json.dumps(federation.to_dict()))
    write_json(root / "dataset.json", federation.summary())
    status = Status(root / "status.json", cfg.name)
    if status.unreadable:
        say(status.unreadable)
    # forget methods no longer in the config (their folders stay on disk)
    status.data["methods"] = {
        k: v for k, v in status.data["methods"].items() if k in {m.key for m in run.methods}
    }
    status.save()
    plans: list[_MethodPlan | StepPlan] = [
        _MethodPlan(run, m, root, status, say=_prefixed(say, i, len(run.methods)))
        for i, m in enumerate(run.methods, 1)
    ]
    # the audit controls first: the longest single task, it then runs beside the methods
    plans.insert(0, ControlsPlan(run, root, status, say=say))  # its lines say "audit controls ..."
    # every formal-DP method's mechanism controls (two twins each), after the methods' plans
    plans += [
        MechanismControlsPlan(run, m, root, status, say=_prefixed(say, i, len(run.methods)))
        for i, m in enumerate(run.methods, 1)
        if m.formal_dp
    ]
    if cfg.workers > 1 and len(plans) > 1:
        _run_parallel(plans, cfg.workers)
    else:
        _FEDERATIONS[str(root / "federation.json")] = federation
        for plan in plans:
            while (stage := plan.next_stage()) is not None:
                plan.record(stage, _execute(run, plan.m, stage, str(root), progress))
    failures = [f for plan in plans for f in plan.failures]
    report = build_report(root, command=command, wall_seconds=time.perf_counter() - t_start)
    paths = write_report(
        report, root, formats=cfg.report.formats, write=write_text, figure_workers=cfg.workers
    )
    status.data["report"] = {
        "state": "done",
        "updated": _now(),
        "files": {k: str(p.name) for k, p in paths.items()},
    }
    status.save()
    return RunOutcome(
        root=root,
        report=report,
        paths=paths,
        failures=failures,
        seconds=time.perf_counter() - t_start,
    )


def _prefixed(say: Log, i: int, n: int) -> Log:
    return lambda msg: say(f"[{i}/{n}] {msg}")


_TRAIN_FILES = ("config.json", "federation.json", "ledger.json", "metrics.json")


class _MethodPlan:
    """Which stage of one method runs next (skipping completed ones) and what came of it."""

    def __init__(self, run: ResolvedRun, m: ResolvedMethod, root: Path, status: Status, say: Log):
        self.run, self.m, self.status, self.say = run, m, status, say
        self.mdir = root / m.key
        self.hashes = stage_hashes(run, m)
        self.todo = list(STAGES)
        self.blocked: str | None = None
        self.failures: list[str] = []
        self.rerun = False
        self.required = {
            "train": self.mdir / "train.json",
            "account": self.mdir / "privacy.json",
            "audit": self.mdir / "audit.json",
        }

    def _intact(self, stage: str) -> bool:
        """Every file the stage wrote is present with a matching checksum (a failing one is
        treated as absent, with a warning, and the stage re-runs)."""
        files = [self.required[stage]]
        if stage == "train":  # what TrainResult.save and the train stage write
            files += [self.mdir / name for name in _TRAIN_FILES]
            files += sorted((self.mdir / "checkpoints").glob("*.pt"))
            if (self.mdir / "artifacts.npz").exists():
                files.append(self.mdir / "artifacts.npz")
        elif stage == "audit" and (self.mdir / "shadows.npz").exists():
            files.append(self.mdir / "shadows.npz")
        failing = [p for p in files if not intact(p, self.say)]  # each one named in a warning
        return not failing

    def next_stage(self) -> str | None:
        m = self.m
        while self.todo:
            stage = self.todo.pop(0)
            digest = self.hashes[stage]
            if self.blocked is not None:
                self.status.set(
                    m.key, m.method, stage, "skipped", digest, error=f"{self.blocked} failed"
                )
            elif stage == "audit" and not self.run.config.audit.enabled:
                self.status.set(
                    m.key, m.method, stage, "skipped", digest, error="audits disabled in config"
                )
            elif (
                not self.rerun and self.status.is_done(m.key, stage, digest) and self._intact(stage)
            ):
                self.say(f"{m.key}: {stage} already done, skipped")
            else:
                self.say(f"{m.key}: {stage} ...")
                self.rerun = True  # the stages after it read its new output: they re-run too
                return stage
        return None

    def record(self, stage: str, outcome: tuple[str | None, str, float]) -> None:
        error, trace, seconds = outcome
        m = self.m
        if error is None:
            self.status.set(m.key, m.method, stage, "done", self.hashes[stage], seconds=seconds)
            self.say(f"{m.key}: {stage} done in {seconds:.1f} s")
            return
        self.status.set(
            m.key, m.method, stage, "failed", self.hashes[stage], error=error, seconds=seconds
        )
        append_log(self.mdir / "errors.log", f"--- {_now()} {stage}\n{trace}\n")
        self.say(f"{m.key}: {stage} FAILED: {error}")
        self.failures.append(f"{m.key}/{stage}: {error}")
        self.blocked = stage
