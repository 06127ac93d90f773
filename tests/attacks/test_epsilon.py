"""Empirical epsilon: known answers (closed forms, notes §4 numbers, randomised response)."""

import math

import numpy as np
import pytest
from scipy import stats

from attacks import epsilon as E
from attacks import one_run as O


def test_clopper_pearson_matches_scipy_exact_interval():
    for k, n in [(0, 10), (3, 50), (49, 50), (50, 50), (270, 1000)]:
        ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.9, method="exact")
        assert E.clopper_pearson_upper(k, n, 0.05) == pytest.approx(ci.high, rel=1e-9)
        assert E.clopper_pearson_interval(k, n, 0.1) == pytest.approx((ci.low, ci.high), rel=1e-9)


@pytest.mark.parametrize("n,expected", [(100, 3.28), (1000, 5.60), (10000, 7.90), (100000, 10.21)])
def test_ceiling_numbers_of_notes(n, expected):
    assert E.epsilon_ceiling(n, n, 0.0, 0.05, "single") == pytest.approx(expected, abs=0.006)
    # closed form ln((1-u)/u), u = 1 - (alpha/2)^(1/n)
    u = 1 - 0.025 ** (1 / n)
    assert E.epsilon_ceiling(n, n, 0.0, 0.05, "single") == pytest.approx(math.log((1 - u) / u))


def test_bonferroni_costs_and_heldout_halves():
    assert E.epsilon_ceiling(1000, 1000, 0, 0.05, "bonferroni") < E.epsilon_ceiling(
        1000, 1000, 0, 0.05, "single"
    )
    assert E.epsilon_ceiling(1000, 1000, 0, 0.05, "heldout") == pytest.approx(
        E.epsilon_ceiling(500, 500, 0, 0.05, "single")
    )


def test_perfect_attack_reaches_ceiling_and_delta_lowers_it():
    s = np.r_[np.ones(200), np.zeros(200)]
    m = s.astype(bool)
    b = E.empirical_epsilon(s, m, delta=0.0)
    assert b.epsilon == pytest.approx(b.ceiling)
    assert E.empirical_epsilon(s, m, delta=0.05).epsilon < b.epsilon


def test_gdp_estimate_example_of_notes():
    # FPR+ = 1 %, FNR+ = 50 %, delta = 1e-5: GDP says ~12.1, the rigorous bound is ln 50 = 3.9
    assert E.gdp_epsilon_estimate(0.01, 0.5, 1e-5) == pytest.approx(12.1, abs=0.05)
    assert float(E.epsilon_from_rates(0.01, 0.5, 0.0, two_sided=False)) == pytest.approx(
        math.log(50)
    )


def _rr(eps, n, rng):
    p = math.exp(eps) / (1 + math.exp(eps))
    s_in = (rng.random(n) < p).astype(float)
    s_out = (rng.random(n) < 1 - p).astype(float)
    return np.r_[s_in, s_out], np.r_[np.ones(n, bool), np.zeros(n, bool)]


@pytest.mark.parametrize(
    "eps,method",
    [(1.0, "bonferroni"), (4.0, "bonferroni"), (1.0, "single"), (4.0, "single"), (1.0, "heldout")],
)
def test_randomised_response_bound_is_valid(eps, method):
    """Lower bound <= true epsilon in repeated trials: violations at most the alpha rate."""
    rng = np.random.default_rng(7)
    reps, violations, bounds = 200, 0, []
    for r in range(reps):
        s, m = _rr(eps, 1000, rng)
        b = E.empirical_epsilon(s, m, delta=0.0, method=method, threshold=0.5, random_state=r)
        bounds.append(b.epsilon)
        violations += b.epsilon > eps
    # P[Bin(200, 0.05) > 19] < 1e-3: more than 19 violations would falsify the 95 % claim
    assert violations <= 19
    assert np.mean(bounds) > 0.5 * eps  # and it is not vacuous


