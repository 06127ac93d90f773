"""A PLD upper bound for random allocation (balls in bins), without Monte Carlo.

One epoch of random allocation uses a record in one uniformly random step of ``t``; in units of
the clipping norm its dominating pair is ``P = (1/t) sum_j N(e_j, sigma^2 I_t)`` against
``Q = N(0, sigma^2 I_t)`` (Chua et al. 2025; Feldman & Shenfeld 2025).  The likelihood ratio is
``P/Q = Zbar = (1/t) sum_j Z_j`` with, under ``Q``, ``Z_j = exp(W_j / sigma - 1 / (2 sigma^2))``
i.i.d. lognormal (``W_j`` standard normal, ``E Z_j = 1``).  Both hockey-stick curves are
expectations of convex functions of ``Zbar`` under ``Q``:

* remove (``P`` against ``Q``): ``delta(eps) = E[(Zbar - e^eps)_+]``, convex and non-decreasing;
* add (``Q`` against ``P``): ``delta(eps) = E[(1 - e^eps Zbar)_+]``, convex and non-increasing.

Bound (every step can only raise both curves, for every ``eps`` at once):

1. Each ``Z_j`` is replaced by a *mean-preserving spread* onto the grid ``{0, h, 2h, ...}``: the
   mass of each cell ``[a, a + h)`` goes to its two ends with the cell's mean kept (closed forms:
   lognormal masses and partial means).  A sum of independent mean-preserving spreads is a
   mean-preserving spread of the sum, and a convex function's expectation can only grow under one.
2. Above a cap: for *add* the mass is moved down to ``min(z(W = 8), t e^4)`` (lowering ``Zbar``
   raises a non-increasing function; a coordinate above ``t e^4`` already makes the curve 0 for
   every ``eps >= -4``, and a fine grid near 0 matters more there); for *remove*, above
   ``z(W = 8)`` the mass is left out and the most it could add,
   ``E[Zbar 1{some Z_j > z_max}] <= E[Z 1{Z > z_max}] + (t - 1) P(Z > z_max)``, is booked as mass at
   infinity (about 1e-12).
3. The ``t``-fold sum is one FFT power (float rounding as dp-accounting's own composition;
   negative round-off is set to 0, which only adds mass).
4. The resulting discrete pair is turned into PLD pmfs (remove: ``P``-weights ``p_k z_k`` at losses
   ``log z_k``; add: weights ``p_k`` at ``-log z_k``, ``z_k = 0`` at infinity) with every loss
   rounded *up* to the grid, and composed over the epochs by dp-accounting.  Raising every
   epoch's curve raises the composition's (``delta_{A x B}(eps) = E_{a ~ A}[delta_B(eps - a)]``).

The spread adds at most ``h^2 / 4`` to each ``Z_j``'s variance, ``h^2 / (4 t)`` to ``Zbar``'s (whose
variance is ``(e^(1/sigma^2) - 1) / t``): second order, so the bound is close to the exact value.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from dp_accounting.pld import privacy_loss_distribution as _pld
from scipy import fft, special

from accountants.fast import _fast_pld, _FastPmf

__all__ = ["random_allocation_pld", "random_allocation_pld_epsilon", "spread_mean_pmf"]

W_MAX = 8.0  # per-coordinate cut: P(W > 8) = 6e-16
ADD_CAP = 4.0  # add direction: Z_j above t e^4 lowered to it (changes nothing for eps >= -4)
SUM_POINTS = 2**21  # grid points of the t-fold sum (sets the cell width h)


def _normal_mass(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``Phi(hi) - Phi(lo)``, from the nearer tail for precision."""
    upper = lo > 0
    return np.where(
        upper, special.ndtr(-lo) - special.ndtr(-hi), special.ndtr(hi) - special.ndtr(lo)
    )


