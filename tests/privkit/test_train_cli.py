"""``privkit train``: run directory contents, --list, and one-line errors (exit 2) before training."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from accountants import Ledger
from privkit.cli import app
from privkit.trainers import REGISTRY

runner = CliRunner()
FED = ["--federation-set", "clients=3", "--federation-set", "alpha=1.0"]
TINY = ["--set", "feature_dim=16", "--set", "pretrain_epochs=1", "--set", "student_epochs=1"]


def test_list_json_shows_every_registered_method():
    res = runner.invoke(app, ["train", "--list", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    names = {m["name"] for m in data["methods"]}
    assert {
        "fedavg",
        "fedprox",
        "feddf",
        "fedaux",
        "fedauxfdp",
        "fedavg-dphead",
        "fedd-dphead",
    } <= names
    assert names == set(REGISTRY)  # reads the registry: the other engineers' methods too
    fdp = next(m for m in data["methods"] if m["name"] == "fedauxfdp")
    assert fdp["formal_dp"] is True
    assert fdp["defaults"]["class_epsilon"] == REGISTRY["fedauxfdp"].config_cls().class_epsilon
    assert fdp["paper"] and fdp["summary"] and fdp["quick"]


def test_train_writes_the_run_directory(tmp_path):
    out = tmp_path / "run"
    res = runner.invoke(
        app,
        [
            "train",
            "fedauxfdp",
            "--quick",
            *TINY,
            *FED,
            "--seed",
            "2",
            "--set",
            'sensitivity_bound="cfree"',
            "--out",
            str(out),
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    for name in (
        "config.json",
        "federation.json",
        "ledger.json",
        "metrics.json",
        "train.json",
        "artifacts.npz",
    ):
        assert (out / name).is_file(), name
    assert (out / "checkpoints" / "model.pt").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["schema_version"] == 1 and config["method"] == "fedauxfdp" and config["seed"] == 2
    assert (
        config["federation"]["clients"] == 3 and config["trainer"]["sensitivity_bound"] == "cfree"
    )
    assert config["trainer"]["feature_dim"] == 16
    metrics = json.loads((out / "metrics.json").read_text())
    assert 0 <= metrics["test_accuracy"] <= 1 and metrics["rounds"][0]["round"] == 1
    assert summary["test_accuracy"] == pytest.approx(metrics["test_accuracy"])
    ledger = Ledger.load(out / "ledger.json")
    assert sorted(ledger.clients) == ["0", "1", "2"]
    assert summary["epsilon"] == pytest.approx(ledger.epsilon(summary["delta"]))


def test_config_file_and_human_output(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        'method = "fedavg"\nseed = 1\n[federation]\nclients = 2\n'
        '[trainer]\narch = "mlp"\nfeature_dim = 16\nrounds = 1\n'
    )
    res = runner.invoke(app, ["train", "--config", str(cfg), "--out", str(tmp_path / "r")])
    assert res.exit_code == 0, res.output
    assert "test accuracy" in res.stdout and "inf" in res.stdout
    assert json.loads((tmp_path / "r" / "config.json").read_text())["seed"] == 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "nosuch", "--out", "X"], "method must be one of"),
        (["train", "fedavg", "--set", "bogus=1", "--out", "X"], "--set key must be a field"),
        (["train", "fedavg", "--set", "rounds=0", "--out", "X"], "rounds"),
        (["train", "fedauxfdp", "--set", 'calibration="exact"', "--out", "X"], "calibration"),
        (["train", "fedavg", "--federation-set", "colour=1", "--out", "X"], "--federation-set key"),
        (["train", "fedavg"], "--out"),
    ],
)
def test_bad_input_is_an_error_before_training(tmp_path, args, message):
    args = [a.replace("X", str(tmp_path / "never")) for a in args]
    res = runner.invoke(app, args)
    assert isinstance(res.exception, ValueError) and message in str(res.exception)
    assert not (tmp_path / "never").exists()


def test_subprocess_one_line_error_exit_2(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from privkit.cli import main; main()",
            "train",
            "fedavg",
            "--set",
            "lr=-1",
            "--out",
            str(tmp_path / "never"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "lr" in lines[0] and "error" in lines[0]
    assert not (tmp_path / "never").exists()
