"""Trade-off curves: the smallest false-negative rate a privacy claim allows at each false-positive rate.

A membership test on a mechanism M has a false-positive rate (FPR, calling a non-member a member)
and a false-negative rate (FNR).  A privacy claim bounds every test from below by a *trade-off
curve* ``f``: ``FNR >= f(FPR)`` (f-DP, Dong, Roth & Su 2022).  Equivalently no attack's ROC point
can have ``TPR > 1 - f(FPR)``.  privkit's curves:

* :class:`GenericCurve` -- the (epsilon, delta)-DP claim itself,
  ``f(a) = max(0, 1 - delta - e^eps a, e^-eps (1 - delta - a))`` (Kairouz et al. 2015).
* :class:`GaussianCurve` -- mu-GDP, ``f(a) = Phi(Phi^-1(1 - a) - mu)``: the exact curve of the
  Gaussian mechanism with sensitivity / noise std = mu.  ``gaussian_curve(eps, delta)`` takes the
  mu at which the Gaussian mechanism is exactly (eps, delta)-DP (analytic Gaussian mechanism,
  Balle & Wang 2018, which is Dong-Roth-Su's Corollary 2.13 solved for mu).
* :class:`ProfileCurve` -- any mechanism known through its privacy profile ``delta(eps)``: a
  dp-accounting privacy loss distribution (:func:`pld_curve`), a privkit :class:`~accountants.Ledger`
  (:func:`ledger_curve`), or a user's own trade-off function (:func:`curve_from_callable`).  The
  curve is the upper envelope over a grid of epsilons of the generic curves ``f_{eps, delta(eps)}``
  (Dong, Roth & Su 2022, Prop. 2.12).  Every ``delta(eps)`` used is an upper bound (dp-accounting's
  pessimistic PLD) and every line dropped only weakens the curve, so a ProfileCurve never claims
  more privacy than its source certifies.

Every curve here is symmetric (``f = f^-1``), convex, non-increasing and ``<= 1 - a``.  Each also
spans a one-parameter family indexed by epsilon (:class:`CurveFamily`), pointwise non-increasing
in epsilon, which the one-run f-DP audit (:mod:`attacks.one_run_fdp`) searches over:

* generic: ``f_{eps, delta}``;
* gaussian: the Gaussian mechanism that is (eps, delta)-DP;
* profile: the source's privacy profile shifted in epsilon, i.e. the claim "(e + s, delta(e))-DP
  for every e" with ``s = eps - eps_source(delta)``; at the source's own epsilon it is the source's
  curve itself, so "rejected at the accounted epsilon" means "not as private as the source says".
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy.special import log_ndtr, ndtr, ndtri

from accountants._validate import (
    check_choice,
    check_int,
    check_nonnegative,
    check_open_unit,
    check_positive,
    check_real,
)
from accountants.gaussian import analytic_gaussian_sigma

__all__ = [
    "CurveFamily",
    "GaussianCurve",
    "GenericCurve",
    "ProfileCurve",
    "TradeoffCurve",
    "curve_family",
    "curve_from_callable",
    "gaussian_curve",
    "gaussian_mu",
    "gdp_curve",
    "generic_curve",
    "ledger_curve",
    "pld_curve",
]

# epsilons above this carry no information a finite audit can use, and e^eps stays finite
_EPS_CAP = 100.0
# a line whose delta is below the source's floor by less than this adds nothing
_DELTA_TOL = 1e-15
_MAX_POINTS = 20_000


def _fpr(fpr) -> np.ndarray:
    a = np.asarray(fpr, dtype=np.float64)
    # two reductions (NaN fails both comparisons): the one-run searches check FPRs thousands of times
    if a.size and not (a.min() >= 0.0 and a.max() <= 1.0):
        raise ValueError(f"fpr must be in [0, 1]; found values in [{np.nanmin(a)}, {np.nanmax(a)}]")
    return a


def _clip(fnr: np.ndarray, a: np.ndarray) -> np.ndarray:
    """A trade-off value lies in [0, 1 - a] (no test is worse than guessing, none beats zero)."""
    return np.minimum(np.maximum(fnr, 0.0), 1.0 - a)  # np.clip, without its per-call overhead


def _check_delta(delta: float) -> float:
    delta = check_real(delta, "delta")
    if not 0.0 <= delta < 1.0:
        raise ValueError(f"delta must be in [0, 1); found {delta!r}")
    return delta


class TradeoffCurve:
    """Base of privkit's trade-off curves: ``curve(fpr)`` is the smallest FNR the claim allows.

    Subclasses are symmetric, so the inverse blow-up used by the one-run f-DP analysis is
    ``inverse_blowup(y) = f(1 - y)``.
    """

    def __call__(self, fpr) -> np.ndarray:
        raise NotImplementedError

    @property
    def claim(self) -> str:
        """What a mechanism promises when it satisfies this curve, in words."""
        raise NotImplementedError

    def family(self, delta: float) -> CurveFamily:
        """The one-parameter family (indexed by epsilon at ``delta``) this curve belongs to."""
        raise NotImplementedError

    def tpr_bound(self, fpr) -> np.ndarray:
        """The largest TPR any attack may reach at ``fpr``: ``1 - f(fpr)``."""
        return 1.0 - self(fpr)

    def inverse_blowup(self, y) -> np.ndarray:
        """``inf{x : 1 - f(x) >= y}``; for a symmetric f it is ``f(1 - y)``."""
        y = np.clip(np.asarray(y, dtype=np.float64), 0.0, 1.0)
        return self(1.0 - y)


# ------------------------------------------------------------------------------------ generic


def _generic(a: np.ndarray, eps: np.ndarray | np.float64, delta: float) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(eps)
        val = np.maximum(1.0 - delta - e * a, (1.0 - delta - a) / e)
    return _clip(np.fmax(val, 0.0), a)  # fmax maps NaN (e^eps = inf at a = 0) to 0


@dataclass(frozen=True)
class GenericCurve(TradeoffCurve):
    """The (epsilon, delta)-DP trade-off curve ``max(0, 1-delta-e^eps a, e^-eps (1-delta-a))``."""

    epsilon: float
    delta: float

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "epsilon", check_nonnegative(self.epsilon, "epsilon", allow_inf=True)
        )
        object.__setattr__(self, "delta", _check_delta(self.delta))

    def __call__(self, fpr) -> np.ndarray:
        return _generic(_fpr(fpr), np.float64(self.epsilon), self.delta)

    @property
    def claim(self) -> str:
        return f"({self.epsilon:.4g}, {self.delta:.3g})-DP"

    def family(self, delta: float | None = None) -> CurveFamily:
        """The generic family at this curve's own delta (``delta`` is ignored)."""
        return CurveFamily("generic", self.delta)


