"""Exact epsilons (mpmath) and the property checked by tests/accountants/test_certified.py and
benchmarks/certified_pld.py: no epsilon privkit prints falls below the exact one, or below the
lower end of the bracket it prints, at any delta down to 1e-300."""

from __future__ import annotations

import math
from dataclasses import dataclass

import mpmath as mp
import numpy as np

import accountants as acc
from accountants.bracket import optimistic_epsilon
from accountants.fast import PldGridError

mp.mp.dps = 60


def _delta_remove(q: mp.mpf, sigma: mp.mpf, eps: mp.mpf) -> mp.mpf:
    """Exact delta at ``eps`` of one Poisson-subsampled Gaussian, P = (1-q) N(0,s) + q N(1,s) vs
    Q = N(0,s): L(x) = log(1 - q + q e^((2x - 1) / (2 s^2))) is increasing in x."""
    if q == 1:
        x = eps * sigma**2 + mp.mpf(1) / 2
    else:
        inner = (mp.e**eps - (1 - q)) / q
        if inner <= 0:
            return 1 - mp.e**eps  # every loss is above eps
        x = sigma**2 * mp.log(inner) + mp.mpf(1) / 2
    p_tail = (1 - q) * mp.ncdf(-x / sigma) + q * mp.ncdf(-(x - 1) / sigma)
    return p_tail - mp.e**eps * mp.ncdf(-x / sigma)


def _delta_add(q: mp.mpf, sigma: mp.mpf, eps: mp.mpf) -> mp.mpf:
    """The other direction: P = N(0,s) vs Q = (1-q) N(0,s) + q N(1,s); L(x) = -log(...) is
    decreasing in x."""
    if q == 1:
        return _delta_remove(q, sigma, eps)
    if eps >= -mp.log(1 - q):
        return mp.mpf(0)  # no loss reaches -log(1 - q)
    inner = (mp.e ** (-eps) - (1 - q)) / q
    x = sigma**2 * mp.log(inner) + mp.mpf(1) / 2  # L > eps  <=>  X < x
    p_tail = mp.ncdf(x / sigma)
    q_tail = (1 - q) * mp.ncdf(x / sigma) + q * mp.ncdf((x - 1) / sigma)
    return p_tail - mp.e**eps * q_tail


def exact_epsilon(q: float, sigma: float, steps: int, delta: float) -> float:
    """The exact epsilon at ``delta`` (add/remove: the larger direction) of ``steps`` Gaussians
    (q = 1: one Gaussian of multiplier ``sigma / sqrt(steps)``) or of one subsampled Gaussian."""
    if q == 1.0:
        s, qq = mp.mpf(sigma) / mp.sqrt(steps), mp.mpf(1)
    elif steps == 1:
        s, qq = mp.mpf(sigma), mp.mpf(q)
    else:
        raise ValueError(f"steps must be 1 when q < 1 for a closed form; found {steps}")
    target = mp.mpf(delta)
    out = 0.0
    for fn in (_delta_remove, _delta_add):
        if fn(qq, s, mp.mpf(0)) <= target:
            continue
        lo, hi = mp.mpf(0), mp.mpf(1)
        while fn(qq, s, hi) > target:
            lo, hi = hi, 2 * hi
        for _ in range(200):  # bisection: delta is decreasing in eps
            mid = (lo + hi) / 2
            if fn(qq, s, mid) > target:
                lo = mid
            else:
                hi = mid
            if hi - lo < mp.mpf(10) ** -30:
                break
        out = max(out, float(lo))
    return out


def _loss_remove(q: mp.mpf, sigma: mp.mpf, x: mp.mpf) -> mp.mpf:
    return mp.log(1 - q + q * mp.e ** ((2 * x - 1) / (2 * sigma**2)))


def _density_remove(q: mp.mpf, sigma: mp.mpf, x: mp.mpf) -> mp.mpf:
    return ((1 - q) * mp.npdf(x, 0, sigma)) + q * mp.npdf(x, 1, sigma)


def two_step_delta(
    q: float,
    sigma: float,
    eps: float,
    direction: str = "remove",
    digits: int = 30,
    scale: float = 0.0,
) -> mp.mpf:
    """Exact delta at ``eps`` of TWO Poisson-subsampled Gaussian steps (q < 1): with ``L`` the
    one-step privacy loss and ``delta_1`` the one-step closed form above,
    ``delta_2(eps) = E_P[(1 - e^(eps - L1 - L2))_+] = E_{x ~ P}[delta_1(eps - L(x))]`` (the inner
    expectation over the second step is ``delta_1`` at ``eps - L1``, which holds for a negative
    argument too: ``E_P[e^(-L)] = 1``).  One mpmath quadrature; the integrand is split where the
    density and the loss change regime (0, 1/2, 1 and the noise's tails).  The quadrature's error
    estimate must be below 1e-11 of the larger of the result and ``scale`` (the delta it is
    compared with), else :class:`ArithmeticError`."""
    with mp.workdps(digits):
        return _two_step_delta(mp.mpf(q), mp.mpf(sigma), mp.mpf(eps), direction, mp.mpf(scale))


