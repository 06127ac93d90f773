"""benchmarks/device_waits.py off a GPU: a wait is attributed to the innermost line of privkit's
packages, only torch's synchronisation warnings are counted, and a device without CUDA's check is
refused in one line with exit code 2 (the steps themselves run on a GPU, by run_gpu.sh)."""

import subprocess
import sys
import traceback
import warnings
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import device_waits  # noqa: E402  (the benchmarks folder, as the script runs)


def test_a_wait_is_attributed_to_the_innermost_line_of_privkit():
    root = device_waits.ROOT
    stack = [
        traceback.FrameSummary(str(root / "tests" / "t.py"), 3, "test"),
        traceback.FrameSummary(str(root / "privkit" / "mechanisms" / "gaussian.py"), 40, "f"),
        traceback.FrameSummary(str(root / "attacks" / "whitebox.py"), 7, "observe"),
        traceback.FrameSummary("/usr/lib/python3/site-packages/torch/x.py", 1, "to"),
    ]
    assert device_waits.site_of(stack) == "attacks/whitebox.py:7 observe"
    assert device_waits.site_of(stack[:1] + stack[3:]) == "outside privkit"


def test_only_synchronisation_warnings_are_counted():
    with device_waits.waits() as sites:
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        warnings.warn("something else", UserWarning, stacklevel=1)
    assert sum(sites.values()) == 2 and set(sites) == {"outside privkit"}


@pytest.mark.parametrize(
    "args, named",
    [
        (
            ["--device", "cpu", "--train", "dpsgd"],
            "--train lists a training's waits on a CUDA device",
        ),
        (["--device", "gpu!"], "found gpu!"),
        (["--steps", "0"], "--steps must be >= 1 and --canaries >= 0; found 0, 500"),
        (["--models", "resnet_small,alexnet"], "--models must name models of dpsgd_step.py"),
        (["--train", "dpsgd,fedsgd"], "--train must name privkit's methods; found 'fedsgd'"),
    ],
)
def test_bad_input_is_refused_in_one_line(args, named):
    run = subprocess.run(
        [sys.executable, str(BENCH / "device_waits.py"), *args], capture_output=True, text=True
    )
    assert run.returncode == 2 and named in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


def test_a_training_s_waits_are_those_of_its_second_run(monkeypatch):
    """``--train``: one quick training first (its first-use costs), then the waits of a second;
    on the CPU a stand-in training that makes one synchronising call per run, counted once."""
    import torch

    import privkit.flower_engine.engine as engine

    calls = []

    def train(method, fed, cfg, seed):
        calls.append((method, cfg["device"], seed))
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)

    monkeypatch.setattr(engine, "train", train)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    with warnings.catch_warnings():  # the first run's, not counted, not shown
        warnings.simplefilter("ignore")
        out = device_waits.measure_training("dpsgd", torch.device("cpu"))
    assert calls == [("dpsgd", "cpu", 0)] * 2
    assert out == {"method": "dpsgd", "waits_per_training": 1, "sites": {"outside privkit": 1}}