def generic_curve(epsilon: float, delta: float) -> GenericCurve:
    """Trade-off curve of the bare (epsilon, delta)-DP claim."""
    return GenericCurve(epsilon, delta)


# ------------------------------------------------------------------------------------ gaussian


@functools.lru_cache(maxsize=4096)
def _mu(epsilon: float, delta: float) -> float:
    if epsilon == 0.0:  # delta(0) = 2 Phi(mu/2) - 1 is total variation
        return 2.0 * float(ndtri((1.0 + delta) / 2.0))
    return 1.0 / analytic_gaussian_sigma(epsilon, delta)


def _mu_lanes(epsilon: np.ndarray, delta: float) -> np.ndarray:
    """:func:`gaussian_mu` for many epsilons at once (bisection on log sigma, all lanes together).

    dp-accounting's ``get_sigma_gaussian`` is scalar (about 2 ms a call); the one-run f-DP search
    needs mu at 16 epsilons per round.  Same equation (Balle & Wang 2018, Eq. 6, in log space):
    ``log delta(sigma) = log Phi(1/sigma - t) + log1p(-exp(eps + log Phi(-t) - log Phi(1/sigma - t)))``
    with ``t = eps sigma + 1/(2 sigma)``, decreasing in sigma; agrees with the scalar path to 1e-9.
    """
    eps = np.asarray(epsilon, dtype=np.float64)
    out = np.empty(eps.shape)
    zero = eps == 0.0
    out[zero] = 2.0 * ndtri((1.0 + delta) / 2.0)
    e = eps[~zero]
    lo, hi = np.full(e.shape, math.log(1e-8)), np.full(e.shape, math.log(1e8))  # log sigma
    target = math.log(delta)
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        sigma = np.exp(mid)
        t = e * sigma + 0.5 / sigma
        x = log_ndtr(1.0 / sigma - t)
        y = e + log_ndtr(-t)
        with np.errstate(divide="ignore", invalid="ignore"):
            log_delta = np.where(y < x, x + np.log1p(-np.exp(y - x)), -np.inf)
        too_small = log_delta > target  # delta too large: more noise
        lo, hi = np.where(too_small, mid, lo), np.where(too_small, hi, mid)
    out[~zero] = np.exp(-hi)  # sigma from above: mu from below, never a stronger claim
    return out


