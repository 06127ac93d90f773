"""Executors (serial, local processes, a caller's concurrent.futures pool) give identical results."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from attacks.executor import SerialExecutor, get_executor, run_tasks
from attacks.experiment import stream_seeds


def _square_plus_noise(task):
    seed, x = task
    return x * x + float(np.random.default_rng(seed).random())


@pytest.mark.parametrize("name", ["serial", "process", None])
def test_executors_give_identical_results(name):
    tasks = list(zip(stream_seeds(0, 4, "t"), range(4)))
    expected = [_square_plus_noise(t) for t in tasks]
    assert run_tasks(_square_plus_noise, tasks, executor=name, workers=2) == expected


def test_a_callers_futures_pool_keeps_task_order():
    tasks = list(zip(stream_seeds(1, 6, "t"), range(6)))
    with ThreadPoolExecutor(3) as pool:
        assert run_tasks(_square_plus_noise, tasks, executor=pool) == [
            _square_plus_noise(t) for t in tasks
        ]


def test_an_executor_object_is_used_as_is():
    ex = SerialExecutor()
    assert get_executor(ex) is ex


def test_unknown_executor():
    with pytest.raises(
        ValueError, match="executor must be one of serial, process, ray; found 'gpu'"
    ):
        get_executor("gpu")
    with pytest.raises(
        ValueError, match="executor must be one of serial, process, ray, a concurrent"
    ):
        get_executor(3)
    with pytest.raises(ValueError, match="workers must be >= 1; found 0"):
        get_executor("process", 0)
