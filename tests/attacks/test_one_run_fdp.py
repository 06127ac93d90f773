"""f-DP analysis of one-run audits: published figures, validity on mechanisms with a known curve
(exact binomial rates and seeded runs), power, and which claim each curve tests."""

import math
import os

import dp_accounting as dpa
import numpy as np
import pytest
from scipy import stats
from scipy.special import expit

from accountants import Ledger, analytic_gaussian_sigma
from accountants.tradeoff import CurveFamily, ledger_curve
from attacks.one_run import epsilon_lower_bound as steinke
from attacks.one_run_fdp import (
    _bound_exceeds,
    _ideal_precisions,
    fdp_detectable_epsilon,
    fdp_epsilon_lower_bound,
    fdp_rejection_threshold,
    fdp_rejects,
    ideal_precision,
    one_run_fdp,
)

SMALL = os.environ.get("PRIVKIT_SLOW") == "small"
SEEDS = 200 if SMALL else 1000
DELTA = 1e-5


def exact_rejection_rate(m, r, eps_true, eps_claim, curve, delta=DELTA, beta=0.05):
    """P[the claim at eps_claim is rejected] when each of r guesses is right w.p. expit(eps_true)."""
    v_star = fdp_rejection_threshold(m, r, eps_claim, delta=delta, curve=curve, beta=beta)
    return float(stats.binom.sf(v_star - 1, r, expit(eps_true)))


def at_most_nominal(count, n, level=0.05):
    """A count of false violations consistent with a rate <= level (one-sided, 0.1% test)."""
    return count <= stats.binom.ppf(0.999, n, level)


# ------------------------------------------------------------------------------ published figures
def test_gaussian_curve_1000_of_1000_reaches_12_3():
    # jax_privacy 2.2 epsilon_one_run_fdp / the issue: 12.3 (Gaussian) against 5.78 (Steinke et al.)
    assert fdp_epsilon_lower_bound(
        1000, 1000, 1000, delta=DELTA, curve="gaussian"
    ) == pytest.approx(12.335, abs=2e-3)
    assert steinke(1000, 1000, 1000, delta=DELTA) == pytest.approx(5.782, abs=1e-3)


def test_2000_all_correct_gaussian_above_7_5_steinke_below_6_5():
    assert fdp_epsilon_lower_bound(2000, 2000, 2000, delta=DELTA, curve="gaussian") > 7.5
    assert steinke(2000, 2000, 2000, delta=DELTA) < 6.5


@pytest.mark.parametrize(
    "m,r,v", [(1000, 1000, 1000), (1000, 100, 90), (1000, 1000, 700), (500, 200, 150)]
)
def test_generic_curve_never_beats_the_exact_pure_dp_test(m, r, v):
    # at delta = 0, V of randomized response is exactly Bin(r, q): Steinke et al.'s binomial tail is
    # the most powerful valid test, so the f-DP analysis may match it but never exceed it
    fdp = fdp_epsilon_lower_bound(m, r, v, delta=0.0)
    exact = steinke(m, r, v, delta=0.0)
    assert exact - 0.02 * exact - 1e-3 <= fdp <= exact + 1e-3


def test_generic_curve_close_to_steinke_at_positive_delta():
    for m, r, v in [(1000, 1000, 1000), (1000, 200, 180), (10000, 5000, 4000)]:
        assert fdp_epsilon_lower_bound(m, r, v, delta=DELTA) == pytest.approx(
            steinke(m, r, v, delta=DELTA), rel=0.02
        )


