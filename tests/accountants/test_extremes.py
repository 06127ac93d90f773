"""Accounting at the extremes (issue 24, item 6): every printed epsilon is an upper bound at any size,
every bracket is ordered or absent with a reason, every bad input is one clean line.

Independent reference: the closed form of composed Gaussian mechanisms.  T Gaussians with noise
multiplier sigma (sampled with probability 1) are mu-GDP with mu = sqrt(T) / sigma (Dong, Roth & Su
2022), whose exact privacy profile is delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)
(Balle & Wang 2018, Thm. 8); it is solved for eps here in mpmath at 40 digits (mpmath comes with
torch, through sympy).  A mechanism known only as (eps1, delta1)-DP is at its worst randomised
response with mass delta1 at infinity (Kairouz, Oh & Viswanath 2015), so its composition with a
Gaussian has the profile delta1 + (1 - delta1) [a delta_G(eps - eps1) + (1 - a) delta_G(eps + eps1)],
a = e^eps1 / (1 + e^eps1): closed form too.
"""

from __future__ import annotations

import json
import math
import sys

import dp_accounting as dpa
import mpmath as mp
import numpy as np
import pytest

import accountants as acc
from accountants import fast
from accountants.bracket import _optimistic_pmf
from accountants.fast import _FastPmf, _VectorGaussianPrivacyLoss
from privkit.cli import main

TOL = 1e-12  # relative: the reference root is found to 1e-25, privkit's float arithmetic is not


def _delta_gaussian(eps, mu):
    return mp.ncdf(-eps / mu + mu / 2) - mp.exp(eps) * mp.ncdf(-eps / mu - mu / 2)


def _solve(profile, delta) -> float:
    """The smallest eps >= 0 with profile(eps) <= delta (profile non-increasing), by bisection."""
    with mp.workdps(40):
        delta = mp.mpf(delta)
        if profile(mp.mpf(0)) <= delta:
            return 0.0
        lo, hi = mp.mpf(0), mp.mpf(1)
        while profile(hi) > delta:
            lo, hi = hi, 2 * hi
        while hi - lo > mp.mpf(10) ** -25 * hi:
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if profile(mid) > delta else (lo, mid)
        return float(hi)


def exact_epsilon(sigma: float, steps: int, delta: float) -> float:
    """Exact epsilon of ``steps`` Gaussians with multiplier ``sigma`` (as privkit composes them)."""
    with mp.workdps(40):
        mu = (
            1 / mp.mpf(sigma / math.sqrt(steps))
            if steps < 2**53
            else mp.sqrt(steps) / mp.mpf(sigma)
        )
        return _solve(lambda e: _delta_gaussian(e, mu), delta)


def exact_with_fixed(sigma: float, eps1: float, delta1: float, delta: float) -> float:
    """Exact epsilon of a Gaussian composed with an (eps1, delta1)-DP mechanism at its worst."""
    with mp.workdps(40):
        mu, e1, d1 = 1 / mp.mpf(sigma), mp.mpf(eps1), mp.mpf(delta1)
        a = mp.exp(e1) / (1 + mp.exp(e1))
        return _solve(
            lambda e: (
                d1
                + (1 - d1)
                * (a * _delta_gaussian(e - e1, mu) + (1 - a) * _delta_gaussian(e + e1, mu))
            ),
            delta,
        )


def _cli_json(monkeypatch, capsys, *args: str) -> dict:
    monkeypatch.setattr(sys, "argv", ["privkit", "budget", *args, "--json"])
    monkeypatch.setenv("COLUMNS", "400")
    try:
        main()
    except SystemExit as exc:  # main() exits only on failure
        pytest.fail(f"exit {exc.code}: {capsys.readouterr().err}")
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return json.loads(captured.out)


# ----------------------------------------------------------------------------- the reference itself
def test_reference_matches_the_analytic_gaussian_and_known_values():
    # issue 24's first case, and scipy-based analytic Gaussian (Balle & Wang) in the usual range
    assert exact_epsilon(0.398, 38, 1.2e-8) == pytest.approx(205.5245626583222, rel=1e-13)
    for sigma, delta in ((1.0, 1e-5), (3.0, 1e-6), (0.7, 1e-3)):
        assert exact_epsilon(sigma, 1, delta) == pytest.approx(
            acc.gaussian_epsilon(sigma, delta, method="analytic"), rel=1e-7
        )
    # with a (0, delta1) mechanism the profile is delta1 + (1 - delta1) delta_G: a shifted target
    assert exact_with_fixed(2.0, 0.0, 1e-6, 1e-5) == pytest.approx(
        exact_epsilon(2.0, 1, (1e-5 - 1e-6) / (1 - 1e-6)), rel=1e-15
    )


