"""dp-accounting's RDP and PLD accountants, with the subsampled Gaussian computed in vectorised form.

dp-accounting builds the Poisson-subsampled Gaussian's RDP curve and PLD with Python loops over
scalars: the RDP series at fractional orders runs up to 1000 terms per order (0.3-0.4 s per
event at noise multipliers below 1), and the PLD's connect-the-dots grid evaluates the inverse
privacy loss once per grid point (0.2-0.3 s per event at a 1e-3 grid).  A federated ledger holds
dozens of such events (one per client data size and noise level), so these loops dominated the
accounting time.

This module computes the same quantities with numpy over all orders / grid points at once,
following dp-accounting's formulas step by step (same terms, same summation order, same stopping
rule), caches them per (q, sigma[, grid]) and plugs them into subclasses of dp-accounting's own
accountants, which do everything else (composition, conversion to epsilon and delta).
``tests/accountants/test_fast.py`` pins both against dp-accounting on random cases.

Where dp-accounting's float arithmetic gives way at the extremes, privkit departs from it, so that
the PLD epsilon stays an upper bound at any size (``tests/accountants/test_extremes.py`` pins this
against the closed form of composed Gaussians):

- Gaussians sampled with probability 1 are one Gaussian with multiplier ``sigma / sqrt(count)``
  (as dp-accounting does for unsampled ones), instead of an FFT power of one step, whose rounding
  (a relative ``count * 2**-52`` on the total mass, spread over every bin) can pull the tail below
  the exact one at small delta.
- The epsilon of a pmf weighs masses by ``exp(-loss)`` relative to a shift past 700 nats (where
  the plain weights under- and overflow), and reads its losses off the grid once the
  repeated-addition losses of dp-accounting's loop drift more than 1e-9 nats from it.
- No pmf grows past :data:`MAX_PLD_POINTS`; :class:`PldGridError` says so before any memory is
  spent, and the callers fall back to RDP or leave the bracket out with that reason.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import dp_accounting as dpa
import numpy as np
from dp_accounting.pld import pld_pmf as _pmf
from dp_accounting.pld import privacy_loss_distribution as _pld
from dp_accounting.pld import privacy_loss_mechanism as _plm
from scipy import fft, signal, special

from accountants.pld_grid import MAX_PLD_POINTS, PldGridError

#: distinct step PLDs the certified epsilon recomposes (seconds each); past it RDP answers, saying
#: why (an adaptive method's ledger of many different noise multipliers)
MAX_CERTIFIED_PARTS = 4
#: certified epsilons by (delta, composed steps): shared by every accountant of the process
_CERTIFIED_CACHE: dict[tuple, float] = {}

__all__ = [
    "MAX_PLD_POINTS",
    "PldAccountant",
    "PldGridError",
    "RdpAccountant",
    "poisson_gaussian_pld",
    "poisson_gaussian_rdp",
]

_NR = dpa.NeighboringRelation
_FRAC_TERMS = 1000  # dp-accounting's _MAX_STEPS_LOG_A_FRAC


def _check_grid(points: int, vdi: float) -> None:
    if points > MAX_PLD_POINTS:
        raise PldGridError(
            f"accountant pld needs a grid of {points:,} points at value_discretization_interval={vdi:g}; "
            f"privkit builds at most {MAX_PLD_POINTS:,} (accountant rdp needs none)"
        )


def _grid_bounds(loss: _plm.AdditiveNoisePrivacyLoss, vdi: float) -> tuple[int, int]:
    """The grid indices ``lo, hi`` of a privacy loss's connect-the-dots range, checked for size."""
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):  # checked just below
        bounds = loss.connect_dots_bounds()
    if not (math.isfinite(bounds.epsilon_lower) and math.isfinite(bounds.epsilon_upper)):
        raise PldGridError(
            f"accountant pld needs an unbounded grid: the privacy loss of noise multiplier "
            f"{loss.standard_deviation:g} reaches {bounds.epsilon_upper:g} nats in float64 "
            "(accountant rdp needs none)"
        )
    lo, hi = math.floor(bounds.epsilon_lower / vdi), math.ceil(bounds.epsilon_upper / vdi)
    _check_grid(hi - lo + 1, vdi)
    return lo, hi