def gaussian_mu(epsilon: float, delta: float) -> float:
    """The mu for which mu-GDP (the Gaussian mechanism with sensitivity/std = mu) is exactly
    (epsilon, delta)-DP: ``1 / sigma`` of the analytic Gaussian mechanism at sensitivity 1
    (dp-accounting's ``get_sigma_gaussian``), i.e. the root of Dong-Roth-Su's
    ``delta = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)``.
    """
    epsilon = check_positive(epsilon, "epsilon")
    delta = check_open_unit(delta, "delta")
    return _mu(epsilon, delta)


def _gaussian(a: np.ndarray, mu: np.ndarray | np.float64) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        val = ndtr(-ndtri(a) - mu)  # Phi^-1(1 - a) as -Phi^-1(a): exact for tiny a
    # a = 0 with mu = inf gives inf - inf; no privacy at all means f = 0 there too
    return _clip(np.where(np.isinf(mu), 0.0, np.nan_to_num(val, nan=0.0)), a)


@dataclass(frozen=True)
class GaussianCurve(TradeoffCurve):
    """mu-GDP: ``f(a) = Phi(Phi^-1(1 - a) - mu)``, the exact curve of a Gaussian mechanism.

    ``epsilon``/``delta`` record the (epsilon, delta) it was calibrated to, when it was.
    """

    mu: float
    epsilon: float | None = None
    delta: float | None = None

    def __post_init__(self) -> None:
        mu = check_real(self.mu, "mu")
        if mu < 0:
            raise ValueError(f"mu must be >= 0; found {mu!r}")
        object.__setattr__(self, "mu", mu)

    def __call__(self, fpr) -> np.ndarray:
        return _gaussian(_fpr(fpr), np.float64(self.mu))

    @property
    def claim(self) -> str:
        if self.epsilon is not None and self.delta is not None:
            return (
                f"as private as the Gaussian mechanism at ({self.epsilon:.4g}, {self.delta:.3g}) "
                f"(mu = {self.mu:.4g})"
            )
        return f"{self.mu:.4g}-GDP (as private as a Gaussian mechanism with mu = {self.mu:.4g})"

    def family(self, delta: float | None = None) -> CurveFamily:
        """Gaussian mechanisms indexed by their epsilon at ``delta`` (default: the calibration delta)."""
        delta = self.delta if delta is None else delta
        if delta is None:
            raise ValueError(
                "delta must be given for a GaussianCurve built from mu alone; found None"
            )
        return CurveFamily("gaussian", delta)


def gaussian_curve(epsilon: float, delta: float) -> GaussianCurve:
    """The Gaussian mechanism's curve at the mu where it is exactly (epsilon, delta)-DP."""
    return GaussianCurve(gaussian_mu(epsilon, delta), float(epsilon), float(delta))


def gdp_curve(mu: float) -> GaussianCurve:
    """The mu-GDP curve."""
    return GaussianCurve(check_nonnegative(mu, "mu", allow_inf=True))


# ------------------------------------------------------------------------------------ profile


