"""Noise-multiplier calibration for a target (epsilon, delta) that never overshoots the target.

Search: a few Brent steps under RDP (about 15 ms per evaluation) give a bracket; Brent's method
under PLD at a coarse ``value_discretization_interval`` (1e-3: about 70 ms per evaluation at
10^4 steps) refines it; the candidate is then moved up until the accountant's own epsilon at it is
<= the target, so the returned ``epsilon`` is a re-checked upper bound (PLD is pessimistic).
"""

from __future__ import annotations

from dataclasses import dataclass

import scipy.optimize

from accountants._validate import check_choice, check_int, check_open_unit, check_positive
from accountants.dpsgd import SAMPLINGS, WOR_NOTE, _check_sample_rate, dpsgd_event, new_accountant

__all__ = ["Calibration", "calibrate_noise_multiplier"]

CALIBRATION_VDI = 1e-3
_SIGMA_MIN, _SIGMA_MAX = 1e-3, 1e5


@dataclass(frozen=True)
class Calibration:
    """Result of :func:`calibrate_noise_multiplier`.

    ``epsilon`` is the accountant's epsilon at ``noise_multiplier`` (re-checked, <= target); the
    same accountant's delta at the target epsilon is <= ``delta`` as well.
    """

    noise_multiplier: float
    epsilon: float
    target_epsilon: float
    delta: float
    sample_rate: float
    steps: int
    sampling: str
    accountant: str
    neighbouring: str
    value_discretization_interval: float | None
    evaluations: int
    warnings: tuple[str, ...]


def calibrate_noise_multiplier(
    epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    sampling: str = "poisson",
    accountant: str = "pld",
    *,
    dataset_size: int | None = None,
    rtol: float = 1e-4,
    value_discretization_interval: float = CALIBRATION_VDI,
) -> Calibration:
    """Smallest noise multiplier (to ``rtol``) with ``epsilon(sigma) <= epsilon`` at ``delta``.

    Parameters
    ----------
    epsilon : float
        Target epsilon (> 0).
    delta : float
        Target delta in (0, 1).
    sample_rate, steps, sampling, dataset_size
        As in :func:`accountants.dpsgd.dpsgd_event`.
    accountant : {"pld", "rdp"}
        The accountant whose epsilon must meet the target (without replacement: rdp only).
    rtol : float
        Relative tolerance on sigma.
    value_discretization_interval : float
        PLD grid for the search and the re-check (1e-3 by default: the pessimistic estimate is
        still an upper bound, and 10x faster than 1e-4).

    Returns
    -------
    Calibration
        ``noise_multiplier`` and its re-checked ``epsilon`` (always <= target).
    """
    target = check_positive(epsilon, "epsilon")
    delta = check_open_unit(delta, "delta")
    q = _check_sample_rate(sample_rate)
    steps = check_int(steps, "steps")
    check_choice(sampling, "sampling", SAMPLINGS)
    check_choice(accountant, "accountant", ("pld", "rdp"))
    rtol = check_positive(rtol, "rtol")
    warns: list[str] = []
    rel = "add_remove"
    if sampling == "without-replacement":
        if accountant != "rdp":
            raise ValueError(
                f"accountant must be rdp for sampling without replacement; found {accountant!r}"
            )
        rel = "replace_one"
        warns.append(WOR_NOTE)
    counter = [0]

    def composed(sigma: float, acct: str):
        counter[0] += 1
        accountant_ = new_accountant(acct, rel, value_discretization_interval)
        accountant_.compose(dpsgd_event(q, sigma, steps, sampling, dataset_size=dataset_size))
        return accountant_

    def eps_at(sigma: float, acct: str) -> float:
        # the search runs on the PLD's plain FFT value (fast); the final check is certified
        a = composed(sigma, acct)
        raw = getattr(a, "raw_epsilon", None)
        return float(raw(delta) if raw is not None else a.get_epsilon(delta))

    def certified(sigma: float) -> tuple[bool, float]:
        # Both directions in the accountant's own arithmetic: epsilon(delta) <= target AND
        # delta(target) <= delta (the two queries are not exact inverses of each other).
        a = composed(sigma, accountant)
        eps = float(a.get_epsilon(delta))
        return eps <= target and float(a.get_delta(target)) <= delta, eps

    # 1. Bracket under RDP (cheap), coarse tolerance.
    sigma_rdp = _root(lambda s: eps_at(s, "rdp") - target, 1.0, 1e-3)
    if accountant == "rdp":
        lo, hi = sigma_rdp * (1 - 2e-3), sigma_rdp * (1 + 2e-3)
    else:
        # PLD is tighter than RDP, so its root lies at or below the RDP one.
        lo, hi = sigma_rdp * 0.85, sigma_rdp * (1 + 2e-3)
    f = lambda s: eps_at(s, accountant) - target
    lo, hi = _expand(f, lo, hi)
    # 2. Refine under the target accountant.
    root = scipy.optimize.brentq(f, lo, hi, xtol=rtol * hi / 4, rtol=1e-12)
    # 3. Re-check: move up until the accountant certifies the target both ways (never overshoot).
    sigma = min(hi, root + rtol * root / 4)
    ok, eps = certified(sigma)
    while not ok:
        sigma = min(hi, sigma * (1 + rtol / 2)) if sigma < hi else sigma * (1 + rtol)
        ok, eps = certified(sigma)
    return Calibration(
        noise_multiplier=sigma,
        epsilon=eps,
        target_epsilon=target,
        delta=delta,
        sample_rate=q,
        steps=steps,
        sampling=sampling,
        accountant=accountant,
        neighbouring=rel,
        value_discretization_interval=value_discretization_interval
        if accountant == "pld"
        else None,
        evaluations=counter[0],
        warnings=tuple(warns),
    )


def _expand(f, lo: float, hi: float) -> tuple[float, float]:
    """Widen ``[lo, hi]`` geometrically until ``f(lo) > 0 >= f(hi)`` (f decreasing in sigma)."""
    while f(hi) > 0:
        lo, hi = hi, hi * 2.0
        if hi > _SIGMA_MAX:
            raise ValueError(f"epsilon target unreachable with noise_multiplier <= {_SIGMA_MAX:g}")
    while f(lo) <= 0:
        hi, lo = lo, lo / 2.0
        if lo < _SIGMA_MIN:
            raise ValueError(
                f"epsilon target is met even at noise_multiplier {_SIGMA_MIN:g}; "
                "the target is too loose to calibrate"
            )
    return lo, hi


def _root(f, start: float, rtol: float) -> float:
    """Root of a decreasing f by bracketing from ``start`` then Brent, returning the safe side."""
    lo, hi = _expand(f, start / 2.0, start)
    root = scipy.optimize.brentq(f, lo, hi, xtol=rtol * hi, rtol=1e-12)
    return min(hi, root * (1 + rtol))