# ----------------------------------------------------------------------------- the issue's cases
ISSUE_CASES = [  # (sigma, steps, delta, exact epsilon), sample rate 1
    (0.398, 38, 1.2e-8, 205.52456265832),
    (0.337, 553, 5.5e-5, 2703.53856832323),
    (0.943, 6959, 1.8e-9, 4433.95732142945),
    (1.447, 4042, 3.2e-10, 1235.8321923726),
]


@pytest.mark.parametrize(
    "sigma,steps,delta,pinned", ISSUE_CASES, ids=[f"T{c[1]}" for c in ISSUE_CASES]
)
def test_budget_dpsgd_prints_an_upper_bound_and_an_ordered_bracket_or_why_not(
    sigma, steps, delta, pinned, monkeypatch, capsys
):
    exact = exact_epsilon(sigma, steps, delta)
    assert exact == pytest.approx(pinned, rel=1e-11)
    out = _cli_json(
        monkeypatch,
        capsys,
        "dpsgd",
        "--sample-rate",
        "1",
        "--noise-multiplier",
        str(sigma),
        "--steps",
        str(steps),
        "--delta",
        str(delta),
    )
    assert out["epsilon"] >= exact * (1 - TOL)
    bracket = out["epsilon_bracket"]
    if bracket is None:  # the PLD's grid is past its limit: RDP's bound, and the reason
        assert out["accountant"] == "rdp" and "grid" in out["bracket_reason"]
        assert any("pld left out" in w and "rdp" in w for w in out["warnings"])
        assert out["epsilon"] == acc.dpsgd_epsilon(1, sigma, steps, delta, accountant="rdp")
    else:
        assert out["accountant"] == "pld" and bracket["upper"] == out["epsilon"]
        assert bracket["lower"] <= exact * (1 + TOL) and exact <= bracket["upper"] * (1 + TOL)
        assert (
            bracket["upper"] - bracket["lower"] < 1e-6 * exact
        )  # and tight: [205.5245626555, ...6599]


def test_issue_cases_through_the_python_api():
    sigma, steps, delta, _ = ISSUE_CASES[2]
    exact = exact_epsilon(sigma, steps, delta)
    res = acc.dpsgd_accounting(1, sigma, steps, delta, accountant="pld")  # was a MemoryError
    assert res.accountant == "rdp" and res.epsilon >= exact and "pld left out" in res.warnings[0]
    assert acc.dpsgd_epsilon(1, sigma, steps, delta, accountant="pld") == res.epsilon
    with pytest.raises(fast.PldGridError, match=r"grid of .* points"):
        acc.pld_bracket(acc.dpsgd_event(1, sigma, steps), delta)
    with pytest.raises(fast.PldGridError):
        acc.optimistic_epsilon(acc.dpsgd_event(1, sigma, steps), delta)


@pytest.mark.parametrize(
    "sigma,steps,delta,_", ISSUE_CASES[1:], ids=[f"T{c[1]}" for c in ISSUE_CASES[1:]]
)
def test_large_epsilons_on_a_coarser_grid_bracket_the_closed_form(sigma, steps, delta, _):
    # a 1e-2 grid keeps these PLDs small; their losses reach thousands of nats, where exp(-loss)
    # underflows and e^eps overflows (the old IndexError, NaN lower end and loose upper end)
    exact = exact_epsilon(sigma, steps, delta)
    event = acc.dpsgd_event(1, sigma, steps)
    upper = acc.dpsgd_epsilon(
        1, sigma, steps, delta, accountant="pld", value_discretization_interval=1e-2
    )
    lower = acc.optimistic_epsilon(event, delta, 1e-2)
    assert lower <= exact * (1 + TOL) and exact <= upper * (1 + TOL)
    assert upper - lower < 1e-7 * exact


