"""accountants.fast: the vectorised subsampled Gaussian gives dp-accounting's own numbers.

dp-accounting is the independent source: its RDP curve, its PLD pmfs and its composed epsilons and
deltas are recomputed here for random (q, sigma, steps) and compared bit for bit (the vectorised
code follows the same formulas and summation order).
"""

import logging

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as pld
from dp_accounting.rdp import rdp_privacy_accountant as rdp

from accountants import fast

logging.getLogger("absl").setLevel(logging.ERROR)  # dp-accounting's non-converged-order notes


def _cases(seed, n, q_range=(-4, 0), s_range=(-0.5, 1.3)):
    rng = np.random.default_rng(seed)
    return [
        (float(10 ** rng.uniform(*q_range)), float(10 ** rng.uniform(*s_range))) for _ in range(n)
    ]


@pytest.mark.parametrize("q,sigma", _cases(0, 8) + [(1.0, 0.7), (0.3, 0.55)])
def test_rdp_curve_equals_dp_accounting(q, sigma):
    orders = rdp.DEFAULT_RDP_ORDERS
    ours = fast.poisson_gaussian_rdp(q, sigma, orders)
    ref = rdp._compute_rdp_poisson_subsampled_gaussian(q, sigma, orders)
    np.testing.assert_array_equal(ours, ref)  # inf where dp-accounting's series does not converge


@pytest.mark.parametrize(
    "q,sigma,vdi",
    [(q, s, v) for (q, s), v in zip(_cases(1, 6, (-3, 0), (-0.3, 1)), [1e-3, 1e-4] * 3)]
    + [(1.0, 1.3, 1e-3)],
)
def test_pld_pmfs_equal_dp_accounting(q, sigma, vdi):
    ours = fast._base_pld(sigma, q, vdi)
    ref = pld.from_gaussian_mechanism(sigma, sampling_prob=q, value_discretization_interval=vdi)
    for a, b in ((ours._pmf_remove, ref._pmf_remove), (ours._pmf_add, ref._pmf_add)):
        a, b = a.to_dense_pmf(), b.to_dense_pmf()
        assert a._lower_loss == b._lower_loss
        np.testing.assert_array_equal(a._probs, b._probs)
        assert a._infinity_mass == b._infinity_mass


def _ledger_events(seed):
    rng = np.random.default_rng(seed)
    events = [
        dpa.SelfComposedDpEvent(
            dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(s)), int(rng.integers(1, 300))
        )
        for q, s in _cases(seed, int(rng.integers(1, 4)), (-3, -0.3), (-0.2, 0.8))
    ]
    return events + [
        dpa.PoissonSampledDpEvent(0.05, dpa.GaussianDpEvent(1.1)),  # one step: count 1
        dpa.GaussianDpEvent(3.0),
        dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(2.0), 5),
        dpa.LaplaceDpEvent(2.0),
    ]


@pytest.mark.parametrize("seed", range(4))
def test_composed_accountants_equal_dp_accounting(seed):
    events = _ledger_events(seed)
    vdi = (1e-3, 1e-4)[seed % 2]
    pairs = [
        (
            fast.PldAccountant(value_discretization_interval=vdi),
            dpa.pld.PLDAccountant(value_discretization_interval=vdi),
        ),
        (fast.RdpAccountant(), dpa.rdp.RdpAccountant()),
    ]
    for ours, ref in pairs:
        for ev in events:
            ours.compose(ev)
            ref.compose(ev)
        for delta in (1e-3, 1e-6, 1e-9):
            # the PLD's plain FFT value (get_epsilon adds the certified allowance)
            raw = ours.raw_epsilon if isinstance(ours, fast.PldAccountant) else ours.get_epsilon
            assert raw(delta) == ref.get_epsilon(delta)
        for eps in (0.5, 3.0):
            assert ours.get_delta(eps) == ref.get_delta(eps)


def test_cache_returns_identical_events_once():
    fast.poisson_gaussian_pld.cache_clear()
    a = fast.poisson_gaussian_pld(0.05, 1.1, 1e-3, 10)
    b = fast.poisson_gaussian_pld(0.05, 1.1, 1e-3, 10)
    assert a is b and fast.poisson_gaussian_pld.cache_info().hits == 1