# ----------------------------------------------------------------------------- RDP
def _log_comb(n: float | np.ndarray, k: np.ndarray) -> np.ndarray:
    return special.gammaln(n + 1) - special.gammaln(k + 1) - special.gammaln(n - k + 1)


@functools.lru_cache(maxsize=64)
def _log_comb_table(alphas: tuple[float, ...], terms: int) -> np.ndarray:
    """log binom(alpha, i) for i < ``terms``, one row per order (independent of q and sigma: cached)."""
    with np.errstate(invalid="ignore"):
        table = _log_comb(np.asarray(alphas)[:, None], np.arange(terms, dtype=float)[None, :])
    table.flags.writeable = False
    return table


def _log_erfc(x: np.ndarray) -> np.ndarray:
    return math.log(2) + special.log_ndtr(-x * 2**0.5)


def _log_a_int(q: float, sigma: float, alphas: np.ndarray) -> np.ndarray:
    """log A at integer orders: dp-accounting's sum over i = 0..alpha, one row per order.

    Rows are padded with -inf past their order; adding -inf in log space leaves a sum unchanged,
    so the last column holds each order's sequential sum.
    """
    i = np.arange(int(alphas.max()) + 1, dtype=float)[None, :]
    a = alphas[:, None]
    with np.errstate(invalid="ignore"):
        log_coef = (
            _log_comb_table(tuple(alphas), i.shape[1]) + i * math.log(q) + (a - i) * math.log1p(-q)
        )
        terms = log_coef + (i * i - i) / (2 * (sigma**2))
    terms = np.where(i <= a, terms, -np.inf)
    return np.logaddexp.accumulate(terms, axis=1)[:, -1]


def _log_a_frac(q: float, sigma: float, alphas: np.ndarray, terms: int) -> np.ndarray:
    """dp-accounting's series for fractional orders (Mironov et al. 2019, Sec. 3.3), all terms at once.

    One row per order.  The result is the partial sum at the first term where dp-accounting's loop
    stops (both parts decreasing and 30 nats below the total), NaN where it does not stop within
    ``terms`` terms.
    """
    z0 = sigma**2 * math.log(1 / q - 1) + 0.5
    log1mq = math.log1p(-q)
    i = np.arange(terms, dtype=float)[None, :]
    a = alphas[:, None]
    j = a - i
    log_coef = _log_comb_table(tuple(alphas), terms)
    log_t0 = log_coef + i * math.log(q) + j * log1mq
    log_t1 = log_coef + j * math.log(q) + i * log1mq
    log_e0 = math.log(0.5) + _log_erfc((i - z0) / (math.sqrt(2) * sigma))
    log_e1 = math.log(0.5) + _log_erfc((z0 - j) / (math.sqrt(2) * sigma))
    log_s0 = log_t0 + (i * i - i) / (2 * (sigma**2)) + log_e0
    log_s1 = log_t1 + (j * j - j) / (2 * (sigma**2)) + log_e1
    total = np.logaddexp(
        np.logaddexp.accumulate(log_s0, axis=1), np.logaddexp.accumulate(log_s1, axis=1)
    )
    minus_inf = np.full((len(alphas), 1), -np.inf)
    prev0 = np.concatenate([minus_inf, log_s0[:, :-1]], axis=1)
    prev1 = np.concatenate([minus_inf, log_s1[:, :-1]], axis=1)
    stop = (log_s0 < prev0) & (log_s1 < prev1) & (np.maximum(log_s0, log_s1) < total - 30)
    first = np.argmax(stop, axis=1)
    return np.where(stop.any(axis=1), total[np.arange(len(alphas)), first], np.nan)


def _frac_orders(q: float, sigma: float, alphas: np.ndarray) -> np.ndarray:
    """log A at fractional orders; ``inf`` where dp-accounting's loop does not stop in 1000 terms
    (it then leaves the order out of the minimum, and so does this)."""
    out = _log_a_frac(q, sigma, alphas, 48)  # most orders stop within a few dozen terms
    late = np.isnan(out)
    if late.any():  # the same terms again, up to dp-accounting's limit
        out[late] = _log_a_frac(q, sigma, alphas[late], _FRAC_TERMS)
    return np.where(np.isnan(out), np.inf, out)


