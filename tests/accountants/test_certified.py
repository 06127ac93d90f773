"""No PLD epsilon privkit prints falls below the exact one, at any delta down to 1e-300.

Exact values come from mpmath (closed forms: the Gaussian, and one subsampled Gaussian step; two
subsampled steps by a quadrature of the one-step closed form);
the full form (more cases, larger epsilons) is benchmarks/certified_pld.py."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from certified_cases import check, draw_cases, exact_epsilon, two_step_check

import accountants as acc
from accountants.bracket import _optimistic_gaussian
from accountants.certified import PldPrecisionError, certified_epsilon
from accountants.fast import PldAccountant, _base_pld

CASES = draw_cases(10, seed=33, max_steps=200, sigma_range=(4.0, 20.0))


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"q{c.q:.3g}-s{c.sigma:.3g}-T{c.steps}-d{c.delta:.1e}"
)
def test_printed_epsilon_is_never_below_the_exact_one(case):
    out = check(case)
    _SEEN[case] = out["accountant"]
    assert out["ok"], out


_SEEN: dict = {}


def test_the_cases_reach_delta_1e_300_and_both_accountants():
    assert min(c.delta for c in CASES) < 1e-200
    seen = {_SEEN.get(c) or check(c)["accountant"] for c in CASES}
    assert seen == {"pld", "rdp"}


def test_plain_fft_falls_below_a_certified_lower_bound_and_certified_does_not():
    # the case: the plain FFT composition loses tail mass to rounding
    q, sigma, steps, delta = 0.3, 1.5, 3000, 1e-12
    pld = PldAccountant(value_discretization_interval=1e-4)
    pld.compose(acc.dpsgd_event(q, sigma, steps))
    raw, certified = pld.raw_epsilon(delta), pld.get_epsilon(delta)
    opt = _optimistic_gaussian(sigma, q, 1e-4, 1)
    directions = [[(opt._pmf_remove, steps)], [(opt._pmf_add, steps)]]
    lower = certified_epsilon(directions, delta, certified, lower=True)
    assert raw < lower <= certified  # the plain value is unsound; the bracket is ordered
    assert certified - lower < 1e-3 * certified  # and tight


def test_gaussian_upper_end_against_mpmath_at_small_delta():
    sigma, delta = 2.0 / math.sqrt(10), 1e-10
    exact = exact_epsilon(1.0, sigma, 1, delta)
    pld = _base_pld(sigma, 1.0, 1e-4)
    up = certified_epsilon([[(pld._pmf_remove, 1)]], delta, exact)
    low_pld = _optimistic_gaussian(sigma, 1.0, 1e-4, 1)
    low = certified_epsilon([[(low_pld._pmf_remove, 1)]], delta, exact, lower=True)
    assert low <= exact <= up
    assert up - low < 1e-6


def test_uncertified_delta_falls_back_to_rdp_and_says_why():
    res = acc.dpsgd_accounting(1.0, 0.5, 1, 1e-300, accountant="pld")
    assert res.accountant == "rdp"
    assert any("infinity" in w for w in res.warnings)
    assert res.epsilon >= exact_epsilon(1.0, 0.5, 1, 1e-300)
    pld = PldAccountant()
    pld.compose(acc.dpsgd_event(1.0, 0.5, 1))
    with pytest.raises(PldPrecisionError, match="delta=1e-300"):
        pld.get_epsilon(1e-300)


@pytest.mark.parametrize("q,sigma,delta", [(0.05, 0.8, 1e-12)])  # more: benchmarks/certified_pld.py
def test_two_subsampled_steps_against_an_mpmath_composition(q, sigma, delta):
    """Two composed steps with q < 1, where no closed form exists: the exact delta (mpmath
    quadrature) at the printed epsilon is at most delta, at the bracket's lower end at least it."""
    out = two_step_check(q, sigma, delta)
    assert out["accountant"] == "pld" and out["lower"] is not None
    assert out["ok"], out
    assert out["printed"] - out["lower"] < 1e-6 * out["printed"]  # and the bracket is tight


def test_prv_is_refused_where_its_fft_rounding_reaches_delta():
    """The issue's case: opacus' PRV put a "certified" lower end (153.186) above the certified PLD's
    upper one (152.864), its FFT's float rounding being far above delta: privkit refuses PRV there
    (one line saying why), so no bracket rests on it; at a usual delta PRV still answers."""
    with pytest.raises(ValueError, match=r"prv is not certified at delta=1e-12 with steps=3000"):
        acc.prv_bracket(0.3, 1.5, 3000, 1e-12)
    low, _, up = acc.prv_bracket(0.01, 1.0, 1000, 1e-5)
    assert low <= acc.dpsgd_epsilon(0.01, 1.0, 1000, 1e-5, accountant="pld") <= up


def test_prv_refusals_name_their_reason_whatever_the_machines_memory(monkeypatch):
    """The rounding refusal is a property of the request and comes first on every machine (CI's
    had so little *free* memory that the grid cap answered instead); the memory cap reads the
    memory the kernel can hand out (MemAvailable, page cache included), and refuses by name."""
    from accountants import dpsgd

    monkeypatch.setattr(dpsgd, "_prv_limit", lambda: 1_000)
    with pytest.raises(ValueError, match=r"prv is not certified at delta=1e-12 with steps=3000"):
        acc.prv_bracket(0.3, 1.5, 3000, 1e-12)
    with pytest.raises(ValueError, match=r"needs a grid of [\d,]+ points .* privkit allows 1,000"):
        acc.prv_bracket(0.01, 1.0, 1000, 1e-5)
    available = dpsgd._available_bytes()
    assert available is None or available > 0


@pytest.mark.parametrize("seed", range(3))
def test_log_mgf_is_its_definition_where_most_terms_underflow(seed):
    # log_mgf raises the terms below e^-700 (relative to the largest) to e^-700 because exp runs
    # 20-200x slower near the subnormal range; with exp(0) = 1 in the sum that changes nothing:
    # bit for bit the plain formula, and logsumexp to rounding, from orders where every term
    # counts to orders where nearly all of them lie 10^4 nats below the largest
    from scipy.special import logsumexp

    from accountants.certified import _Part

    rng = np.random.default_rng(seed)
    n = 20_000
    log_p = -np.abs(rng.normal(0.0, 300.0, n)) - np.linspace(0.0, 400.0, n)
    part = _Part(-5_000, np.exp(log_p), 0.0, 3)
    orders = np.concatenate([[0.0], np.geomspace(1e-6, 2.0, 40), -np.geomspace(1e-6, 2.0, 20)])
    got = part.log_mgf(orders)
    x = orders[:, None] * part.index[None, :] + part.log_probs[None, :]
    top = x.max(axis=1)
    plain = top + np.log(np.exp(x - top[:, None]).sum(axis=1))
    assert ((x - top[:, None]) < -700).mean(axis=1).max() > 0.9  # the floor is exercised
    assert np.array_equal(got, plain)
    np.testing.assert_allclose(got, logsumexp(x, axis=1), rtol=1e-14, atol=0)
