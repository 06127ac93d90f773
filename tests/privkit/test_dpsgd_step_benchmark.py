"""benchmarks/dpsgd_step.py in a small configuration: its JSON (every variant timed, the ratios
from the interleaved repeats), the clock it says it used with one torch thread and with several,
and bad input refused in one line with exit code 2."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "dpsgd_step.py"


def _run(*args):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize("threads", [1, 2])
def test_the_benchmark_times_every_variant_on_the_threads_asked(threads):
    run = _run("--models", "resnet_small", "--repeats", "2", "--threads", str(threads), "--json")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["schema_version"] == 1 and out["threads"] == threads
    r = out["models"]["resnet_small"]
    assert r["privkit_path"] == "ghost_clipping"
    variants = {"sgd", "opacus_hooks", "opacus_ghost", "privkit", "privkit_seeded"}
    assert set(r["times_ms"]) == variants and all(len(t) == 2 for t in r["times_ms"].values())
    for v, times in r["times_ms"].items():  # the ratios are the repeats' paired ratios
        pairs = zip(times, r["times_ms"]["sgd"], strict=True)
        assert r["vs_sgd"][v] == pytest.approx(statistics.median(a / b for a, b in pairs))
    assert r["median_ms"]["sgd"] == pytest.approx(statistics.median(r["times_ms"]["sgd"]))


@pytest.mark.parametrize(
    "args, named",
    [
        (["--repeats", "0"], "--repeats must be >= 1; found 0"),
        (["--threads", "0"], "--threads must be >= 1; found 0"),
        (["--threads", "2", "--device", "meta"], "found --device meta"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(args, named):
    run = _run(*args)
    assert run.returncode == 2 and named in run.stderr.splitlines()[-1]