@functools.lru_cache(maxsize=4096)
def _rdp_curve(q: float, sigma: float, orders: tuple[float, ...]) -> np.ndarray:
    alphas = np.asarray(orders, dtype=float)
    out = np.empty(len(alphas))
    if q == 0:
        out[:] = 0.0
    elif sigma == 0:
        out[:] = math.inf
    elif q == 1.0:
        with np.errstate(divide="ignore"):  # sigma**2 underflowing to 0: infinite, as it is
            out[:] = alphas / (2 * sigma**2)
    else:
        finite = np.isfinite(alphas)
        frac = finite & (alphas != np.floor(alphas))
        whole = finite & ~frac
        if frac.any():
            out[frac] = _frac_orders(q, sigma, alphas[frac]) / (alphas[frac] - 1)
        if whole.any():
            out[whole] = _log_a_int(q, sigma, alphas[whole]) / (alphas[whole] - 1)
    out[np.isinf(alphas)] = math.inf
    out.flags.writeable = False
    return out


def poisson_gaussian_rdp(q: float, sigma: float, orders: Sequence[float]) -> np.ndarray:
    """RDP of one Poisson-subsampled Gaussian step at ``orders`` (cached; read-only array).

    Equal to dp-accounting's ``_compute_rdp_poisson_subsampled_gaussian`` up to rounding.
    """
    if not 0 <= q <= 1:
        raise ValueError(f"sampling_probability must be in [0, 1]; found {q!r}")
    if sigma < 0:
        raise ValueError(f"noise_multiplier must be >= 0; found {sigma!r}")
    return _rdp_curve(float(q), float(sigma), tuple(float(a) for a in orders))


class RdpAccountant(dpa.rdp.RdpAccountant):
    """dp-accounting's RDP accountant; Poisson-subsampled and plain Gaussians use the cached curve."""

    def _maybe_compose(self, event: dpa.DpEvent, count: int, do_compose: bool):
        sampled = isinstance(event, dpa.PoissonSampledDpEvent) and isinstance(
            event.event, dpa.GaussianDpEvent
        )
        if sampled and self._neighboring_relation in (_NR.ADD_OR_REMOVE_ONE, _NR.REPLACE_SPECIAL):
            if do_compose:
                self._rdp += count * poisson_gaussian_rdp(
                    event.sampling_probability, event.event.noise_multiplier, self._orders
                )
            return None
        if isinstance(event, dpa.GaussianDpEvent):
            if do_compose:
                self._rdp += count * poisson_gaussian_rdp(1.0, event.noise_multiplier, self._orders)
            return None
        return super()._maybe_compose(event, count, do_compose)

    def rdp_curve(self) -> tuple[np.ndarray, np.ndarray]:
        """(orders, accumulated RDP): what the epsilon conversion minimises over."""
        return np.array(self._orders, dtype=float), np.array(self._rdp, dtype=float)


