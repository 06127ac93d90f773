"""A pipeline step beside the methods' train -> account -> audit chain: one stage, keyed by a hash,
recorded in ``status.json`` under a slot of its own, skipped on a re-run when done for the same
hash. The run's audit controls (:mod:`~privkit.pipeline.controls`) and each method's mechanism
controls (:mod:`~privkit.pipeline.mechanism_controls`) are such steps.

A step has the interface of a method's plan (``next_stage`` / ``record``, ``run``, ``m``, ``mdir``),
so the serial loop and the worker pool (:mod:`~privkit.pipeline.workers`) run it like one; the
worker runs ``stages.execute(run, m, stage, mdir.parent)``, so ``mdir`` lies directly in the run
directory. A failure is recorded with its error (traceback in the step's log), the methods go on.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from privkit.files import append_log, intact
from privkit.files import now as _now
from privkit.pipeline.config import ResolvedMethod, ResolvedRun
from privkit.pipeline.state import Status


class StepPlan:
    """One resumable step.

    Parameters
    ----------
    run, m : the run and the method the step works for (``m.key``: the step's folder for the
        audit controls, the method's label for its mechanism controls).
    mdir : the step's folder, directly in the run directory.
    status : the run's ``status.json``; the step's entry is ``status.data[slot[0]]...[slot[-1]]``.
    slot : keys of the step's entry in ``status.json``.
    digest : hash of what the step depends on.
    stage : the stage name :func:`privkit.pipeline.stages.execute` dispatches on.
    output : the file the step writes (a done entry without it re-runs the step).
    title : the step's name in the log lines.
    name : the step's name in the run's failures (``<name>: <error>``).
    log : where a failure's traceback goes.
    disabled : why the step does not run (``None``: it runs); recorded as ``skipped``.
    """

    def __init__(
        self,
        run: ResolvedRun,
        m: ResolvedMethod,
        *,
        mdir: Path,
        status: Status,
        slot: tuple[str, ...],
        digest: str,
        stage: str,
        output: Path,
        title: str,
        name: str,
        log: Path,
        say: Callable[[str], None],
        disabled: str | None = None,
    ):
        self.run, self.m, self.mdir, self.status, self.say = run, m, mdir, status, say
        self.slot, self.digest, self.stage, self.output = slot, digest, stage, output
        self.title, self.name, self.log = title, name, log
        self.failures: list[str] = []
        self.pending = disabled is None
        if disabled is not None:
            self._set({"state": "skipped", "hash": None, "updated": _now(), "error": disabled})

    def entry(self) -> dict:
        """The step's entry in ``status.json`` (empty if it never ran)."""
        node = self.status.data
        for key in self.slot:
            node = node.get(key) or {}
        return node

    def _set(self, value: dict) -> None:
        node = self.status.data
        for key in self.slot[:-1]:
            node = node.setdefault(key, {})
        node[self.slot[-1]] = value
        self.status.save()

    def next_stage(self) -> str | None:
        if not self.pending:
            return None
        self.pending = False
        done = self.entry()
        if (
            done.get("state") == "done"
            and done.get("hash") == self.digest
            and intact(self.output, self.say)
        ):
            self.say(f"{self.title} already done, skipped")
            return None
        self.say(f"{self.title} ...")
        return self.stage

    def record(self, stage: str, outcome: tuple[str | None, str, float]) -> None:
        error, trace, seconds = outcome
        self._set(
            {
                "state": "failed" if error else "done",
                "hash": self.digest,
                "error": error,
                "seconds": round(seconds, 3),
                "updated": _now(),
            }
        )
        if error is None:
            self.say(f"{self.title} done in {seconds:.1f} s")
            return
        append_log(self.log, f"--- {_now()} {stage}\n{trace}\n")
        self.say(f"{self.title} FAILED: {error}")
        self.failures.append(f"{self.name}: {error}")