class ProfileCurve(TradeoffCurve):
    """Upper envelope of the generic curves ``f_{eps_i, delta_i}`` of a privacy profile.

    Parameters
    ----------
    epsilons : 1-D array, ascending, >= 0
        Grid of epsilons.
    deltas : 1-D array
        An upper bound on the source's delta at each epsilon (entries >= 1 carry nothing and are
        dropped).
    source : str
        What the profile describes, e.g. "the ledger's PLD" (used in :attr:`claim`).

    Notes
    -----
    The envelope of the lines ``1 - delta_i - e^eps_i a`` is found by ordering them by slope and
    intersecting neighbours; ``delta`` is convex in ``e^eps`` for every hockey-stick profile, so
    neighbours' intersections are monotone.  Evaluation picks one line per point by binary search;
    whatever line is picked is a valid lower bound, so rounding can only weaken the curve.  The
    second branch ``e^-eps_i (1 - delta_i - a)`` is the mirror image, giving a symmetric curve.
    """

    def __init__(self, epsilons, deltas, source: str = "a privacy profile") -> None:
        eps = np.asarray(epsilons, dtype=np.float64).ravel()
        dl = np.asarray(deltas, dtype=np.float64).ravel()
        if eps.shape != dl.shape or eps.size == 0:
            raise ValueError(
                f"epsilons and deltas must be non-empty and of equal length; found "
                f"{eps.size} and {dl.size}"
            )
        if np.any(~np.isfinite(eps)) or np.any(eps < 0) or np.any(np.diff(eps) <= 0):
            raise ValueError(
                "epsilons must be finite, >= 0 and strictly ascending; found "
                f"[{eps.min()}, {eps.max()}] with {int((np.diff(eps) <= 0).sum())} non-ascending steps"
            )
        if np.any(np.isnan(dl)) or np.any(dl < 0):
            raise ValueError(f"deltas must be >= 0; found minimum {np.nanmin(dl)!r}")
        keep = dl < 1.0
        self.source = source
        self.epsilons = eps[keep]
        self.deltas = dl[keep]
        self._build()

    @classmethod
    def no_privacy(cls, source: str) -> ProfileCurve:
        """The curve f = 0 (a mechanism with no guarantee, e.g. a non-private release)."""
        return cls([0.0], [1.0], source)

    def _build(self) -> None:
        eps, dl = self.epsilons, self.deltas
        self._empty = eps.size == 0
        if self._empty:
            return
        # conservative running sup from the right: delta at eps is at least delta at any larger eps
        self._dsup = np.maximum.accumulate(dl[::-1])[::-1]
        a = 1.0 - dl
        h = np.diff(eps)
        gap = np.maximum(dl[:-1] - dl[1:], 0.0)
        # g: lines ordered by descending epsilon (steepest first); breakpoint of lines i-1, i
        # is x = (delta_{i-1} - delta_i) / (e^eps_i - e^eps_{i-1}), computed without cancellation
        x = gap / (np.exp(eps[:-1]) * np.expm1(h))
        self._g_bp = np.maximum.accumulate(x[::-1])  # ascending in a
        # h = g^-1: lines ordered by ascending epsilon; breakpoint y = a_{i-1} - gap / expm1(step)
        y = a[:-1] - gap / np.expm1(h)
        self._h_bp = np.maximum.accumulate(y)
        # each line's slope and its mirror's, once: evaluation only gathers them
        self._a, self._up, self._down = a, np.exp(eps), np.exp(-eps)

    def _g(self, x: np.ndarray) -> np.ndarray:
        """First branch: max_i 1 - delta_i - e^eps_i x (line chosen by binary search)."""
        n = self.epsilons.size
        k = np.searchsorted(self._g_bp, x, side="left")  # k-th line from the steepest
        i = n - 1 - k
        with np.errstate(over="ignore", invalid="ignore"):
            val = self._a[i] - self._up[i] * x
        return np.fmax(val, -np.inf)  # NaN (inf * 0 for an overflowing shift) -> -inf

    def _h(self, y: np.ndarray) -> np.ndarray:
        """Mirror branch: max_i e^-eps_i (1 - delta_i - y)."""
        i = np.searchsorted(self._h_bp, y, side="right")
        return (self._a[i] - y) * self._down[i]

    def shifted(self, fpr, shift) -> np.ndarray:
        """The member of this curve's family whose every epsilon is moved by ``shift`` (broadcast).

        ``max(g(e^s a), e^-s g^-1(a))`` clipped to ``[0, 1 - a]``: the envelope of the lines
        ``f_{eps_i + s, delta_i}``.  For ``s < 0`` the clip keeps the claim feasible.
        """
        return self._shifted_fn(shift)(fpr)

    def _shifted_fn(self, shift) -> Callable[[np.ndarray], np.ndarray]:
        """``fpr -> shifted(fpr, shift)`` with ``e^s`` and ``e^-s`` computed once: the one-run
        searches evaluate one member at thousands of FPRs, a few at a time."""
        s = np.asarray(shift, dtype=np.float64)
        if self._empty:
            return lambda fpr: np.zeros(np.broadcast_shapes(_fpr(fpr).shape, s.shape))
        with np.errstate(over="ignore"):
            up, down = np.exp(s), np.exp(-s)

        def member(fpr) -> np.ndarray:
            a = _fpr(fpr)  # a <= 1: only _g's own products can overflow
            return _clip(np.maximum(self._g(up * a), down * self._h(a)), a)

        return member

    def __call__(self, fpr) -> np.ndarray:
        return self.shifted(fpr, 0.0)

    def epsilon(self, delta: float) -> float:
        """The smallest grid epsilon whose delta (and every larger one's) is <= ``delta``."""
        delta = _check_delta(delta)
        if self._empty:
            return math.inf
        ok = np.nonzero(self._dsup <= delta)[0]
        return float(self.epsilons[ok[0]]) if ok.size else math.inf

    def delta(self, epsilon: float) -> float:
        """An upper bound on delta at ``epsilon``: the profile at the largest grid point <= epsilon."""
        epsilon = check_nonnegative(epsilon, "epsilon")
        if self._empty:
            return 1.0
        i = np.searchsorted(self.epsilons, epsilon, side="right") - 1
        return float(self._dsup[i]) if i >= 0 else 1.0

    @property
    def claim(self) -> str:
        return f"as private as {self.source}"

    def family(self, delta: float) -> CurveFamily:
        """This profile shifted in epsilon, indexed by its epsilon at ``delta``."""
        return CurveFamily("profile", _check_delta(delta), self)

    def __repr__(self) -> str:
        return f"ProfileCurve(source={self.source!r}, points={self.epsilons.size})"