# ----------------------------------------------------------------------------- PLD
class _VectorGaussianPrivacyLoss(_plm.GaussianPrivacyLoss):
    """dp-accounting's Gaussian privacy loss with ``get_delta_for_epsilon`` over arrays at once."""

    def _inverse_vec(self, eps: np.ndarray) -> np.ndarray:
        q, s, var = self.sampling_prob, self.sensitivity, self.standard_deviation**2
        if q == 1.0:
            loss = eps
        else:
            a, c = 1 / q, 1 - 1 / q  # log(a e^b + c) with c < 0, as common.log_a_times_exp_b_plus_c
            b = eps if self.adjacency_type == _plm.AdjacencyType.REMOVE else -eps
            d = b + np.log(a)
            with np.errstate(divide="ignore", invalid="ignore"):
                loss = np.where(b == 0, np.log(a + c), d + np.log1p(-np.exp(np.log(-c) - d)))
            if self.adjacency_type == _plm.AdjacencyType.ADD:
                loss = -loss
        x = -0.5 * s - loss * var / s  # inverse of the unsampled loss (REMOVE form)
        if self.adjacency_type == _plm.AdjacencyType.ADD:
            x = s + x
        if q < 1.0:  # math.isclose cases of dp-accounting's scalar code
            edge = (
                -math.log(1 - q)
                if self.adjacency_type == _plm.AdjacencyType.ADD
                else math.log(1 - q)
            )
            close = np.abs(eps - edge) <= 1e-9 * np.maximum(np.abs(eps), abs(edge))
            x = np.where(
                close, -np.inf if self.adjacency_type == _plm.AdjacencyType.ADD else np.inf, x
            )
        return x

    def get_delta_for_epsilon(self, epsilon):
        is_scalar = np.ndim(epsilon) == 0
        epsilons = np.atleast_1d(np.asarray(epsilon, dtype=float))
        if self.adjacency_type not in (_plm.AdjacencyType.ADD, _plm.AdjacencyType.REMOVE):
            return super().get_delta_for_epsilon(epsilon)
        deltas = np.zeros_like(epsilons, dtype=float)
        if self.sampling_prob == 1.0:
            idx = np.full_like(epsilons, True, dtype=bool)
        elif self.adjacency_type == _plm.AdjacencyType.ADD:
            idx = epsilons < -math.log1p(-self.sampling_prob)
        else:
            idx = epsilons > math.log1p(-self.sampling_prob)
            deltas[~idx] = -np.expm1(epsilons[~idx])
        x = self._inverse_vec(epsilons[idx])
        deltas[idx] = self.mu_upper_cdf(x) - np.exp(epsilons[idx] + self.mu_lower_log_cdf(x))
        deltas = np.clip(deltas, 0, 1)
        return float(deltas[0]) if is_scalar else deltas


def _prefix_to_truncate(arr: np.ndarray, threshold: float) -> int:
    """Longest prefix with sum <= threshold (dp-accounting's loop: the cumulative sum is sequential too)."""
    hits = np.flatnonzero(np.cumsum(arr) > threshold)
    return int(hits[0]) if hits.size else len(arr)


def _truncate_tails(probs: np.ndarray, tail_mass_truncation: float, pessimistic: bool):
    """dp-accounting's ``pld_pmf._truncate_tails`` without its Python loop."""
    if tail_mass_truncation == 0:
        return 0, probs, 0
    # at least one point stays, also when all the mass is below the truncation (dp-accounting's loop
    # stops there too); the mass cut off on the left is then booked on it
    left_idx = min(_prefix_to_truncate(probs, tail_mass_truncation / 2), len(probs) - 1)
    right_idx = len(probs) - _prefix_to_truncate(np.flip(probs), tail_mass_truncation / 2)
    right_idx = max(right_idx, left_idx + 1)
    left_mass = np.sum(probs[:left_idx])
    right_mass = np.sum(probs[right_idx:])
    truncated = probs[left_idx:right_idx]
    if pessimistic:
        truncated[0] += left_mass
        return left_idx, truncated, right_mass
    truncated[-1] += right_mass
    return left_idx, truncated, 0


def _self_convolve_bounds(
    probs: np.ndarray, num_times: int, tail_mass_truncation: float
) -> tuple[int, int]:
    """dp-accounting's ``common.compute_self_convolve_bounds`` (Chernoff bounds), the 40 moment
    generating functions in one array operation.

    The moment generating functions can differ from scipy's ``logsumexp`` in the last bits; a bound
    is then rounded to a neighbouring grid point at most, and either point is a valid Chernoff
    bound (the truncated mass is still at most ``tail_mass_truncation / 2`` per side, to rounding).
    """
    upper, lower = (len(probs) - 1) * num_times, 0
    if tail_mass_truncation == 0:
        return lower, upper
    orders = np.concatenate((np.arange(-20, 0), np.arange(1, 21))) / len(probs)
    # log E[exp(order * i)] for all 40 orders at once (scipy's logsumexp per order cost 25 ms here)
    support = np.flatnonzero(probs > 0)
    exponents = support[None, :] * orders[:, None]
    top = exponents.max(axis=1)
    # in place: the (40, support) array is tens of MB, and each temporary as large cost more than
    # the arithmetic (2.3x faster than new arrays for a 10-step round's pmf; the same floats)
    exponents -= top[:, None]
    np.exp(exponents, out=exponents)
    log_mgfs = top + np.log(exponents @ probs[support])
    for order, log_mgf in zip(orders, log_mgfs):
        bound = (num_times * log_mgf + math.log(2 / tail_mass_truncation)) / order
        if not math.isfinite(bound):
            continue
        if order > 0:
            upper = min(upper, math.ceil(bound))
        if order < 0:
            lower = max(lower, math.floor(bound))
    return lower, upper


