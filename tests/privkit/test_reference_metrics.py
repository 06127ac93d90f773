"""An audit's reference runs skip the metrics only a report reads (``privkit.batched.many.unreported``).

A reference run is the auditor's own model, never reported: its run object leaves out every
round's test accuracy (FLiP's: Eq. 5's model on each round's aggregate), its client models'
accuracies and the paper's claimed epsilon (what its
training reads, FedKADP's validation metrics, stays); dpsgd's, every epoch's test accuracy but the
last. What must hold: its model and final test
accuracy are bit for bit those of the same run taking every metric, and the target run keeps them
all.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from audit_helpers import TINY_DPFED, TINY_FEDAVG

from privkit.batched.many import train_many
from privkit.data import FederationConfig, build_federation


@pytest.mark.parametrize(
    "method, config",
    [
        ("dp-fedavg", TINY_DPFED),
        ("fedkadp", {**TINY_DPFED, "rounds": 3}),
        ("fedkd-dp", {**TINY_DPFED, "mentor_feature_dim": 24, "rounds": 2}),
        ("fedavg", TINY_FEDAVG),
        ("flip", {"k": 1, "rounds": 2, "local_epochs": 2, "feature_dim": 8}),
    ],
)
def test_reference_runs_skip_only_the_reported_metrics(monkeypatch, method, config):
    """Reference runs leave out the metrics only a report reads (every round's test accuracy, the
    client models' accuracies): their models are bit for bit those of runs that take them, and so
    is their final test accuracy; the target run keeps every metric."""
    from privkit.batched import many, many_dpfed, many_fedavg, many_flip

    fed = build_federation(FederationConfig(partition="dirichlet", clients=20, seed=0))
    refs = [False, True, True]
    skipped = train_many(method, [fed] * 3, config, [1, 2, 3], references=refs)
    for module in (many, many_dpfed, many_fedavg, many_flip):
        monkeypatch.setattr(module, "unreported", lambda runs, marks: None)
    taken = train_many(method, [fed] * 3, config, [1, 2, 3], references=refs)
    for s, t in zip(skipped[1:], taken[1:]):
        assert all(
            torch.equal(a, b)
            for a, b in zip(s.model.state_dict().values(), t.model.state_dict().values())
        )
        assert s.test_accuracy == t.test_accuracy
        assert np.isnan([r["test_accuracy"] for r in s.rounds[:-1]]).all()
        assert not np.isnan([r["test_accuracy"] for r in t.rounds]).any()
        assert not s.client_accuracy and len(t.client_accuracy) == len(t.client_models)
        assert len(t.client_models) > 0 or method in ("dp-fedavg", "fedkadp", "flip")
        if method in ("dp-fedavg", "fedkadp"):  # the paper's formula: reported only
            assert np.isnan(s.claims["epsilon"]) and np.isfinite(t.claims["epsilon"])
            assert s.claims["privkit_epsilon"] == t.claims["privkit_epsilon"]
    assert not np.isnan([r["test_accuracy"] for r in skipped[0].rounds]).any()


DPSGD = {"arch": "mlp", "feature_dim": 16, "epochs": 3, "batch_size": 64, "lr": 0.5}
DPSGD.update(device="cpu", noise_multiplier=1.0, clip_norm=1.0)


def test_dpsgd_reference_runs_evaluate_their_last_epoch_only(monkeypatch):
    """dpsgd's reference runs leave out every epoch's test accuracy but the last: their models,
    losses, ledgers and final accuracy are bit for bit those of runs that take every epoch's
    (all runs references: a release-mode run's secret batch sizes would pad the others' stacked
    products differently from call to call); the target run beside them keeps every epoch's."""
    from privkit.batched import many_dpsgd

    torch.set_num_threads(1)
    fed = build_federation(FederationConfig(partition="dirichlet", clients=20, seed=0))
    refs = [True, True]
    skipped = train_many("dpsgd", [fed] * 2, DPSGD, [1, 2], references=refs)
    monkeypatch.setattr(many_dpsgd, "unreported", lambda runs, marks: None)
    taken = train_many("dpsgd", [fed] * 2, DPSGD, [1, 2], references=refs)
    for s, t in zip(skipped, taken):
        assert all(
            torch.equal(a, b)
            for a, b in zip(s.model.state_dict().values(), t.model.state_dict().values())
        )
        assert s.test_accuracy == t.test_accuracy
        assert s.ledger.to_dict() == t.ledger.to_dict()
        assert [r["loss"] for r in s.rounds] == [r["loss"] for r in t.rounds]
        assert len(s.rounds) == DPSGD["epochs"]
        assert np.isnan([r["test_accuracy"] for r in s.rounds[:-1]]).all()
        assert s.rounds[-1]["test_accuracy"] == t.rounds[-1]["test_accuracy"] == t.test_accuracy
        assert not np.isnan([r["test_accuracy"] for r in t.rounds]).any()
    monkeypatch.undo()
    target, ref = train_many("dpsgd", [fed] * 2, DPSGD, [1, 2], references=[False, True])
    assert not np.isnan([r["test_accuracy"] for r in target.rounds]).any()
    assert np.isnan([r["test_accuracy"] for r in ref.rounds[:-1]]).all()