# ------------------------------------------------------------------------------ validity, exactly
@pytest.mark.parametrize("eps", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("m,r", [(1000, 1000), (1000, 100), (200, 200)])
def test_generic_curve_false_violation_on_randomized_response_is_at_most_5pct(eps, m, r):
    # randomized response on the membership bit is exactly eps-DP: its guesses are right w.p. expit(eps)
    assert exact_rejection_rate(m, r, eps, eps, "generic") <= 0.05


@pytest.mark.parametrize(
    "eps,m,r,floor", [(1.0, 1000, 100, 0.3), (2.0, 1000, 100, 0.6), (1.0, 1000, 1000, 0.6)]
)
def test_gaussian_curve_over_rejects_randomized_response(eps, m, r, floor):
    # the documented reason the default stays generic: RR is (eps, delta)-DP but not Gaussian-like,
    # and the Gaussian curve at the same (eps, delta) calls it a violation in most runs
    assert exact_rejection_rate(m, r, eps, eps, "gaussian") > floor


def test_rejection_is_monotone_in_right_guesses_and_in_epsilon():
    fam = CurveFamily("generic", DELTA)
    rej = [bool(fdp_rejects(200, 120, v, fam, [1.0])[0]) for v in range(121)]
    assert rej == sorted(rej)  # False ... False True ... True
    eps = np.linspace(0, 6, 61)
    for v in (80, 100, 120):
        r = fdp_rejects(200, 120, v, CurveFamily("gaussian", DELTA), eps)
        assert list(r) == sorted(r, reverse=True)  # a prefix of rejections


# ------------------------------------------------------------------------------ validity, seeded runs
def _gaussian_outcome(rng, eps, m, k):
    """A Gaussian mechanism that is exactly (eps, DELTA)-DP per audit point; top/bottom-k guesses."""
    sigma = analytic_gaussian_sigma(eps, DELTA)
    b = rng.random(m) < 0.5
    y = b + sigma * rng.standard_normal(m)
    order = np.argsort(-y)
    return int(b[order[:k]].sum() + (~b[order[m - k :]]).sum())


@pytest.mark.parametrize("eps", [1.0, 2.0])
def test_seeded_randomized_response_generic_curve(eps):
    fam = CurveFamily("generic", DELTA)
    m = r = 500
    hits = sum(
        bool(
            fdp_rejects(m, r, int(np.random.default_rng(s).binomial(r, expit(eps))), fam, [eps])[0]
        )
        for s in range(SEEDS)
    )
    assert at_most_nominal(hits, SEEDS)


@pytest.mark.parametrize("eps,k", [(1.0, 20), (4.0, 50)])
def test_seeded_gaussian_mechanism_gaussian_curve(eps, k):
    fam = CurveFamily("gaussian", DELTA)
    hits = sum(
        bool(
            fdp_rejects(
                1000, 2 * k, _gaussian_outcome(np.random.default_rng(s), eps, 1000, k), fam, [eps]
            )[0]
        )
        for s in range(SEEDS)
    )
    assert at_most_nominal(hits, SEEDS)


def test_gaussian_curve_has_power_where_generic_has_less():
    # a Gaussian mechanism at eps 8 claimed at eps 3: the Gaussian curve catches it in most runs
    outcomes = [_gaussian_outcome(np.random.default_rng(s), 8.0, 1000, 50) for s in range(40)]
    gauss = np.mean(
        [fdp_rejects(1000, 100, v, CurveFamily("gaussian", DELTA), [3.0])[0] for v in outcomes]
    )
    generic = np.mean(
        [fdp_rejects(1000, 100, v, CurveFamily("generic", DELTA), [3.0])[0] for v in outcomes]
    )
    assert gauss >= 0.9 and generic < gauss


# ------------------------------------------------------------------------------ ledger curve
@pytest.fixture(scope="module")
def gaussian_ledger():
    ledger = Ledger()
    ledger.add(0, dpa.GaussianDpEvent(analytic_gaussian_sigma(2.0, DELTA)), "release")
    return ledger


def test_ledger_curve_of_a_gaussian_tests_the_gaussian_claim(gaussian_ledger):
    curve = ledger_curve(gaussian_ledger)
    ref = curve.family(DELTA).reference_epsilon
    assert ref == pytest.approx(2.0, abs=2e-3)
    for v in range(150, 201, 5):  # the same verdict as the Gaussian curve at the ledger's epsilon
        assert (
            fdp_rejects(1000, 200, v, curve.family(DELTA), [ref])[0]
            == fdp_rejects(1000, 200, v, CurveFamily("gaussian", DELTA), [2.0])[0]
        )


def test_result_says_which_claim_it_tests(gaussian_ledger):
    g = one_run_fdp(1000, 200, 190, delta=DELTA)
    assert g.tests == "(eps, delta)-DP" and g.ceiling >= g.epsilon > 0
    ga = one_run_fdp(1000, 200, 190, delta=DELTA, curve="gaussian")
    assert (
        ga.tests == "as private as the Gaussian mechanism at (eps, delta)"
        and ga.epsilon > g.epsilon
    )
    led = one_run_fdp(1000, 200, 190, delta=DELTA, curve=ledger_curve(gaussian_ledger))
    assert led.tests == "as private as the ledger's PLD"
    assert led.epsilon > led.reference_epsilon  # 190 of 200 refutes "as private as the ledger says"
    assert "privacy profile raised by" in led.claim_at_bound
    d = led.to_dict()
    assert d["curve"] == "profile" and math.isfinite(d["epsilon"])


# ------------------------------------------------------------------------------ the searches, pinned
@pytest.fixture(scope="module")
def families(gaussian_ledger):
    profile = ledger_curve(gaussian_ledger).family(DELTA)
    return {
        "generic": CurveFamily("generic", DELTA),
        "gaussian": CurveFamily("gaussian", DELTA),
        "ledger": profile,
        "ledger-anchored": profile.anchored(2.3),  # as audits test an accounted epsilon
    }


def scalar_ideal_precision(family, eps, fraction):
    """The definition, one FPR per call: plain bisection on log FPR down to float resolution."""
    member = family.members(np.array([eps]))
    f = lambda a: float(member(np.array([a]))[0])
    flagged = lambda a: 0.5 * (a + 1.0 - f(a))
    if flagged(0.0) >= fraction:
        return 1.0
    lo, hi = math.log(1e-300), 0.0
    while lo < (mid := 0.5 * (lo + hi)) < hi:
        lo, hi = (mid, hi) if flagged(math.exp(mid)) < fraction else (lo, mid)
    return min(1.0, 0.5 * (1.0 - f(math.exp(lo))) / fraction)


def scalar_detectable(m, k_pos, k_neg, family, target, beta=0.05):
    """fdp_detectable_epsilon's definition: bisections over v and over epsilon, one at a time."""
    r = k_pos + k_neg
    bound = lambda v: fdp_epsilon_lower_bound(m, r, v, delta=DELTA, curve=family, beta=beta)
    if bound(r) <= target:
        return math.inf
    lo, hi = -1, r
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if mid >= 0 and bound(mid) > target else (mid, hi)

    def half(eps):
        pmf = np.array([1.0])
        for k in (k_pos, k_neg):
            p = scalar_ideal_precision(family, eps, k / m)
            pmf = np.convolve(pmf, stats.binom.pmf(np.arange(k + 1), k, p))
        return pmf[hi:].sum() >= 0.5

    if not half(100.0):
        return math.inf
    if half(0.0):
        return 0.0
    lo_e, hi_e = 0.0, 100.0
    while hi_e - lo_e > 1e-4:
        mid_e = 0.5 * (lo_e + hi_e)
        lo_e, hi_e = (lo_e, mid_e) if half(mid_e) else (mid_e, hi_e)
    return hi_e


@pytest.mark.parametrize("eps", [0.0, 0.5, 1.0, 3.0, 8.0])
def test_ideal_precision_of_pure_dp_is_randomized_response(eps):
    fam = CurveFamily("generic", 0.0)
    for fraction in (0.02, 0.2, 0.5):
        assert ideal_precision(fam, eps, fraction) == pytest.approx(expit(eps), rel=1e-12)


@pytest.mark.parametrize("kind", ["generic", "gaussian", "ledger", "ledger-anchored"])
def test_ideal_precision_matches_a_scalar_bisection(families, kind):
    fam = families[kind]
    eps, fractions = np.array([0.0, 0.7, 2.0, 6.0, 30.0]), np.array([0.001, 0.05, 0.3, 0.5])
    ref = np.array([[scalar_ideal_precision(fam, e, q) for q in fractions] for e in eps])
    # all lanes at once, and one at a time through the public function
    np.testing.assert_allclose(_ideal_precisions(fam, eps[:, None], fractions), ref, rtol=1e-12)
    got = np.array([[ideal_precision(fam, e, q) for q in fractions] for e in eps])
    np.testing.assert_allclose(got, ref, rtol=1e-12)


@pytest.mark.parametrize("kind", ["generic", "gaussian", "ledger-anchored"])
@pytest.mark.parametrize("k_pos,k_neg,target", [(50, 50, 0.0), (30, 10, 1.5), (25, 0, 2.3)])
def test_detectable_epsilon_matches_scalar_searches(families, kind, k_pos, k_neg, target):
    fam = families[kind]
    got = fdp_detectable_epsilon(1000, k_pos, k_neg, delta=DELTA, curve=fam, target=target)
    ref = scalar_detectable(1000, k_pos, k_neg, fam, target)
    assert got == ref or abs(got - ref) <= 1e-4


def test_bound_exceeds_is_the_bound_above_target(families):
    fam = families["ledger-anchored"]
    for v in range(0, 121, 8):
        bound = fdp_epsilon_lower_bound(400, 120, v, delta=DELTA, curve=fam)
        for target in (0.0, bound - 1e-9, bound, bound + 1e-9, 2.3, 7.0):
            assert _bound_exceeds(400, 120, v, fam, 0.05, target) == (bound > target)


@pytest.mark.parametrize("kind", ["generic", "gaussian", "ledger"])
def test_lower_bound_is_tested_rejected_and_within_tol(families, kind):
    fam = families[kind]
    for m, r, v in [(1000, 100, 80), (1000, 1000, 900), (5000, 500, 500), (300, 300, 240)]:
        bound = fdp_epsilon_lower_bound(m, r, v, delta=DELTA, curve=fam)
        assert bound > 0 and fdp_rejects(m, r, v, fam, [bound])[0]
        assert not fdp_rejects(m, r, v, fam, [bound + 1e-4])[0]


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: fdp_epsilon_lower_bound(10, 5, 6, delta=DELTA), "0 <= v <= r <= m"),
        (lambda: fdp_epsilon_lower_bound(10, 5, 5, delta=DELTA, beta=1.5), "beta must be in"),
        (
            lambda: fdp_epsilon_lower_bound(10, 5, 5, delta=DELTA, curve="laplace"),
            "curve must be one of",
        ),
        (
            lambda: fdp_epsilon_lower_bound(10, 5, 5, delta=0.0, curve="gaussian"),
            "delta must be in",
        ),
        (lambda: fdp_epsilon_lower_bound(10.5, 5, 5, delta=DELTA), "m must be an integer"),
    ],
)
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