class _FastPmf(_pmf.DensePLDPmf):
    """dp-accounting's dense PLD pmf; composition with the truncation steps above (same results)."""

    @classmethod
    def of(cls, pmf: _pmf.PLDPmf) -> _FastPmf:
        if isinstance(pmf, cls):
            return pmf
        d = pmf.to_dense_pmf()
        return cls(
            d._discretization,
            d._lower_loss,
            np.asarray(d._probs, dtype=float),
            d._infinity_mass,
            d._pessimistic_estimate,
        )

    def compose(self, other: _pmf.PLDPmf, tail_mass_truncation: float = 0) -> _FastPmf:
        other = other.to_dense_pmf()
        self.validate_composable(other)
        _check_grid(len(self._probs) + len(other._probs) - 1, self._discretization)
        lower_loss = self._lower_loss + other._lower_loss
        probs = signal.fftconvolve(self._probs, other._probs)
        infinity_mass = (
            self._infinity_mass + other._infinity_mass - self._infinity_mass * other._infinity_mass
        )
        offset, probs, right_tail = _truncate_tails(
            probs, tail_mass_truncation, self._pessimistic_estimate
        )
        return _FastPmf(
            self._discretization,
            lower_loss + offset,
            probs,
            infinity_mass + right_tail,
            self._pessimistic_estimate,
        )

    def get_epsilon_for_delta(self, delta: float) -> float:
        upper_loss = (self._lower_loss + len(self._probs) - 1) * self._discretization
        # itertools.count(upper_loss, -d) adds -d repeatedly; a sequential cumulative sum does the same
        steps = np.full(len(self._probs), -self._discretization)
        steps[0] = upper_loss
        losses = np.cumsum(steps)
        # that sum drifts off the grid (1e-11 over 1e5 points near 10 nats, 1e-8 near 300): where the
        # drift passes 1e-9 nats the grid's own losses are used, or a mass could sit below its loss
        exact = (
            self._lower_loss + np.arange(len(self._probs) - 1, -1, -1, dtype=float)
        ) * self._discretization
        if len(losses) and float(np.max(np.abs(losses - exact))) > _LOSS_DRIFT:
            losses = exact
        return _epsilon_for_delta(self._infinity_mass, losses, np.flip(self._probs), delta)

    def self_compose(self, num_times: int, tail_mass_truncation: float = 1e-15) -> _FastPmf:
        if num_times <= 0:
            raise ValueError(f"num_times should be >= 1, num_times={num_times}")
        lo, hi = _self_convolve_bounds(self._probs, num_times, tail_mass_truncation)
        output_len = hi - lo + 1
        _check_grid(
            output_len, self._discretization
        )  # before the FFT: steps=10**23 is one line, not a crash
        fast_len = fft.next_fast_len(max(output_len, len(self._probs)))
        out = np.real(fft.ifft(fft.fft(self._probs, fast_len) ** num_times))
        probs = np.array(np.roll(out, -lo)[:output_len])
        inf_prob = tail_mass_truncation - math.expm1(num_times * math.log1p(-self._infinity_mass))
        return _FastPmf(
            self._discretization,
            self._lower_loss * num_times + lo,
            probs,
            inf_prob,
            self._pessimistic_estimate,
        )


