"""Certified brackets around a tight PLD epsilon: ``lower <= exact epsilon <= upper``.

privkit's PLD epsilon is dp-accounting's *pessimistic* connect-the-dots PLD (Doroshenko et al.
2022): an upper bound on the exact epsilon of the composed mechanism.  The lower end comes from an
*optimistic* PLD on the same kind of grid, built here (:func:`_optimistic_pmf`):

* As a function of ``x = e^eps`` a mechanism's hockey-stick curve ``f(x) = E_P[(1 - x e^-L)_+]``
  is convex; a pmf on the grid ``k vdi`` has a curve that is linear between the points
  ``e^(k vdi)``.  Connect-the-dots joins the points of ``f`` (chords lie above ``f``); the
  optimistic pmf joins points lowered onto tangents of ``f`` (chords lie below ``f``), so its
  ``delta(eps)`` is at most the mechanism's for every real ``eps``.
* That order survives composition: ``delta_{A x B}(eps) = E_{a ~ A}[delta_B(eps - a)]`` (P-weights
  only), so lowering ``delta_B`` everywhere lowers the composition, and likewise for ``A``.
  dp-accounting's composition steps only drop mass or move it to lower losses in optimistic mode,
  except ``self_compose``, which books its tail-truncation mass (1e-15 per call) at infinity
  whatever the direction; the exact PLDs of Gaussian events have no mass at infinity, so
  :class:`OptimisticPldAccountant` removes that mass before the epsilon.
* Under add/remove the exact epsilon of a composition is the larger of the two directions' (the
  same record is added, or removed, in every step), and so is each end.

dp-accounting's own optimistic PLD (privacy buckets: every loss rounded down) loses up to ``vdi``
per composition: over 14,063 DP-SGD steps on a 1e-4 grid its lower end is 1.68 where the exact
epsilon is 2.3817.  Tangents lose only second-order terms: 2.38153 on that grid.  On a coarse grid
the optimistic end is looser than the pessimistic one (2.23 on a 1e-3 grid), so :func:`pld_bracket`
computes it on a grid of at most :data:`LOWER_VDI`.

Covered events: Gaussian and Poisson-subsampled Gaussian under add/remove (privkit's DP-SGD,
DP-FedAvg, FedKADP and head releases), and their compositions.  Other events get no bracket (an
error naming the event); RDP conversions and closed-form compositions have none by nature: they
are not tight estimates, so there is no discretisation error to bracket.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import dp_accounting as dpa
import numpy as np
from dp_accounting.pld import privacy_loss_distribution as _pld
from dp_accounting.pld import privacy_loss_mechanism as _plm

from accountants.fast import _fast_pld, _FastPmf, _VectorGaussianPrivacyLoss

__all__ = ["LOWER_VDI", "Bracket", "OptimisticPldAccountant", "optimistic_epsilon", "pld_bracket"]

LOWER_VDI = 1e-4
METHOD = ("PLD: optimistic tangent discretisation (lower) and dp-accounting's pessimistic "
          "connect-the-dots (upper); the exact epsilon lies between")


@dataclass(frozen=True)
class Bracket:
    """``lower <= exact epsilon <= upper``, both certified; ``grid`` / ``lower_grid`` are the PLD
    discretisations of the two ends."""

    lower: float
    upper: float
    grid: float
    lower_grid: float
    method: str = METHOD

    def to_dict(self) -> dict:
        return {"lower": self.lower, "upper": self.upper, "grid": self.grid, "lower_grid": self.lower_grid,
                "method": self.method}


def _tails(loss: _VectorGaussianPrivacyLoss, eps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``P(L > eps)`` and ``Q(L > eps)`` (P = mu_upper, Q = mu_lower; L is non-increasing in x)."""
    x = np.empty_like(eps)
    q = loss.sampling_prob
    if q < 1 and loss.adjacency_type == _plm.AdjacencyType.REMOVE:
        inside = eps > math.log1p(-q)
        x[~inside] = np.inf  # every loss is above log(1 - q)
    elif q < 1:
        inside = eps < -math.log1p(-q)
        x[~inside] = -np.inf  # no loss reaches -log(1 - q)
    else:
        inside = np.ones_like(eps, dtype=bool)
    with np.errstate(invalid="ignore", divide="ignore"):
        x[inside] = loss._inverse_vec(eps[inside])
        return (np.asarray(loss.mu_upper_cdf(x), dtype=float),
                np.exp(np.asarray(loss.mu_lower_log_cdf(x), dtype=float)))


def _tangent_values(loss: _VectorGaussianPrivacyLoss, tau: np.ndarray, at: np.ndarray) -> np.ndarray:
    """The tangent of the hockey-stick curve (as a function of ``e^eps``) at ``eps = tau``, evaluated
    at ``eps = at``: ``delta(tau) - Q(L > tau) (e^at - e^tau)`` (its slope in ``e^eps`` is
    ``-Q(L > tau)``)."""
    p_tail, q_tail = _tails(loss, tau)
    return (p_tail - np.exp(tau) * q_tail) - q_tail * np.exp(tau) * np.expm1(at - tau)