def test_randomised_response_single_threshold_matches_notes_self_test():
    # notes §4: n = 1000 per class, true eps = 1 / 4 give about 0.83 / 3.74 with a fixed rule
    rng = np.random.default_rng(0)
    for eps, ref in [(1.0, 0.83), (4.0, 3.74)]:
        vals = [
            E.empirical_epsilon(
                *_rr(eps, 1000, rng), delta=0.0, method="single", threshold=0.5
            ).epsilon
            for _ in range(30)
        ]
        assert np.median(vals) == pytest.approx(ref, abs=0.25)
        assert max(vals) <= eps + 0.2


def test_randomised_response_bound_approaches_truth_with_many_trials():
    rng = np.random.default_rng(1)
    small = E.empirical_epsilon(*_rr(2.0, 200, rng), delta=0.0).epsilon
    large = E.empirical_epsilon(*_rr(2.0, 200_000, rng), delta=0.0).epsilon
    assert small < large <= 2.0
    assert large > 1.9


# --------------------------------------------------------------------------- one-run audit
def _reference_p_value(m, r, v, eps, delta):
    """Loop form of the authors' code (Steinke et al. 2023), kept independent of attacks.one_run."""
    q = 1 / (1 + math.exp(-eps))
    beta = stats.binom.sf(v - 1, r, q)
    alpha, acc = 0.0, 0.0
    for i in range(1, v + 1):
        acc += stats.binom.pmf(v - i, r, q)
        if acc > i * alpha:
            alpha = acc / i
    return min(beta + alpha * delta * 2 * m, 1)


@pytest.mark.parametrize(
    "m,r,v,eps,delta",
    [
        (1000, 100, 90, 1.0, 1e-5),
        (1000, 1000, 980, 3.0, 1e-5),
        (50, 50, 40, 0.5, 0.0),
        (2000, 200, 150, 2.0, 1e-4),
    ],
)
def test_one_run_p_value_matches_reference_code(m, r, v, eps, delta):
    assert O.p_value(m, r, v, eps, delta) == pytest.approx(
        _reference_p_value(m, r, v, eps, delta), rel=1e-9
    )


def test_one_run_ceilings_of_notes():
    assert O.epsilon_lower_bound(100, 100, 100, delta=0) == pytest.approx(3.49, abs=0.006)
    assert O.epsilon_lower_bound(1000, 1000, 1000, delta=0) == pytest.approx(5.81, abs=0.006)
    # the notes' self-test: 988 of 1000 RR(eps=4) guesses correct -> 3.92
    assert O.epsilon_lower_bound(1000, 1000, 988, delta=0) == pytest.approx(3.92, abs=0.01)
    # the delta term can only lower the bound
    assert O.epsilon_lower_bound(1000, 1000, 988, delta=1e-4) < O.epsilon_lower_bound(
        1000, 1000, 988, delta=0
    )


def test_one_run_randomised_response_valid():
    rng = np.random.default_rng(3)
    eps, m = 2.0, 1000
    q = 1 / (1 + math.exp(-eps))
    bounds = []
    for _ in range(100):
        inc = rng.random(m) < 0.5
        correct = rng.random(m) < q
        scores = np.where(correct == inc, 1.0, 0.0) + rng.random(m) * 1e-3  # RR output, ties split
        res = O.one_run_audit(scores, inc, delta=0.0, k_pos=0.2, k_neg=0.2)
        assert res.guesses == 400
        bounds.append(res.epsilon)
    assert np.mean(np.array(bounds) > eps) <= 0.05
    assert np.median(bounds) > 1.0


def test_one_run_bad_input():
    with pytest.raises(ValueError, match="k_pos"):
        O.one_run_audit(np.zeros(10), np.zeros(10, bool), delta=0, k_pos=20)
    with pytest.raises(ValueError, match="beta"):
        O.epsilon_lower_bound(10, 10, 10, delta=0, beta=2)


# --------------------------------------------------------------------------- verdict
def _gaussian_runs(sigma, n, rng):
    """Independent runs of a sum query (sensitivity 1) with and without the target record."""
    s_in = 1.0 + sigma * rng.normal(size=n)
    s_out = 0.0 + sigma * rng.normal(size=n)
    return np.r_[s_in, s_out], np.r_[np.ones(n, bool), np.zeros(n, bool)]