def _epsilon_for_delta(
    infinity_mass: float, rev_losses: np.ndarray, rev_probs: np.ndarray, delta: float
) -> float:
    """dp-accounting's ``pld_pmf._get_epsilon_for_delta`` with its loop over losses (from the top)
    replaced by cumulative sums.  Step k of that loop first tests whether epsilon >= loss k with
    the masses of the losses above it, then adds loss k; both tests are evaluated for every k and
    the first one to fire decides, as in the loop.

    The loop weighs each mass by ``exp(-loss)``, which leaves float range past about 700 nats
    (every weight is 0 above 745, and the loop then answers a grid loss, or 0).  The weights are
    therefore taken relative to ``exp(-shift)``, ``shift`` being the loss at which the mass above
    first exceeds delta (the loop cannot stop before it); ``shift`` is 0, and the arithmetic
    dp-accounting's, while every loss stays within :data:`_EXP_SAFE` nats of 0.
    """
    if infinity_mass > delta:
        return math.inf
    upper = np.cumsum(
        np.concatenate([[infinity_mass], rev_probs])
    )  # masses before step k = index k
    n = len(rev_probs)
    shift = 0.0
    if n and max(abs(float(rev_losses[0])), abs(float(rev_losses[-1]))) > _EXP_SAFE:
        if not upper[-1] > delta:  # all the mass is at most delta: the loop ends and answers 0
            return 0
        k0 = int(np.argmax(upper[1:] > delta))
        shift = float(rev_losses[k0])
    with np.errstate(
        over="ignore", under="ignore", invalid="ignore"
    ):  # inf (* 0) only past the stop
        lower = np.cumsum(np.concatenate([[0.0], np.exp(shift - rev_losses) * rev_probs]))
    with np.errstate(divide="ignore", invalid="ignore"):
        stop = (
            (upper[:n] > delta)
            & (lower[:n] > 0)
            & (np.log((upper[:n] - delta) / lower[:n]) + shift >= rev_losses)
        )
    zero = (upper[1:] >= delta) & (lower[1:] == 0)
    k_stop = int(np.argmax(stop)) if stop.any() else n
    k_zero = int(np.argmax(zero)) if zero.any() else n
    if k_zero < k_stop:
        return max(0, float(rev_losses[k_zero]))
    mass_upper, mass_lower = float(upper[k_stop]), float(lower[k_stop])
    if shift == 0.0:
        if mass_upper <= mass_lower + delta:
            return 0
        return math.log((mass_upper - delta) / mass_lower)
    if not math.isfinite(mass_lower):
        # the weights overflowed (losses more than 700 nats below the shift) before the loop stopped:
        # answer the loss at the shift, whose mass above is at most delta, so its delta is too
        return max(0, float(rev_losses[k0]))
    if mass_upper - delta <= mass_lower * math.exp(-shift):
        return 0
    return math.log((mass_upper - delta) / mass_lower) + shift


_EXP_SAFE = 700.0  # |loss| up to which exp(-loss) keeps full precision in float64
_LOSS_DRIFT = (
    1e-9  # nats the losses of dp-accounting's loop may drift off the grid before privkit's are used
)


def _fast_pld(pld: _pld.PrivacyLossDistribution) -> _pld.PrivacyLossDistribution:
    """The same PLD with pmfs whose composition runs vectorised."""
    remove = _FastPmf.of(pld._pmf_remove)
    if pld._symmetric:
        return _pld.PrivacyLossDistribution(remove)
    return _pld.PrivacyLossDistribution(remove, _FastPmf.of(pld._pmf_add))


def _connect_dots_pmf(loss: _VectorGaussianPrivacyLoss, vdi: float) -> _FastPmf:
    """dp-accounting's pessimistic connect-the-dots pmf on a fixed grid (Doroshenko et al. 2022,
    Alg. 1), as ``pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap`` computes it, built
    straight into a dense array (dp-accounting goes through a dict of every grid point)."""
    lo, hi = _grid_bounds(loss, vdi)
    deltas = np.asarray(loss.get_delta_for_epsilon(np.arange(lo, hi + 1) * vdi), dtype=np.float64)
    if not np.all(np.isfinite(deltas)):
        raise ValueError(
            f"the PLD of a Gaussian with noise multiplier {loss.standard_deviation:g} is not finite "
            "in float64 on this grid"
        )
    if lo == hi:
        return _FastPmf(vdi, lo, np.array([1 - deltas[0]]), float(deltas[0]), True)
    if np.any(np.diff(deltas) > _pmf._DELTA_DIFF_TOLERANCE):
        raise ValueError(f"deltas are not in non-increasing order: deltas={deltas}.")
    deltas = np.minimum.accumulate(deltas)
    diffs = np.diff(deltas)
    probs = np.zeros_like(deltas)
    probs[0] = 1 - deltas[0] + diffs[0] / math.expm1(vdi)
    probs[1:-1] = (diffs[1:] - diffs[:-1] * math.exp(vdi)) / math.expm1(vdi)
    probs[-1] = diffs[-1] / math.expm1(-vdi)
    return _FastPmf(vdi, lo, np.maximum(0.0, probs), float(deltas[-1]), True)


