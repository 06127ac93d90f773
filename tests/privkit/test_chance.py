"""Near-chance accuracy: the threshold, the warning in TrainResult/metrics.json, and the CLI output."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from privkit.cli import app
from privkit.data import FederationConfig, build_federation
from privkit.methods.chance import chance_level, chance_warning, near_chance_threshold
from privkit.trainers import TrainResult, train

runner = CliRunner()
NO_LEARNING = {"arch": "mlp", "feature_dim": 8, "rounds": 1, "lr": 1e-12, "participation": 1.0}
LEARNING = {"arch": "mlp", "feature_dim": 16, "rounds": 2, "local_epochs": 3, "participation": 1.0}


@pytest.fixture(scope="module")
def fed():
    return build_federation(FederationConfig(clients=3, partition="iid", seed=0))


def test_threshold_is_a_tenth_of_the_way_from_chance_to_perfect():
    assert near_chance_threshold(0.1) == pytest.approx(0.19)
    assert near_chance_threshold(0.5) == pytest.approx(0.55)
    assert chance_warning("m", 0.19, 0.1) is not None  # at the threshold: warns
    assert chance_warning("m", 0.1901, 0.1) is None
    w = chance_warning("fedx", 0.108, 0.1)
    assert w.startswith("near-chance accuracy: fedx ends at test accuracy 0.1080, chance is 0.1000")
    assert chance_warning("m", float("nan"), 0.1) is None


def test_chance_is_the_most_frequent_test_class(fed):
    _, y = fed.test_arrays()
    assert chance_level(fed) == pytest.approx(np.bincount(y).max() / len(y))


def test_a_run_that_learns_nothing_warns_and_metrics_say_so(fed, tmp_path):
    res = train("fedavg", fed, NO_LEARNING, seed=0)
    assert res.test_accuracy <= near_chance_threshold(res.chance_accuracy)
    assert res.near_chance and res.warnings[0].startswith("near-chance accuracy: fedavg ends at")
    res.save(tmp_path)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["near_chance"] is True and metrics["chance_accuracy"] == pytest.approx(
        chance_level(fed)
    )
    assert metrics["warnings"] == [res.warnings[0]]
    # train.json carries it too (the report lists a run's warnings from there)
    assert TrainResult.load(tmp_path).warnings[0] == res.warnings[0]


def test_a_run_that_learns_does_not_warn(fed, tmp_path):
    res = train("fedavg", fed, LEARNING, seed=0)
    assert res.test_accuracy > near_chance_threshold(res.chance_accuracy)
    assert not res.near_chance and not any(w.startswith("near-chance") for w in res.warnings)
    res.save(tmp_path)
    assert json.loads((tmp_path / "metrics.json").read_text())["warnings"] == []


def test_cli_names_the_method_and_its_accuracy(tmp_path):
    sets = [x for k, v in NO_LEARNING.items() for x in ("--set", f"{k}={v}")]
    fed_sets = ["--federation-set", "clients=3", "--federation-set", "partition=iid"]
    res = runner.invoke(app, ["train", "fedavg", *sets, *fed_sets, "--out", str(tmp_path / "r")])
    assert res.exit_code == 0, res.output
    assert "warning: near-chance accuracy: fedavg ends at test accuracy" in " ".join(
        res.stdout.split()
    )
    res = runner.invoke(
        app, ["train", "fedavg", *sets, *fed_sets, "--out", str(tmp_path / "j"), "--json"]
    )
    summary = json.loads(res.stdout)
    assert summary["near_chance"] is True and summary["chance_accuracy"] > 0
