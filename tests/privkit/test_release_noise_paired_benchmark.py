"""benchmarks/release_noise_paired.py in a small configuration: a past revision's release noise
swapped in and out within one process, its JSON, and bad input refused with exit code 2."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "release_noise_paired.py"


def _run(*args):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600
    )


def _script():
    spec = importlib.util.spec_from_file_location("release_noise_paired", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_before_swaps_the_past_revisions_draw_in_and_after_restores_this_one():
    from privkit.mechanisms import grid_noise
    from privkit.mechanisms.dp_random import DpRandom

    bench = _script()
    old = bench.load_revision("HEAD")
    mine = grid_noise.grid_release
    with bench.revision(old):
        assert grid_noise.grid_release is old.grid_release
        assert isinstance(DpRandom.secret().bits(), old.NumpyBits)
        # the past revision's draw still releases on its grid
        grid = grid_noise.Grid.for_release(1.0, 1.0, 100)
        out = grid_noise.grid_release(torch.zeros(100), grid, DpRandom.secret().bits())
        assert torch.equal(out.double() / grid.gamma, torch.round(out.double() / grid.gamma))
    assert grid_noise.grid_release is mine
    assert isinstance(DpRandom.secret().bits(), grid_noise.CipherBits)


def test_the_benchmark_reports_both_sides_and_their_ratio():
    run = _run("--before", "HEAD", "--methods", "dpsgd", "--repeats", "1", "--n", "3000", "--json")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["schema_version"] == 1 and out["sizes"] == [3000]
    assert set(out["results"]) == {"release_3000", "dpsgd"}
    for r in out["results"].values():
        assert r["before_s"] > 0 and r["after_s"] > 0
        assert r["ratio"] == pytest.approx(r["after_s"] / r["before_s"], rel=5e-3)
        (a,), (b,) = r["after_all_s"], r["before_all_s"]
        assert r["ratio_paired_median"] == pytest.approx(a / b, rel=5e-3)


@pytest.mark.parametrize(
    "args, named",
    [
        (["--before", "HEAD", "--repeats", "0"], "--repeats must be >= 1; found 0"),
        (["--before", "HEAD", "--methods", "nope"], "unknown method 'nope'"),
        (["--before", "HEAD", "--n", "10,x"], "found '10,x'"),
        (["--before", "no-such-rev"], "'no-such-rev'"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(args, named):
    run = _run(*args)
    assert run.returncode == 2 and named in run.stderr.splitlines()[-1]
