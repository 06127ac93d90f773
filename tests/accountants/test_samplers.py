"""Samplers: shuffle and random-allocation bounds against closed forms, quadrature and dp-accounting."""

import math

import dp_accounting as dpa
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

import accountants as acc
from accountants import samplers as S
from accountants.gaussian import safe_gaussian_epsilon


def _hermite_2d(fn, sigma, mean=(0.0, 0.0), n=80):
    """E[fn(Y1, Y2)] for independent Y_i ~ N(mean_i, sigma^2) by Gauss-Hermite quadrature."""
    x, w = np.polynomial.hermite_e.hermegauss(n)
    w = w / w.sum()
    y1 = mean[0] + sigma * x[:, None]
    y2 = mean[1] + sigma * x[None, :]
    return float(np.sum(w[:, None] * w[None, :] * fn(y1, y2)))


@pytest.mark.parametrize("alpha", [2, 3, 5, 8])
@pytest.mark.parametrize("sigma", [1.5, 3.0])
def test_random_allocation_remove_rdp_is_exact(alpha, sigma):
    # t = 1 is the Gaussian mechanism: alpha / (2 sigma^2)
    assert S.random_allocation_rdp_remove(alpha, 1, sigma) == pytest.approx(
        alpha / (2 * sigma**2), rel=1e-12
    )
    # t = 2: E_Q[(P/Q)^alpha] by quadrature, P/Q = mean_j exp((y_j - 1/2)/sigma^2)
    ratio = lambda a, b: 0.5 * (np.exp((a - 0.5) / sigma**2) + np.exp((b - 0.5) / sigma**2))
    moment = _hermite_2d(lambda a, b: ratio(a, b) ** alpha, sigma)
    assert S.random_allocation_rdp_remove(alpha, 2, sigma) == pytest.approx(
        math.log(moment) / (alpha - 1), rel=1e-6
    )


@pytest.mark.parametrize("alpha", [2, 4, 7])
@pytest.mark.parametrize("sigma", [1.2, 2.5])
def test_random_allocation_add_bound_holds(alpha, sigma):
    # the AM-GM bound against the exact D_alpha(Q||P) for t = 2 (quadrature)
    ratio = lambda a, b: 0.5 * (np.exp((a - 0.5) / sigma**2) + np.exp((b - 0.5) / sigma**2))
    exact = math.log(_hermite_2d(lambda a, b: ratio(a, b) ** (1 - alpha), sigma)) / (alpha - 1)
    assert exact <= S.random_allocation_rdp_add(alpha, 2, sigma)
    assert S.random_allocation_rdp_add(alpha, 2, sigma) <= alpha / (
        2 * sigma**2
    )  # never worse than no amplification


def test_shuffle_upper_is_the_composed_gaussian():
    res = acc.sampler_accounting("shuffle", 0.1, 1.3, 55, 1e-5)
    assert res.batches_per_epoch == 10 and res.epochs == 5.5
    assert res.epsilon == pytest.approx(
        safe_gaussian_epsilon(1.3 / math.sqrt(6), 1e-5), rel=1e-12
    )  # 6 started epochs
    pld = dpa.pld.PLDAccountant(value_discretization_interval=1e-4)
    pld.compose(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(1.3), 6))
    assert pld.get_epsilon(1e-5) == pytest.approx(
        res.epsilon, rel=1e-6
    )  # dp-accounting's exact Gaussian PLD


@pytest.mark.parametrize("epochs", [1, 3])
def test_lower_bounds_are_exact_for_one_batch_per_epoch(epochs):
    # t = 1: the max statistic is the batch sum itself, a Gaussian with shift 1 per epoch
    exact = safe_gaussian_epsilon(0.9 / math.sqrt(epochs), 1e-6)
    for lower in (
        S.shuffle_lower_epsilon(1, 0.9, epochs, 1e-6),
        S.random_allocation_lower_epsilon(1, 0.9, epochs, 1e-6),
    ):
        assert exact * 0.99 <= lower <= exact


def _cases(n, seed=0):
    rng = np.random.default_rng(seed)
    return [
        (
            int(rng.integers(2, 300)),
            float(10 ** rng.uniform(-0.3, 0.6)),
            int(rng.integers(1, 6)),
            float(10 ** rng.uniform(-8, -3)),
        )
        for _ in range(n)
    ]


@pytest.mark.parametrize("t,sigma,epochs,delta", _cases(6))
def test_lower_never_above_upper(t, sigma, epochs, delta):
    for sampler in ("shuffle", "random-allocation"):
        res = acc.sampler_accounting(sampler, 1.0 / t, sigma, t * epochs, delta)
        assert res.epsilon_lower is not None and 0 <= res.epsilon_lower <= res.epsilon
    # random allocation's lower bound is also a lower bound for the composed Gaussian (no amplification)
    assert S.random_allocation_lower_epsilon(t, sigma, epochs, delta) <= safe_gaussian_epsilon(
        sigma / math.sqrt(epochs), delta
    )


