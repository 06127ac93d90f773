"""An audit's runs' federations over one shared private dataset
(:func:`privkit.audit.recipes.federations_over`): each the federation
:func:`~privkit.audit.recipes.federation_over` builds on its own copy, record for record."""

from __future__ import annotations

import numpy as np
import pytest

from privkit.audit.recipes import federation_over, federations_over
from privkit.data import FederationConfig, build_federation


@pytest.fixture(scope="module")
def base():
    return build_federation(FederationConfig(partition="dirichlet", clients=6, seed=0))


def _same(got, want) -> None:
    assert got.num_clients == want.num_clients
    for i in range(want.num_clients):
        gx, gy = got.client_arrays(i)
        wx, wy = want.client_arrays(i)
        assert np.array_equal(gx, wx) and np.array_equal(gy, wy)
    for a, b in zip(got.test_arrays(), want.test_arrays()):
        assert np.array_equal(a, b)
    for a, b in zip(got.pooled_arrays(), want.pooled_arrays()):
        assert np.array_equal(a, b)  # the pooled records in the same order
    assert got.public is want.public and got.shadow_pool.size == 0
    assert np.array_equal(got.client_class_counts(), want.client_class_counts())


def test_shared_federations_hold_each_runs_records_in_order(base):
    """Six runs over increasing index sets of a pool (an audit's design), seeded partitions:
    every client's records and labels, the test set and the pooled records are those of the
    run's own federation_over; the runs share one private dataset (one copy of the pool)."""
    rng = np.random.default_rng(0)
    x, y = base.private.x[base.members], base.private.y[base.members]
    sets = [np.sort(rng.choice(len(y), 300, replace=False)) for _ in range(6)]
    seeds = [int(s) for s in rng.integers(0, 2**31, 6)]
    got = federations_over(base, x, y, sets, seeds)
    for fed, ix, seed in zip(got, sets, seeds):
        _same(fed, federation_over(base, x[ix], y[ix], seed))
        assert fed.private is got[0].private
    assert len(got[0].private) == len(y) + len(base.test)
    assert len({tuple(len(c) for c in f.clients) for f in got}) > 1  # the seeds partition apart


def test_an_index_set_out_of_order_gets_its_own_copy(base):
    """An index set that is not increasing (a caller's own order) gets federation_over's own
    federation: its clients' records in the order that set gives them."""
    x, y = base.private.x[base.members], base.private.y[base.members]
    ix = np.arange(200)[::-1].copy()
    (fed,) = federations_over(base, x, y, [ix], [3])
    _same(fed, federation_over(base, x[ix], y[ix], 3))
    assert len(fed.private) == len(ix) + len(base.test)
