"""Random allocation's PLD upper bound (accountants.allocation_pld) against independent references:
the Gaussian mechanism (t = 1: no amplification, exact analytic epsilon), the exact moments
``E_Q[Zbar^a]`` of the likelihood ratio (multinomial expansion, Feldman & Shenfeld 2025 Cor. 6.2),
a Monte Carlo estimate of one epoch's hockey-stick divergences (a statistic: 5 standard errors), and
the certified attack lower bound."""

import math

import numpy as np
import pytest

import accountants as acc
from accountants import samplers as S
from accountants.allocation_pld import random_allocation_pld_epsilon, spread_mean_pmf


@pytest.mark.parametrize("sigma,epochs", [(1.1, 1), (0.8, 6)])
def test_one_step_per_epoch_is_the_gaussian(sigma, epochs):
    exact = acc.gaussian_epsilon(sigma / math.sqrt(epochs), 1e-5, method="analytic")
    ours = random_allocation_pld_epsilon(1, sigma, epochs, 1e-5)
    assert exact <= ours <= exact * (1 + 1e-3)


@pytest.mark.parametrize("t,sigma", [(5, 0.9), (40, 1.3)])
def test_spread_moments_bound_the_exact_moments(t, sigma):
    p, step, _ = spread_mean_pmf(t, sigma, "remove")
    z = np.arange(len(p)) * step
    for a in (2, 3, 4):  # E_Q[Zbar^a] = exp((a - 1) D_a(P || Q)), exact
        exact = math.exp((a - 1) * S.random_allocation_rdp_remove(a, t, sigma))
        assert exact * (1 - 1e-9) <= float(np.sum(p * z**a)) <= exact * 1.05


def test_one_epoch_divergences_against_monte_carlo():
    t, sigma, n = 4, 1.0, 400_000
    w = np.random.default_rng(7).standard_normal((n, t))
    zbar = np.exp(w / sigma - 1 / (2 * sigma**2)).mean(1)
    for direction, loss in (
        ("remove", lambda z, e: np.maximum(z - math.exp(e), 0)),
        ("add", lambda z, e: np.maximum(1 - math.exp(e) * z, 0)),
    ):
        p, step, infinity = spread_mean_pmf(t, sigma, direction)
        grid = np.arange(len(p)) * step
        for eps in (0.3, 1.0, 2.0):
            sample = loss(zbar, eps)
            mc, se = sample.mean(), sample.std() / math.sqrt(n)
            ours = float(np.sum(p * loss(grid, eps))) + infinity
            assert mc - 5 * se <= ours <= mc + 5 * se + 1e-3 * mc, (direction, eps)


@pytest.mark.parametrize("t,sigma,epochs", [(10, 0.8, 5), (234, 1.1, 10), (1000, 1.5, 2)])
def test_between_the_attack_and_the_older_bounds(t, sigma, epochs):
    ours = random_allocation_pld_epsilon(t, sigma, epochs, 1e-5)
    assert S.random_allocation_lower_epsilon(t, sigma, epochs, 1e-5) <= ours
    assert ours <= S._random_allocation_rdp_epsilon(t, sigma, epochs, 1e-5)
    assert ours <= acc.gaussian_epsilon(sigma / math.sqrt(epochs), 1e-5, method="analytic")