def _lower_hull(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The lower convex hull of the points ``(x, y)`` (x increasing), evaluated at ``x``."""
    keep: list[int] = []
    for i in range(len(x)):
        while len(keep) >= 2:
            a, b = keep[-2], keep[-1]
            if (y[b] - y[a]) * (x[i] - x[a]) >= (y[i] - y[a]) * (x[b] - x[a]):  # b on or above chord a-i
                keep.pop()
            else:
                break
        keep.append(i)
    return np.interp(x, x[keep], y[keep])


def _optimistic_pmf(loss: _VectorGaussianPrivacyLoss, vdi: float) -> _FastPmf:
    """A PLD pmf on the grid ``k vdi`` whose hockey-stick curve lies below the mechanism's for every
    real epsilon: its epsilon at any delta, also after composition, is a lower bound.

    As a function of ``x = e^eps`` the mechanism's curve ``f(x) = E_P[(1 - x e^-L)_+]`` is convex,
    and a pmf on the grid has a curve that is linear between grid points ``x_k = e^(k vdi)``.
    Connect-the-dots (pessimistic) joins the points ``(x_k, f(x_k))``: chords lie above ``f``.
    Here each interval ``[x_k, x_(k+1)]`` gets the tangent of ``f`` at its middle
    (``eps = (k + 1/2) vdi``), ``[0, x_lo]`` the tangent at ``x_lo``, and the curve takes at each
    grid point the lower of its two neighbouring tangents: every chord then lies below a tangent,
    so below ``f``.  Past the top it is 0 (no mass at infinity), reached by lowering the last
    points to 0; the lower convex hull of the points makes the pmf non-negative.  Lowering keeps
    the curve below ``f``.  Tangent and chord differ from ``f`` by second-order terms only, so the
    bound is as tight as the pessimistic one (rounding every loss down, dp-accounting's
    optimistic privacy buckets, loses ``vdi / 2`` per composition instead).
    """
    bounds = loss.connect_dots_bounds()
    lo, hi = math.floor(bounds.epsilon_lower / vdi), math.ceil(bounds.epsilon_upper / vdi)
    k = np.arange(lo, hi + 1, dtype=float)
    mid = (k[:-1] + 0.5) * vdi
    left = np.concatenate([[lo * vdi], mid])   # tangent point of the interval left of x_k
    right = np.concatenate([mid, [hi * vdi]])  # and of the interval right of it
    g = np.minimum(_tangent_values(loss, left, k * vdi), _tangent_values(loss, right, k * vdi))
    top = np.flatnonzero(g <= 0)  # from just before the curve would cross 0: 0 (a lowering)
    g[max(0, (top[0] if top.size else len(g) - 1) - 1):] = 0.0
    p0 = float(_tails(loss, np.array([lo * vdi]))[0][0])  # the tangent at x_lo meets x = 0 at P(L > lo vdi)
    xs = np.concatenate([[0.0], np.exp(k * vdi)])
    h = _lower_hull(xs, np.concatenate([[p0], g]))
    em1 = math.expm1(vdi)
    diffs = np.diff(h[1:])
    probs = np.empty(len(k))
    probs[0] = diffs[0] / em1 - (h[1] - p0) if len(k) > 1 else p0
    probs[1:-1] = (diffs[1:] - diffs[:-1] * math.exp(vdi)) / em1
    if len(k) > 1:
        probs[-1] = diffs[-1] / math.expm1(-vdi)
    # slopes of a convex curve only grow: negative masses are rounding (of order 1e-17)
    return _FastPmf(vdi, lo, np.maximum(probs, 0.0), 0.0, False)


@functools.lru_cache(maxsize=1024)
def _optimistic_gaussian(sigma: float, q: float, vdi: float, count: int) -> _pld.PrivacyLossDistribution:
    """Optimistic PLD of ``count`` Poisson-subsampled (q < 1) or plain Gaussians, add/remove."""
    def pmf(adjacency: _plm.AdjacencyType) -> _FastPmf:
        return _optimistic_pmf(_VectorGaussianPrivacyLoss(sigma, sampling_prob=q, adjacency_type=adjacency), vdi)

    remove = pmf(_plm.AdjacencyType.REMOVE)
    base = (_pld.PrivacyLossDistribution(remove) if q == 1.0
            else _pld.PrivacyLossDistribution(remove, pmf(_plm.AdjacencyType.ADD)))
    return base.self_compose(count) if count > 1 else base


def _gaussian_parts(event: dpa.DpEvent) -> tuple[float, float] | None:
    """(noise multiplier, sampling probability) of a Gaussian or Poisson-subsampled Gaussian."""
    if isinstance(event, dpa.GaussianDpEvent):
        return float(event.noise_multiplier), 1.0
    if isinstance(event, dpa.PoissonSampledDpEvent) and isinstance(event.event, dpa.GaussianDpEvent):
        return float(event.event.noise_multiplier), float(event.sampling_probability)
    return None


class OptimisticPldAccountant(dpa.pld.PLDAccountant):
    """dp-accounting's PLD accountant with optimistic rounding: ``get_epsilon`` is a certified lower
    bound on the exact epsilon (see the module docstring).  Gaussian-based events only."""

    def __init__(self, neighboring_relation: dpa.NeighboringRelation = dpa.NeighboringRelation.ADD_OR_REMOVE_ONE,
                 value_discretization_interval: float = 1e-4) -> None:
        super().__init__(neighboring_relation, value_discretization_interval)
        self._pld = _fast_pld(_pld.identity(value_discretization_interval, pessimistic_estimate=False))

    def _maybe_compose(self, event: dpa.DpEvent, count: int, do_compose: bool):
        wrappers = (dpa.NoOpDpEvent, dpa.NonPrivateDpEvent, dpa.SelfComposedDpEvent, dpa.ComposedDpEvent)
        if isinstance(event, wrappers):  # dp-accounting's own handling recurses into this method
            return super()._maybe_compose(event, count, do_compose)
        parts = _gaussian_parts(event)
        if self.neighboring_relation != dpa.NeighboringRelation.ADD_OR_REMOVE_ONE:
            return self.CompositionErrorDetails(
                invalid_event=event, error_message="no optimistic PLD under replace-one here (add/remove only)")
        if parts is None:
            return self.CompositionErrorDetails(
                invalid_event=event, error_message="no optimistic PLD: privkit brackets Gaussian and "
                "Poisson-subsampled Gaussian events only")
        sigma, q = parts
        if do_compose and q > 0:
            if sigma == 0:
                self._contains_non_dp_event = True
            elif q == 1.0:  # count Gaussians are one Gaussian with multiplier sigma / sqrt(count)
                self._pld = self._pld.compose(_optimistic_gaussian(
                    sigma / math.sqrt(count), 1.0, self._value_discretization_interval, 1))
            else:
                self._pld = self._pld.compose(_optimistic_gaussian(
                    sigma, q, self._value_discretization_interval, count))
        return None

    def get_epsilon(self, target_delta: float) -> float:
        if self._contains_non_dp_event:
            return math.inf
        pmfs = [self._pld._pmf_remove] + ([] if self._pld._symmetric else [self._pld._pmf_add])
        return max(_finite_part(p).get_epsilon_for_delta(target_delta) for p in pmfs)

    def get_delta(self, target_epsilon: float) -> float:
        if self._contains_non_dp_event:
            return 1.0
        pmfs = [self._pld._pmf_remove] + ([] if self._pld._symmetric else [self._pld._pmf_add])
        return max(_finite_part(p).get_delta_for_epsilon(target_epsilon) for p in pmfs)


def _finite_part(pmf) -> _FastPmf:
    """The pmf without its infinity mass (truncation bookkeeping only, for Gaussian events)."""
    d = _FastPmf.of(pmf)
    return _FastPmf(d._discretization, d._lower_loss, d._probs, 0.0, False)


def optimistic_epsilon(event: dpa.DpEvent, delta: float, vdi: float = LOWER_VDI) -> float:
    """A certified lower bound on the exact epsilon of ``event`` at ``delta`` (add/remove);
    ``ValueError`` naming the event when it has no optimistic PLD here."""
    low = OptimisticPldAccountant(dpa.NeighboringRelation.ADD_OR_REMOVE_ONE, vdi)
    if not low.supports(event):
        raise ValueError(f"no certified lower bound for event {event!r}: only Gaussian and "
                         "Poisson-subsampled Gaussian events under add/remove have an optimistic PLD here")
    low.compose(event)
    return float(low.get_epsilon(delta))


def pld_bracket(event: dpa.DpEvent, delta: float, vdi: float = 1e-4) -> Bracket:
    """Certified ``[lower, upper]`` epsilon of ``event`` at ``delta`` (add/remove).

    ``upper`` is privkit's PLD epsilon on the grid ``vdi`` (pessimistic, what ``accountant="pld"``
    reports); ``lower`` is :func:`optimistic_epsilon` on a grid of ``min(vdi, LOWER_VDI)``.
    """
    from accountants.dpsgd import new_accountant

    lower_vdi = min(vdi, LOWER_VDI)
    lower = optimistic_epsilon(event, delta, lower_vdi)
    up = new_accountant("pld", "add_remove", vdi)
    up.compose(event)
    return Bracket(lower, float(up.get_epsilon(delta)), vdi, lower_vdi)