def test_steps_beyond_any_grid_print_rdps_bound_and_the_exact_steps(monkeypatch, capsys):
    steps = "99999999999999999999999"  # an OverflowError traceback before
    out = _cli_json(
        monkeypatch,
        capsys,
        "dpsgd",
        "--sample-rate",
        "1",
        "--noise-multiplier",
        "1",
        "--steps",
        steps,
        "--delta",
        "1e-5",
    )
    assert out["steps"] == int(steps)  # read exactly, not as the float 1e23
    assert out["accountant"] == "rdp" and out["epsilon_bracket"] is None
    assert out["epsilon"] >= exact_epsilon(1.0, int(steps), 1e-5) * (1 - TOL)
    assert math.isfinite(out["epsilon"])


def test_poisson_case_with_losses_past_float_range_is_ordered():
    # issue 24: q 0.30617, sigma 0.87678, 31,809 steps, delta 2.5e-5 printed [2807.6053994, 2807.6053993]
    q, sigma, steps, delta = 0.30617, 0.87678, 31809, 2.5e-5
    res = acc.dpsgd_accounting(q, sigma, steps, delta, accountant="pld")  # default grid: too large
    assert res.accountant == "rdp" and res.epsilon == acc.dpsgd_epsilon(q, sigma, steps, delta)
    upper = acc.dpsgd_epsilon(
        q, sigma, steps, delta, accountant="pld", value_discretization_interval=1e-3
    )
    lower = acc.optimistic_epsilon(acc.dpsgd_event(q, sigma, steps), delta, 1e-3)
    assert lower <= upper <= res.epsilon
    assert upper - lower < 1e-5 * upper  # [2806.62807, 2806.63228]
    # Poisson subsampling never costs more than the full batch (a closed form): sample rate 1
    assert upper <= exact_epsilon(sigma, steps, delta)


# ----------------------------------------------------------------------------- random cases
def _random_cases(seed: int, n: int) -> list[tuple[float, int, float, float]]:
    rng = np.random.default_rng(seed)
    cases = [
        (
            float(10 ** rng.uniform(-1, 0.5)),
            int(10 ** rng.uniform(0, 4)),
            float(10 ** rng.uniform(-14, -1.5)),
            (1e-3, 1e-2)[i % 2],
        )
        for i in range(n)
    ]
    extremes = [
        (0.05, 1, 1e-12, 1e-2),
        (3.0, 1, 0.3, 1e-3),
        (0.2, 10**6, 1e-9, 1e-2),
        (1.0, 2, 1e-300, 1e-3),
        (0.1, 10**30, 1e-5, 1e-2),
    ]
    return cases + extremes


@pytest.mark.parametrize("sigma,steps,delta,vdi", _random_cases(24, 36))
def test_random_cases_bracket_the_closed_form(sigma, steps, delta, vdi, monkeypatch):
    """Upper end never below the exact epsilon, lower end never above, ordered or absent with a
    reason, over sigma in [0.1, 3.2], 1 to 10^4 steps (and the extremes), delta in [1e-14, 0.03]."""
    monkeypatch.setattr(
        fast, "MAX_PLD_POINTS", 2**20
    )  # fallbacks at test size: epsilons past ~300 or ~5000
    exact = exact_epsilon(sigma, steps, delta)
    res = acc.dpsgd_accounting(
        1.0, sigma, steps, delta, accountant="pld", value_discretization_interval=vdi
    )
    assert res.epsilon >= exact * (1 - TOL)
    if res.accountant == "rdp":
        assert "grid" in res.warnings[0]
    try:
        lower = acc.optimistic_epsilon(acc.dpsgd_event(1.0, sigma, steps), delta, vdi)
    except fast.PldGridError as exc:  # absent, and says why
        assert "grid of" in str(exc)
        return
    assert lower <= exact * (1 + TOL)
    assert lower <= res.epsilon
    if res.accountant == "pld":
        acc.bracket.check_ordered(lower, res.epsilon)


def test_optimistic_pmf_lies_below_the_curve_past_float_range():
    sigma_eff, vdi = (
        1 / 45.0,
        1e-2,
    )  # mu 45: losses from -400 to 2900 nats, e^eps overflows past 709
    pmf = _optimistic_pmf(_VectorGaussianPrivacyLoss(sigma_eff, sampling_prob=1.0), vdi)
    losses = (pmf._lower_loss + np.arange(len(pmf._probs))) * vdi
    assert np.all(pmf._probs >= 0) and math.isfinite(pmf._probs.sum())
    with mp.workdps(30):
        mu = mp.mpf(45)
        for eps in np.linspace(losses[0] - 1, losses[-1], 41)[1:] + 0.0037:
            mask = losses > eps
            ours = float(np.sum(pmf._probs[mask] * -np.expm1(eps - losses[mask])))
            exact = float(_delta_gaussian(mp.mpf(eps), mu))
            assert ours <= exact * (1 + 1e-10) + 1e-300, eps


