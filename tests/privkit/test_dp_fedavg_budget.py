"""dp-fedavg's per-client budget check (``_Budget``, shared with FedKD+DP): its RDP epsilon is
dp-accounting's for the rounds composed, and the cached conversion changes no value."""

from __future__ import annotations

import dp_accounting as dpa
import pytest

from privkit.trainers.dp_fedavg import _Budget, _rdp_epsilon

DELTA = 1e-5


def _by_hand(rounds: list[tuple[float, float, int]]) -> float:
    """dp-accounting's RDP epsilon of the rounds (rate, noise multiplier, local steps), composed."""
    acc = dpa.rdp.RdpAccountant()
    for q, z, steps in rounds:
        acc.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), steps)
    return float(acc.get_epsilon(DELTA))


def _walk(budget: _Budget, rounds: list[tuple[float, float, int]]) -> list[float]:
    out = []
    for q, z, steps in rounds:
        state, eps = budget.would_be(3, q, z, steps)
        budget.commit(3, state, eps)
        out.append(eps)
    return out


ROUNDS = [(0.05, 1.1, 10), (0.05, 1.1, 10), (0.02, 0.9, 5), (0.1, 1.3, 20)]


def test_each_round_s_epsilon_is_dp_accountings_composition():
    got = _walk(_Budget("rdp", DELTA), ROUNDS)
    for t, eps in enumerate(got):
        assert eps == pytest.approx(_by_hand(ROUNDS[: t + 1]), rel=1e-12)
    assert got == sorted(got)  # every round adds to the client's budget


def test_a_second_run_over_the_same_rounds_is_served_from_the_cache_unchanged():
    _rdp_epsilon.cache_clear()
    first = _walk(_Budget("rdp", DELTA), ROUNDS)
    misses = _rdp_epsilon.cache_info().misses
    second = _walk(_Budget("rdp", DELTA), ROUNDS)
    assert second == first
    info = _rdp_epsilon.cache_info()
    assert info.misses == misses and info.hits >= len(ROUNDS)
    # another delta is another conversion, not a cached one
    other = _walk(_Budget("rdp", 1e-3), ROUNDS)
    assert all(a < b for a, b in zip(other, first))
    assert _rdp_epsilon.cache_info().misses == misses + len(ROUNDS)
