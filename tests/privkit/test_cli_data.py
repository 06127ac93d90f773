"""`privkit --version`, `privkit data list`, `privkit data split` and the one-line error contract."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

import privkit
from privkit.cli import app

runner = CliRunner()


def _cli(*args):
    """Run the real console entry point in a subprocess (exit codes and stderr as a user sees them)."""
    return subprocess.run(
        [sys.executable, "-c", "from privkit.cli import main; main()", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_version():
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and privkit.__version__ in res.stdout


def test_data_list_json():
    res = runner.invoke(app, ["data", "list", "--json"])
    names = {d["name"]: d["embedded"] for d in json.loads(res.stdout)["datasets"]}
    assert names["mnist5k"] is True and names["cifar10"] is False


def test_data_split_json_contract(tmp_path):
    res = runner.invoke(
        app,
        [
            "data",
            "split",
            "--dataset",
            "mnist5k",
            "--clients",
            "20",
            "--alpha",
            "0.01",
            "--seed",
            "0",
            "--json",
            "--save",
            str(tmp_path / "split.json"),
        ],
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert len(out["clients"]) == 20
    assert all(
        c["size"] == sum(c["class_counts"]) and len(c["class_counts"]) == 10 for c in out["clients"]
    )
    assert out["top_class_shares"][0] >= 0.8 and abs(sum(out["top_class_shares"])) <= 1.0 + 1e-9
    saved = json.loads((tmp_path / "split.json").read_text())
    assert [len(c) for c in saved["clients"]] == [c["size"] for c in out["clients"]]


def test_data_split_table_output():
    res = runner.invoke(app, ["data", "split", "--clients", "3", "--partition", "shards"])
    assert res.exit_code == 0 and "mean share of each client's 3 largest classes" in res.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--alpha", "0"], "alpha: Input should be greater than 0 (found 0.0)"),
        (["--clients", "100000"], "clients must be <= the number of samples to split"),
        (["--dataset", "imagenet"], "dataset must be one of"),
        (
            ["--dataset", "cifar10", "--data-root", "/nonexistent"],
            "dataset file not found: /nonexistent/cifar-10-batches-py",
        ),
        (["--partition", "zipf"], "partition: Input should be 'dirichlet', 'iid' or 'shards'"),
    ],
)
def test_bad_input_is_one_line_exit_2(args, message):
    res = _cli("data", "split", *args)
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], res.stderr
    assert "Traceback" not in res.stderr