def _cells(sigma: float, h: float, k_max: int) -> tuple[np.ndarray, np.ndarray]:
    """Per cell ``[k h, (k+1) h)``, ``k < k_max``: ``Q``-mass and partial mean ``E[Z 1{cell}]``."""
    edges = np.arange(k_max + 1) * h
    with np.errstate(divide="ignore"):
        w = sigma * np.log(edges) + 1.0 / (
            2 * sigma
        )  # W at the edges (log Z = W / sigma - 1 / (2 sigma^2))
    mass = _normal_mass(w[:-1], w[1:])
    mean = _normal_mass(
        w[:-1] - 1.0 / sigma, w[1:] - 1.0 / sigma
    )  # e^(w/sigma - 1/(2 sigma^2)) phi(w) = phi(w - 1/sigma)
    return mass, mean


def spread_mean_pmf(t: int, sigma: float, direction: str) -> tuple[np.ndarray, float, float]:
    """``(p, step, infinity)``: a pmf ``p`` of ``Zbar`` (spread, see the module docstring) on the
    grid ``k * step``, and the mass to book at infinity (remove direction only)."""
    z_max = math.exp(W_MAX / sigma - 1.0 / (2 * sigma**2))
    if (
        direction == "add"
    ):  # a coordinate above t e^c makes Zbar > e^c: (1 - e^eps Zbar)_+ = 0 for eps >= -c
        z_max = min(z_max, t * math.exp(ADD_CAP))
    h = z_max * t / SUM_POINTS
    k_max = math.ceil(z_max / h)
    mass, mean = _cells(sigma, h, k_max)
    a = np.arange(k_max) * h
    up = np.clip((mean - a * mass) / h, 0.0, None)  # to the cell's top: keeps its mean
    one = np.zeros(k_max + 1)
    one[:-1] += np.clip(mass - up, 0.0, None)
    one[1:] += up
    w_top = sigma * math.log(k_max * h) + 1.0 / (2 * sigma)
    tail, tail_mean = special.ndtr(-w_top), special.ndtr(-(w_top - 1.0 / sigma))
    infinity = 0.0
    if direction == "add":
        one[-1] += tail  # lowered onto the top of the grid
    else:  # what a coordinate above the grid could add to E[(Zbar - e^eps)_+]
        infinity = float(tail_mean + (t - 1) * tail)
    size = fft.next_fast_len(k_max * t + 1, real=True)
    p = fft.irfft(fft.rfft(one, size) ** t, size)[: k_max * t + 1]
    return np.clip(p, 0.0, None), h / t, infinity


def _pmf(losses: np.ndarray, weights: np.ndarray, vdi: float, infinity: float) -> _FastPmf:
    """Weights at losses, each loss rounded up to the grid ``vdi`` (a pessimistic pmf)."""
    keep = weights > 0
    idx = np.ceil(losses[keep] / vdi).astype(np.int64)
    lo = int(idx.min())
    probs = np.bincount(idx - lo, weights=weights[keep])
    return _FastPmf(vdi, lo, probs, infinity, True)


@functools.lru_cache(maxsize=64)
def random_allocation_pld(t: int, sigma: float, vdi: float = 1e-4) -> _pld.PrivacyLossDistribution:
    """Pessimistic PLD (remove, add) of one epoch of random allocation over ``t`` steps."""
    p, step, infinity = spread_mean_pmf(t, sigma, "remove")
    z = np.arange(len(p)) * step
    with np.errstate(divide="ignore"):
        remove = _pmf(np.log(z), p * z, vdi, infinity)
    p, step, _ = spread_mean_pmf(t, sigma, "add")
    z = np.arange(len(p)) * step
    with np.errstate(divide="ignore"):
        add = _pmf(-np.log(z[1:]), p[1:], vdi, float(p[0]))  # Zbar = 0: infinite loss
    return _fast_pld(_pld.PrivacyLossDistribution(remove, add))


def random_allocation_pld_epsilon(
    t: int, sigma: float, epochs: int, delta: float, vdi: float = 1e-4
) -> float:
    """Upper bound on the epsilon of ``epochs`` epochs of random allocation (add/remove)."""
    pld = random_allocation_pld(int(t), float(sigma), float(vdi))
    if epochs > 1:
        pld = pld.self_compose(int(epochs))
    return float(pld.get_epsilon_for_delta(delta))
