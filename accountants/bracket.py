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
DP-FedAvg, FedKADP and head releases), and their compositions; mechanisms known only by an
(epsilon, delta) join the lower end at their worst (:meth:`OptimisticPldAccountant.epsilon_with_fixed`).
Other events get no bracket (an error naming the event); RDP conversions and closed-form
compositions have none by nature: they are not tight estimates, so there is no discretisation
error to bracket.

At any size: the curve is built in ``eps`` (``e^eps`` overflows past 709 nats), its convexity is
restored by lowering points (vectorised), rounding left negative is removed by lowering the tail
masses (never by clipping, which adds mass), and 1e-9 of delta is given away to float rounding.
A grid past :data:`~accountants.fast.MAX_PLD_POINTS` raises :class:`PldGridError`; a bracket whose
ends come out of order is refused (:func:`check_ordered`), never printed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import dp_accounting as dpa
import numpy as np
from dp_accounting.pld import privacy_loss_distribution as _pld
from dp_accounting.pld import privacy_loss_mechanism as _plm
from scipy import special

from accountants.certified import certified_epsilon
from accountants.fast import (
    PldGridError,
    _check_grid,
    _fast_pld,
    _FastPmf,
    _grid_bounds,
    _VectorGaussianPrivacyLoss,
)

__all__ = [
    "LOWER_VDI",
    "Bracket",
    "OptimisticPldAccountant",
    "PldGridError",
    "check_ordered",
    "optimistic_epsilon",
    "pld_bracket",
]

LOWER_VDI = 1e-4
METHOD = (
    "PLD: optimistic tangent discretisation (lower) and dp-accounting's pessimistic "
    "connect-the-dots (upper); the exact epsilon lies between"
)


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
        return {
            "lower": self.lower,
            "upper": self.upper,
            "grid": self.grid,
            "lower_grid": self.lower_grid,
            "method": self.method,
        }


