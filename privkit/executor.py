"""Run independent tasks (shadow models, clients) serially, in local processes, or on Ray.

A task is ``fn(arg)`` with a picklable module-level ``fn``; every task carries its own seed, so the
results are identical whichever executor runs them (tested).
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any, Callable, Iterable, Protocol, Sequence

from privkit.errors import PrivkitError

EXECUTORS = ("serial", "process", "ray")


def _progress(total: int, description: str, enabled: bool):
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn)

    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), disable=not enabled, transient=False)
    return progress, total, description


class Executor(Protocol):
    def map(self, fn: Callable[[Any], Any], tasks: Sequence[Any], *, progress: bool = False,
            description: str = "tasks") -> list[Any]: ...


class SerialExecutor:
    """Run tasks one after the other in this process."""

    def map(self, fn, tasks, *, progress=False, description="tasks"):
        bar, total, desc = _progress(len(tasks), description, progress)
        out = []
        with bar:
            tid = bar.add_task(desc, total=total)
            for t in tasks:
                out.append(fn(t))
                bar.advance(tid)
        return out


def _limited(fn_and_arg):
    # one torch thread per worker: workers already use every core between them
    import torch

    torch.set_num_threads(1)
    fn, arg = fn_and_arg
    return fn(arg)


class ProcessExecutor:
    """Run tasks in a pool of local processes (spawned, one torch thread each)."""

    def __init__(self, workers: int | None = None):
        self.workers = workers or max(1, (os.cpu_count() or 1))
        if self.workers < 1:
            raise PrivkitError(f"workers must be >= 1; found {workers}")

    def map(self, fn, tasks, *, progress=False, description="tasks"):
        bar, total, desc = _progress(len(tasks), description, progress)
        out: list[Any] = [None] * len(tasks)
        with bar, ProcessPoolExecutor(self.workers, mp_context=get_context("spawn")) as pool:
            tid = bar.add_task(desc, total=total)
            futures = {pool.submit(_limited, (fn, t)): i for i, t in enumerate(tasks)}
            from concurrent.futures import as_completed

            for fut in as_completed(futures):
                out[futures[fut]] = fut.result()
                bar.advance(tid)
        return out


class RayExecutor:
    """Run tasks as Ray remote functions (optional extra: ``pip install "privkit[ray]"``)."""

    def __init__(self, num_cpus: int | None = None):
        try:
            import ray
        except ImportError as exc:
            raise PrivkitError('executor "ray" needs Ray: pip install "privkit[ray]"') from exc
        self._ray = ray
        if not ray.is_initialized():
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)

    def map(self, fn, tasks, *, progress=False, description="tasks"):
        ray = self._ray
        remote = ray.remote(num_cpus=1)(_limited)
        refs = [remote.remote((fn, t)) for t in tasks]
        bar, total, desc = _progress(len(tasks), description, progress)
        with bar:
            tid = bar.add_task(desc, total=total)
            pending = list(refs)
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                bar.advance(tid, len(done))
        return ray.get(refs)


def check_executor(name: str, option: str = "executor") -> None:
    """Refuse an unknown executor, or Ray when it is not installed, before any work starts."""
    from importlib.util import find_spec

    if name not in EXECUTORS:
        raise PrivkitError(f"{option} must be one of {', '.join(EXECUTORS)}; found {name!r}")
    if name == "ray" and find_spec("ray") is None:
        raise PrivkitError(f'{option} ray needs Ray, which is not installed; found none '
                           '(pip install "privkit[ray]")')


def get_executor(name: str = "serial", workers: int | None = None) -> Executor:
    """``serial``, ``process`` (local pool) or ``ray``."""
    if name == "serial":
        return SerialExecutor()
    if name == "process":
        return ProcessExecutor(workers)
    if name == "ray":
        return RayExecutor(workers)
    raise PrivkitError(f"executor must be one of {', '.join(EXECUTORS)}; found {name!r}")


def run_tasks(fn: Callable[[Any], Any], tasks: Iterable[Any], executor: str = "serial",
              workers: int | None = None, progress: bool = False, description: str = "tasks") -> list:
    return get_executor(executor, workers).map(fn, list(tasks), progress=progress, description=description)
