"""FedProx's proximal term acts at its default strength (issue: fedavg and fedprox with mu = 0.01
printed the same accuracy and AUC in the quickstart report)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from privkit.data import FederationConfig, build_federation
from privkit.trainers import get_trainer, train
from privkit.trainers.fedavg import _prox_term


def test_proximal_term_value_and_gradient_match_the_closed_form():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    anchor = {k: v.detach().clone() for k, v in model.named_parameters()}
    moved = copy.deepcopy(model)  # a local copy, as in a FedProx round
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(torch.randn_like(p))
    mu = 0.01
    value = _prox_term(mu, anchor)(moved, torch.zeros(1, 5), torch.zeros(1, 2))
    value.backward()
    diffs = {k: p.detach() - anchor[k] for k, p in moved.named_parameters()}
    expected = 0.5 * mu * sum(float(d.pow(2).sum()) for d in diffs.values())
    assert float(value.detach()) == pytest.approx(expected, rel=1e-6)
    for (
        k,
        p,
    ) in moved.named_parameters():  # d/dtheta (mu/2)||theta - theta_t||^2 = mu (theta - theta_t)
        torch.testing.assert_close(p.grad, mu * diffs[k])


def test_default_fedprox_differs_from_fedavg():
    """Same seed, same federation: only the proximal term (default mu) separates the two."""
    torch.set_num_threads(1)
    fed = build_federation(
        FederationConfig(dataset="digits", public_dataset=None, clients=4, partition="iid")
    )
    base = {"arch": "mlp", "rounds": 2}
    prox_cfg = {**get_trainer("fedprox").quick_config(), **base}
    assert prox_cfg["mu"] == get_trainer("fedprox").defaults()["mu"] == 0.01
    avg_cfg = {k: v for k, v in prox_cfg.items() if k != "mu"}
    a = train("fedavg", fed, avg_cfg, seed=0).model.state_dict()
    b = train("fedprox", fed, prox_cfg, seed=0).model.state_dict()
    gap = max(float((a[k] - b[k]).abs().max()) for k in a)
    same_recipe = train("fedavg", fed, avg_cfg, seed=0).model.state_dict()
    assert all(torch.equal(a[k], same_recipe[k]) for k in a)  # the gap is not run-to-run noise
    assert gap > 1e-4, gap
    assert np.isfinite(gap)
