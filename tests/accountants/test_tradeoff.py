"""Trade-off curves: closed forms, dp-accounting PLDs, ledgers, shape, families, bad input."""

import math

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from scipy import stats

from accountants import EpsilonDeltaEvent, Ledger, NonPrivateEvent
from accountants.tradeoff import (
    CurveFamily,
    GaussianCurve,
    GenericCurve,
    ProfileCurve,
    curve_family,
    curve_from_callable,
    gaussian_curve,
    gaussian_mu,
    gdp_curve,
    generic_curve,
    ledger_curve,
    pld_curve,
)

FPR = np.r_[0.0, np.geomspace(1e-9, 1.0, 400)]


def _generic_ref(a: float, eps: float, delta: float) -> float:
    """Kairouz et al.: FPR + e^eps FNR >= 1 - delta and e^eps FPR + FNR >= 1 - delta."""
    return max(0.0, 1 - delta - math.exp(eps) * a, math.exp(-eps) * (1 - delta - a))


@pytest.fixture(scope="module")
def pld_gauss():
    return {
        s: pld_curve(pld_lib.from_gaussian_mechanism(s, value_discretization_interval=1e-4))
        for s in (0.5, 1.0, 3.0)
    }


@pytest.fixture(scope="module")
def dpsgd_ledger():
    ledger = Ledger()
    step = dpa.PoissonSampledDpEvent(0.02, dpa.GaussianDpEvent(1.1))
    ledger.add("a", dpa.SelfComposedDpEvent(step, 600), "dp-sgd")
    ledger.add("b", dpa.SelfComposedDpEvent(step, 200), "dp-sgd")
    return ledger


# ------------------------------------------------------------------------------ closed forms
@pytest.mark.parametrize(
    "eps,delta", [(0.0, 0.0), (0.5, 1e-5), (1.0, 0.0), (3.0, 0.01), (8.0, 1e-6)]
)
def test_generic_matches_closed_form(eps, delta):
    got = generic_curve(eps, delta)(FPR)
    ref = np.array([_generic_ref(a, eps, delta) for a in FPR])
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-15)
    assert got[0] == pytest.approx(1 - delta)
    fixed = (1 - delta) / (1 + math.exp(eps))  # the curve crosses the diagonal here
    assert generic_curve(eps, delta)(fixed) == pytest.approx(fixed, rel=1e-12)


@pytest.mark.parametrize("eps,delta", [(0.3, 1e-5), (1.0, 1e-5), (4.0, 1e-8), (10.0, 1e-5)])
def test_gaussian_mu_solves_dong_roth_su(eps, delta):
    mu = gaussian_mu(eps, delta)
    n = stats.norm
    drs = n.cdf(-eps / mu + mu / 2) - math.exp(eps) * n.cdf(-eps / mu - mu / 2)
    assert drs == pytest.approx(delta, rel=1e-6)
    curve = gaussian_curve(eps, delta)
    assert curve.mu == mu and "Gaussian mechanism at" in curve.claim


def test_gaussian_is_the_neyman_pearson_test_of_two_normals():
    # N(0,1) vs N(mu,1): reject N(0,1) above t with P0[X > t] = a; FNR = P_mu[X <= t]
    mu, a = 1.3, np.array([1e-4, 0.01, 0.2, 0.7])
    t = stats.norm.isf(a)
    np.testing.assert_allclose(gdp_curve(mu)(a), stats.norm.cdf(t, loc=mu), rtol=1e-12)


# ------------------------------------------------------------------------------ dp-accounting PLDs
@pytest.mark.parametrize("sigma", [0.5, 1.0, 3.0])
def test_pld_of_gaussian_matches_closed_form(pld_gauss, sigma):
    got, exact = pld_gauss[sigma](FPR), gdp_curve(1 / sigma)(FPR)
    assert np.all(got <= exact + 1e-12)  # pessimistic: never more private than the truth
    assert np.max(exact - got) < 1e-6  # within the PLD discretisation (1e-4)
    # its epsilon at delta agrees with the analytic Gaussian mechanism, rounded up by the grid
    from accountants import gaussian_epsilon

    exact_eps = gaussian_epsilon(sigma, 1e-5)
    assert exact_eps <= pld_gauss[sigma].epsilon(1e-5) <= exact_eps + 1e-3


def test_pld_of_randomized_response_is_the_pure_dp_curve():
    p = 0.4  # keep the bit w.p. 1 - p/2: epsilon = ln((1 - p/2) / (p/2))
    eps = math.log((1 - p / 2) / (p / 2))
    curve = pld_curve(pld_lib.from_randomized_response(p, 2, value_discretization_interval=1e-4))
    got = curve(FPR)
    assert np.all(got <= generic_curve(eps, 0.0)(FPR) + 1e-12)
    assert np.all(got >= generic_curve(eps + 2e-4, 0.0)(FPR) - 1e-12)


