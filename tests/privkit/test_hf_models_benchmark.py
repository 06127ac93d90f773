"""benchmarks/hf_models.py in a small configuration: its JSON, the paths it reports against the
tests' (GPT-2 by ghost clipping now, ResNet's BatchNorm by torch.func), its norms' agreement,
and bad input refused with exit code 2."""

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
    assert resnet["path"].startswith("torch.func") and "BatchNorm2d" in resnet["path"]
    assert set(gpt2["vs_sgd"]) == {"sgd", "privkit", "torch_func"} and gpt2["vs_sgd"]["sgd"] == 1


@pytest.mark.parametrize(
    "args, named",
    [(["--repeats", "0"], "--repeats must be >= 1; found 0"), (["--families", "xl"], "found xl")],
)
def test_bad_input_is_one_line_and_exit_code_2(args, named):
    run = _run(*args)
    assert run.returncode == 2 and named in run.stderr.splitlines()[-1]
