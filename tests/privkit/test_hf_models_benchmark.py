"""benchmarks/hf_models.py in a small configuration: its JSON, the paths it reports against the
tests' (GPT-2 and ResNet, its BatchNorm in eval mode, by ghost clipping), its norms' agreement,
each step's peak memory in a process of its own, the trace's cost per operation, and bad input
refused with exit code 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "hf_models.py"


def _run(*args):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600
    )


def test_the_benchmark_reports_paths_norms_and_ratios():
    run = _run("--families", "gpt2,resnet", "--repeats", "1", "--batch", "4", "--json")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["schema_version"] == 1
    gpt2, resnet = out["families"]["gpt2"], out["families"]["resnet"]
    assert gpt2["path"] == "ghost_clipping" and gpt2["max_relative_difference"] < 1e-12
    assert resnet["path"] == "ghost_clipping" and resnet["max_relative_difference"] < 1e-12
    assert set(gpt2["vs_sgd"]) == {"sgd", "privkit", "torch_func"} and gpt2["vs_sgd"]["sgd"] == 1


def test_peak_memory_per_step_in_processes_of_their_own():
    """Each variant's peak in a fresh process: the same memory before the first step in each
    (one process would carry the earlier variants' peaks into the later ones' start), and both
    DP-SGD steps above plain SGD's (each holds per-example quantities SGD does not)."""
    run = _run(
        "--families", "t5", "--batch", "16", "--width", "128", "--length", "16", "--memory",
        "--check-only", "--json",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    t5 = json.loads(run.stdout)["families"]["t5"]
    assert t5["path"] == "ghost_clipping"
    memory = t5["memory"]
    assert all(0 < m["before_gb"] <= m["peak_gb"] for m in memory.values()), memory
    starts = [m["before_gb"] for m in memory.values()]
    assert max(starts) - min(starts) < 0.05, memory
    assert memory["sgd"]["peak_gb"] < min(
        memory["privkit"]["peak_gb"], memory["torch_func"]["peak_gb"]
    )


def test_the_trace_cost_is_a_pass_plain_against_traced():
    """``--trace-cost``: both passes timed, the ratio and the cost per operation from them."""
    run = _run("--families", "swin", "--check-only", "--trace-cost", "--repeats", "3", "--json")
    assert run.returncode == 0, run.stderr
    cost = json.loads(run.stdout)["families"]["swin"]["trace_cost"]
    assert cost["plain_ms"] > 0 and cost["traced_ms"] > 0 and cost["ratio"] > 0
    assert cost["operations"] > 50  # Swin's forward: attention, windows, norms, MLPs
    added = (cost["traced_ms"] - cost["plain_ms"]) * 1e3 / cost["operations"]
    assert cost["us_per_operation"] == pytest.approx(added)


@pytest.mark.parametrize(
    "args, named",
    [
        (["--repeats", "0"], "--repeats must be >= 1; found 0"),
        (["--layers", "0"], "--layers must be >= 1; found 0"),
        (["--families", "xl"], "found xl"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(args, named):
    run = _run(*args)
    assert run.returncode == 2 and named in run.stderr.splitlines()[-1]