# ------------------------------------------------------------------------------ shape
@pytest.fixture(scope="module")
def curves(pld_gauss, dpsgd_ledger):
    return {
        "generic": generic_curve(1.0, 1e-5),
        "gaussian": gaussian_curve(2.0, 1e-5),
        "pld": pld_gauss[1.0],
        "ledger": ledger_curve(dpsgd_ledger),
    }


@pytest.mark.parametrize("name", ["generic", "gaussian", "pld", "ledger"])
def test_curves_are_tradeoff_functions(curves, name):
    f = curves[name]
    a = np.linspace(0, 1, 20001)
    y = f(a)
    assert np.all(y >= 0) and np.all(y <= 1 - a + 1e-15)
    assert np.all(np.diff(y) <= 1e-13), "non-increasing"
    assert np.min(y[:-2] - 2 * y[1:-1] + y[2:]) >= -1e-12, "convex"
    # symmetric: f = f^-1, so f(f(a)) = a wherever f is strictly decreasing
    inside = (y > 1e-9) & (a < y[0])
    np.testing.assert_allclose(f(y[inside]), a[inside], atol=1e-9)


def test_ledger_curve_single_gaussian_is_the_closed_form():
    ledger = Ledger()
    ledger.add(0, dpa.GaussianDpEvent(2.0), "release")
    got, exact = ledger_curve(ledger)(FPR), gdp_curve(0.5)(FPR)
    assert np.all(got <= exact + 1e-12) and np.max(exact - got) < 1e-6


def test_ledger_curve_agrees_with_the_ledgers_pld(dpsgd_ledger):
    curve = ledger_curve(dpsgd_ledger)
    step = curve.epsilons[1]
    for delta in (1e-3, 1e-5, 1e-7):
        eps = dpsgd_ledger.epsilon(delta, accountant="pld")
        assert eps - 1e-9 <= curve.epsilon(delta) <= eps + step + 1e-9
    for eps in (0.25, 1.0, 2.0):
        # the curve's delta is the ledger's (worst client) at the grid point at or below eps
        assert curve.delta(eps) >= dpsgd_ledger.delta(eps, accountant="pld") - 1e-12
        assert curve.delta(eps) <= dpsgd_ledger.delta(max(eps - step, 0), accountant="pld") + 1e-9
    # worst client: never stronger than either client's own curve
    for c in ("a", "b"):
        assert np.all(curve(FPR) <= ledger_curve(dpsgd_ledger, client=c)(FPR) + 1e-12)
    assert "ledger's PLD" in curve.claim


def test_ledger_curve_fixed_and_nonprivate_events():
    ledger = Ledger()
    ledger.add(0, EpsilonDeltaEvent(1.0, 1e-6), "scores")
    curve = ledger_curve(ledger)
    assert np.all(curve(FPR) <= generic_curve(1.0, 1e-6)(FPR) + 1e-12)
    assert np.all(curve(FPR) >= generic_curve(1.0 + 1e-4, 1e-6)(FPR) - 1e-12)
    ledger.add(1, NonPrivateEvent("no noise"), "release")
    assert np.all(ledger_curve(ledger)(FPR) == 0.0)
    assert ledger_curve(ledger, client=0)(0.1) > 0


def test_rdp_ledger_curve_is_weaker_than_pld(dpsgd_ledger):
    rdp, pld = ledger_curve(dpsgd_ledger, accountant="rdp"), ledger_curve(dpsgd_ledger)
    assert rdp.epsilon(1e-5) >= dpsgd_ledger.epsilon(1e-5, accountant="rdp") - 1e-9
    assert np.mean(rdp(FPR) <= pld(FPR) + 1e-9) > 0.95


def test_curve_from_callable_never_exceeds_the_callable():
    exact = gdp_curve(1.0)
    approx = curve_from_callable(exact)
    got = approx(FPR)
    assert np.all(got <= exact(FPR) + 1e-12)
    assert np.max(exact(FPR) - got) < 2e-3


# ------------------------------------------------------------------------------ families
@pytest.mark.parametrize("kind", ["generic", "gaussian", "ledger"])
def test_families_are_monotone_in_epsilon(curves, kind):
    curve = curves["ledger"] if kind == "ledger" else kind
    fam = curve_family(curve, 1e-5)
    eps = np.linspace(0, 12, 49)
    vals = fam.fnr(FPR[:, None], eps[None, :])
    assert np.all(np.diff(vals, axis=1) <= 1e-12)
    assert np.all(vals <= 1 - FPR[:, None] + 1e-15)


