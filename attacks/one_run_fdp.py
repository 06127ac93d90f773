"""One-run audits analysed against a trade-off curve (Mahloujifar, Melis & Chaudhuri 2024).

Setting as in :mod:`attacks.one_run`: m audit points, each included by an independent fair coin;
the auditor guesses the coin of r of them (either sign) and v guesses are right.  "Auditing
f-Differential Privacy in One Run" bounds the chance of v or more right guesses for *every*
mechanism that is f-DP with respect to each audit point, by a recursion on the curve's inverse
blow-up ``B^-1(y) = inf{x : 1 - f(x) >= y}`` (their Algorithm "audit_rh_with_cap", two symbols)::

    r_v = beta v / m,  h_v = beta (r - v) / m
    for i = v-1, ..., 0:   h_i = max(h_{i+1}, B^-1(r_{i+1}))
                           r_i = min(r_{i+1} + i / (r - i) (h_i - h_{i+1}), 1)
    reject "M is f-DP" at level beta  iff  r_0 + h_0 > r / m

Given a family of curves indexed by epsilon and pointwise non-increasing in it
(:class:`accountants.tradeoff.CurveFamily`), rejection is monotone in epsilon, and the result is
the largest epsilon whose curve is rejected at confidence ``1 - beta``.

**Which claim is tested.** The bound is only as valid as the curve is true of the mechanism:

* ``curve="generic"`` tests "(eps, delta)-DP" itself (valid for every (eps, delta)-DP mechanism;
  a little above Steinke et al.'s bound at delta > 0, a little below it at delta = 0);
* ``curve="gaussian"`` tests "as private as the Gaussian mechanism at (eps, delta)" -- much
  stronger (1000 of 1000 right at delta 1e-5: 12.3 against 5.8), and wrong for mechanisms that are
  (eps, delta)-DP but not Gaussian: on randomized response, which is exactly eps-DP, it reports a
  "violation" in most runs (see tests/attacks/test_one_run_fdp.py);
* a ledger's curve (:func:`accountants.tradeoff.ledger_curve`) tests "as private as the ledger
  says"; its family shifts the ledger's privacy profile in epsilon, so the bound exceeds the
  ledger's own epsilon exactly when the ledger's curve is rejected.

jax_privacy 2.2's ``epsilon_one_run_fdp`` runs the same recursion with the Gaussian curve only;
this module agrees with it (12.335 for 1000 of 1000 at delta 1e-5).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import numpy as np
from scipy import stats

from accountants.tradeoff import CurveFamily, curve_family

__all__ = [
    "FdpBound",
    "fdp_detectable_epsilon",
    "fdp_epsilon_lower_bound",
    "fdp_rejection_threshold",
    "fdp_rejects",
    "ideal_precision",
    "one_run_fdp",
]

_LANES = 16
# ideal_precision's threshold search on log FPR, over [log 1e-300, 0]: each round tries
# _CANDIDATES points per lane, so _ROUNDS rounds shrink the bracket 64^9-fold, to 3e-14 in log FPR,
# which bounds the result's relative error (the ROC 1 - f is concave through the origin)
_LOG_FPR_MIN = math.log(1e-300)
_CANDIDATES = 63
_ROUNDS = 9


def _check_counts(m: int, r: int, v: int) -> None:
    for name, x in (("m", m), ("r", r), ("v", v)):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise ValueError(f"{name} must be an integer; found {x!r}")
    if m < 1 or not 0 <= v <= r <= m:
        raise ValueError(f"need m >= 1 and 0 <= v <= r <= m; found m={m}, r={r}, v={v}")


def _check_beta(beta: float) -> float:
    if not 0 < beta < 1:
        raise ValueError(f"beta must be in (0, 1); found {beta!r}")
    return float(beta)


def fdp_rejects(
    m: int, r: int, v: int, family: CurveFamily, epsilons, *, beta: float = 0.05
) -> np.ndarray:
    """For each epsilon: is "M satisfies the family's curve at epsilon" rejected at level beta?

    Vectorised over ``epsilons`` (one lane each); the recursion stops as soon as no lane moves
    (once ``h`` is unchanged, neither ``h`` nor ``r`` can change again).
    """
    _check_counts(m, r, v)
    beta = _check_beta(beta)
    eps = np.atleast_1d(np.asarray(epsilons, dtype=np.float64))
    if v == 0:
        return np.zeros(eps.shape, dtype=bool)
    member = family.members(eps)
    rr = np.full(eps.shape, beta * v / m)
    h = np.full(eps.shape, beta * (r - v) / m)
    for i in range(v - 1, -1, -1):
        # inverse blow-up of a symmetric curve: B^-1(y) = f(1 - y)
        h_new = np.maximum(h, member(1.0 - rr))
        if (h_new == h).all():
            break
        rr = np.minimum(rr + (i / (r - i)) * (h_new - h), 1.0)
        h = h_new
    return rr + h > r / m


def fdp_rejection_threshold(
    m: int, r: int, epsilon: float, *, delta: float, curve="generic", beta: float = 0.05
) -> int:
    """Smallest number of right guesses (out of r) that rejects the curve at ``epsilon``.

    ``r + 1`` when even r right guesses do not.  Rejection is monotone in the number of right
    guesses, so this is a binary search.  With it, the chance of a rejection is a binomial tail
    whenever each guess is right independently with a known probability (randomized response:
    ``e^eps / (1 + e^eps)``), which gives exact false-violation rates and detection rates.
    """
    family = curve_family(curve, delta)
    _check_counts(m, r, 0)
    lo, hi = 0, r + 1  # answer in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if fdp_rejects(m, r, mid, family, [epsilon], beta=beta)[0]:
            hi = mid
        else:
            lo = mid + 1
    return lo


def fdp_epsilon_lower_bound(
    m: int,
    r: int,
    v: int,
    *,
    delta: float,
    curve="generic",
    beta: float = 0.05,
    tol: float = 1e-4,
    eps_max: float = 100.0,
) -> float:
    """Largest epsilon whose curve the outcome (m, r, v) rejects at confidence ``1 - beta``.

    Parameters
    ----------
    m, r, v : audit points, guesses, right guesses (r fixed before the coins are looked at).
    delta : delta of the claims (the family's own delta for a GenericCurve/GaussianCurve object).
    curve : "generic" | "gaussian" | TradeoffCurve | CurveFamily | callable FPR -> FNR
        See :func:`accountants.tradeoff.curve_family`.
    beta : 1 - confidence.
    tol : width of the final bracket; the returned value is its (rejected) lower end.
    eps_max : returned when even this epsilon is rejected.

    Returns
    -------
    float
        0.0 when no epsilon is rejected.  Only epsilons actually tested and rejected are returned,
        so the search never overstates the bound.
    """
    family = curve_family(curve, delta)
    beta = _check_beta(beta)
    _check_counts(m, r, v)
    *_, (lo, _) = _bound_brackets(m, r, v, family, beta, tol, eps_max)
    return lo


def _bound_brackets(
    m: int, r: int, v: int, family: CurveFamily, beta: float, tol: float, eps_max: float
) -> Iterator[tuple[float, float]]:
    """The search of :func:`fdp_epsilon_lower_bound`, one bracket ``(lo, hi)`` a round: ``lo``
    tested and rejected, ``hi`` tested and kept, each inside the one before; the last one's ``lo``
    is the bound.  ``(0, 0)`` when epsilon 0 is kept, ``(eps_max, inf)`` when eps_max is rejected.
    """
    # geometric first round (bounds near 0 and near eps_max alike), then linear refinement
    grid = np.r_[0.0, np.geomspace(min(0.01, eps_max / 2), eps_max, _LANES - 1)]
    while True:
        rej = fdp_rejects(m, r, v, family, grid, beta=beta)
        if not rej[0]:  # lane 0: epsilon 0 in the first round, a rejected lo in later ones
            yield 0.0, 0.0
            return
        first_kept = int(np.argmin(rej)) if not rej.all() else grid.size
        if first_kept == grid.size:
            yield float(grid[-1]), math.inf
            return
        lo, hi = grid[first_kept - 1], grid[first_kept]
        yield float(lo), float(hi)
        if hi - lo <= tol:
            return
        grid = np.linspace(lo, hi, _LANES + 1)


def _bound_exceeds(m: int, r: int, v: int, family: CurveFamily, beta: float, target: float) -> bool:
    """``fdp_epsilon_lower_bound(m, r, v) > target`` at its default tol and eps_max, decided by the
    first bracket of its search that lies on one side of ``target`` (the bound stays in each)."""
    for lo, hi in _bound_brackets(m, r, v, family, beta, 1e-4, 100.0):
        if lo > target or hi <= target:
            return lo > target
    return False  # the bound is the last lo, and lo <= target


def ideal_precision(family: CurveFamily, epsilon: float, fraction: float) -> float:
    """Share of right guesses when the member at ``epsilon`` is met with equality and the auditor
    guesses "in" on a ``fraction`` of the audit points (half of them included).

    The most favourable mechanism the member allows releases, per audit point, the statistic of
    the optimal test between its two output distributions, whose ROC is ``1 - f``.  Guessing "in"
    above a threshold with false-positive rate a flags ``(a + 1 - f(a)) / 2`` of the points, of which
    ``(1 - f(a)) / 2`` are right; ``a`` solves ``(a + 1 - f(a)) / 2 = fraction``.  By symmetry the
    same share holds for "out" guesses.  For the pure eps-DP curve this is e^eps / (1 + e^eps):
    randomized response.
    """
    return float(_ideal_precisions(family, np.array([float(epsilon)]), float(fraction))[0])


def _ideal_precisions(
    family: CurveFamily, epsilons: np.ndarray, fractions: np.ndarray | float
) -> np.ndarray:
    """:func:`ideal_precision` for many lanes at once: ``epsilons`` and ``fractions`` broadcast.

    ``a`` is searched on log a (the threshold's FPR can be astronomically small), with
    ``_CANDIDATES`` FPRs per lane in one call of the members per round rather than one bisection
    step per call; the result is the share at the largest FPR found with flagged < fraction.
    """
    eps, frac = np.broadcast_arrays(np.asarray(epsilons, dtype=np.float64), fractions)
    f = family.members(eps)
    flagged = lambda a: 0.5 * (a + 1.0 - f(a))
    lo, hi = np.full(eps.shape, _LOG_FPR_MIN), np.zeros(eps.shape)
    steps = np.arange(1, _CANDIDATES + 1).reshape((-1,) + (1,) * eps.ndim) / (_CANDIDATES + 1)
    for _ in range(_ROUNDS):
        # the bracket's ends around its candidates, ascending along axis 0 (lanes behind)
        points = np.concatenate([lo[None], lo + (hi - lo) * steps, hi[None]])
        # flagged is non-decreasing in a: the candidates below the fraction are a prefix
        below = np.sum(flagged(np.exp(points[1:-1])) < frac, axis=0, keepdims=True)
        lo = np.take_along_axis(points, below, 0)[0]
        hi = np.take_along_axis(points, below + 1, 0)[0]
    share = np.minimum(1.0, 0.5 * (1.0 - f(np.exp(lo))) / frac)
    # the curve's mass at FPR 0 alone fills the guesses: all right
    return np.where(flagged(np.zeros(eps.shape)) >= frac, 1.0, share)


def fdp_detectable_epsilon(
    m: int,
    k_pos: int,
    k_neg: int,
    *,
    delta: float,
    curve="generic",
    beta: float = 0.05,
    target: float = 0.0,
    eps_max: float = 100.0,
) -> float:
    """Smallest epsilon whose most favourable mechanism (:func:`ideal_precision`) makes this audit's
    f-DP bound exceed ``target`` at least half the time; ``inf`` if no outcome can.

    ``v*`` is the fewest right guesses (of ``k_pos + k_neg``) whose bound exceeds ``target``; the
    right guesses are modelled as ``Bin(k_pos, p) + Bin(k_neg, p)`` with ``p`` the ideal
    precision of each side, and the answer is where their median reaches ``v*`` (to 1e-4, searched
    on lanes: ``p`` grows with epsilon).  Real attacks guess worse, so an audit never detects less
    than this says.
    """
    family = curve_family(curve, delta)
    r = k_pos + k_neg
    _check_counts(m, r, 0)
    beta = _check_beta(beta)
    exceeds = lambda v: _bound_exceeds(m, r, v, family, beta, target)
    if r == 0 or not exceeds(r):
        return math.inf
    lo, hi = -1, r  # bound(lo) <= target < bound(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if mid >= 0 and exceeds(mid) else (mid, hi)
    v_star = hi

    # the median of the right guesses reaches v* from some epsilon on (p grows with epsilon):
    # 16 intervals a round, whose points over [0, 100] are the very ones a bisection visits
    grid = np.linspace(0.0, eps_max, _LANES + 1)
    reached = _median_reaches(family, grid, m, (k_pos, k_neg), v_star)
    if not reached[-1]:
        return math.inf
    if reached[0]:
        return 0.0
    while True:
        first = int(np.argmax(reached))  # the first lane that reaches v*
        lo, hi = grid[first - 1], grid[first]
        if hi - lo <= 1e-4:
            return float(hi)
        grid = np.linspace(lo, hi, _LANES + 1)
        reached = _median_reaches(family, grid, m, (k_pos, k_neg), v_star)
        reached[0], reached[-1] = False, True  # the bracket's ends, decided the round before


def _median_reaches(
    family: CurveFamily, epsilons: np.ndarray, m: int, ks: tuple[int, ...], v_star: int
) -> np.ndarray:
    """Per epsilon: ``P[sum_j Bin(ks[j], p_j) >= v_star] >= 1/2``, with ``p_j`` the ideal precision
    of guessing ``ks[j]`` of the m points (a side with no guesses adds nothing)."""
    ks = tuple(k for k in ks if k)
    p = _ideal_precisions(family, np.asarray(epsilons)[:, None], np.array(ks) / m)
    pmf = np.ones((len(epsilons), 1))
    for j, k in enumerate(ks):
        side = stats.binom.pmf(np.arange(k + 1), k, p[:, j, None])
        pmf = np.array([np.convolve(a, b) for a, b in zip(pmf, side)])
    return pmf[:, v_star:].sum(axis=1) >= 0.5


@dataclass
class FdpBound:
    """Outcome of the f-DP analysis of a one-run audit."""

    epsilon: float
    ceiling: float
    curve: str
    tests: str
    claim_at_bound: str
    confidence: float
    delta: float
    m: int
    guesses: int
    correct: int
    reference_epsilon: float | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["reference_epsilon"] is not None and math.isinf(d["reference_epsilon"]):
            d["reference_epsilon"] = None
        return d


def one_run_fdp(
    m: int, r: int, v: int, *, delta: float, curve="generic", beta: float = 0.05, tol: float = 1e-4
) -> FdpBound:
    """The f-DP bound of an outcome with its ceiling (every guess right) and the claim it tests.

    ``tests`` says which claim a bound above a given epsilon refutes: "(eps, delta)-DP",
    "as private as the Gaussian mechanism at (eps, delta)", or "as private as the ledger's PLD".
    """
    family = curve_family(curve, delta)
    eps = fdp_epsilon_lower_bound(m, r, v, delta=delta, curve=family, beta=beta, tol=tol)
    ceiling = fdp_epsilon_lower_bound(m, r, r, delta=delta, curve=family, beta=beta, tol=tol)
    notes = [
        "f-DP analysis of a one-run audit (Mahloujifar, Melis & Chaudhuri 2024); "
        "the guesses were fixed before the coins were looked at"
    ]
    if family.kind == "gaussian":
        notes.append(
            "valid only if the mechanism is at least as private as a Gaussian mechanism; "
            "for a bare (eps, delta)-DP claim use curve='generic'"
        )
    return FdpBound(
        epsilon=eps,
        ceiling=ceiling,
        curve=family.kind,
        tests=family.description,
        claim_at_bound=family.claim(eps),
        confidence=1 - beta,
        delta=family.delta,
        m=m,
        guesses=r,
        correct=v,
        reference_epsilon=family.reference_epsilon,
        notes=notes,
    )