def test_epsilon_of_a_pmf_past_float_range_is_its_own_exact_epsilon():
    # three losses near 2000 nats: exp(-loss) underflows, and the old search answered a grid loss
    vdi, probs = 0.5, np.array([0.5, 0.3, 0.2])
    pmf = _FastPmf(vdi, 4000, probs, 0.0, True)  # losses 2000, 2000.5, 2001
    losses = [2000.0, 2000.5, 2001.0]

    def profile(e):
        return mp.fsum(p * (1 - mp.exp(e - loss)) for p, loss in zip(probs, losses) if loss > e)

    for delta in (0.3, 0.1, 0.05):
        eps = pmf.get_epsilon_for_delta(delta)
        with mp.workdps(30):
            assert profile(mp.mpf(eps)) == pytest.approx(delta, rel=1e-12)
        assert 1999.0 < eps < 2001.0 and eps not in losses


# ----------------------------------------------------------------------------- ledgers
@pytest.mark.parametrize("eps1,delta1", [(0.0, 2e-6), (0.4, 1e-7), (1.5, 3e-6)])
def test_ledger_lower_end_holds_the_exact_composition_with_fixed_events(eps1, delta1):
    sigma, delta = 0.8, 1e-5
    ledger = acc.Ledger()
    ledger.add(0, dpa.GaussianDpEvent(sigma), "head")
    ledger.add(0, acc.EpsilonDeltaEvent(eps1, delta1), "fixed")
    exact = exact_with_fixed(sigma, eps1, delta1, delta)
    end = ledger.pld_bracket(delta)["worst"]
    assert end["lower"] <= exact <= end["upper"]
    assert end["upper"] == ledger.epsilon(
        delta, accountant="pld"
    )  # basic composition of the fixed part
    assert exact - end["lower"] < 1e-6 * exact  # tight at the lower end
    # what the lower end was before: the same basic composition at both ends, above the exact value
    alone = acc.Ledger()
    alone.add(0, dpa.GaussianDpEvent(sigma), "head")
    if eps1 > 0:
        assert alone.pld_bracket(delta - delta1)["worst"]["lower"] + eps1 > exact


def test_ledger_past_the_grid_answers_rdp_and_says_why(tmp_path, monkeypatch, capsys):
    sigma, steps, delta = (
        0.5,
        400,
        1e-6,
    )  # mu 40: 2.4 million points on a 1e-3 grid, 24 million on 1e-4
    ledger = acc.Ledger()
    ledger.add("a", acc.dpsgd_event(1, sigma, steps), "dp-sgd")
    ledger.add("b", acc.dpsgd_event(0.01, 1.0, 100), "dp-sgd")
    summary = ledger.summary(delta)
    assert "pld" not in summary["worst"] and "grid of" in summary["not_applicable"]["pld"]
    assert summary["worst"]["best"] >= exact_epsilon(sigma, steps, delta)
    with pytest.raises(acc.UnsupportedEventError, match="grid of"):
        ledger.epsilon(delta, accountant="pld")
    # the CLI's coarser default grid fits the PLD, not its lower end (1e-4): no bracket, and why
    path = ledger.save(tmp_path / "ledger.json")
    out = _cli_json(monkeypatch, capsys, "ledger", str(path), "--delta", str(delta))
    assert out["worst"]["pld"] >= exact_epsilon(sigma, steps, delta)
    assert out["epsilon_bracket"]["pld"] is None and "grid of" in out["bracket_reason"]["pld"]


def test_calibrate_without_a_bracket_says_why(monkeypatch, capsys):
    monkeypatch.setattr(
        acc.bracket, "LOWER_VDI", 1e-12
    )  # the upper PLD fits, a lower end this fine does not
    out = _cli_json(
        monkeypatch,
        capsys,
        "calibrate",
        "--epsilon",
        "3",
        "--delta",
        "1e-5",
        "--sample-rate",
        "0.01",
        "--steps",
        "50",
    )
    assert out["epsilon"] <= 3
    assert out["epsilon_bracket"] is None and "grid of" in out["bracket_reason"]