def test_threshold_bound_sees_a_mechanism_that_forgets_its_noise():
    """Independent runs: the Clopper-Pearson bound stays below a true epsilon and exceeds it when
    the noise is forgotten (the verdict itself goes through attacks.audit_scores)."""
    eps, delta = 1.0, 1e-5
    sigma = math.sqrt(2 * math.log(1.25 / delta)) / eps  # classic Gaussian mechanism, sensitivity 1
    rng = np.random.default_rng(0)
    honest = E.empirical_epsilon(*_gaussian_runs(sigma, 2000, rng), delta=delta)
    broken = E.empirical_epsilon(*_gaussian_runs(0.0, 2000, rng), delta=delta)  # noise forgotten
    assert honest.epsilon <= eps < 5 < broken.epsilon


def test_one_run_p_value_matches_reference_code_on_a_grid():
    """Tails included (tiny pmf values, q near 1): relative error below 1e-9 wherever p > 0."""
    import itertools

    for m, r, v, eps, delta in itertools.product(
        [1000], [20, 200, 1000], [1, 10, 190, 1000], [0.0, 0.3, 3, 20], [1e-5, 1e-3]
    ):
        if v <= r:
            ref = _reference_p_value(m, r, v, eps, delta)
            assert O.p_value(m, r, v, eps, delta) == pytest.approx(ref, rel=1e-9, abs=1e-300)


# --------------------------------------------------------------------------- ties (issue 11)
def test_guess_breaks_ties_at_random_not_by_position():
    """Constant scores: over seeds every position is guessed equally often (chi-square), whatever
    the order; a stable sort guessed the first k every time (members first: all correct)."""
    m, k = 50, 5
    counts = np.zeros(m)
    for seed in range(2000):
        g = O.guess(np.zeros(m), k, k, seed=seed)
        assert (g == 1).sum() == k and (g == -1).sum() == k
        counts += g == 1
    assert stats.chisquare(counts).pvalue > 0.001
    # strict order among distinct scores is kept: ties are only broken inside a tie group
    s = np.r_[np.full(10, 2.0), np.full(30, 1.0), np.full(10, 0.0)]
    for seed in range(20):
        g = O.guess(s, 15, 10, seed=seed)
        assert (g[:10] == 1).all() and (g[40:] == -1).all() and (g[10:40] == 1).sum() == 5


def test_one_run_constant_scores_members_first_median_zero():
    m = 1000
    bounds = []
    for seed in range(100):
        inc = np.sort(np.random.default_rng(seed).random(m) < 0.5)[::-1]  # members listed first
        bounds.append(O.one_run_audit(np.zeros(m), inc, delta=1e-5, seed=seed).epsilon)
    assert np.median(bounds) == 0.0
    assert (
        stats.binomtest(int(np.sum(np.array(bounds) > 0)), 100, 0.05, alternative="greater").pvalue
        > 0.01
    )


def test_threshold_bound_credits_no_tie_and_ignores_order():
    """A threshold admits a whole tie group, so constant scores give 0 and order changes nothing."""
    mem = np.r_[np.ones(300, bool), np.zeros(300, bool)]
    for method in ("bonferroni", "heldout", "single"):
        assert (
            E.empirical_epsilon(np.zeros(600), mem, delta=0.0, method=method, threshold=0.0).epsilon
            == 0.0
        )
    rng = np.random.default_rng(0)
    s, m = _rr(1.0, 300, rng)  # one-bit scores: ties everywhere
    perm = rng.permutation(s.size)
    for method in ("bonferroni", "single"):
        a = E.empirical_epsilon(s, m, delta=0.0, method=method, threshold=0.5)
        b = E.empirical_epsilon(s[perm], m[perm], delta=0.0, method=method, threshold=0.5)
        assert a.epsilon == b.epsilon > 0
