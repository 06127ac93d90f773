"""The audit experiment's random inclusion: fair, independent coins from the audit's own stream."""

import numpy as np
import pytest
from scipy import stats

from attacks.experiment import design_experiment, inclusion_coins, membership_mask, stream_seeds

N, SEEDS = 500, 400  # 200 000 coins


@pytest.fixture(scope="module")
def coins():
    return np.stack([inclusion_coins(N, s) for s in range(SEEDS)])  # (seeds, records)


def test_coins_are_balanced(coins):
    assert stats.binomtest(int(coins.sum()), coins.size, 0.5).pvalue > 1e-3
    # each record's inclusion count over the seeds is Bin(SEEDS, 1/2): chi-square over the records
    k = coins.sum(0)
    chi2 = float(((k - SEEDS / 2) ** 2 / (SEEDS / 4)).sum())
    assert stats.chi2.sf(chi2, N) > 1e-3 and stats.chi2.cdf(chi2, N) > 1e-3


def test_coins_are_independent_across_records_and_seeds(coins):
    # agreement of neighbouring records (same seed) and of neighbouring seeds (same record): each
    # pair agrees with probability 1/2 when the coins are independent
    for a, b in ((coins[:, :-1], coins[:, 1:]), (coins[:-1], coins[1:])):
        agree = int((a == b).sum())
        assert stats.binomtest(agree, a.size, 0.5).pvalue > 1e-3
    # no record is correlated with another: the largest |correlation| over 200 x 200 pairs stays
    # within what independent coins give (|r| ~ N(0, 1/SEEDS); 5 sigma over ~2e4 pairs)
    r = np.corrcoef(coins[:, :200].T.astype(float))
    assert np.abs(r[np.triu_indices(200, 1)]).max() < 5 / np.sqrt(SEEDS)


def test_coins_are_independent_of_the_seeds_handed_to_the_recipe():
    """A recipe that draws its own coins from the seed it is given cannot reproduce the audit's."""
    agree = total = 0
    for s in range(200):
        d = design_experiment(N, shadows=2, seed=s)
        for own_seed in d.seeds():
            own = np.random.default_rng(own_seed).integers(0, 2, N).astype(bool)
            agree += int((own == d.included).sum())
            total += N
        # the seeds handed to the recipe are not the coin stream's
        assert d.target_seed not in d.reference_seeds
    assert stats.binomtest(agree, total, 0.5).pvalue > 1e-3


def test_design_does_not_depend_on_the_recipe_side():
    # the coins depend on the audit seed only: not on the number of reference models, nor on
    # which other records are audited
    a = design_experiment(N, shadows=2, seed=7)
    b = design_experiment(N, shadows=8, seed=7)
    assert (a.included == b.included).all() and a.target_seed == b.target_seed
    sub = np.zeros(N, bool)
    sub[::3] = True
    c = design_experiment(N, shadows=2, seed=7, audited=sub)
    assert (c.included[sub] == a.included[sub]).all() and c.included[~sub].all()
    assert design_experiment(N, shadows=2, seed=8).included.tolist() != a.included.tolist()


def test_reference_design_matches_the_target_size():
    d = design_experiment(1000, shadows=8, seed=0)
    assert (d.keep.sum(0) == 4).all()  # every record in exactly half of the reference models
    assert d.keep.shape == (8, 1000) and len(d.reference_seeds) == 8
    sizes = d.keep.sum(1)
    # both the target and each reference model train on ~ n/2 records (Bin(1000, 1/2) sd ~ 16)
    assert abs(d.included.sum() - 500) < 80 and np.all(np.abs(sizes - 500) < 80)
    sets = d.index_sets()
    assert len(sets) == 9 and (sets[0] == np.flatnonzero(d.included)).all()
    s = d.summary()
    assert s["audited"] == 1000 and s["target_train_size"] == int(d.included.sum())
    assert s["reference_train_size"]["mean"] == 500.0


def test_design_validation():
    with pytest.raises(ValueError, match="shadows must be 0 or an even number >= 2; found 3"):
        design_experiment(10, shadows=3, seed=0)
    with pytest.raises(ValueError, match="seed must be a non-negative integer; found -1"):
        design_experiment(10, shadows=2, seed=-1)
    with pytest.raises(ValueError, match="audited must be a bool array of length 10"):
        design_experiment(10, shadows=2, seed=0, audited=np.ones(3, bool))
    with pytest.raises(ValueError, match="at least 2 records must be audited; found 1"):
        design_experiment(10, shadows=2, seed=0, audited=np.eye(10, dtype=bool)[0])
    with pytest.raises(ValueError, match="n_models must be an even number"):
        membership_mask(3, 10, 0)
    assert stream_seeds(0, 5, "x")[:3] == stream_seeds(0, 3, "x")  # adding models shifts nothing