def _tails(loss: _VectorGaussianPrivacyLoss, eps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``P(L > eps)`` and ``log Q(L > eps)`` (P = mu_upper, Q = mu_lower; L is non-increasing in x)."""
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
        return (
            np.asarray(loss.mu_upper_cdf(x), dtype=float),
            np.asarray(loss.mu_lower_log_cdf(x), dtype=float),
        )


def _tangent_values(
    loss: _VectorGaussianPrivacyLoss, tau: np.ndarray, at: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The tangent of the hockey-stick curve (as a function of ``e^eps``) at ``eps = tau``, evaluated
    at ``eps = at``: ``delta(tau) - e^tau Q(L > tau) expm1(at - tau)`` (its slope in ``e^eps`` is
    ``-Q(L > tau)``), and the size of the terms it is computed from (its rounding scale).

    ``e^tau Q(L > tau)`` is at most ``P(L > tau)`` and is formed in log space: no overflow at any
    epsilon (``e^tau`` alone overflows past 709)."""
    p_tail, log_q = _tails(loss, tau)
    with np.errstate(under="ignore"):
        eq = np.exp(tau + log_q)
    slope_part = eq * np.expm1(at - tau)
    return (p_tail - eq) - slope_part, p_tail + eq + np.abs(slope_part)


def _masses(g: np.ndarray, p0: float, vdi: float) -> np.ndarray:
    """Masses on the grid of the pmf whose curve is linear in ``x = e^eps`` between the points
    ``(0, p0)`` and ``(e^(k vdi), g_k)`` (the mass at a grid loss is the slope change there times
    ``e^loss``; everything in ``eps``, nothing in ``x``, so nothing overflows)."""
    em1 = math.expm1(vdi)
    probs = np.empty(len(g))
    if len(g) == 1:
        probs[0] = p0
        return probs
    d = np.diff(g)
    probs[0] = d[0] / em1 - (g[0] - p0)
    probs[1:-1] = (d[1:] - d[:-1] * math.exp(vdi)) / em1
    probs[-1] = d[-1] / math.expm1(-vdi)
    return probs


def _end_edges(g: np.ndarray, p0: float, eps: np.ndarray) -> None:
    """Lower ``g`` (in place) onto the first and last edges of the lower convex hull of the points
    ``(0, p0), (e^eps_k, g_k)``, the last point being 0: the edge from ``(0, p0)`` to the point of
    steepest chord, and the edge into the last point from the point of flattest chord.  These are
    the long edges (the curve is cut to 0 at the top, and meets ``x = 0`` below the grid); the
    rest of the curve is convex but for rounding."""
    with np.errstate(under="ignore"):
        first = (g - p0) * np.exp(eps[0] - eps)  # chord slopes from (0, p0), times e^eps_0
    j = int(np.argmin(first))
    if j > 0:
        g[:j] = np.minimum(g[:j], p0 + (g[j] - p0) * np.exp(eps[:j] - eps[j]))
    positive = np.flatnonzero(g > 0)
    t = int(positive[-1]) + 1 if positive.size else 0  # the first point of the zeros at the top
    if 1 < t < len(g):
        last = g[:t] / np.expm1(eps[:t] - eps[t])  # chord slopes into (x_t, 0), times e^eps_t
        j = int(np.argmax(last))
        if g[j] > 0:
            g[j + 1 : t] = np.minimum(
                g[j + 1 : t], g[j] * np.expm1(eps[j + 1 : t] - eps[t]) / np.expm1(eps[j] - eps[t])
            )


def _convex_below(
    g: np.ndarray, scale: np.ndarray, p0: float, eps: np.ndarray, vdi: float
) -> np.ndarray:
    """Non-negative masses of a curve (in ``x = e^eps``) below the points ``(0, p0), (e^eps_k, g_k)``.

    Non-convexity shows as a negative mass.  Beyond the rounding of ``g`` (``scale`` is the size of
    the terms each ``g_k`` was computed from), each such point is lowered onto the chord of its
    neighbours, for all of them at once, until none is left: lowering keeps the curve below.  The
    long edges at both ends (:func:`_end_edges`) come first, since lowering point by point would
    take one round per point there.  What is left negative (rounding) is removed by
    :func:`_lowered_nonnegative`, which lowers the curve too, instead of being clipped to 0 (clipping
    adds mass: about 1e-8 on a 1e-4 grid, enough to lift the curve above the mechanism's)."""
    _end_edges(g, p0, eps)
    em1 = math.expm1(vdi)
    tol = np.empty(len(g))
    tol[1:-1] = 16 * _U * (scale[:-2] + 2 * scale[1:-1] + scale[2:]) / em1
    tol[0] = 16 * _U * ((scale[0] + scale[min(1, len(g) - 1)]) / em1 + p0)
    tol[-1] = 16 * _U * scale[-1] / em1
    w = 1.0 / (
        1.0 + math.exp(vdi)
    )  # the chord of k - 1 and k + 1 at k: g[k-1] + (g[k+1] - g[k-1]) w
    for _ in range(_CONVEX_ROUNDS):
        probs = _masses(g, p0, vdi)
        bad = np.flatnonzero(probs < -tol)
        if not bad.size:
            break
        if bad[0] == 0:  # the chord of (0, p0) and point 1 at x_0 = x_1 e^-vdi
            g[0] = min(g[0], p0 + (g[1] - p0) * math.exp(-vdi))
        for parity in (0, 1):
            k = bad[(bad % 2 == parity) & (bad > 0) & (bad < len(g) - 1)]
            g[k] = np.minimum(g[k], g[k - 1] + (g[k + 1] - g[k - 1]) * w)
    else:
        probs = _masses(g, p0, vdi)
    return _lowered_nonnegative(probs)


def _lowered_nonnegative(probs: np.ndarray) -> np.ndarray:
    """Non-negative masses whose hockey-stick curve lies below that of the signed ``probs``.

    ``delta(eps) = sum_k T_k (w_k - w_(k-1))`` with ``T_k`` the mass at losses ``>= loss_k`` and
    weights ``w_k = (1 - e^(eps - loss_k))_+`` non-decreasing in k: lowering every ``T_k`` lowers
    the curve.  The running minimum of ``T`` (from the bottom) is lower and non-increasing, so its
    differences are non-negative masses (a ``T_k`` below 0, rounding at the top, is taken as 0)."""
    tails = np.cumsum(probs[::-1])[::-1]
    tails = np.maximum(np.minimum.accumulate(tails), 0.0)
    return tails - np.append(tails[1:], 0.0)


_U = float(np.finfo(float).eps)
_CONVEX_ROUNDS = 64


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
    points to 0; points are then lowered until the curve is convex (:func:`_convex_below`), which
    makes the pmf non-negative.  Lowering keeps the curve below ``f``.  Tangent and chord differ
    from ``f`` by second-order terms only, so the bound is as tight as the pessimistic one
    (rounding every loss down, dp-accounting's optimistic privacy buckets, loses ``vdi / 2`` per
    composition instead).  Everything is computed in ``eps`` (``e^eps`` itself overflows past 709
    nats), so the bound holds at any epsilon the grid reaches.
    """
    lo, hi = _grid_bounds(loss, vdi)
    k = np.arange(lo, hi + 1, dtype=float)
    eps = k * vdi
    mid = (k[:-1] + 0.5) * vdi
    left = np.concatenate([[lo * vdi], mid])  # tangent point of the interval left of x_k
    right = np.concatenate([mid, [hi * vdi]])  # and of the interval right of it
    (g_left, s_left), (g_right, s_right) = (
        _tangent_values(loss, left, eps),
        _tangent_values(loss, right, eps),
    )
    g, scale = np.minimum(g_left, g_right), np.maximum(s_left, s_right)
    if not (np.all(np.isfinite(g)) and np.all(np.isfinite(scale))):
        raise ValueError(
            f"no certified lower bound: the hockey-stick curve of a Gaussian with noise multiplier "
            f"{loss.standard_deviation:g} is not finite in float64 on this grid"
        )
    top = np.flatnonzero(g <= 0)  # from just before the curve would cross 0: 0 (a lowering)
    g[max(0, (top[0] if top.size else len(g) - 1) - 1) :] = 0.0
    p0 = float(
        _tails(loss, np.array([lo * vdi]))[0][0]
    )  # the tangent at x_lo meets x = 0 at P(L > lo vdi)
    return _FastPmf(vdi, lo, _convex_below(g, scale, p0, eps, vdi), 0.0, False)


@functools.lru_cache(maxsize=1024)
def _optimistic_gaussian(
    sigma: float, q: float, vdi: float, count: int
) -> _pld.PrivacyLossDistribution:
    """Optimistic PLD of ``count`` Poisson-subsampled (q < 1) or plain Gaussians, add/remove."""

    def pmf(adjacency: _plm.AdjacencyType) -> _FastPmf:
        return _optimistic_pmf(
            _VectorGaussianPrivacyLoss(sigma, sampling_prob=q, adjacency_type=adjacency), vdi
        )

    remove = pmf(_plm.AdjacencyType.REMOVE)
    base = (
        _pld.PrivacyLossDistribution(remove)
        if q == 1.0
        else _pld.PrivacyLossDistribution(remove, pmf(_plm.AdjacencyType.ADD))
    )
    return base.self_compose(count) if count > 1 else base


def _gaussian_parts(event: dpa.DpEvent) -> tuple[float, float] | None:
    """(noise multiplier, sampling probability) of a Gaussian or Poisson-subsampled Gaussian."""
    if isinstance(event, dpa.GaussianDpEvent):
        return float(event.noise_multiplier), 1.0
    if isinstance(event, dpa.PoissonSampledDpEvent) and isinstance(
        event.event, dpa.GaussianDpEvent
    ):
        return float(event.event.noise_multiplier), float(event.sampling_probability)
    return None


class OptimisticPldAccountant(dpa.pld.PLDAccountant):
    """dp-accounting's PLD accountant with optimistic rounding: ``get_epsilon`` is a certified lower
    bound on the exact epsilon (see the module docstring).  Gaussian-based events only; (epsilon,
    delta)-only events join through :meth:`epsilon_with_fixed`."""

    def __init__(
        self,
        neighboring_relation: dpa.NeighboringRelation = dpa.NeighboringRelation.ADD_OR_REMOVE_ONE,
        value_discretization_interval: float = 1e-4,
    ) -> None:
        super().__init__(neighboring_relation, value_discretization_interval)
        self._pld = _fast_pld(
            _pld.identity(value_discretization_interval, pessimistic_estimate=False)
        )
        # the composed steps as (one step's optimistic PLD, count): the lower end is recomposed
        # from them with an allowance for the FFT's rounding (accountants.certified)
        self._parts: list[tuple[_pld.PrivacyLossDistribution, int]] = []

    def _maybe_compose(self, event: dpa.DpEvent, count: int, do_compose: bool):
        wrappers = (
            dpa.NoOpDpEvent,
            dpa.NonPrivateDpEvent,
            dpa.SelfComposedDpEvent,
            dpa.ComposedDpEvent,
        )
        if isinstance(event, wrappers):  # dp-accounting's own handling recurses into this method
            return super()._maybe_compose(event, count, do_compose)
        parts = _gaussian_parts(event)
        if self.neighboring_relation != dpa.NeighboringRelation.ADD_OR_REMOVE_ONE:
            return self.CompositionErrorDetails(
                invalid_event=event,
                error_message="no optimistic PLD under replace-one here (add/remove only)",
            )
        if parts is None:
            return self.CompositionErrorDetails(
                invalid_event=event,
                error_message="no optimistic PLD: privkit brackets Gaussian and "
                "Poisson-subsampled Gaussian events only",
            )
        sigma, q = parts
        if do_compose and q > 0 and not math.isinf(sigma):  # infinite noise releases nothing
            if sigma == 0:
                self._contains_non_dp_event = True
            elif q == 1.0:  # count Gaussians are one Gaussian with multiplier sigma / sqrt(count)
                one = _optimistic_gaussian(
                    sigma / math.sqrt(count), 1.0, self._value_discretization_interval, 1
                )
                self._pld = self._pld.compose(one)
                self._parts.append((one, 1))
            else:
                self._pld = self._pld.compose(
                    _optimistic_gaussian(sigma, q, self._value_discretization_interval, count)
                )
                self._parts.append(
                    (_optimistic_gaussian(sigma, q, self._value_discretization_interval, 1), count)
                )
        return None

    def _pmfs(self) -> list[_FastPmf]:
        return [
            _finite_part(p)
            for p in [self._pld._pmf_remove]
            + ([] if self._pld._symmetric else [self._pld._pmf_add])
        ]

    def get_epsilon(self, target_delta: float) -> float:
        return self.epsilon_with_fixed(target_delta, ())

    def epsilon_with_fixed(
        self, target_delta: float, fixed: Sequence[tuple[float, float]]
    ) -> float:
        """Lower bound on the exact epsilon at ``target_delta`` of the composed events together with
        mechanisms known only as ``(epsilon, delta)``-DP, each taken at its worst: the pair of
        randomised response with mass ``delta`` at infinity (Kairouz et al. 2015), which every
        ``(epsilon, delta)``-DP mechanism is a post-processing of, so the exact epsilon of any
        composition with them is at most this one's, and randomised response attains it.  Its
        losses ``+-epsilon`` are rounded down to the grid (optimistic) and composed exactly (two
        shifted copies per event, no FFT); the masses at infinity, ``1 - prod(1 - delta_i)`` in
        all, leave ``target_delta`` less that for the finite part.  A relative 1e-9 of the target
        is given away to float rounding (the curve is tight where the tangents touch it)."""
        if self._contains_non_dp_event:
            return math.inf
        at_infinity = -math.expm1(math.fsum(math.log1p(-d) for _, d in fixed)) if fixed else 0.0
        if at_infinity > target_delta:
            return math.inf
        budget = (target_delta - at_infinity) * (1 + _ROUNDING)
        counts: dict[tuple[float, float], int] = {}
        for pair in fixed:
            counts[pair] = counts.get(pair, 0) + 1
        out = []
        for pmf in self._pmfs():
            for (eps, delta), count in counts.items():
                pmf = _with_randomised_response(pmf, eps, delta, count)
            out.append(pmf.get_epsilon_for_delta(budget))
        guess = max(out)
        if not self._parts:
            return guess
        # the plain FFT's value can sit above the exact epsilon (its rounding adds tail mass):
        # the certified composition of the same steps, with randomised response as steps of its own
        vdi = self._value_discretization_interval
        rr = [(_randomised_response_pmf(vdi, e, d), c) for (e, d), c in counts.items()]
        directions = [[(_finite_part(p._pmf_remove), c) for p, c in self._parts] + rr]
        if not all(p._symmetric for p, _ in self._parts):
            directions.append(
                [
                    (_finite_part(p._pmf_remove if p._symmetric else p._pmf_add), c)
                    for p, c in self._parts
                ]
                + rr
            )
        return certified_epsilon(directions, budget, out[: len(directions)], lower=True)

    def get_delta(self, target_epsilon: float) -> float:
        if self._contains_non_dp_event:
            return 1.0
        return max(p.get_delta_for_epsilon(target_epsilon) for p in self._pmfs())


_ROUNDING = 1e-9


def _with_randomised_response(pmf: _FastPmf, eps: float, delta: float, count: int = 1) -> _FastPmf:
    """``pmf`` composed with ``count`` copies of the finite part of randomised response at ``eps``
    (masses ``(1 - delta) e^eps / (1 + e^eps)`` at loss ``eps`` and ``(1 - delta) / (1 + e^eps)``
    at ``-eps``, both rounded down to the grid): scaled, shifted copies of ``pmf`` (a scaling alone
    at ``eps`` 0; the binomial of the ``count`` copies, convolved once, when there are many)."""
    vdi = pmf._discretization
    # rounded down; a quotient within 1e-9 below an integer is that integer (0.4 / 1e-4 is
    # 3999.9999999999995), a rounding up by 1e-13 nats that the 1e-9 of delta given away covers
    hi, lo = math.floor(eps / vdi + 1e-9), math.floor(-eps / vdi + 1e-9)
    p_hi = (1 - delta) / (1 + math.exp(-eps))  # e^eps / (1 + e^eps), without overflow
    p_lo = (1 - delta) - p_hi
    if hi == lo:  # both losses on one grid point: a scaling (NFDP's (0, delta))
        return _FastPmf(
            vdi, pmf._lower_loss + count * lo, pmf._probs * (1 - delta) ** count, 0.0, False
        )
    width = hi - lo
    _check_grid(len(pmf._probs) + count * width, vdi)
    if count <= _DIRECT_COPIES:
        for _ in range(count):
            probs = np.zeros(len(pmf._probs) + width)
            probs[: len(pmf._probs)] += p_lo * pmf._probs
            probs[width:] += p_hi * pmf._probs
            pmf = _FastPmf(vdi, pmf._lower_loss + lo, probs, 0.0, False)
        return pmf
    j = np.arange(count + 1)
    with np.errstate(
        divide="ignore"
    ):  # p_lo or p_hi of 0 (delta near 1 and eps huge): log 0 = -inf
        log_mass = (
            special.gammaln(count + 1)
            - special.gammaln(j + 1)
            - special.gammaln(count - j + 1)
            + j * math.log(p_hi)
            + (count - j) * (math.log(p_lo) if p_lo > 0 else -np.inf)
        )
    atoms = np.zeros(count * width + 1)
    atoms[j * width] = np.exp(log_mass)
    return pmf.compose(_FastPmf(vdi, count * lo, atoms, 0.0, False))


_DIRECT_COPIES = 4


def _randomised_response_pmf(vdi: float, eps: float, delta: float) -> _FastPmf:
    """The finite part of randomised response at ``eps`` (losses rounded down to the grid)."""
    hi, lo = math.floor(eps / vdi + 1e-9), math.floor(-eps / vdi + 1e-9)
    p_hi = (1 - delta) / (1 + math.exp(-eps))
    probs = np.zeros(hi - lo + 1)
    probs[0] += (1 - delta) - p_hi
    probs[-1] += p_hi
    return _FastPmf(vdi, lo, probs, 0.0, False)


def _finite_part(pmf) -> _FastPmf:
    """The pmf without its infinity mass (truncation bookkeeping only, for Gaussian events)."""
    d = _FastPmf.of(pmf)
    return _FastPmf(d._discretization, d._lower_loss, d._probs, 0.0, False)


def optimistic_epsilon(event: dpa.DpEvent, delta: float, vdi: float = LOWER_VDI) -> float:
    """A certified lower bound on the exact epsilon of ``event`` at ``delta`` (add/remove);
    ``ValueError`` naming the event when it has no optimistic PLD here, :class:`PldGridError` when
    its grid would pass :data:`~accountants.fast.MAX_PLD_POINTS`."""
    low = OptimisticPldAccountant(dpa.NeighboringRelation.ADD_OR_REMOVE_ONE, vdi)
    if not low.supports(event):
        raise ValueError(
            f"no certified lower bound for event {event!r}: only Gaussian and "
            "Poisson-subsampled Gaussian events under add/remove have an optimistic PLD here"
        )
    low.compose(event)
    return float(low.get_epsilon(delta))


def check_ordered(lower: float, upper: float) -> None:
    """``ValueError`` unless ``lower <= upper`` (both numbers): a bracket is printed ordered or not at all."""
    if not lower <= upper:
        raise ValueError(
            f"no certified bracket: its ends came out as [{lower!r}, {upper!r}], not ordered "
            "(float arithmetic at this size); the upper end alone stands"
        )


def pld_bracket(event: dpa.DpEvent, delta: float, vdi: float = 1e-4) -> Bracket:
    """Certified ``[lower, upper]`` epsilon of ``event`` at ``delta`` (add/remove).

    ``upper`` is privkit's PLD epsilon on the grid ``vdi`` (pessimistic, what ``accountant="pld"``
    reports); ``lower`` is :func:`optimistic_epsilon` on a grid of ``min(vdi, LOWER_VDI)``.
    ``ValueError`` (:class:`PldGridError` for a grid past the limit) when there is no bracket.
    """
    from accountants.dpsgd import new_accountant

    lower_vdi = min(vdi, LOWER_VDI)
    up = new_accountant("pld", "add_remove", vdi)
    up.compose(event)
    upper = float(up.get_epsilon(delta))
    lower = optimistic_epsilon(event, delta, lower_vdi)
    check_ordered(lower, upper)
    return Bracket(lower, upper, vdi, lower_vdi)