def _grid(delta_fn: Callable[[np.ndarray], np.ndarray], step: float, max_points: int) -> np.ndarray:
    """Epsilons from 0 to where the profile stops falling (at most ``_EPS_CAP``)."""
    floor = float(np.asarray(delta_fn(np.array([_EPS_CAP])))[0]) + _DELTA_TOL
    hi = 1.0
    while hi < _EPS_CAP and float(np.asarray(delta_fn(np.array([hi])))[0]) > floor:
        hi = min(2.0 * hi, _EPS_CAP)
    n = int(min(max_points, math.ceil(hi / step) + 1))
    return np.linspace(0.0, hi, max(n, 2))


def _dense_pmf_delta(pmf) -> Callable[[np.ndarray], np.ndarray]:
    """Hockey-stick divergence of one dp-accounting PLD pmf at many epsilons, vectorised.

    delta(eps) = inf_mass + sum_{loss > eps} p (1 - e^(eps - loss)), the formula of
    dp-accounting's own ``get_delta_for_epsilon`` (whose vectorised form loops in Python), with
    suffix sums; a relative margin of 1e-12 covers the rounding of the sums. The dense pmf and
    its suffix sums are formed once: a curve's grid search asks for delta a dozen times.
    """
    dense = pmf.to_dense_pmf()
    p = np.asarray(dense._probs, dtype=np.float64)
    losses = (dense._lower_loss + np.arange(p.size)) * dense._discretization
    inf_mass = float(dense._infinity_mass)
    with np.errstate(over="ignore"):
        q = p * np.exp(-losses)
    tail_p = np.r_[np.cumsum(p[::-1])[::-1], 0.0]
    tail_q = np.r_[np.cumsum(q[::-1])[::-1], 0.0]

    def delta(eps: np.ndarray) -> np.ndarray:
        idx = np.searchsorted(losses, eps, side="right")
        e = np.exp(eps)
        raw = tail_p[idx] - e * tail_q[idx]
        return inf_mass + np.maximum(raw, 0.0) + 1e-12 * (tail_p[idx] + e * tail_q[idx])

    return delta