@functools.lru_cache(maxsize=1024)
def _base_pld(sigma: float, q: float, vdi: float) -> _pld.PrivacyLossDistribution:
    def pmf(adjacency: _plm.AdjacencyType) -> _FastPmf:
        return _connect_dots_pmf(
            _VectorGaussianPrivacyLoss(sigma, sampling_prob=q, adjacency_type=adjacency), vdi
        )

    remove = pmf(_plm.AdjacencyType.REMOVE)
    if q == 1.0:
        return _pld.PrivacyLossDistribution(remove)
    return _pld.PrivacyLossDistribution(remove, pmf(_plm.AdjacencyType.ADD))


@functools.lru_cache(maxsize=1024)
def poisson_gaussian_pld(
    q: float, sigma: float, vdi: float, count: int = 1
) -> _pld.PrivacyLossDistribution:
    """Pessimistic connect-the-dots PLD of ``count`` Poisson-subsampled Gaussian steps (add/remove).

    Identical to dp-accounting's ``from_gaussian_mechanism(sigma, sampling_prob=q,
    value_discretization_interval=vdi).self_compose(count)``; cached, so identical events across
    clients and rounds are built and self-composed once.
    """
    base = _base_pld(float(sigma), float(q), float(vdi))
    # dp-accounting self-composes even once (its tail truncation then applies): so does this
    return base.self_compose(int(count))


