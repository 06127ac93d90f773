"""DP-SGD step (clipping, noise, Poisson sampling) and the centralised dpsgd / centralized trainers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from accountants import dpsgd_epsilon
from privkit.data import FederationConfig, build_federation
from privkit.errors import PrivkitError
from privkit.mechanisms.dp_sgd_step import (
    DpSgdStep,
    clip_per_sample,
    per_sample_gradients,
    poisson_batch,
)
from privkit.models import build_model
from privkit.trainers import train


def _ce(logits, target, aux):
    return F.cross_entropy(logits, target)


@pytest.fixture(scope="module")
def fed():
    return build_federation(FederationConfig(partition="shards", clients=20, seed=0))


def _linear_case():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    x = torch.tensor([[1.0, 2.0, -1.0], [0.1, 0.0, 0.2], [-3.0, 1.0, 4.0]])
    y = torch.tensor([0, 1, 1])
    return model, x, y


def _hand_grads(
    model: nn.Linear, x: torch.Tensor, y: torch.Tensor
) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample CE gradients of a linear model by the closed form (softmax - onehot) x^T."""
    w, b = (
        model.weight.detach().numpy().astype(np.float64),
        model.bias.detach().numpy().astype(np.float64),
    )
    xs = x.numpy().astype(np.float64)
    logits = xs @ w.T + b
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    r = p - np.eye(2)[y.numpy()]
    return np.einsum("bi,bj->bij", r, xs), r


def test_per_sample_gradients_match_closed_form_on_linear_model():
    model, x, y = _linear_case()
    g = per_sample_gradients(model, x, y, _ce)
    gw, gb = _hand_grads(model, x, y)
    np.testing.assert_allclose(g["weight"].numpy(), gw, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g["bias"].numpy(), gb, rtol=1e-5, atol=1e-6)


def test_noise_free_step_is_mean_of_hand_clipped_gradients():
    model, x, y = _linear_case()
    c, q, n = 0.5, 0.5, 6  # expected batch size q*n = 3
    gw, gb = _hand_grads(model, x, y)
    norms = np.sqrt((gw**2).sum((1, 2)) + (gb**2).sum(1))
    scale = np.minimum(1.0, c / norms)
    assert (norms > c).any() and (norms < c).any()  # the case exercises both branches
    want_w = (gw * scale[:, None, None]).sum(0) / (q * n)
    want_b = (gb * scale[:, None]).sum(0) / (q * n)
    step = DpSgdStep(clip_norm=c, noise_multiplier=0.0, sample_rate=q, dataset_size=n)
    got = step.noisy_gradient(model, x, y, _ce, torch.Generator().manual_seed(0))
    np.testing.assert_allclose(got["weight"].numpy(), want_w, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got["bias"].numpy(), want_b, rtol=1e-5, atol=1e-7)


def test_clipping_bounds_norms_and_keeps_small_gradients():
    grads = {"a": torch.tensor([[3.0, 4.0], [0.3, 0.4]]), "b": torch.tensor([[0.0], [0.0]])}
    clipped, norms = clip_per_sample(grads, 1.0)
    np.testing.assert_allclose(norms.numpy(), [5.0, 0.5])
    np.testing.assert_allclose(clipped["a"].numpy(), [[0.6, 0.8], [0.3, 0.4]], rtol=1e-6)
    with pytest.raises(PrivkitError, match="clip_norm"):
        clip_per_sample(grads, 0.0)


def test_noise_is_sigma_c_gaussian_divided_by_expected_batch():
    model = nn.Linear(50, 20)  # 1020 coordinates
    sigma, c, q, n = 2.0, 0.7, 0.1, 40
    step = DpSgdStep(clip_norm=c, noise_multiplier=sigma, sample_rate=q, dataset_size=n)
    empty_x, empty_y = torch.zeros(0, 50), torch.zeros(0, dtype=torch.long)
    gen, ref = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    draws = []
    for _ in range(20):
        g = step.noisy_gradient(model, empty_x, empty_y, _ce, gen)
        # exact: the noise is sigma*c*N(0,1) drawn in parameter-name order, divided by q*n
        for k in sorted(g):
            want = sigma * c * torch.randn(g[k].shape, generator=ref) / (q * n)
            torch.testing.assert_close(g[k], want)
        draws.append(torch.cat([g[k].flatten() for k in sorted(g)]))
    values = torch.cat(draws).numpy()
    assert values.std() == pytest.approx(sigma * c / (q * n), rel=0.03)
    assert abs(values.mean()) < 0.03 * sigma * c / (q * n)


def test_per_sample_gradients_match_opacus_and_single_sample_loop():
    from opacus import GradSampleModule

    torch.manual_seed(1)
    model = build_model("cnn", (1, 28, 28), 10, width=4, feature_dim=8)
    x, y = torch.rand(5, 1, 28, 28), torch.randint(0, 10, (5,))
    ours = per_sample_gradients(model, x, y, _ce)
    # loop of single-sample backward passes
    for i in range(5):
        model.zero_grad()
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        for k, p in model.named_parameters():
            torch.testing.assert_close(ours[k][i], p.grad, rtol=1e-4, atol=1e-6)
    # opacus' hooks (loss summed so grad_sample is each record's own gradient)
    gsm = GradSampleModule(
        build_model("cnn", (1, 28, 28), 10, width=4, feature_dim=8), loss_reduction="sum"
    )
    gsm._module.load_state_dict(model.state_dict())
    F.cross_entropy(gsm(x), y, reduction="sum").backward()
    for k, p in gsm._module.named_parameters():
        torch.testing.assert_close(ours[k], p.grad_sample, rtol=1e-4, atol=1e-6)