def _pld_delta_fn(pld) -> Callable[[np.ndarray], np.ndarray]:
    """Vectorised delta(eps) of a dp-accounting PrivacyLossDistribution (max of remove/add).

    Uses the pmf arrays when dp-accounting exposes them in the known layout and agrees with its
    own scalar ``get_delta_for_epsilon`` at three points; otherwise its slower public vector path.
    """
    try:
        pmfs = [pld._pmf_remove] if pld._symmetric else [pld._pmf_remove, pld._pmf_add]
        deltas = [_dense_pmf_delta(p) for p in pmfs]

        def fast(eps: np.ndarray) -> np.ndarray:
            return np.max([d(eps) for d in deltas], axis=0)

        probe = np.array([0.0, 0.5, 2.0])
        ref = np.array([float(pld.get_delta_for_epsilon(float(e))) for e in probe])
        got = fast(probe)
        if np.all(got >= ref - 1e-12) and np.all(got <= ref + 1e-9 + 1e-6 * ref):
            return fast
    except (AttributeError, TypeError, ValueError):
        pass
    return lambda eps: np.asarray(
        pld.get_delta_for_epsilon(np.sort(np.asarray(eps, dtype=np.float64)))
    )


def pld_curve(
    pld, *, source: str = "the privacy loss distribution", max_points: int = _MAX_POINTS
) -> ProfileCurve:
    """Trade-off curve of a dp-accounting ``PrivacyLossDistribution``.

    Pessimistic PLDs (dp-accounting's default) give an upper bound on delta at every epsilon, so
    the curve is a lower bound on the mechanism's true curve; the epsilon grid runs from 0 to where
    delta stops falling, at the PLD's own discretisation or coarser (``max_points`` at most).
    """
    max_points = check_int(max_points, "max_points", minimum=2)
    fn = _pld_delta_fn(pld)
    step = float(getattr(pld._pmf_remove, "_discretization", 1e-4))
    eps = _grid(fn, step, max_points)
    return ProfileCurve(eps, fn(eps), source)


def ledger_curve(
    ledger,
    *,
    client: str | int | None = None,
    labels=None,
    accountant: str = "pld",
    max_points: int = _MAX_POINTS,
) -> ProfileCurve:
    """Trade-off curve of what a privkit :class:`~accountants.Ledger` promises.

    Built as the ledger's own ``pld`` (or ``rdp``) accountant builds epsilon: the dp-accounting
    events of each client are composed by that accountant, privkit's (epsilon, delta)-only events
    add by basic composition (``delta(eps) = delta_T(eps - eps_fixed) + delta_fixed``), and the
    worst client's delta is taken at every epsilon.  A non-private event gives the curve f = 0.

    Parameters
    ----------
    ledger : accountants.Ledger
    client : optional client id (default: every client, worst case at each epsilon).
    labels : optional labels to restrict to (as in :meth:`Ledger.epsilon`).
    accountant : {"pld", "rdp"}
        ``rdp`` is for events the PLD accountant cannot handle (sampling without replacement).
    """
    from accountants import ledger as _ledger

    check_choice(accountant, "accountant", ("pld", "rdp"))
    max_points = check_int(max_points, "max_points", minimum=2)
    source = "the ledger's " + ("PLD" if accountant == "pld" else "RDP profile")
    parts = []
    for key, entries in ledger._selected(client, labels).items():
        split = _ledger._split(entries, key)
        if split.nonprivate:
            return ProfileCurve.no_privacy(
                source + " (non-private: " + "; ".join(split.nonprivate) + ")"
            )
        tight = None
        if split.units:
            acc = _ledger._composed(
                accountant,
                split.units,
                split.neighbouring or "add_remove",
                ledger.value_discretization_interval,
            )
            tight = (
                _pld_delta_fn(acc._pld)
                if accountant == "pld"
                else np.vectorize(
                    lambda e, a=acc: float(a.get_delta(float(e))), otypes=[np.float64]
                )
            )
        parts.append((split.fixed_epsilon, split.fixed_delta, tight))

    def delta_fn(eps: np.ndarray) -> np.ndarray:
        eps = np.asarray(eps, dtype=np.float64)
        worst = np.zeros_like(eps)
        for fixed_eps, fixed_delta, tight in parts:
            free = eps - fixed_eps
            d = np.full_like(eps, 1.0)
            ok = free >= 0
            d[ok] = fixed_delta + (tight(free[ok]) if tight is not None else 0.0)
            worst = np.maximum(worst, np.minimum(d, 1.0))
        return worst

    step = ledger.value_discretization_interval if accountant == "pld" else 1e-3
    points = max_points if accountant == "pld" else min(max_points, 2000)
    eps = _grid(delta_fn, step, points)
    return ProfileCurve(eps, delta_fn(eps), source)


