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
