"""The public validation of an audit's FedKADP reference runs in one stacked pass
(:func:`privkit.batched.many_dpfed.stacked_validation`): each run's (loss, accuracy) as its own
evaluation gives them, for the reference runs only; the target validates as its single run."""

from __future__ import annotations

import pytest
import torch
from audit_helpers import TINY_DPFED, subset_federations

from privkit.batched import many_dpfed
from privkit.data import FederationConfig, build_federation
from privkit.methods.contract import make_config
from privkit.trainers.dp_fedavg import _public_eval
from privkit.trainers.fedkadp import run_for

# a budget the Renyi filter admits for all four rounds (at 1e6 its order-1.1 budget stops at round 3)
CONFIG = {**TINY_DPFED, "rounds": 4, "target_epsilon": 50.0, "reproducible_noise": True}


@pytest.fixture(scope="module")
def feds():
    fed = build_federation(FederationConfig(partition="dirichlet", clients=8, seed=0))
    return subset_federations(fed, 4)


def _runs(feds, method="fedkadp", **extra):
    cfg = make_config(method, {**CONFIG, **extra})
    return [run_for(method, f, cfg, seed) for seed, f in enumerate(feds)]


def test_stacked_validation_is_each_runs_own(feds):
    """Four runs of distinct initial models (their seeds) on one federation layout's public
    digits: the stacked pass gives each run's own evaluation's loss to float rounding and the
    same accuracy; a run over other validation records is refused."""
    runs = _runs(feds)
    got = many_dpfed.stacked_validation(runs)
    for run, (loss, acc) in zip(runs, got):
        want_loss, want_acc = _public_eval(run.model, run.x_val, run.y_val, run.device)
        assert loss == pytest.approx(want_loss, rel=1e-5)
        assert acc == want_acc
    assert len({loss for loss, _ in got}) == len(runs)  # distinct models, distinct losses
    other = _runs(feds[:1])[0]
    other.federation = build_federation(FederationConfig(partition="dirichlet", clients=8, seed=1))
    with pytest.raises(ValueError, match="same validation records"):
        many_dpfed.stacked_validation(runs[:1] + [other])


def test_reference_runs_validate_together_and_the_target_alone(feds, monkeypatch):
    """In a batched FedKADP audit (one target, three reference runs) every round's stacked pass
    holds the three reference runs and never the target; every run records a validation loss
    each round (what its feedback read)."""
    seen: list[list[int]] = []
    real = many_dpfed.stacked_validation

    def spy(runs):
        seen.append([r.seed for r in runs])
        return real(runs)

    monkeypatch.setattr(many_dpfed, "stacked_validation", spy)
    cfg = make_config("fedkadp", CONFIG)
    results = many_dpfed.train_dpfed_many(
        "fedkadp", feds, [cfg] * 4, [10, 11, 12, 13], [False, True, True, True]
    )
    assert seen == [[11, 12, 13]] * CONFIG["rounds"]
    for res in results:
        assert len(res.rounds) == CONFIG["rounds"]
        assert all(r["loss"] == r["loss"] for r in res.rounds)  # validated: not NaN


def test_a_cnn_reference_run_validates_alone(feds):
    """Convolutional models have no stacked pass: their reference runs validate one by one
    (their feedback still reads a loss each round)."""
    cfg = make_config("fedkadp", {**CONFIG, "arch": "cnn", "width": 4, "rounds": 2})
    results = many_dpfed.train_dpfed_many(
        "fedkadp", feds[:3], [cfg] * 3, [1, 2, 3], [False, True, True]
    )
    for res in results:
        assert all(torch.isfinite(torch.tensor(r["loss"])) for r in res.rounds)
