"""Hypothesis properties: monotonicity of epsilon in sigma and delta, composition never below parts."""

import itertools

import dp_accounting as dpa
from hypothesis import given, settings
from hypothesis import strategies as st

import accountants as acc

FAST = settings(max_examples=15, deadline=None)
COARSE = 1e-2  # PLD grid for property tests (pessimistic: still upper bounds)


@FAST
@given(s1=st.floats(0.3, 30), s2=st.floats(0.3, 30), delta=st.floats(1e-10, 1e-2))
def test_gaussian_epsilon_non_increasing_in_sigma(s1, s2, delta):
    lo, hi = sorted((s1, s2))
    assert acc.gaussian_epsilon(hi, delta) <= acc.gaussian_epsilon(lo, delta) + 1e-9


@FAST
@given(
    q=st.floats(1e-3, 0.2), s1=st.floats(0.6, 5), s2=st.floats(0.6, 5), steps=st.integers(1, 200)
)
def test_dpsgd_epsilon_non_increasing_in_sigma(q, s1, s2, steps):
    lo, hi = sorted((s1, s2))
    for kind in ("rdp", "pld"):
        e_hi = acc.dpsgd_epsilon(
            q, hi, steps, 1e-5, accountant=kind, value_discretization_interval=COARSE
        )
        e_lo = acc.dpsgd_epsilon(
            q, lo, steps, 1e-5, accountant=kind, value_discretization_interval=COARSE
        )
        assert e_hi <= e_lo + 1e-9


@FAST
@given(
    sigmas=st.lists(st.floats(0.5, 20), min_size=2, max_size=4),
    eds=st.lists(st.tuples(st.floats(0.01, 1), st.floats(1e-9, 1e-7)), max_size=2),
)
def test_composition_never_below_its_parts(sigmas, eds):
    ledger = acc.Ledger(value_discretization_interval=COARSE)
    for i, s in enumerate(sigmas):
        ledger.add(0, dpa.GaussianDpEvent(s), f"g{i}")
    for i, (e, d) in enumerate(eds):
        ledger.add(0, acc.EpsilonDeltaEvent(e, d), f"ed{i}")
    delta = 1e-5
    whole = ledger.epsilon(delta)
    # Every single part, accounted alone at the same total delta, is at most the whole.
    for s in sigmas:
        assert whole >= acc.gaussian_epsilon(s, delta) - 1e-9
    for e, _ in eds:
        assert whole >= e - 1e-12


@FAST
@given(e1=st.floats(0, 5), e2=st.floats(0, 5), s=st.floats(0.5, 5))
def test_delta_of_epsilon_non_increasing(e1, e2, s):
    ledger = acc.Ledger(value_discretization_interval=COARSE)
    ledger.add(0, acc.dpsgd_event(0.05, s, 20), "dp")
    ledger.add(0, acc.EpsilonDeltaEvent(0.1, 1e-8), "ed")
    lo, hi = sorted((e1, e2))
    for kind in ("basic", "rdp", "pld", "best"):
        assert ledger.delta(hi, accountant=kind) <= ledger.delta(lo, accountant=kind) + 1e-12


@FAST
@given(
    n=st.integers(1, 10**6),
    k=st.integers(1, 10**6),
    rep=st.booleans(),
    eps=st.lists(st.floats(0, 10), min_size=2, max_size=5),
)
def test_nfdp_profile_non_increasing_and_at_most_theorem(n, k, rep, eps):
    if not rep and k > n:
        k = n
    prof = acc.nfdp_profile(n, k, rep, sorted(eps))
    assert all(a >= b - 1e-15 for a, b in itertools.pairwise(prof))
    assert max(prof) <= acc.nfdp_epsilon_delta(n, k, rep)[1] + 1e-15
