"""Certified brackets around the PLD epsilon (accountants.bracket).

Independent references: the exact hockey-stick curve of the (subsampled) Gaussian from
dp-accounting's privacy-loss objects (the optimistic pmf must lie below it at every epsilon, also
off the grid and below zero); the analytic Gaussian (Balle & Wang 2018), exact for composed
Gaussians; dp-accounting's pessimistic PLD on a finer grid and opacus PRV's certified interval
(Gopi et al. 2021), both of which the true epsilon respects; notes/accounting.md section 4 for the
MNIST DP-SGD case (dp-accounting at a 2e-6 grid: 2.3816900, an upper bound).
"""

import math

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as pld
from dp_accounting.pld import privacy_loss_mechanism as plm

import accountants as acc
from accountants.bracket import _optimistic_pmf
from accountants.fast import _VectorGaussianPrivacyLoss


def _cases(seed, n):
    rng = np.random.default_rng(seed)
    return [
        (
            float(10 ** rng.uniform(-2.5, -0.5)),
            float(rng.uniform(0.7, 2.5)),
            int(rng.integers(10, 600)),
        )
        for _ in range(n)
    ]


@pytest.mark.parametrize(
    "q,sigma,adjacency",
    [
        (0.01, 0.8, plm.AdjacencyType.REMOVE),
        (0.01, 0.8, plm.AdjacencyType.ADD),
        (0.2, 1.5, plm.AdjacencyType.ADD),
        (1.0, 2.0, plm.AdjacencyType.REMOVE),
    ],
)
def test_optimistic_pmf_lies_below_the_exact_curve_everywhere(q, sigma, adjacency):
    loss = plm.GaussianPrivacyLoss(sigma, sampling_prob=q, adjacency_type=adjacency)
    pmf = _optimistic_pmf(
        _VectorGaussianPrivacyLoss(sigma, sampling_prob=q, adjacency_type=adjacency), 1e-3
    )
    losses = (pmf._lower_loss + np.arange(len(pmf._probs))) * 1e-3
    for eps in np.concatenate([np.linspace(-0.3, 0.4, 701) + 1.7e-4, np.linspace(0.4, 6.0, 57)]):
        ours = float(np.sum(pmf._probs * np.maximum(0.0, -np.expm1(eps - losses))))
        assert ours <= loss.get_delta_for_epsilon(eps) + 1e-15, eps


@pytest.mark.parametrize("sigma,count", [(3.0, 10), (1.2, 1), (20.0, 400)])
def test_bracket_holds_the_exact_epsilon_of_composed_gaussians(sigma, count):
    event = dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(sigma), count)
    exact = acc.gaussian_epsilon(sigma / math.sqrt(count), 1e-5, method="analytic")
    b = acc.pld_bracket(event, 1e-5)
    # the reference is a root found to about 1e-9 relative (dp-accounting's upper end can sit that close)
    assert b.lower <= exact <= b.upper * (1 + 1e-9)
    assert b.upper - b.lower <= 1e-6 * exact


@pytest.mark.parametrize("q,sigma,steps", _cases(3, 3))
def test_bracket_contains_the_pld_epsilon_and_a_finer_grid_value(q, sigma, steps):
    delta = 1e-5
    event = acc.dpsgd_event(q, sigma, steps)
    b = acc.pld_bracket(event, delta)
    assert b.upper == acc.dpsgd_epsilon(
        q, sigma, steps, delta, accountant="pld"
    )  # the printed value
    # dp-accounting itself on a grid twice as fine: still an upper bound, and no looser (its
    # connect-the-dots points include the coarse ones)
    fine = dpa.pld.PLDAccountant(value_discretization_interval=5e-5)
    fine.compose(event)
    assert b.lower <= fine.get_epsilon(delta) <= b.upper
    assert b.upper - b.lower <= 2e-3 * b.upper  # tight: the grid's cost only


def test_bracket_meets_prvs_certified_interval():
    b = acc.pld_bracket(acc.dpsgd_event(0.01, 1.0, 1000), 1e-5)
    prv_low, _, prv_up = acc.prv_bracket(0.01, 1.0, 1000, 1e-5)
    assert b.lower <= prv_up and prv_low <= b.upper  # both hold the exact epsilon
    assert prv_low < b.lower and b.upper < prv_up  # and the PLD bracket is the narrower one