def curve_from_callable(
    fn: Callable, *, source: str = "a user-supplied trade-off curve", points: int = 8192
) -> ProfileCurve:
    """A :class:`ProfileCurve` no stronger than a user's trade-off function ``fn: FPR -> FNR``.

    ``fn`` is evaluated on a grid ``a_0 = 0 < a_1 < ... < a_n = 1`` (half log-spaced towards 0,
    half evenly spaced); as it
    is non-increasing, ``f(a) >= f(a_{k+1})`` on ``(a_k, a_{k+1}]``, which gives an upper bound on
    the profile ``delta(eps) = sup_a 1 - f(a) - e^eps a``.  The envelope built from it is the
    symmetrised convex minorant of that step function: never above ``fn`` where ``fn`` is a
    symmetric trade-off function.
    """
    points = check_int(points, "points", minimum=16)
    grid = np.unique(
        np.r_[np.geomspace(1e-12, 1.0, points // 2), np.linspace(0.0, 1.0, points // 2)]
    )
    f = np.asarray(fn(grid), dtype=np.float64)
    if f.shape != grid.shape or np.any(~np.isfinite(f)) or np.any((f < 0) | (f > 1)):
        raise ValueError(
            "curve must map an array of FPRs to FNRs in [0, 1] of the same shape; "
            f"found shape {f.shape} with range [{np.nanmin(f)}, {np.nanmax(f)}]"
        )
    if np.any(np.diff(f) > 1e-12):
        raise ValueError(
            f"curve must be non-increasing; found an increase of {np.diff(f).max():.3g}"
        )
    f = np.minimum(f, 1.0 - grid)
    left, right_f = grid[:-1], f[1:]

    def delta_fn(eps: np.ndarray) -> np.ndarray:
        out = np.empty(eps.shape)
        for lo in range(0, eps.size, 256):  # chunks keep the (eps x grid) block small
            e = np.exp(eps[lo : lo + 256])[:, None]
            out[lo : lo + 256] = np.max(1.0 - right_f[None, :] - e * left[None, :], axis=1)
        return np.maximum(out, 1.0 - f[0])

    eps = _grid(delta_fn, 1e-3, 4000)
    return ProfileCurve(eps, delta_fn(eps), source)


# ------------------------------------------------------------------------------------ families


@dataclass(frozen=True)
class CurveFamily:
    """Trade-off curves indexed by epsilon, pointwise non-increasing in epsilon.

    ``kind`` is ``"generic"`` (f_{eps, delta}), ``"gaussian"`` (the Gaussian mechanism that is
    (eps, delta)-DP) or ``"profile"``: ``base`` with every epsilon of its privacy profile moved by
    ``eps - anchor``, where ``anchor`` is the epsilon the base curve is said to have at ``delta``
    (default: its own, :meth:`ProfileCurve.epsilon`).  Anchoring at a ledger's accounted epsilon
    makes the member at that epsilon the ledger's curve itself.
    """

    kind: str
    delta: float
    base: ProfileCurve | None = None
    anchor: float | None = None

    def __post_init__(self) -> None:
        check_choice(self.kind, "kind", ("generic", "gaussian", "profile"))
        if self.kind == "gaussian":
            check_open_unit(self.delta, "delta")
        if self.kind == "profile" and self.base is None:
            raise ValueError("a profile family needs its base ProfileCurve; found None")
        if self.anchor is not None:
            check_nonnegative(self.anchor, "anchor", allow_inf=True)

    @property
    def reference_epsilon(self) -> float | None:
        """The epsilon at which the member is the base curve itself (profile families only)."""
        if self.kind != "profile":
            return None
        return self._reference()

    @property
    def _profile(self) -> ProfileCurve:
        """The base curve of a profile family (its presence is checked when the family is made)."""
        if self.base is None:
            raise ValueError(f"a {self.kind} family has no base ProfileCurve")
        return self.base

    def _reference(self) -> float:
        return self.anchor if self.anchor is not None else self._profile.epsilon(self.delta)

    def anchored(self, epsilon: float | None) -> CurveFamily:
        """This family with a profile base anchored at ``epsilon`` (other kinds: unchanged)."""
        if self.kind != "profile" or epsilon is None:
            return self
        return CurveFamily(self.kind, self.delta, self.base, float(epsilon))

    def fnr(self, fpr, epsilon) -> np.ndarray:
        """FNR floor of the member at ``epsilon`` for each ``fpr`` (broadcast)."""
        return self.members(epsilon)(fpr)

    def members(self, epsilon) -> Callable[[np.ndarray], np.ndarray]:
        """``fpr -> FNR`` of the members at an array of epsilons (parameters computed once).

        The returned function broadcasts ``fpr`` against ``epsilon``; the one-run analysis calls
        it once per step of its recursion with one FPR per epsilon.
        """
        eps = np.asarray(epsilon, dtype=np.float64)
        if np.any(np.isnan(eps)) or np.any(eps < 0):
            raise ValueError(f"epsilon must be >= 0; found {np.nanmin(eps)!r}")
        if self.kind == "generic":
            return lambda fpr: _generic(_fpr(fpr), eps, self.delta)
        if self.kind == "gaussian":
            mu = _mu_lanes(eps, self.delta)
            return lambda fpr: _gaussian(_fpr(fpr), mu)
        ref = self._reference()
        if math.isinf(ref):
            return lambda fpr: np.zeros(np.broadcast_shapes(np.shape(fpr), eps.shape))
        return self._profile._shifted_fn(eps - ref)

    def member(self, epsilon: float) -> TradeoffCurve:
        """The member at ``epsilon`` as a curve object."""
        epsilon = check_nonnegative(epsilon, "epsilon")
        if self.kind == "generic":
            return GenericCurve(epsilon, self.delta)
        if self.kind == "gaussian":
            return GaussianCurve(_mu(epsilon, self.delta), epsilon, self.delta)
        return _Shifted(self, epsilon)

    def claim(self, epsilon: float) -> str:
        """The claim the member at ``epsilon`` states, in words."""
        if self.kind != "profile":
            return self.member(epsilon).claim
        shift = epsilon - self._reference()
        if math.isclose(shift, 0.0, abs_tol=1e-12):
            return self._profile.claim
        return (
            f"as private as {self._profile.source} with every epsilon of its privacy profile "
            f"{'raised' if shift > 0 else 'lowered'} by {abs(shift):.4g}"
        )

    @property
    def description(self) -> str:
        """Which claim the family's members test, in words (for reports)."""
        if self.kind == "generic":
            return "(eps, delta)-DP"
        if self.kind == "gaussian":
            return "as private as the Gaussian mechanism at (eps, delta)"
        return self._profile.claim


@dataclass(frozen=True)
class _Shifted(TradeoffCurve):
    """A member of a profile family, as a curve object."""

    fam: CurveFamily
    epsilon: float

    def __call__(self, fpr) -> np.ndarray:
        return self.fam.fnr(fpr, self.epsilon)

    @property
    def claim(self) -> str:
        return self.fam.claim(self.epsilon)

    def family(self, delta: float) -> CurveFamily:
        return self.fam


def curve_family(curve, delta: float) -> CurveFamily:
    """The family an audit searches for ``curve``.

    ``curve`` is ``"generic"`` (the bare (eps, delta)-DP claim), ``"gaussian"`` (the Gaussian
    mechanism at (eps, delta)), a :class:`TradeoffCurve` (e.g. :func:`ledger_curve`: its own
    family), or any callable FPR -> FNR (:func:`curve_from_callable`, then shifted in epsilon).
    """
    if isinstance(curve, str):
        check_choice(curve, "curve", ("generic", "gaussian"))
        return CurveFamily(curve, _check_delta(delta))
    if isinstance(curve, CurveFamily):
        return curve
    if isinstance(curve, TradeoffCurve):
        return curve.family(delta)
    if callable(curve):
        return curve_from_callable(curve).family(delta)
    raise ValueError(
        f"curve must be 'generic', 'gaussian', a TradeoffCurve or a callable; found {curve!r}"
    )