class PldAccountant(dpa.pld.PLDAccountant):
    """dp-accounting's PLD accountant; Poisson-subsampled and plain Gaussians use cached PLDs and
    every composition runs through :class:`_FastPmf`."""

    def __init__(
        self,
        neighboring_relation: dpa.NeighboringRelation = _NR.ADD_OR_REMOVE_ONE,
        value_discretization_interval: float = 1e-4,
    ) -> None:
        super().__init__(neighboring_relation, value_discretization_interval)
        self._pld: Any = _fast_pld(self._pld)
        # what was composed, as (one step's PLD, count): recomposed with an error bound by
        # get_epsilon (accountants.certified); events without a base PLD here are named instead
        self._parts: list[tuple[_pld.PrivacyLossDistribution, int]] = []
        self._part_keys: list[tuple[float, float, float]] = []  # (sigma, q, grid) of each part
        self._uncertified: list[str] = []

    def _maybe_compose(self, event: dpa.DpEvent, count: int, do_compose: bool):
        relation_ok = self.neighboring_relation in (_NR.ADD_OR_REMOVE_ONE, _NR.REPLACE_SPECIAL)
        sampled = isinstance(event, dpa.PoissonSampledDpEvent) and isinstance(
            event.event, dpa.GaussianDpEvent
        )
        gaussian = isinstance(event, dpa.GaussianDpEvent) or (
            sampled and event.sampling_probability == 1.0
        )
        sigma = (
            (event.event if sampled else event).noise_multiplier if (sampled or gaussian) else None
        )
        if relation_ok and gaussian and sigma is not None and sigma > 0:
            if do_compose and math.isfinite(sigma):
                # count Gaussians (sampled with probability 1 or not) are one Gaussian with multiplier
                # sigma / sqrt(count): one discretisation, exact in float, instead of an FFT power whose
                # rounding noise can reach the tail masses at small delta
                pld = _base_pld(
                    float(sigma / math.sqrt(count)), 1.0, float(self._value_discretization_interval)
                )
                self._pld = self._pld.compose(pld)
                self._parts.append((pld, 1))
                self._part_keys.append(
                    (
                        float(sigma / math.sqrt(count)),
                        1.0,
                        float(self._value_discretization_interval),
                    )
                )
            return None  # infinite noise releases nothing: the identity
        if (
            relation_ok
            and sampled
            and event.sampling_probability > 0
            and sigma is not None
            and sigma > 0
        ):
            if do_compose and math.isfinite(sigma):
                pld = poisson_gaussian_pld(
                    event.sampling_probability, sigma, self._value_discretization_interval, count
                )
                self._pld = self._pld.compose(pld)
                base = _base_pld(
                    float(sigma),
                    float(event.sampling_probability),
                    float(self._value_discretization_interval),
                )
                self._parts.append((base, int(count)))
                self._part_keys.append(
                    (
                        float(sigma),
                        float(event.sampling_probability),
                        float(self._value_discretization_interval),
                    )
                )
            return None
        wrappers = (
            dpa.NoOpDpEvent,
            dpa.NonPrivateDpEvent,
            dpa.SelfComposedDpEvent,
            dpa.ComposedDpEvent,
        )
        if do_compose and not isinstance(event, wrappers):
            self._uncertified.append(type(event).__name__)
        return super()._maybe_compose(event, count, do_compose)

    def raw_epsilon(self, target_delta: float) -> float:
        """dp-accounting's epsilon of the composed PLD (plain FFT composition, no error allowance:
        it can fall below the exact epsilon at small delta; :meth:`get_epsilon` cannot)."""
        return float(super().get_epsilon(target_delta))

    def get_epsilon(self, target_delta: float) -> float:
        """A certified upper bound on the exact epsilon at ``target_delta``: the composed steps'
        pessimistic PLDs recomposed with an allowance for the FFT's rounding
        (:func:`accountants.certified.certified_epsilon`).  Raises
        :class:`~accountants.certified.PldPrecisionError` (a :class:`PldGridError`) where privkit
        cannot certify one; callers then give RDP's epsilon with that reason."""
        from accountants.certified import PldPrecisionError, certified_epsilon

        if self._contains_non_dp_event:
            return math.inf
        if self._uncertified:
            raise PldPrecisionError(
                f"no certified PLD epsilon for {', '.join(sorted(set(self._uncertified)))} "
                "(composed by dp-accounting's own FFT, without an error bound)"
            )
        if not self._parts:
            return 0.0
        parts = self._distinct_parts()
        if len(parts) > MAX_CERTIFIED_PARTS:
            raise PldPrecisionError(
                f"no certified PLD epsilon for {len(parts)} distinct mechanisms (privkit "
                f"recomposes at most {MAX_CERTIFIED_PARTS} with its error bound: seconds each)"
            )
        raw = self.raw_epsilon(target_delta)
        # every accountant composing the same steps at the same delta gets the same certified
        # value (an epsilon curve over rounds, clients with equal rates): computed once
        key = (float(target_delta), self._signature())
        cache = _CERTIFIED_CACHE
        if len(cache) > 4096:
            cache.clear()
        if key not in cache:
            directions = [[(pld._pmf_remove, c) for pld, c in parts]]
            if not all(pld._symmetric for pld, _ in parts):
                directions.append(
                    [(pld._pmf_remove if pld._symmetric else pld._pmf_add, c) for pld, c in parts]
                )
            cache[key] = certified_epsilon(directions, float(target_delta), raw)
        return cache[key]

    def _signature(self) -> tuple:
        """The composed steps as ((sigma, q, grid), count) pairs, equal steps merged, sorted."""
        counts: dict[tuple[float, float, float], int] = {}
        for k, (_, c) in zip(self._part_keys, self._parts):
            counts[k] = counts.get(k, 0) + int(c)
        return tuple(sorted(counts.items()))

    def _distinct_parts(self) -> list[tuple[_pld.PrivacyLossDistribution, int]]:
        """The composed steps with equal ones merged (their counts added; composition commutes):
        a step's PLD is built once per (sigma, q, grid), so equal steps are the same object."""
        merged: dict[int, list] = {}
        for pld, count in self._parts:
            if id(pld) in merged:
                merged[id(pld)][1] += count
            else:
                merged[id(pld)] = [pld, count]
        return [(pld, int(c)) for pld, c in merged.values()]

    @property
    def pld(self) -> _pld.PrivacyLossDistribution:
        """The composed privacy loss distribution."""
        return self._pld
