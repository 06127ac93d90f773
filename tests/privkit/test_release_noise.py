"""Release mode: DP noise and amplifying sampling are secret; everything else follows the seed.

Two release-mode runs with the same seed must agree in the data split, the model initialisation,
the client sampling and the ledger, and differ in the noise and the Poisson batches (which the
accountant's amplification assumes secret). Reproducible mode must repeat bit for bit, and say
"reproducible noise: not for release" in the ledger, the result and the CLI output.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from accountants import NOT_FOR_RELEASE, Ledger
from privkit.cli import app
from privkit.data import FederationConfig, build_federation
from privkit.mechanisms import dp_sgd_step
from privkit.seeding import noise_generator, noise_rng
from privkit.trainers import dp_fedavg, train

TINY = {
    "arch": "mlp",
    "feature_dim": 16,
    "rounds": 2,
    "local_steps": 2,
    "batch_size": 32,
    "client_fraction": 0.25,
    "noise_multiplier": 2.0,
    "target_epsilon": 1e6,
    "lr": 0.1,
    "device": "cpu",
}


@pytest.fixture(scope="module")
def fed():
    return build_federation(FederationConfig(partition="shards", clients=20, seed=0))


def test_generators_secret_in_release_mode_and_seeded_otherwise():
    a, b = (
        noise_generator(7, "noise", reproducible=False),
        noise_generator(7, "noise", reproducible=False),
    )
    assert not torch.equal(a.randn(8), b.randn(8))
    a, b = (
        noise_generator(7, "noise", reproducible=True),
        noise_generator(7, "noise", reproducible=True),
    )
    assert torch.equal(a.randn(8), b.randn(8))
    assert not np.array_equal(
        noise_rng(7, "x", reproducible=False).normal(size=8),
        noise_rng(7, "x", reproducible=False).normal(size=8),
    )
    assert np.array_equal(
        noise_rng(7, "x", reproducible=True).normal(size=8),
        noise_rng(7, "x", reproducible=True).normal(size=8),
    )


REAL = (dp_fedavg._local_update, dp_sgd_step.poisson_batch, dp_sgd_step.gaussian_release)


def _recorded_run(monkeypatch, fed, **over):
    """dp-fedavg with the initial model, the Poisson batches and the noise of every step recorded."""
    seen = {"init": [], "batches": [], "noise": []}
    real_update, real_sample, real_noise = REAL

    def update(global_model, *args, **kwargs):
        if not seen["init"]:
            seen["init"].append({k: v.clone() for k, v in global_model.state_dict().items()})
        return real_update(global_model, *args, **kwargs)

    def sample(n, q, generator):
        idx = real_sample(n, q, generator)
        seen["batches"].append(idx.clone())
        return idx

    def noise(total, **kw):
        out, receipt = real_noise(total, **kw)
        seen["noise"].append(torch.cat([(out[k] - total[k]).flatten() for k in sorted(total)]))
        return out, receipt

    monkeypatch.setattr(dp_fedavg, "_local_update", update)
    monkeypatch.setattr(dp_sgd_step, "poisson_batch", sample)
    monkeypatch.setattr(dp_sgd_step, "gaussian_release", noise)
    result = train("dp-fedavg", fed, {**TINY, **over}, seed=3)
    return result, seen


def _same_everything_but_secret_randomness(r1, s1, r2, s2):
    for k, v in s1["init"][0].items():  # initialisation follows the seed
        assert torch.equal(v, s2["init"][0][k])
    assert [r["clients"] for r in r1.rounds] == [
        r["clients"] for r in r2.rounds
    ]  # client sampling too
    assert r1.ledger.to_dict() == r2.ledger.to_dict()  # so does what is accounted
    assert len(s1["noise"]) == len(s2["noise"]) > 0


def test_two_release_runs_differ_in_noise_and_batches_only(monkeypatch, fed):
    r1, s1 = _recorded_run(monkeypatch, fed)
    r2, s2 = _recorded_run(monkeypatch, fed)
    _same_everything_but_secret_randomness(r1, s1, r2, s2)
    assert all(not torch.equal(a, b) for a, b in zip(s1["noise"], s2["noise"]))
    assert any(not torch.equal(a, b) for a, b in zip(s1["batches"], s2["batches"]))
    assert not torch.equal(next(r1.model.parameters()), next(r2.model.parameters()))
    assert not r1.reproducible_noise and r1.ledger.to_dict()["reproducible_noise"] is False
    assert "noise" not in r1.ledger.to_dict() and not any(NOT_FOR_RELEASE in w for w in r1.warnings)


def test_reproducible_mode_repeats_and_is_stamped(monkeypatch, fed, tmp_path):
    r1, s1 = _recorded_run(monkeypatch, fed, reproducible_noise=True)
    r2, s2 = _recorded_run(monkeypatch, fed, reproducible_noise=True)
    _same_everything_but_secret_randomness(r1, s1, r2, s2)
    assert all(torch.equal(a, b) for a, b in zip(s1["noise"], s2["noise"]))
    assert all(torch.equal(a, b) for a, b in zip(s1["batches"], s2["batches"]))
    for a, b in zip(r1.model.parameters(), r2.model.parameters()):
        assert torch.equal(a, b)
    assert r1.reproducible_noise and any(NOT_FOR_RELEASE in w for w in r1.warnings)
    saved = json.loads(r1.ledger.save(tmp_path / "ledger.json").read_text())
    assert saved["reproducible_noise"] is True and saved["noise"] == NOT_FOR_RELEASE
    assert Ledger.load(tmp_path / "ledger.json").reproducible_noise is True
    assert r1.ledger.summary(1e-5, accountants=["rdp"])["noise"] == NOT_FOR_RELEASE


def test_opacus_dpsgd_noise_is_secret_in_release_mode(fed):
    cfg = {
        "epochs": 1,
        "arch": "mlp",
        "width": 4,
        "feature_dim": 8,
        "batch_size": 256,
        "noise_multiplier": 1.0,
        "device": "cpu",
    }
    a, b = train("dpsgd", fed, cfg, seed=1), train("dpsgd", fed, cfg, seed=1)
    assert not torch.equal(next(a.model.parameters()), next(b.model.parameters()))
    c, d = (train("dpsgd", fed, {**cfg, "reproducible_noise": True}, seed=1) for _ in range(2))
    for p, q in zip(c.model.parameters(), d.model.parameters()):
        assert torch.equal(p, q)


def test_train_cli_stamps_reproducible_runs(tmp_path):
    runner = CliRunner()
    args = [
        "train",
        "dp-fedavg",
        "--quick",
        "--set",
        "rounds=1",
        "--set",
        "local_steps=1",
        "--set",
        "arch=mlp",
        "--set",
        "feature_dim=8",
        "--federation-set",
        "clients=4",
        "--out",
        str(tmp_path / "run"),
        "--json",
        "--reproducible-noise",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["reproducible_noise"] is True and out["noise"] == NOT_FOR_RELEASE
    assert any(NOT_FOR_RELEASE in w for w in out["warnings"])
    assert json.loads((tmp_path / "run" / "ledger.json").read_text())["noise"] == NOT_FOR_RELEASE
