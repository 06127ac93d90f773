"""Rényi filter: the conversion matches dp-accounting; adaptive Gaussian interactions obey the theorem."""

import math

import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant as rdp

import accountants as acc
from accountants.filter import conversion_offset


@pytest.mark.parametrize("order", [1.5, 2.0, 8.0, 64.0])
@pytest.mark.parametrize("delta", [1e-3, 1e-7])
def test_conversion_is_dp_accountings(order, delta):
    eps, _ = rdp.compute_epsilon([order], [2.5], delta)
    assert 2.5 + conversion_offset(order, delta) == pytest.approx(eps, rel=1e-12)
    f = (
        acc.RenyiFilter.for_epsilon(3.0, delta, order)
        if conversion_offset(order, delta) < 3
        else None
    )
    if f is not None:
        assert f.epsilon(delta) == pytest.approx(3.0, rel=1e-12)


def test_filter_admits_exactly_up_to_its_budget():
    f = acc.RenyiFilter(order=4.0, budget=1.0)
    for _ in range(4):
        assert f.admits("a", 0.25)
        f.spend("a", 0.25)
    assert not f.admits("a", 1e-9) and f.admits("b", 1.0)
    with pytest.raises(ValueError, match="budget"):
        f.spend("a", 0.1)


def _adaptive_renyi(order, budget, sigma1, rule, n=4001, use_filter=True):
    """Exact D_order(P || Q) of a two-step adaptive Gaussian interaction under the filter.

    Step 1 releases Y1 ~ N(1, sigma1^2) (P) or N(0, sigma1^2) (Q); step 2 picks sigma2 = rule(Y1) and
    runs only if the filter admits its RDP order/(2 sigma2^2). E_Q[(P/Q)^a] integrates the first step's
    likelihood ratio against exp((a-1) rho_2(y1)) (the second step's conditional moment), by quadrature.
    """
    rho1 = order / (2 * sigma1**2)
    y = np.linspace(-12 * sigma1, 12 * sigma1 + 1, n)
    q = np.exp(-(y**2) / (2 * sigma1**2)) / (sigma1 * math.sqrt(2 * math.pi))
    ratio = np.exp((y - 0.5) / sigma1**2)
    rho2 = np.array([order / (2 * rule(v) ** 2) for v in y])
    if use_filter:
        rho2 = np.where(rho1 + rho2 <= budget, rho2, 0.0)  # the filter refuses step 2
    moment = np.trapezoid(q * ratio**order * np.exp((order - 1) * rho2), y)
    return math.log(moment) / (order - 1), rho2


@pytest.mark.parametrize("order", [2.0, 5.0])
def test_adaptive_interaction_obeys_the_filter_theorem(order):
    sigma1, budget = 3.0, 0.5
    rule = lambda y1: 1.2 if y1 > 1.0 else 6.0
    renyi, rho2 = _adaptive_renyi(order, budget, sigma1, rule)
    assert renyi <= budget + 1e-9  # Feldman & Zrnic Thm 3.1: the interaction is (order, budget)-RDP
    assert (rho2 > 0).any() and (
        rho2 == 0
    ).any()  # the rule mattered and the filter refused some paths
    # without the filter the same rule overspends: the guarantee is the filter's doing
    assert _adaptive_renyi(order, budget, sigma1, rule, use_filter=False)[0] > budget


def test_plan_order_uses_only_what_it_is_given():
    rho = lambda a: 10 * acc.fast.poisson_gaussian_rdp(0.05, 1.0, a)
    order, budget = acc.plan_order(3.0, 1e-5, rho, rdp.DEFAULT_RDP_ORDERS[20:])
    f = acc.RenyiFilter.for_epsilon(3.0, 1e-5, order)
    assert f.budget == pytest.approx(budget) and f.epsilon(1e-5) == pytest.approx(3.0)
    # the planned order affords at least as many steps as any other order of the grid
    steps = {
        a: (3.0 - conversion_offset(a, 1e-5)) / rho([a])[0] for a in rdp.DEFAULT_RDP_ORDERS[20:]
    }
    assert steps[order] == max(steps.values())
