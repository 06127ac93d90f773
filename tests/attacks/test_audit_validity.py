"""The verdict's statistics, tested as statistics (issue 11, item 7; the long run is
benchmarks/audit_validity.py).

Each case audits 200 independent releases of a mechanism whose epsilon is known, with every record
included by a fair coin, and counts false VIOLATIONs against a true claim. The 95% claim fails if
the binomial test of "rate <= 5%" rejects at the 1% level. Permuting the records must leave the
distribution of bounds unchanged (two-sample Kolmogorov-Smirnov), and the positive controls must
be caught.
"""

import numpy as np
import pytest

from attacks.validity import permutation_test, simulate

SEEDS = 200
M = 1000


def _valid(res):
    assert res.p_value > 0.01, (
        f"{res.scenario} eps={res.epsilon} x{res.n_attacks} ({res.order}): "
        f"{res.violations}/{res.seeds} false violations, upper CI {res.rate_upper:.3f}"
    )


@pytest.mark.parametrize("scenario", ["constant", "independent"])
def test_null_models_members_first(scenario):
    """0-DP releases claiming epsilon 0; records listed members first (where ties used to count)."""
    res = simulate(scenario, claim=0.0, m=M, seeds=SEEDS, order="members-first")
    _valid(res)
    assert res.median_bound == 0.0


@pytest.mark.parametrize("eps", [0.5, 1.0, 2.0])
def test_randomised_response_one_attack(eps):
    res = simulate("rr", epsilon=eps, m=M, seeds=SEEDS, order="members-first")
    _valid(res)
    assert 0 < res.median_bound < eps  # not vacuous: the tight mechanism is seen


def test_randomised_response_family_and_permutation():
    """Four attacks (independent tie-breaks of the same RR bits): Bonferroni holds the family at 5%,
    and listing members first gives the same distribution of bounds as a random order."""
    first = simulate("rr", epsilon=1.0, m=M, n_attacks=4, seeds=SEEDS, order="members-first")
    shuffled = simulate("rr", epsilon=1.0, m=M, n_attacks=4, seeds=SEEDS, order="shuffled")
    _valid(first)
    _valid(shuffled)
    assert permutation_test(first, shuffled) > 0.01
    assert abs(np.median(first.bounds) - np.median(shuffled.bounds)) < 0.1


def test_constant_scores_permutation_invariant():
    first = simulate("constant", claim=0.0, m=M, n_attacks=4, seeds=SEEDS, order="members-first")
    shuffled = simulate("constant", claim=0.0, m=M, n_attacks=4, seeds=SEEDS, order="shuffled")
    _valid(first)
    assert permutation_test(first, shuffled) > 0.01
    assert np.median(first.bounds) == np.median(shuffled.bounds) == 0.0


def test_gaussian_mechanism_family():
    res = simulate("gaussian", epsilon=2.0, delta=1e-5, m=M, n_attacks=4, seeds=SEEDS)
    _valid(res)
    assert res.median_bound > 0  # the noisy membership bit is seen, and stays below the truth


def test_positive_control_non_private_release_is_caught():
    res = simulate("exact", claim=1.0, m=M, n_attacks=4, seeds=20)
    assert res.violations == 20
    assert res.median_bound == pytest.approx(res.mean_ceiling)  # every guess right: the ceiling


def test_detectable_epsilon_is_flagged_half_the_time():
    """RR at the detectable epsilon (for a claim of 1) is flagged in at least half of the audits."""
    d = simulate("rr", epsilon=1.0, m=M, seeds=1).detectable_epsilon
    res = simulate("rr", epsilon=d + 1e-6, claim=1.0, m=M, seeds=SEEDS)
    from scipy import stats

    assert stats.binomtest(res.violations, SEEDS, 0.5, alternative="less").pvalue > 0.01
    below = simulate("rr", epsilon=1.0 + 0.5 * (d - 1.0), claim=1.0, m=M, seeds=SEEDS)
    assert below.violations < res.violations