def test_mnist_dpsgd_bracket_is_tight_where_rounding_down_is_not():
    q, sigma, steps, delta = 256 / 60000, 1.1, 14063, 1e-5
    event = acc.dpsgd_event(q, sigma, steps)
    b = acc.pld_bracket(event, delta)
    assert (
        b.lower <= 2.3816900 <= b.upper
    )  # notes section 4: dp-accounting at a 2e-6 grid (upper bound)
    assert b.lower >= 2.3805457  # tighter than PRV's certified lower end at eps_error 1e-3 (notes)
    rounded_down = dpa.pld.PLDAccountant(value_discretization_interval=1e-3)
    rounded_down._pld = pld.identity(1e-3, pessimistic_estimate=False)
    rounded_down._pld = rounded_down._pld.compose(
        pld.from_gaussian_mechanism(
            sigma,
            sampling_prob=q,
            pessimistic_estimate=False,
            value_discretization_interval=1e-3,
            use_connect_dots=False,
        ).self_compose(steps)
    )
    assert (
        rounded_down.get_epsilon(delta) < 0.9 * b.lower
    )  # dp-accounting's optimistic PLD: useless here


def test_unsupported_events_name_themselves():
    with pytest.raises(ValueError, match="LaplaceDpEvent"):
        acc.optimistic_epsilon(dpa.LaplaceDpEvent(1.0), 1e-5)
    assert acc.optimistic_epsilon(dpa.NonPrivateDpEvent(), 1e-5) == math.inf


def test_ledger_brackets_per_client_and_worst():
    ledger = acc.Ledger()
    for c in range(3):
        ledger.add(c, acc.dpsgd_event(0.02 * (c + 1), 1.2, 100), "dp-sgd")
        ledger.add(c, dpa.GaussianDpEvent(4.0), "head")
    ledger.add(2, acc.EpsilonDeltaEvent(0.3, 1e-7), "fixed")
    summary = ledger.summary(1e-5, accountants=["rdp", "pld"])
    out = ledger.brackets(1e-5, accountants=["rdp", "pld"])
    assert out["epsilon_bracket"]["rdp"] is None and out["bracket_reason"] == {"rdp": "not-tight"}
    pld_b = out["epsilon_bracket"]["pld"]
    for cid, row in summary["clients"].items():
        assert pld_b["clients"][cid]["lower"] <= row["pld"] == pld_b["clients"][cid]["upper"]
    assert pld_b["worst"]["upper"] == summary["worst"]["pld"]
    # client 2: the (0.3, 1e-7) event adds 0.3 to the upper end (basic composition, the DpEvents at
    # delta 1e-5 - 1e-7); the lower end composes it at its worst (randomised response), which costs
    # less than 0.3 but more than nothing (test_extremes pins it against the closed form)
    tight = acc.Ledger()
    tight.add(0, acc.dpsgd_event(0.06, 1.2, 100), "dp-sgd")
    tight.add(0, dpa.GaussianDpEvent(4.0), "head")
    assert pld_b["clients"]["2"]["upper"] == pytest.approx(
        tight.epsilon(1e-5 - 1e-7, accountant="pld") + 0.3, rel=1e-12
    )
    alone = tight.pld_bracket(1e-5)["worst"]["lower"]
    assert (
        alone
        < pld_b["clients"]["2"]["lower"]
        < tight.pld_bracket(1e-5 - 1e-7)["worst"]["lower"] + 0.3
    )
    laplace = acc.Ledger()
    laplace.add(0, dpa.LaplaceDpEvent(1.0), "laplace")
    assert "LaplaceDpEvent" in laplace.brackets(1e-5, accountants=["pld"])["bracket_reason"]["pld"]


def test_worst_only_bracket_is_the_top_clients_and_the_best_skips_no_winner():
    """``worst_only`` brackets the client with the largest upper end alone: the same worst bracket
    as bracketing every client (here that client also has the largest lower end); and ``best``,
    which skips basic/advanced compositions whose plain estimate already loses, equals the minimum
    over the accountants computed one by one."""
    ledger = acc.Ledger()
    for c in range(3):
        ledger.add(c, acc.dpsgd_event(0.02 * (c + 1), 1.2, 100), "dp-sgd")
        ledger.add(c, dpa.GaussianDpEvent(4.0), "head")
    full = ledger.pld_bracket(1e-5)
    top = ledger.pld_bracket(1e-5, worst_only=True)
    assert list(top["clients"]) == ["2"]
    assert top["worst"] == full["worst"] == full["clients"]["2"]
    kinds = {k: ledger.epsilon(1e-5, client=0, accountant=k) for k in acc.ledger.ACCOUNTANTS}
    assert ledger.epsilon(1e-5, client=0) == min(kinds.values())
    single = acc.Ledger()  # one entry: basic composition equals the tight accountants and may win
    single.add(0, dpa.GaussianDpEvent(2.0), "g")
    one = {k: single.epsilon(1e-5, accountant=k) for k in acc.ledger.ACCOUNTANTS}
    assert single.epsilon(1e-5) == min(one.values())
