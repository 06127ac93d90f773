"""Methods in parallel local processes (one torch thread each); a method's stages stay in order."""

from __future__ import annotations

import shutil
import signal
import traceback
from typing import Any

from privkit.files import StorageError, staging_dir
from privkit.files import one_line as _one_line
from privkit.pipeline.stages import execute as _execute


def _worker_init() -> None:
    # Ctrl-C reaches every process of the terminal's group: only the parent acts on it (it stops
    # the workers and says so once), so no worker dies printing a traceback of its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _execute_in_worker(args: tuple[Any, Any, str, str]) -> tuple[str | None, str, float]:
    import torch

    torch.set_num_threads(1)  # the workers share the cores between them
    return _execute(*args, progress=False)


def _priority(plan) -> tuple:
    """Every method trains first (in list order, after the audit controls and before the methods'
    mechanism controls, plans of one step each);
    then the longest trainers' account and audit stages start first (an audit re-runs the recipe
    once per reference model, so its cost follows the training time): the last stage to finish is
    a short one and both workers stay busy."""
    todo = getattr(plan, "todo", None)
    if todo is None or (todo and todo[0] == "train"):
        return (0, 0.0)
    seconds = plan.status.stage(plan.m.key, "train").get("seconds") or 0.0
    return (1, -float(seconds))


def _stop(pool) -> None:
    """Stop the workers now: a stage in flight is lost (it re-runs on resume), finished ones stay."""
    terminate = getattr(pool, "terminate_workers", None)  # Python >= 3.14
    if terminate is not None:
        terminate()
        return
    processes = list((getattr(pool, "_processes", None) or {}).values())
    for proc in processes:
        proc.terminate()
    for proc in processes:
        proc.join(timeout=10)
    pool.shutdown(wait=False, cancel_futures=True)


RETRIES = 2  # a stage whose worker process dies is run again up to this many times


def _new_pool(workers: int):
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    return ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_worker_init)


def _submit(pool, running: dict, plan, stage: str) -> None:
    args = (plan.run, plan.m, stage, str(plan.mdir.parent))
    running[pool.submit(_execute_in_worker, args)] = (plan, stage)


def run_parallel(plans: list, workers: int) -> None:
    """Run stages of different methods in ``workers`` processes; a method's stages stay in order.

    A worker process that dies (killed, out of memory) breaks the pool: the stages that finished
    keep their results, the stages lost with it (the dead worker's and those in flight beside it)
    run again in a fresh pool, up to :data:`RETRIES` times each, then fail with the reason.
    On Ctrl-C (or any error of this loop) the workers are stopped at once and the half-written
    training folders of the stages in flight are removed; finished stages are already recorded.
    """
    from concurrent.futures import FIRST_COMPLETED, wait
    from concurrent.futures.process import BrokenProcessPool

    waiting = list(plans)
    running: dict = {}
    losses: dict = {}
    pool = _new_pool(workers)
    try:
        while waiting or running:
            while waiting and len(running) < workers:
                plan = min(waiting, key=_priority)  # stable: ties keep config order
                waiting.remove(plan)
                stage = plan.next_stage()
                if stage is not None:
                    _submit(pool, running, plan, stage)
            if not running:
                continue
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            if any(isinstance(f.exception(), BrokenProcessPool) for f in done):
                wait(running)  # the broken pool settles every future: a result or the breakage
                done = set(running)
            lost = []
            for fut in done:
                plan, stage = running.pop(fut)
                try:
                    outcome = fut.result()
                except StorageError:  # a full or read-only disk stops the run (see stages.execute)
                    raise
                except BrokenProcessPool:
                    lost.append((plan, stage))
                    continue
                except Exception as exc:  # the stage's own error fails that stage only
                    outcome = (
                        f"{type(exc).__name__}: {_one_line(exc)}",
                        traceback.format_exc(),
                        0.0,
                    )
                plan.record(stage, outcome)
                waiting.insert(0, plan)
            if lost:
                pool.shutdown(wait=True)
                pool = _new_pool(workers)
                for plan, stage in lost:
                    key = (plan.m.key, stage)
                    losses[key] = losses.get(key, 0) + 1
                    if losses[key] <= RETRIES:
                        _submit(pool, running, plan, stage)
                        continue
                    plan.record(
                        stage,
                        (
                            f"worker process lost {losses[key]} times (killed or out of memory)",
                            "",
                            0.0,
                        ),
                    )
                    waiting.insert(0, plan)
    except BaseException:
        _stop(pool)
        for plan, stage in running.values():
            if stage == "train":
                shutil.rmtree(staging_dir(plan.mdir), ignore_errors=True)
        raise
    pool.shutdown()
