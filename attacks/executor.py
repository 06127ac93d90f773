"""Run independent tasks (reference models, shadow federations, clients) serially, in local
processes, or on Ray.

A task is ``fn(arg)`` with a picklable module-level ``fn``; every task carries its own seed, so the
results are identical whichever executor runs them (tested). :func:`get_executor` also accepts an
executor object: anything with ``map(fn, tasks, *, progress, description)`` (the classes here), or a
:class:`concurrent.futures.Executor` (``map(fn, tasks)`` in order).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor as FuturesExecutor
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context
from typing import Any, Protocol

from attacks.progress import progress_bar

EXECUTORS = ("serial", "process", "ray")


class Executor(Protocol):
    def map(
        self,
        fn: Callable[[Any], Any],
        tasks: Sequence[Any],
        *,
        progress: bool = False,
        description: str = "tasks",
    ) -> list[Any]: ...


class SerialExecutor:
    """Run tasks one after the other in this process."""

    def map(self, fn, tasks, *, progress=False, description="tasks"):
        out = []
        with progress_bar(progress) as bar:
            tid = bar.add_task(description, total=len(tasks))
            for t in tasks:
                out.append(fn(t))
                bar.advance(tid)
        return out


def _one_thread() -> None:
    # workers already use every core between them: one BLAS/OpenMP/torch thread each. The
    # environment covers libraries imported later; torch, if already imported, is told directly.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


def _limited(fn_and_arg):
    _one_thread()
    fn, arg = fn_and_arg
    return fn(arg)


class ProcessExecutor:
    """Run tasks in a pool of local processes (spawned, one thread each).

    A worker process that dies (killed, out of memory) breaks the whole pool
    (:class:`~concurrent.futures.process.BrokenProcessPool`): the finished tasks' results are
    kept and only the unfinished tasks (the lost one and those in flight or queued) are submitted
    again to a fresh pool, up to ``retries`` times; ``resubmitted`` lists their indices.
    """

    def __init__(self, workers: int | None = None, retries: int = 3):
        if workers is not None and workers < 1:
            raise ValueError(f"workers must be >= 1; found {workers}")
        if retries < 0:
            raise ValueError(f"retries must be >= 0; found {retries}")
        self.workers = workers or max(1, (os.cpu_count() or 1))
        self.retries = retries
        self.resubmitted: list[int] = []

    def map(self, fn, tasks, *, progress=False, description="tasks"):
        out: list[Any] = [None] * len(tasks)
        todo = list(range(len(tasks)))
        with progress_bar(progress) as bar:
            tid = bar.add_task(description, total=len(tasks))
            for attempt in range(self.retries + 1):
                todo = self._round(fn, tasks, todo, out, lambda: bar.advance(tid))
                if not todo:
                    return out
                if attempt < self.retries:
                    self.resubmitted += todo
        raise RuntimeError(
            f"{len(todo)} task(s) lost their worker process {self.retries + 1} times "
            f"(first: task {todo[0]}); a task that kills its process each time, e.g. "
            "out of memory, cannot finish"
        )

    def _round(self, fn, tasks, todo, out, advance) -> list[int]:
        """Run the tasks ``todo`` in a fresh pool; the indices lost to a broken pool."""
        lost: list[int] = []
        with ProcessPoolExecutor(
            min(self.workers, len(todo)), mp_context=get_context("spawn"), initializer=_one_thread
        ) as pool:
            futures = {pool.submit(_limited, (fn, tasks[i])): i for i in todo}
            for fut in as_completed(futures):
                try:
                    out[futures[fut]] = fut.result()
                except BrokenProcessPool:
                    lost.append(futures[fut])
                    continue
                advance()
        return sorted(lost)


class RayExecutor:
    """Run tasks as Ray remote functions (optional extra: ``pip install "privkit-ml[ray]"``).

    A task whose worker process dies is re-run by Ray itself (``max_retries``, Ray's retry of
    tasks on system failures: worker or node death); an exception raised by the task is not
    retried (``retry_exceptions=False``): it is the task's own error, and would recur.
    """

    def __init__(self, num_cpus: int | None = None, max_retries: int = 3):
        try:
            import ray
        except ImportError as exc:
            raise ValueError('executor "ray" needs Ray: pip install "privkit-ml[ray]"') from exc
        self._ray = ray
        self.max_retries = max_retries
        if not ray.is_initialized():
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)

    def map(self, fn, tasks, *, progress=False, description="tasks"):
        ray = self._ray
        remote = ray.remote(num_cpus=1, max_retries=self.max_retries, retry_exceptions=False)(
            _limited
        )
        refs = [remote.remote((fn, t)) for t in tasks]
        with progress_bar(progress) as bar:
            tid = bar.add_task(description, total=len(tasks))
            pending = list(refs)
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                bar.advance(tid, len(done))
        return ray.get(refs)


class FuturesAdapter:
    """A :class:`concurrent.futures.Executor` the caller owns (not shut down here), as an Executor."""

    def __init__(self, pool: FuturesExecutor):
        self.pool = pool

    def map(self, fn, tasks, *, progress=False, description="tasks"):
        out: list[Any] = [None] * len(tasks)
        with progress_bar(progress) as bar:
            tid = bar.add_task(description, total=len(tasks))
            futures = {self.pool.submit(fn, t): i for i, t in enumerate(tasks)}
            for fut in as_completed(futures):
                out[futures[fut]] = fut.result()
                bar.advance(tid)
        return out


def get_executor(name: Any = "serial", workers: int | None = None) -> Executor:
    """``serial`` (also ``None``), ``process`` (local pool), ``ray``, or an executor object."""
    if name is None or name == "serial":
        return SerialExecutor()
    if isinstance(name, str):
        if name == "process":
            return ProcessExecutor(workers)
        if name == "ray":
            return RayExecutor(workers)
        raise ValueError(f"executor must be one of {', '.join(EXECUTORS)}; found {name!r}")
    if isinstance(name, FuturesExecutor):
        return FuturesAdapter(name)
    if callable(getattr(name, "map", None)):
        return name
    raise ValueError(
        f"executor must be one of {', '.join(EXECUTORS)}, a concurrent.futures.Executor or "
        f"an object with map(fn, tasks, progress=, description=); found {name!r}"
    )


def run_tasks(
    fn: Callable[[Any], Any],
    tasks: Iterable[Any],
    executor: Any = "serial",
    workers: int | None = None,
    progress: bool = False,
    description: str = "tasks",
) -> list:
    """``fn`` over ``tasks`` on the named executor, results in task order."""
    return get_executor(executor, workers).map(
        fn, list(tasks), progress=progress, description=description
    )
