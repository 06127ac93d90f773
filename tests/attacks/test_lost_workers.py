"""A worker process killed mid-audit (issue 24, item 2): the audit finishes on the process pool and
on a local Ray cluster with the serial executor's result, re-running only the lost work.

The recipe (``recipes_for_tests.logreg_losing_its_worker``) SIGKILLs the worker running its third
call, once; every call leaves a file, so the tests count what ran twice.
"""

from __future__ import annotations

import os

import pytest
from recipes_for_tests import digits, logreg_losing_its_worker

from attacks import audit_recipe
from attacks.executor import ProcessExecutor

SHADOWS = 4  # 5 models: the target and 4 references
KW = {
    "accounted_epsilon": 1.0,
    "delta": 1e-5,
    "shadows": SHADOWS,
    "seed": 3,
    "attacks": ["threshold", "lira"],
}


@pytest.fixture()
def calls(tmp_path, monkeypatch):
    monkeypatch.setenv("PRIVKIT_TEST_KILL_DIR", str(tmp_path))
    monkeypatch.setenv("PRIVKIT_TEST_MAIN_PID", str(os.getpid()))
    return tmp_path


def _calls(folder) -> dict[int, int]:
    """How many times the recipe ran for each model seed."""
    out: dict[int, int] = {}
    for f in folder.glob("call-*"):
        seed = int(f.name.split("-")[1])
        out[seed] = out.get(seed, 0) + 1
    return out


def _serial(x, y) -> dict:
    out = audit_recipe(logreg_losing_its_worker, x, y, **KW).to_dict()
    out.pop("experiment")
    return out


def test_process_pool_resubmits_only_the_unfinished_models(calls):
    x, y = digits()
    serial = _serial(x, y)
    assert sum(_calls(calls).values()) == SHADOWS + 1 and not (calls / "killed").exists()
    for f in calls.glob("call-*"):
        f.unlink()
    ex = ProcessExecutor(workers=2)
    res = audit_recipe(logreg_losing_its_worker, x, y, executor=ex, **KW)
    pooled = res.to_dict()
    pooled.pop("experiment")
    assert (calls / "killed").exists()  # a worker died mid-audit
    assert pooled == serial  # same scores, bounds and verdict as the serial executor
    # the pool broke once: the killed model and those in flight or queued were resubmitted, the
    # models finished before the kill were kept (at least the first: the third call is the one
    # that dies, and the second may still be running on the other worker), nothing else ran twice
    seeds = res.design.seeds()
    ran = _calls(calls)
    assert sorted(ran) == sorted(seeds) and 1 <= len(ex.resubmitted) <= SHADOWS + 1 - 1
    resubmitted = {seeds[i] for i in ex.resubmitted}
    assert {s for s, n in ran.items() if n == 2} <= resubmitted and max(ran.values()) == 2
    assert all(ran[s] == 1 for s in seeds if s not in resubmitted)


def _always_dies(task):
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def test_a_task_that_always_kills_its_worker_is_one_error_after_the_retries():
    ex = ProcessExecutor(workers=1, retries=1)
    with pytest.raises(
        RuntimeError,
        match=r"1 task\(s\) lost their worker process 2 times \(first: "
        r"task 0\)",
    ):
        ex.map(_always_dies, [0])
    assert ex.resubmitted == [0]


@pytest.mark.slow
def test_ray_retries_the_lost_task(calls):
    ray = pytest.importorskip("ray")
    from test_recipe_audit import _pythonpath

    x, y = digits()
    serial = _serial(x, y)
    for f in calls.glob("call-*"):
        f.unlink()
    env = {k: os.environ[k] for k in ("PRIVKIT_TEST_KILL_DIR", "PRIVKIT_TEST_MAIN_PID")}
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": _pythonpath(), **env}},
    )
    try:  # a local cluster of two worker processes; Ray re-runs a task whose worker died
        on_ray = audit_recipe(logreg_losing_its_worker, x, y, executor="ray", **KW).to_dict()
    finally:
        ray.shutdown()
    on_ray.pop("experiment")
    assert (calls / "killed").exists()
    assert on_ray == serial
    # the killed task alone ran again (Ray's max_retries); the others once
    assert sorted(_calls(calls).values()) == [1] * SHADOWS + [2]
