"""audit_scores with a trade-off curve: the claim each bound tests, the same curve for bound,
ceiling and detectable epsilon, validity on the mechanisms each curve is true of, and power."""

import os

import dp_accounting as dpa
import numpy as np
import pytest
from scipy import stats

from accountants import Ledger, analytic_gaussian_sigma
from accountants.tradeoff import (
    CurveFamily,
    curve_from_callable,
    gaussian_mu,
    gdp_curve,
    ledger_curve,
)
from attacks.audit_scores import audit_scores, decide
from attacks.one_run_fdp import fdp_detectable_epsilon, fdp_epsilon_lower_bound
from attacks.validity import simulate

SMALL = os.environ.get("PRIVKIT_SLOW") == "small"
SEEDS = 40 if SMALL else 200
DELTA = 1e-5


def perfect(n, seed=0):
    """n audit points, half members, scored by their membership: every guess right."""
    member = np.random.default_rng(seed).permutation(
        np.r_[np.ones(n // 2, bool), np.zeros(n // 2, bool)]
    )
    return member.astype(float), member


def at_most_nominal(count, n, level=0.05):
    return count <= stats.binom.ppf(0.999, n, level)


@pytest.fixture(scope="module")
def ledger2():
    """A ledger whose one event is the Gaussian mechanism that is (2, 1e-5)-DP."""
    ledger = Ledger()
    ledger.add(0, dpa.GaussianDpEvent(analytic_gaussian_sigma(2.0, DELTA)), "release")
    return ledger


@pytest.mark.parametrize("n,gauss_min,generic_max", [(2000, 7.5, 6.5), (1000, 12.3, 5.79)])
def test_all_guesses_right(n, gauss_min, generic_max):
    scores, member = perfect(n)
    g = audit_scores(
        scores, member, delta=DELTA, guesses=0.5, curve="gaussian", accounted_epsilon=1.0
    )
    s = audit_scores(scores, member, delta=DELTA, guesses=0.5, accounted_epsilon=1.0)
    assert g.epsilon_lower_bound > gauss_min and s.epsilon_lower_bound < generic_max
    assert g.verdict == s.verdict == "violation"
    assert g.claim_tested == "as private as the Gaussian mechanism at (eps, delta)"
    assert s.claim_tested == "(eps, delta)-DP"
    assert "testing the claim 'as private as the Gaussian mechanism" in g.message
    d = g.to_dict()
    assert d["curve"] == "gaussian" and d["claim_tested"] == g.claim_tested
    assert (
        "Mahloujifar" in d["attacks"]["scores"]["bound"]
        and "Steinke" in s.to_dict()["attacks"]["scores"]["bound"]
    )
    assert d["attacks"]["scores"]["tests"] == g.claim_tested


def test_bound_ceiling_and_detectable_use_the_same_curve():
    rng = np.random.default_rng(1)
    member = rng.random(1000) < 0.5
    scores = member + 1.5 * rng.standard_normal(1000)
    res = audit_scores(
        {"a": scores, "b": -np.abs(scores)},
        member,
        delta=DELTA,
        accounted_epsilon=2.0,
        curve="gaussian",
        guesses=0.1,
    )
    fam, beta = CurveFamily("gaussian", DELTA), 0.05 / 2
    assert res.epsilon_ceiling == pytest.approx(
        fdp_epsilon_lower_bound(1000, 200, 200, delta=DELTA, curve=fam, beta=beta)
    )
    assert res.detectable_epsilon == pytest.approx(
        fdp_detectable_epsilon(1000, 100, 100, delta=DELTA, curve=fam, beta=beta, target=2.0)
    )
    assert res.verdict == decide(res.epsilon_lower_bound, res.epsilon_ceiling, 2.0)
    a = res.attacks[res.attack]
    assert res.epsilon_lower_bound == pytest.approx(
        fdp_epsilon_lower_bound(1000, a.guesses, a.correct, delta=DELTA, curve=fam, beta=beta)
    )


def test_ledger_curve_is_anchored_at_the_accounted_epsilon(ledger2):
    scores, member = perfect(400)
    res = audit_scores(
        scores, member, delta=DELTA, accounted_epsilon=2.0, curve=ledger_curve(ledger2)
    )
    assert res.curve == "profile" and res.claim_tested == "as private as the ledger's PLD"
    assert res.verdict == "violation" and res.epsilon_lower_bound > 2.0
    # the ledger's own curve is what "violation" refutes: it is rejected by this outcome
    fam = CurveFamily("profile", DELTA, ledger_curve(ledger2), 2.0)
    assert fdp_epsilon_lower_bound(400, 80, 80, delta=DELTA, curve=fam) > 2.0


# ------------------------------------------------------------------------------ validity and power
def test_gaussian_curve_valid_on_the_gaussian_mechanism():
    for eps in (1.0, 4.0):
        res = simulate("gaussian", epsilon=eps, delta=DELTA, seeds=SEEDS, curve="gaussian")
        assert at_most_nominal(res.violations, SEEDS), res.to_dict()


def test_ledger_curve_valid_on_its_mechanism_and_catches_less_noise(ledger2):
    curve = ledger_curve(ledger2)
    ok = simulate("gaussian", epsilon=2.0, delta=DELTA, seeds=SEEDS, curve=curve)
    assert at_most_nominal(ok.violations, SEEDS)
    # noise for epsilon 5 released under a ledger claiming 2: the ledger's curve catches it (about
    # every run), the bare (2, delta) claim hardly ever (the Gaussian mechanism at 5 is (2, 0.04)-DP)
    bad = simulate("gaussian", epsilon=5.0, claim=2.0, delta=DELTA, seeds=SEEDS, curve=curve)
    generic = simulate("gaussian", epsilon=5.0, claim=2.0, delta=DELTA, seeds=SEEDS)
    assert bad.rate >= 0.9 and generic.rate <= 0.3


def test_gaussian_curve_on_randomized_response_over_rejects():
    # randomized response is (eps, delta)-DP but not Gaussian: the default stays generic
    rr = simulate("rr", epsilon=1.0, delta=DELTA, seeds=SEEDS, curve="gaussian")
    assert rr.rate > 0.3
    assert at_most_nominal(simulate("rr", epsilon=1.0, delta=DELTA, seeds=SEEDS).violations, SEEDS)


def test_detectable_epsilon_of_the_gaussian_curve_is_about_where_half_are_caught():
    d = simulate("gaussian", epsilon=2.0, delta=DELTA, seeds=1, curve="gaussian").detectable_epsilon
    assert 2.0 < d < 8.0
    below = simulate(
        "gaussian", epsilon=0.8 * d, claim=2.0, delta=DELTA, seeds=SEEDS, curve="gaussian"
    )
    above = simulate(
        "gaussian", epsilon=1.25 * d, claim=2.0, delta=DELTA, seeds=SEEDS, curve="gaussian"
    )
    assert below.rate < 0.35 and above.rate > 0.65


def test_any_callable_curve_is_tested_as_given():
    rng = np.random.default_rng(2)
    member = rng.random(1000) < 0.5
    scores = member + 0.8 * rng.standard_normal(1000)
    mu = gaussian_mu(2.0, DELTA)
    obj = audit_scores(scores, member, delta=DELTA, accounted_epsilon=2.0, curve=gdp_curve(mu))
    fn = audit_scores(
        scores, member, delta=DELTA, accounted_epsilon=2.0, curve=lambda a: gdp_curve(mu)(a)
    )
    assert obj.curve == "gaussian" and fn.curve == "profile"
    assert fn.claim_tested == "as private as a user-supplied trade-off curve"
    # the same claim at the accounted epsilon: the same verdict; a tabulated callable is never stronger
    assert obj.verdict == fn.verdict
    assert 0 < fn.epsilon_lower_bound <= obj.epsilon_lower_bound + 0.05
    assert curve_from_callable(gdp_curve(mu))(0.01) <= gdp_curve(mu)(0.01)
