"""Audits of Flower apps (privkit.flower.audit): a dp-fedavg Flower app's DP-SGD mechanism takes the
white-box canaries inside its ClientApps (Ray actors) and conforms to its ledger when correct; with
half the noise its ledger accounts for, the audit says violation for the noise. And the CLI path:
``privkit train --engine flower`` writes the same run as in-process, ``privkit audit`` audits it
on Flower (mechanism canaries; fair-coin target and reference runs in one simulation).

Each Flower simulation on Ray starts Ray (seconds): the module runs three, so its tests are marked slow;
the configuration is small (two clients, four rounds of five DP-SGD steps) in every mode.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

pytest.importorskip("flwr")
pytest.importorskip("ray")

from audit_helpers import tiny_federation_config

from privkit.audit.recipes import federation_over
from privkit.cli import app
from privkit.data import build_federation
from privkit.flower.audit import audit_app, audit_app_mechanisms
from privkit.flower_engine.engine import method_app
from privkit.trainers import get_trainer, train

pytestmark = pytest.mark.slow
runner = CliRunner()
DELTA = 1e-5
SMALL = {"rounds": 4, "local_steps": 5, "client_fraction": 1.0}
FED_SETS = ["--federation-set", "clients=2", "--federation-set", 'partition="iid"']
TRAIN_SETS = [a for k, v in SMALL.items() for a in ("--set", f"{k}={str(v).lower()}")]


@pytest.fixture(scope="module")
def base():
    torch.set_num_threads(1)
    fed_cfg = tiny_federation_config(public_dataset=None, dataset="digits")
    return build_federation(fed_cfg)


def test_flower_app_mechanism_audit_correct_is_consistent(base, tmp_path):
    """privkit's dp-fedavg as a user-level Flower app (method_app) on the records the audit gives it.

    The app's noise is seeded: a correct mechanism passes a 95% test 95% of the time, so with
    release noise this test failed about one run in twenty by design (the test's error rate is
    measured on known mechanisms over many seeds in tests/attacks/test_release_law.py)."""
    cfg = {**get_trainer("dp-fedavg").quick_config(), **SMALL, "reproducible_noise": True}

    def app_fn(x, y, seed):
        return method_app(
            "dp-fedavg", federation_over(base, x, y, seed), cfg, seed, workdir=tmp_path
        )

    x, y = base.pooled_arrays()
    rec = audit_app_mechanisms(app_fn, x, y, delta=DELTA, seed=0)
    assert rec["status"] == "consistent", rec["message"]
    (probe,) = rec["probes"]
    assert probe["client"] == 0 and probe["mechanism"] == "dp-sgd"
    # the canaries saw every release of client 0: rounds x local steps
    assert probe["canaries"]["steps"] == SMALL["rounds"] * SMALL["local_steps"]


def test_audit_app_membership_fair_coins_and_reference_runs(base, tmp_path):
    """audit_app: the app's target run on the coin-included records, two reference runs of the same
    app on random halves (privkit's in-process Flower driver here: the same apps without Ray)."""
    cfg = {**get_trainer("dp-fedavg").quick_config(), **SMALL, "reproducible_noise": True}
    seen = []

    def app_fn(x, y, seed):
        seen.append(len(y))
        return method_app(
            "dp-fedavg", federation_over(base, x, y, seed), cfg, seed, workdir=tmp_path
        )

    x, y = base.pooled_arrays()
    half = len(y) // 2  # the claim: the same method's ledger on half the pool, the runs' data size
    claim = train(
        "dp-fedavg", federation_over(base, x[:half], y[:half], 0), cfg, seed=0
    ).ledger.epsilon(DELTA)
    res = audit_app(
        app_fn,
        x,
        y,
        delta=DELTA,
        accounted_epsilon=claim,
        shadows=2,
        driver="inprocess",
        attacks=["threshold", "lira"],
    )
    assert len(seen) == 3 and all(abs(n - half) <= 0.15 * len(y) for n in seen)
    assert res.experiment["recipe"].startswith("Flower app")
    assert res.verdict != "violation" and res.epsilon_lower_bound <= claim


def test_cli_flower_run_equals_inprocess_and_privkit_audit_audits_it_on_flower(tmp_path):
    runs = {}
    for engine in ("inprocess", "flower"):
        out = tmp_path / engine
        res = runner.invoke(
            app,
            [
                "train",
                "dp-fedavg",
                "--quick",
                *TRAIN_SETS,
                *FED_SETS,
                "--seed",
                "1",
                "--reproducible-noise",
                "--engine",
                engine,
                "--out",
                str(out),
                "--json",
            ],
        )
        assert res.exit_code == 0, res.output
        runs[engine] = out
    flower = runs["flower"]
    assert json.loads((flower / "config.json").read_text())["engine"] == "flower"
    assert "engine" not in json.loads((runs["inprocess"] / "config.json").read_text())
    a = torch.load(runs["inprocess"] / "checkpoints" / "model.pt")
    b = torch.load(flower / "checkpoints" / "model.pt")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-5
    assert json.loads((runs["inprocess"] / "ledger.json").read_text()) == json.loads(
        (flower / "ledger.json").read_text()
    )

    # white-box canaries in the ClientApps: half the noise the ledger accounts for is caught
    res = runner.invoke(
        app, ["audit", str(flower), "--mechanisms", "--mutation", "noise x1/2", "--json"]
    )
    assert res.exit_code == 0, res.output
    rec = json.loads(res.stdout)
    assert rec["status"] == "violation" and rec["probes"][0]["rejected"] == ["noise"], rec[
        "message"
    ]

    # membership: fair-coin target and two reference runs of the same Flower app, one simulation
    res = runner.invoke(
        app, ["audit", str(flower), "--shadows", "2", "--attacks", "threshold", "--json"]
    )
    assert res.exit_code == 0, res.output
    rec = json.loads((flower / "audit.json").read_text())
    assert "on flower" in rec["experiment"]["recipe"]
    assert len(rec["shadow_test_accuracy"]) == 2 and rec["audit_target_test_accuracy"] is not None
    assert rec["n_audit"]["members"] > 0 and rec["n_audit"]["nonmembers"] > 0
    assert rec["verdict"]["status"] != "violation", rec["verdict"]["message"]
