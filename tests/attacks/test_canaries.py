"""Canary records: fair-coin inclusion, what gets trained on, scores, and the canary audit's power
(a memorising recipe is caught) and validity (a recipe that never sees the canaries is not)."""

import numpy as np
import pytest
from scipy import stats
from scipy.special import log_softmax

from attacks.canaries import (
    ONE_SIDED_GUESSES,
    audit_canaries,
    canary_scores,
    insert_canaries,
    make_canaries,
)


@pytest.fixture(scope="module")
def pool():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 4, 400)
    x = (rng.normal(size=(400, 64)) + y[:, None]).astype(np.float32)
    return x, y


def test_coins_are_fair_and_independent_across_seeds_and_positions(pool):
    x, y = pool
    m, seeds = 60, 300
    coins = np.array([insert_canaries(x, y, m, seed=s).included for s in range(seeds)])
    total = int(coins.sum())
    # total count: Bin(m * seeds, 1/2); two-sided p-value well above 1e-3
    assert stats.binomtest(total, m * seeds, 0.5).pvalue > 1e-3
    # every position is a fair coin: chi-square over positions of the per-position counts
    per_pos = coins.sum(0)
    chi2 = float((((per_pos - seeds / 2) ** 2) / (seeds / 4)).sum())
    assert stats.chi2.sf(chi2, m) > 1e-3
    # neighbouring positions are uncorrelated (pairs agree half of the time)
    agree = int((coins[:, :-1] == coins[:, 1:]).sum())
    assert stats.binomtest(agree, seeds * (m - 1), 0.5).pvalue > 1e-3


def test_coins_do_not_depend_on_the_canaries(pool):
    x, y = pool
    a = insert_canaries(x, y, 50, kind="mislabel", seed=7)
    b = insert_canaries(x, y, 50, kind="ood", seed=7)
    np.testing.assert_array_equal(
        a.included, b.included
    )  # own stream, drawn apart from the canaries
    assert not np.array_equal(a.included, insert_canaries(x, y, 50, seed=8).included)


def test_mislabel_canaries_replace_their_sources(pool):
    x, y = pool
    d = insert_canaries(x, y, 80, kind="mislabel", seed=3)
    x_train, y_train, index, included = d  # unpacks as the brief's 4-tuple
    assert np.all(d.canary_y != y[d.source])  # every label moved to another class
    assert len(np.unique(d.source)) == 80
    assert len(y_train) == len(y) - 80 + included.sum()
    # included canaries sit at their index with their wrong label; excluded ones are absent
    np.testing.assert_array_equal(x_train[index[included]], d.canary_x[included])
    np.testing.assert_array_equal(y_train[index[included]], d.canary_y[included])
    assert np.all(index[~included] == -1)
    # the sources are out of the training data (their correct copies do not contradict the canary)
    rows = {r.tobytes() for r in x_train[: len(y) - 80]}
    assert not any(x[s].tobytes() in rows for s in d.source)


def test_mislabel_labels_are_uniform_over_the_other_classes(pool):
    x, y = pool
    shifts = np.concatenate(
        [
            (make_canaries(x, y, 100, seed=s)[1] - y[make_canaries(x, y, 100, seed=s)[2]]) % 4
            for s in range(40)
        ]
    )
    counts = np.bincount(shifts, minlength=4)
    assert counts[0] == 0
    assert stats.chisquare(counts[1:]).pvalue > 1e-3


def test_ood_canaries_light_a_fixed_fraction_far_outside_the_pool(pool):
    x, y = pool
    cx, cy, src = make_canaries(x, y, 30, kind="ood", seed=1, ood_fraction=0.05, ood_amplitude=5.0)
    assert np.all(src == -1)
    high = cx > x.max()
    np.testing.assert_array_equal(high.sum(1), np.full(30, 3))  # round(0.05 * 64) = 3 coordinates
    assert len({r.tobytes() for r in high}) == 30  # every canary its own pattern
    assert np.all(cy >= 0) and np.all(cy < 4)
    with pytest.raises(ValueError, match="patterns for n = 30"):
        make_canaries(x[:, :4], y, 30, kind="ood", ood_fraction=0.25)  # C(4, 1) = 4 patterns


def test_scores_match_log_softmax_and_the_hinge():
    rng = np.random.default_rng(2)
    z = rng.normal(size=(50, 5)) * 3
    lab = rng.integers(0, 5, 50)
    np.testing.assert_allclose(
        canary_scores(z, lab, "loss"), log_softmax(z, axis=1)[np.arange(50), lab], rtol=1e-12
    )
    gap = canary_scores(z, lab, "logit-gap")
    for i in range(50):
        assert gap[i] == pytest.approx(z[i, lab[i]] - np.delete(z[i], lab[i]).max())
    # log-probabilities (a scikit-learn model's output) give the same loss score as the logits
    np.testing.assert_allclose(
        canary_scores(log_softmax(z, axis=1), lab, "loss"),
        canary_scores(z, lab, "loss"),
        rtol=1e-12,
    )


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"n": 1}, "n .number of canaries."),
        ({"kind": "poison"}, "kind must be one of"),
        ({"n": 10_000}, "n must be <= the pool size"),
    ],
)
def test_bad_input_names_the_parameter(pool, bad, match):
    x, y = pool
    args = {"n": 10, "kind": "mislabel", **bad}
    with pytest.raises(ValueError, match=match):
        insert_canaries(x, y, args["n"], kind=args["kind"])


class _Lookup:
    """Publishes its training set: confident on records it saw, uniform elsewhere (no privacy)."""

    def __init__(self, x, y):
        self.table = {r.tobytes(): int(c) for r, c in zip(x, y)}

    def __call__(self, q):
        p = np.full((len(q), 4), 0.25)
        for i, r in enumerate(q):
            if r.tobytes() in self.table:
                p[i] = 0.01
                p[i, self.table[r.tobytes()]] = 0.97
        return p


def _memorise(x, y, seed):
    return _Lookup(x, y)


def _blind(x, y, seed):
    """Ignores its data: the canaries cannot leak (a 0-DP recipe)."""
    return lambda q: np.full((len(q), 4), 0.25)


@pytest.mark.parametrize("kind", ["mislabel", "ood"])
def test_positive_control_memorising_recipe_is_a_violation(pool, kind):
    x, y = pool
    for seed in range(3):
        res = audit_canaries(
            _memorise,
            x,
            y,
            200,
            kind=kind,
            accounted_epsilon=1.0,
            delta=1e-5,
            seed=seed,
            num_classes=4,
        )
        assert res.verdict == "violation", res.message
        assert res.epsilon_lower_bound == pytest.approx(res.epsilon_ceiling)  # every guess right
        assert res.guess_grid == ONE_SIDED_GUESSES


def test_negative_control_blind_recipe_is_never_a_violation(pool):
    x, y = pool
    bounds = []
    for seed in range(20):
        res = audit_canaries(
            _blind,
            x,
            y,
            100,
            kind="mislabel",
            accounted_epsilon=0.5,
            delta=1e-5,
            seed=seed,
            num_classes=4,
        )
        assert res.verdict != "violation"
        bounds.append(res.epsilon_lower_bound)
    # constant scores: every guess is a coin toss (random tie-break); the bound is 0 in most runs
    assert np.median(bounds) == 0.0
