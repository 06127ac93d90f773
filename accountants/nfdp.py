"""Noise-free DP by subsampling (FedMD-NFDP, Sun & Lyu, IJCAI'21; seed 001).

A client holding ``n`` records releases (something computed from) a uniformly random subsample of
size ``k``: without replacement (a k-subset) or with replacement (k i.i.d. uniform draws).

Theorems 1-2 of the paper give ``(ln((n+1)/(n+1-k)), k/n)`` and
``(k ln((n+1)/n), 1 - ((n-1)/n)^k)`` (natural logarithms).  :func:`nfdp_profile` computes the exact
privacy profile ``delta(epsilon)`` of releasing the subsample itself, under add/remove-one
neighbours of a dataset of size ``n`` (neighbours of size n+1 and n-1, both orders of the pair).

Derivation (hockey-stick divergence ``H_e(P||Q) = sum_o max(0, P(o) - e^eps Q(o))``):

*Without replacement*, ``D`` of size n, ``D+ = D + {u}``, ``D- = D - {u}``.

- ``H(M(D+)||M(D))``: subsets containing u have mass ``k/(n+1)`` under M(D+) and 0 under M(D);
  every other subset is more likely under M(D).  So ``delta = k/(n+1)`` for every eps >= 0.
- ``H(M(D)||M(D+)) = max(0, 1 - e^eps C(n,k)/C(n+1,k)) = max(0, 1 - e^eps (n+1-k)/(n+1))``.
- ``H(M(D)||M(D-))``: subsets containing u have mass ``k/n`` under M(D), 0 under M(D-):
  ``delta = k/n``.
- ``H(M(D-)||M(D)) = max(0, 1 - e^eps (n-k)/n)``.

For eps >= 0 all four are <= k/n, attained by the third: the exact profile is the constant
``delta(eps) = k/n``.  *With replacement* the same four terms are ``1 - (n/(n+1))^k``,
``max(0, 1 - e^eps (n/(n+1))^k)``, ``1 - ((n-1)/n)^k`` and ``max(0, 1 - e^eps ((n-1)/n)^k)``, and
the profile is the constant ``1 - ((n-1)/n)^k``.

So the release is exactly ``(0, delta_thm)``-DP and no smaller delta holds at any epsilon: the
theorems' delta is tight, their epsilon is not needed.  Because that delta is ``>= 1/n`` for every
``k >= 1``, the guarantee permits publishing one record in the clear (the subsample does exactly
that), which :func:`nfdp_warnings` flags.  (When ``k = n`` without replacement, ``D-`` cannot
produce a k-subset; the two outputs are then distinguishable with certainty, ``delta = 1 = k/n``.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from accountants._validate import check_int, check_nonnegative

__all__ = [
    "nfdp_delta",
    "nfdp_epsilon_delta",
    "nfdp_profile",
    "nfdp_warnings",
    "record_exposure_warning",
]


def _check_nk(n: int, k: int, replacement: bool) -> tuple[int, int]:
    n = check_int(n, "n")
    k = check_int(k, "k")
    if not isinstance(replacement, bool):
        raise ValueError(f"replacement must be True or False; found {replacement!r}")
    if not replacement and k > n:
        raise ValueError(f"k must be <= n for sampling without replacement; found k={k}, n={n}")
    return n, k


def nfdp_epsilon_delta(n: int, k: int, replacement: bool) -> tuple[float, float]:
    """(epsilon, delta) of FedMD-NFDP Theorem 1 (without) or Theorem 2 (with replacement).

    Parameters
    ----------
    n : int
        The client's dataset size (>= 1).
    k : int
        Subsample size (>= 1; <= n without replacement).
    replacement : bool
        Sampling with replacement (Theorem 2) or without (Theorem 1).

    Returns
    -------
    tuple of float
        ``(ln((n+1)/(n+1-k)), k/n)`` or ``(k ln((n+1)/n), 1 - ((n-1)/n)^k)``.
    """
    n, k = _check_nk(n, k, replacement)
    if replacement:
        return k * math.log1p(1.0 / n), -math.expm1(k * math.log1p(-1.0 / n)) if n > 1 else 1.0
    return math.log((n + 1) / (n + 1 - k)), k / n


def nfdp_delta(n: int, k: int, replacement: bool) -> float:
    """The exact (flat) delta of the subsample release: ``k/n`` or ``1 - ((n-1)/n)^k``."""
    return nfdp_epsilon_delta(n, k, replacement)[1]


def _pair_deltas(n: int, k: int, replacement: bool, eps: float) -> list[float]:
    """The four hockey-stick divergences of the module docstring at one eps."""
    e = math.exp(eps)
    if replacement:
        up = (n / (n + 1)) ** k  # P_{D+}[no draw of u]
        down = ((n - 1) / n) ** k  # P_D[no draw of u]
        p_up = -math.expm1(k * math.log(n / (n + 1)))  # 1 - up, without cancellation
        p_down = -math.expm1(k * math.log1p(-1.0 / n)) if n > 1 else 1.0
    else:
        up = (n + 1 - k) / (n + 1)
        down = (n - k) / n
        p_up, p_down = k / (n + 1), k / n
    # For eps >= 0, 1 - e^eps * x <= 1 - x exactly; clamp so rounding cannot break that identity.
    return [p_up, min(p_up, max(0.0, 1.0 - e * up)), p_down, min(p_down, max(0.0, 1.0 - e * down))]


def nfdp_profile(n: int, k: int, replacement: bool, epsilons: Sequence[float]) -> np.ndarray:
    """Exact privacy profile delta(epsilon) of releasing the NFDP subsample itself.

    Add/remove-one neighbours of a dataset of size ``n``: the maximum over both neighbours
    (sizes n+1 and n-1) and both orders of each pair.  See the module docstring for the
    derivation; the profile is flat at :func:`nfdp_delta` for all epsilon >= 0.

    Parameters
    ----------
    n, k, replacement
        As in :func:`nfdp_epsilon_delta`.
    epsilons : sequence of float
        Non-negative epsilons.

    Returns
    -------
    numpy.ndarray
        ``delta(epsilon)`` for each epsilon.
    """
    n, k = _check_nk(n, k, replacement)
    eps_list = [check_nonnegative(float(e), "epsilon", allow_inf=True) for e in epsilons]
    return np.array([max(_pair_deltas(n, k, replacement, e)) for e in eps_list], dtype=float)


def record_exposure_warning(delta: float, n: int) -> str | None:
    """Warning text when ``delta >= 1/n``: such a guarantee allows releasing one record outright."""
    if delta >= 1.0 / n:
        return (
            f"delta={delta:.4g} >= 1/n={1.0 / n:.4g}: an (epsilon, delta) guarantee with delta >= 1/n "
            "permits publishing a record of the dataset in the clear"
        )
    return None


def nfdp_warnings(n: int, k: int, replacement: bool) -> tuple[str, ...]:
    """Caveats for an NFDP guarantee (always includes the delta >= 1/n flag for k >= 1)."""
    eps, delta = nfdp_epsilon_delta(n, k, replacement)
    warns = []
    exposure = record_exposure_warning(delta, n)
    if exposure is not None:
        warns.append(
            exposure + " (the NFDP release is the subsample itself, so it does: every sampled "
            "record is exposed)"
        )
    warns.append(
        "the exact privacy profile of the subsample release is flat: delta(epsilon) = "
        f"{delta:.6g} for every epsilon >= 0, so the theorem's epsilon={eps:.6g} buys nothing"
    )
    return tuple(warns)