def test_profile_family_at_its_own_epsilon_is_the_curve(curves):
    curve = curves["ledger"]
    fam = curve_family(curve, 1e-5)
    ref = fam.reference_epsilon
    assert ref == curve.epsilon(1e-5)
    np.testing.assert_array_equal(fam.fnr(FPR, ref), curve(FPR))
    assert fam.claim(ref) == "as private as the ledger's PLD"
    assert (
        fam.claim(ref + 1.5)
        == "as private as the ledger's PLD with every epsilon of its privacy profile raised by 1.5"
    )
    # anchored at another epsilon (an accounted epsilon), the member there is the curve itself
    anchored = fam.anchored(ref + 0.1)
    np.testing.assert_array_equal(anchored.fnr(FPR, ref + 0.1), curve(FPR))
    assert anchored.claim(ref + 0.1) == "as private as the ledger's PLD"


def _gaussian_profile(mu: float, eps: np.ndarray) -> np.ndarray:
    """Dong, Roth & Su's delta(eps) of mu-GDP (a hockey-stick profile)."""
    return stats.norm.cdf(-eps / mu + mu / 2) - np.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2)


@pytest.mark.parametrize("shift", [-0.7, 0.0, 0.3, 2.5, np.array([-0.2, 0.0, 1.0, 4.0])])
def test_shifted_profile_is_the_envelope_of_its_shifted_lines(shift):
    # brute force: every line f_{eps_i + s, delta_i} at every FPR; the breakpoint search (and the
    # slopes it gathers, computed once) may only drop a line by rounding, never add one
    eps = np.linspace(0.0, 8.0, 300)
    curve = ProfileCurve(eps, _gaussian_profile(1.5, eps))
    s = np.asarray(shift)[..., None, None]
    a = FPR[:, None]
    up = np.exp(eps + s)
    lines = np.maximum(1 - curve.deltas - up * a, (1 - curve.deltas - a) / up)
    brute = np.clip(lines.max(axis=-1), 0.0, 1.0 - FPR)
    got = curve.shifted(FPR[:, None] if np.ndim(shift) else FPR, shift).T.reshape(brute.shape)
    assert np.all(got <= brute + 1e-15)
    assert np.max(brute - got) < 1e-12
    # the family's members are the same function
    fam = curve.family(1e-5)
    at = fam.reference_epsilon + np.asarray(shift)
    np.testing.assert_array_equal(fam.members(at)(a), curve.shifted(a, at - fam.reference_epsilon))


def test_gaussian_family_member_is_the_calibrated_gaussian():
    fam = CurveFamily("gaussian", 1e-5)
    # gaussian_curve takes sigma from analytic_gaussian_sigma, which rounds toward more noise (by a
    # relative 1e-8 at most); the family's vectorised bisection stops at the root itself
    np.testing.assert_allclose(fam.fnr(FPR, 2.0), gaussian_curve(2.0, 1e-5)(FPR), rtol=1e-8)
    # epsilon 0: total variation delta, mu = 2 Phi^-1((1 + delta) / 2)
    assert fam.member(0.0).mu == pytest.approx(2 * stats.norm.ppf((1 + 1e-5) / 2), rel=1e-9)
    assert isinstance(fam.member(1.0), GaussianCurve) and isinstance(
        CurveFamily("generic", 0.0).member(1.0), GenericCurve
    )


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: GenericCurve(-1.0, 1e-5), "epsilon must be"),
        (lambda: GenericCurve(1.0, 1.5), "delta must be in"),
        (lambda: generic_curve(1.0, 1e-5)(np.array([0.2, 1.2])), "fpr must be in"),
        (lambda: generic_curve(1.0, 1e-5)(np.array([0.2, np.nan])), "fpr must be in"),
        (lambda: ProfileCurve([0.0, 1.0], [0.5, 0.1])(-1e-9), "fpr must be in"),
        (lambda: ProfileCurve([0.0], [1.0]).shifted([0.2, np.nan], 1.0), "fpr must be in"),
        (lambda: gaussian_mu(1.0, 0.0), "delta must be in"),
        (lambda: curve_family("gauss", 1e-5), "curve must be one of"),
        (lambda: curve_family(3, 1e-5), "curve must be"),
        (lambda: curve_from_callable(lambda a: a), "non-increasing"),
        (lambda: ledger_curve(Ledger()), "ledger is empty"),
    ],
)
def test_bad_input_names_the_value(make, match):
    with pytest.raises(ValueError, match=match):
        make()