def test_opacus_like_shuffle_leaks_more_than_its_poisson_claim():
    # batch 256 of 60000 (234 batches), sigma 1.1, 10 epochs: Chua et al. (2024)'s gap, certified
    shuffle = acc.sampler_accounting("shuffle", 1 / 234, 1.1, 2340, 1e-5)
    poisson = acc.sampler_accounting("poisson", 1 / 234, 1.1, 2340, 1e-5)
    assert shuffle.epsilon_lower > 3 * poisson.epsilon
    alloc = acc.sampler_accounting("random-allocation", 1 / 234, 1.1, 2340, 1e-5)
    assert (
        alloc.epsilon_lower < alloc.epsilon < S._random_allocation_rdp_epsilon(234, 1.1, 10, 1e-5)
    )
    assert (
        alloc.epsilon == pytest.approx(0.8816, abs=1e-3) and "mean-preserving" in alloc.upper_method
    )


def test_partial_epochs_and_non_integral_rates():
    res = acc.sampler_accounting(
        "shuffle", 0.3, 2.0, 2, 1e-5
    )  # 1/q = 3.33: upper uses 3, lower 4 batches
    assert res.epsilon_lower is None and any("no lower bound" in n for n in res.notes)
    assert any("not a whole number" in n for n in res.notes)


def test_describe_loader_maps_pytorch_and_opacus_loaders():
    from opacus.data_loader import DPDataLoader

    ds = TensorDataset(torch.zeros(1000, 2))
    shuffled = acc.describe_loader(DataLoader(ds, batch_size=64, shuffle=True))
    assert (shuffled["sampler"], shuffled["batches_per_epoch"]) == ("shuffle", 16)
    assert (
        acc.describe_loader(DataLoader(ds, batch_size=64, shuffle=True, drop_last=True))[
            "batches_per_epoch"
        ]
        == 15
    )
    assert "fixed order" in acc.describe_loader(DataLoader(ds, batch_size=64))["notes"][0]
    poisson = acc.describe_loader(DPDataLoader.from_data_loader(DataLoader(ds, batch_size=64)))
    assert poisson["sampler"] == "poisson" and poisson["sample_rate"] == pytest.approx(1 / 16)
    with pytest.raises(ValueError, match="with replacement"):
        acc.describe_loader(
            DataLoader(ds, batch_size=10, sampler=WeightedRandomSampler([1.0] * 1000, 1000))
        )
    res = acc.account_loader(DataLoader(ds, batch_size=50, shuffle=True), 1.0, 1e-5, epochs=3)
    assert (
        res.steps == 60
        and res.epsilon == acc.sampler_accounting("shuffle", 0.05, 1.0, 60, 1e-5).epsilon
    )
    opacus_res = acc.account_loader(
        DPDataLoader.from_data_loader(DataLoader(ds, batch_size=64)), 1.0, 1e-5, epochs=2
    )
    assert opacus_res.epsilon == pytest.approx(
        acc.dpsgd_epsilon(1 / 16, 1.0, 32, 1e-5, accountant="pld")
    )


def _exact_epsilon_two_batches(sigma, shift_with, shift_without, delta, n=900):
    """epsilon at delta of one epoch with t = 2 batches, by quadrature of the 2-D hockey-stick divergence.

    With the record, one of the 2 batch sums (uniformly) is shifted by ``shift_with``; without it by
    ``shift_without`` (0 for random allocation, 1 for the shuffle attack's zero-gradient neighbour).
    """
    y = np.linspace(-9 * sigma, 9 * sigma + 3, n)
    h = y[1] - y[0]
    y1, y2 = np.meshgrid(y, y, indexing="ij")

    def density(shift):
        g = lambda a, m: np.exp(-((a - m) ** 2) / (2 * sigma**2)) / (sigma * math.sqrt(2 * math.pi))
        return 0.5 * (g(y1, shift) * g(y2, 0) + g(y1, 0) * g(y2, shift))

    p, q = density(shift_with), density(shift_without)

    def hockey(eps):
        return (
            max(
                np.sum(np.maximum(p - math.exp(eps) * q, 0)),
                np.sum(np.maximum(q - math.exp(eps) * p, 0)),
            )
            * h
            * h
        )

    lo, hi = 0.0, 30.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if hockey(mid) > delta else (lo, mid)
    return hi


@pytest.mark.parametrize("sigma", [0.7, 1.5])
def test_two_batch_bounds_bracket_the_exact_epsilon(sigma):
    """t = 2, one epoch: the exact epsilon of each sampler (2-D quadrature) lies between privkit's bounds."""
    delta = 1e-4
    exact_shuffle = _exact_epsilon_two_batches(sigma, 2.0, 1.0, delta)
    res = acc.sampler_accounting("shuffle", 0.5, sigma, 2, delta)
    assert res.epsilon_lower <= exact_shuffle * (1 + 1e-3) and exact_shuffle <= res.epsilon * (
        1 + 1e-3
    )
    exact_alloc = _exact_epsilon_two_batches(sigma, 1.0, 0.0, delta)
    res = acc.sampler_accounting("random-allocation", 0.5, sigma, 2, delta)
    assert res.epsilon_lower <= exact_alloc * (1 + 1e-3) and exact_alloc <= res.epsilon * (1 + 1e-3)
    assert res.epsilon <= exact_alloc * 1.01  # the PLD bound is tight
