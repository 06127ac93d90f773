"""Closed-form composition of (epsilon, delta) guarantees: basic and advanced (KOV) composition."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["advanced_composition", "basic_composition"]


def basic_composition(params: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Basic composition (Dwork & Roth Thm 3.16): ``(sum eps_i, sum delta_i)``, delta capped at 1."""
    eps = math.fsum(e for e, _ in params)
    delta = math.fsum(d for _, d in params)
    return eps, min(1.0, delta)


def advanced_composition(
    params: Sequence[tuple[float, float]], delta_slack: float
) -> tuple[float, float]:
    """Heterogeneous advanced composition (Kairouz, Oh & Viswanath 2015, Thm 3.5).

    The composition of ``(eps_i, delta_i)``-DP mechanisms is ``(eps, 1 - (1 - s) prod(1 - delta_i))``-DP
    for any slack ``s`` in (0, 1], with ``eps`` the minimum of ``sum eps_i``,
    ``a + sqrt(2 S ln(e + sqrt(S)/s))`` and ``a + sqrt(2 S ln(1/s))``, where
    ``a = sum eps_i (e^eps_i - 1)/(e^eps_i + 1)`` and ``S = sum eps_i^2``.

    Returns
    -------
    tuple of float
        ``(eps, delta)`` with ``delta <= s + sum delta_i``.
    """
    if not 0.0 < delta_slack <= 1.0:
        raise ValueError(f"delta_slack must be in (0, 1]; found {delta_slack!r}")
    eps_list = [float(e) for e, _ in params]
    total = 1.0 - (1.0 - delta_slack) * math.prod(1.0 - d for _, d in params)
    if any(math.isinf(e) for e in eps_list):
        return math.inf, total
    a = math.fsum(e * math.tanh(e / 2.0) for e in eps_list)  # (e^x - 1)/(e^x + 1) = tanh(x/2)
    s = math.fsum(e * e for e in eps_list)
    candidates = [
        math.fsum(eps_list),
        a + math.sqrt(2.0 * s * math.log(math.e + math.sqrt(s) / delta_slack)),
        a + math.sqrt(2.0 * s * math.log(1.0 / delta_slack)),
    ]
    return min(candidates), min(1.0, total)
