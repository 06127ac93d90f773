"""Which delta a standalone `privkit audit RUN_DIR` uses when --delta is not given."""

from privkit.audit.run import resolve_delta


def test_given_delta_wins():
    assert resolve_delta(1e-3, {"delta": 1e-6}, {}, 1000) == 1e-3


def test_run_delta_below_one_over_n_is_used():
    assert resolve_delta(None, {"delta": 1e-6}, {"delta": 1e-7}, 1000) == 1e-6
    assert resolve_delta(None, {}, {"delta": 1e-7}, 1000) == 1e-7


def test_delta_at_or_above_one_over_n_is_not_audited():
    """FedMD-NFDP's theorem gives delta 0.098 on 50 records: auditing at it would allow any leak."""
    assert resolve_delta(None, {}, {"delta": 0.098}, 50) == 1e-5
    assert resolve_delta(None, {"delta": 1.0}, {}, 50) == 1e-5
    assert resolve_delta(None, {}, {"delta": 0.001}, 1000) == 1e-5  # exactly 1/n
    assert resolve_delta(None, {}, {}, 200_000) == 1 / 200_000  # min(1e-5, 1/n)