def test_poisson_batch_rate_and_validation():
    gen = torch.Generator().manual_seed(0)
    sizes = [len(poisson_batch(200, 0.1, gen)) for _ in range(400)]
    # Binomial(200, 0.1): mean 20, sd of the mean over 400 draws = sqrt(18/400) ~ 0.21
    assert np.mean(sizes) == pytest.approx(20, abs=1.0)
    assert np.var(sizes) == pytest.approx(18, rel=0.25)
    assert len(set(sizes)) > 5  # variable batch sizes, not a fixed-size batch
    with pytest.raises(PrivkitError, match="sample_rate"):
        poisson_batch(10, 0.0, gen)
    with pytest.raises(PrivkitError, match="noise_multiplier"):
        DpSgdStep(1.0, -1.0, 0.1, 10)


SMALL = {
    "arch": "mlp",
    "feature_dim": 16,
    "epochs": 2,
    "batch_size": 160,
    "lr": 0.2,
    "device": "cpu",
}


def test_dpsgd_ledger_matches_dpsgd_epsilon(fed):
    res = train("dpsgd", fed, {**SMALL, "noise_multiplier": 1.3}, seed=0)
    q, steps = 160 / 3200, 2 * 20  # 3200 pooled records, 20 batches per epoch
    assert res.claims["sample_rate"] == pytest.approx(q)
    assert res.claims["steps"] == steps
    want = dpsgd_epsilon(q, 1.3, steps, 1e-5, accountant="rdp")
    assert len(res.ledger.clients) == fed.num_clients
    for k in (0, 7, 19):
        assert res.ledger.epsilon(1e-5, client=k, accountant="rdp") == pytest.approx(want, rel=1e-9)
    assert res.ledger.epsilon(1e-5, accountant="pld") == pytest.approx(
        dpsgd_epsilon(q, 1.3, steps, 1e-5, accountant="pld"), rel=1e-6
    )
    assert [r["round"] for r in res.rounds] == [1, 2] and res.rounds[-1]["steps"] == steps


def test_dpsgd_calibrates_to_target_and_is_deterministic(fed):
    cfg = {**SMALL, "target_epsilon": 2.0, "delta": 1e-5, "reproducible_noise": True}
    a = train("dpsgd", fed, cfg, seed=3)
    b = train("dpsgd", fed, cfg, seed=3)
    sigma = a.claims["noise_multiplier"]
    eps = dpsgd_epsilon(160 / 3200, sigma, 40, 1e-5, accountant="pld")
    assert eps <= 2.0 and eps > 1.9  # calibrated, not grossly over-noised
    assert a.ledger.epsilon(1e-5, accountant="pld") <= 2.0
    for (k, v), w in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        torch.testing.assert_close(v, w, rtol=0, atol=0, msg=k)
    assert a.rounds == b.rounds
    c = train("dpsgd", fed, cfg, seed=4)
    assert not torch.equal(a.model.head.weight, c.model.head.weight)


def test_dpsgd_calibration_is_remembered_and_equal_to_the_search():
    """An audit's runs share one calibration: the remembered result is the search's own, and a
    second run with the same plan does not search again."""
    from accountants import calibrate_noise_multiplier
    from privkit.trainers.dpsgd import _calibrated

    _calibrated.cache_clear()
    args = (2.0, 1e-5, 160 / 3200, 40, "rdp")
    first = _calibrated(*args)
    assert first == calibrate_noise_multiplier(2.0, 1e-5, 160 / 3200, 40, accountant="rdp")
    assert _calibrated(*args) is first and _calibrated.cache_info().hits == 1
    other = _calibrated(2.0, 1e-5, 160 / 3200, 80, "rdp")  # more steps: more noise
    assert other.noise_multiplier > first.noise_multiplier


def test_centralized_is_non_private_and_deterministic(fed):
    cfg = dict(SMALL)
    a = train("centralized", fed, cfg, seed=1)
    b = train("centralized", fed, cfg, seed=1)
    assert math.isinf(a.ledger.epsilon(1e-5))
    assert len(a.ledger.clients) == fed.num_clients
    torch.testing.assert_close(a.model.head.weight, b.model.head.weight, rtol=0, atol=0)
    assert a.test_accuracy == b.test_accuracy


def test_dpsgd_rejects_bad_config(fed):
    with pytest.raises(ValueError, match="delta"):
        train("dpsgd", fed, {**SMALL, "delta": 1.5})
    with pytest.raises(ValueError, match="batch_size"):
        train("dpsgd", fed, {**SMALL, "batch_size": 10_000, "noise_multiplier": 1.0})