def _two_step_delta(qq: mp.mpf, s: mp.mpf, e: mp.mpf, direction: str, scale: mp.mpf) -> mp.mpf:
    if direction == "remove":
        density = lambda x: _density_remove(qq, s, x)
        loss = lambda x: _loss_remove(qq, s, x)
        inner = _delta_remove
    else:  # P = N(0, s), loss -L_remove
        density = lambda x: mp.npdf(x, 0, s)
        loss = lambda x: -_loss_remove(qq, s, x)
        inner = _delta_add
    cuts = {mp.mpf(c) * s + o for c in (-40, -20, *range(-12, 13, 2), 20, 40) for o in (0, 1)}
    # delta_1 has a kink where its argument crosses -log(1 - q) (add) or log(1 - q) (remove):
    # the x where the first step's loss puts it there
    level = e - mp.log(1 - qq) if direction == "remove" else -mp.log(1 - qq) - e
    if level > mp.log(1 - qq):
        cuts.add(s**2 * mp.log((mp.e**level - (1 - qq)) / qq) + mp.mpf(1) / 2)
    points = [-mp.inf, *sorted(cuts), mp.inf]
    value, error = mp.quad(lambda x: density(x) * inner(qq, s, e - loss(x)), points, error=True)
    if error > max(value, scale) * mp.mpf(1e-11):  # relative to the delta compared with
        raise ArithmeticError(f"quadrature error {float(error):.3g} on delta {float(value):.3g}")
    return value


def two_step_check(q: float, sigma: float, delta: float) -> dict:
    """privkit's printed epsilon for two steps of (q, sigma) at ``delta`` and its bracket's lower
    end against the exact two-step delta: ``ok`` where the exact delta at the printed epsilon is at
    most ``delta`` and at the lower end at least ``delta`` (both directions of add/remove)."""
    res = acc.dpsgd_accounting(q, sigma, 2, delta, accountant="pld")
    try:
        lower = optimistic_epsilon(acc.dpsgd_event(q, sigma, 2), delta)
    except (PldGridError, ValueError):
        lower = None
    # delta_1 is a difference of tails that cancel down to about delta: 25 digits beyond it
    digits = 25 + int(-math.log10(delta))
    at_printed = max(
        two_step_delta(q, sigma, res.epsilon, d, digits, delta) for d in ("remove", "add")
    )
    tol = mp.mpf(1e-10)  # the quadrature's error estimate is below 1e-11 (else it raises)
    ok = at_printed <= mp.mpf(delta) * (1 + tol)
    at_lower = None
    if lower is not None:
        at_lower = max(two_step_delta(q, sigma, lower, d, digits, delta) for d in ("remove", "add"))
        ok = ok and at_lower >= mp.mpf(delta) * (1 - tol)
    return {
        "q": q,
        "sigma": sigma,
        "steps": 2,
        "delta": delta,
        "printed": res.epsilon,
        "accountant": res.accountant,
        "lower": lower,
        "exact_delta_at_printed": float(at_printed),
        "exact_delta_at_lower": None if at_lower is None else float(at_lower),
        "ok": bool(ok),
    }


@dataclass(frozen=True)
class Case:
    q: float
    sigma: float
    steps: int
    delta: float


def draw_cases(
    n: int, seed: int, max_steps: int = 20_000, sigma_range: tuple[float, float] = (0.5, 20.0)
) -> list[Case]:
    """``n`` random cases: q = 1 (any steps, the Gaussian of multiplier ``sigma / 4``) or
    steps = 1 (any q), delta log-uniform in [1e-14, 1e-3] (60%) or [1e-300, 1e-3], noise multipliers log-uniform in
    ``sigma_range``."""
    rng = np.random.default_rng(seed)
    cases = []
    for i in range(n):
        # most cases where the PLD answers (delta above its grids' truncation), the rest anywhere
        delta = float(10.0 ** -rng.uniform(3, 14 if rng.random() < 0.6 else 300))
        sigma = float(np.exp(rng.uniform(*np.log(sigma_range))))
        if i % 2 == 0:
            steps = int(np.exp(rng.uniform(0, math.log(max_steps))))
            cases.append(Case(1.0, sigma * math.sqrt(steps) / 4, steps, delta))
        else:
            cases.append(Case(float(rng.uniform(0.01, 0.99)), sigma, 1, delta))
    return cases


def check(case: Case) -> dict:
    """What privkit prints for ``case`` (PLD, RDP when PLD cannot certify; its bracket) against
    the exact epsilon: ``ok`` is False where a printed value falls below the exact one or below the
    bracket's lower end, or the lower end above the exact one."""
    exact = exact_epsilon(case.q, case.sigma, case.steps, case.delta)
    res = acc.dpsgd_accounting(case.q, case.sigma, case.steps, case.delta, accountant="pld")
    event = acc.dpsgd_event(case.q, case.sigma, case.steps)
    try:
        lower = optimistic_epsilon(event, case.delta)
    except (PldGridError, ValueError):
        lower = None
    tol = 1e-9 * max(1.0, exact)  # the exact value's own bisection and float conversion
    ok = res.epsilon >= exact - tol
    if lower is not None:
        ok = ok and lower <= exact + tol and (lower <= res.epsilon or res.accountant != "pld")
    return {
        "q": case.q,
        "sigma": case.sigma,
        "steps": case.steps,
        "delta": case.delta,
        "exact": exact,
        "printed": res.epsilon,
        "accountant": res.accountant,
        "lower": lower,
        "ok": bool(ok),
    }
