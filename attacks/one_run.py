"""Privacy auditing with one training run (Steinke, Nasr & Jagielski, NeurIPS 2023).

m canaries, each included independently with probability 1/2 (S_i in {+1, -1}). After training the
auditor guesses +1 on the k+ highest scores, -1 on the k- lowest, and abstains on the rest
(r = k+ + k- guesses, v correct). If the algorithm is (epsilon, delta)-DP then::

    P[V >= v] <= P[Bin(r, q) >= v] + 2 m delta max_{1<=i<=v} (1/i) P[v-i <= Bin(r, q) < v],
    q = e^eps / (1 + e^eps)

(the delta term as in the authors' code). The bound ``sup{eps : p(eps, delta) < beta}`` is found by
bisection (p increases with eps). k+ and k- must be fixed before the auditor looks at S; a grid of
(k+, k-) pairs is allowed only with a Bonferroni-corrected beta (:func:`one_run_epsilon_grid`).

Ties. Which records get a guess must never depend on the order the records are listed in (a
stable sort over records listed members first turns every member/non-member tie into a correct
guess: constant scores then "prove" epsilon 2.96). :func:`guess` breaks ties with a random key
drawn from the audit's seed. That keeps the theorem: its bound holds conditionally on the guess
vector T for any T computed from the algorithm's output and randomness independent of S, and the
tie-break key is such randomness. It is preferred to abstaining on tied groups across the k
boundary because abstention loses the power on discrete scores (randomised response scores are one
bit: the tied group straddling k holds half the records, and abstaining on it leaves no guess at
all), and because with random tie-breaking r = k+ + k- stays fixed before looking, so the ceiling
and the detectable epsilon are known in advance.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field

import numpy as np
from scipy import special


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """P-value of ``>= v`` correct guesses out of ``r`` under (epsilon, delta)-DP with m canaries."""
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m; found v={v}, r={r}, m={m}")
    if epsilon < 0:
        raise ValueError(f"epsilon must be >= 0; found {epsilon}")
    if not 0 <= delta <= 1:
        raise ValueError(f"delta must be in [0, 1]; found {delta}")
    q = 1.0 / (1.0 + math.exp(-epsilon))
    # scipy.special rather than scipy.stats.binom: the same numbers (tests pin them to 1e-9 against
    # the authors' loop) at a tenth of the cost; audits evaluate this thousands of times
    tail = 1.0 if v == 0 else float(special.bdtrc(v - 1, r, q))
    if delta == 0 or v == 0:
        return min(tail, 1.0)
    # cumulative P[v-i <= Bin < v] for i = 1..v, then max_i (1/i) * cumulative
    term = float(
        np.max(np.cumsum(_binom_pmf(np.arange(v - 1, -1, -1), r, q)) / np.arange(1, v + 1))
    )
    return min(tail + 2 * m * delta * term, 1.0)


def _binom_pmf(k: np.ndarray, r: int, q: float) -> np.ndarray:
    """Bin(r, q) pmf at the integers ``k`` (log-space, exact to ~1e-13 relative)."""
    if q >= 1.0:
        return (k == r).astype(np.float64)
    log = (
        special.gammaln(r + 1)
        - special.gammaln(k + 1)
        - special.gammaln(r - k + 1)
        + k * math.log(q)
        + (r - k) * math.log1p(-q)
    )
    return np.exp(log)


def epsilon_lower_bound(
    m: int,
    r: int,
    v: int,
    *,
    delta: float,
    beta: float = 0.05,
    tol: float = 1e-6,
    eps_max: float = 100.0,
) -> float:
    """``sup{eps : p_value(m, r, v, eps, delta) < beta}`` by bisection (0 if none)."""
    if not 0 < beta < 1:
        raise ValueError(f"beta must be in (0, 1); found {beta}")
    return _bound(int(m), int(r), int(v), float(delta), float(beta), float(tol), float(eps_max))


@functools.lru_cache(maxsize=8192)
def _bound(m: int, r: int, v: int, delta: float, beta: float, tol: float, eps_max: float) -> float:
    # cached: ceilings, detectable epsilons and repeated audits ask for the same (m, r, v) often
    if p_value(m, r, v, 0.0, delta) >= beta:
        return 0.0
    lo, hi = 0.0, 1.0
    while p_value(m, r, v, hi, delta) < beta:
        lo, hi = hi, 2 * hi
        if hi > eps_max:
            return float(eps_max)
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if p_value(m, r, v, mid, delta) < beta:
            lo = mid
        else:
            hi = mid
    return float(lo)


@dataclass
class OneRunResult:
    """Outcome of a one-run audit."""

    epsilon: float
    ceiling: float
    confidence: float
    delta: float
    m: int
    k_pos: int
    k_neg: int
    guesses: int
    correct: int
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _resolve_k(k: float, m: int, name: str) -> int:
    if isinstance(k, float) and 0 < k < 1:
        return max(1, round(k * m))
    if isinstance(k, (int, np.integer)) and 0 <= k <= m:
        return int(k)
    raise ValueError(f"{name} must be a count in [0, m] or a fraction in (0, 1); found {k}")


def guess(scores: np.ndarray, k_pos: int, k_neg: int, *, seed=0) -> np.ndarray:
    """+1 on the k_pos highest scores, -1 on the k_neg lowest, 0 elsewhere.

    Ties are broken by a uniform random key from ``seed`` (an int, a ``SeedSequence`` or a
    ``Generator``), never by position: the distribution of the guesses does not depend on the order
    of the input (see the module docstring for why this keeps the one-run theorem valid).
    """
    s = np.asarray(scores, dtype=np.float64)
    if k_pos + k_neg > s.size:
        raise ValueError(
            f"k_pos + k_neg must be <= number of canaries {s.size}; found {k_pos + k_neg}"
        )
    key = np.random.default_rng(seed).random(s.size)
    order = np.lexsort((key, -s))  # by score, highest first; ties in random order
    out = np.zeros(s.size, dtype=np.int8)
    out[order[:k_pos]] = 1
    if k_neg:
        out[order[s.size - k_neg :]] = -1
    return out


def one_run_audit(
    scores: np.ndarray,
    included: np.ndarray,
    *,
    delta: float,
    k_pos: float = 0.1,
    k_neg: float = 0.1,
    beta: float = 0.05,
    seed=0,
) -> OneRunResult:
    """One-run audit of m canaries with scores (higher = "included").

    Parameters
    ----------
    scores : (m,) score per canary.
    included : (m,) bool, which canaries were inserted (each independently with probability 1/2).
    delta : delta of the guarantee being tested.
    k_pos, k_neg : number (or fraction of m) of +1 / -1 guesses, fixed in advance.
    beta : 1 - confidence.
    seed : seed of the random tie-break (:func:`guess`); it must not depend on ``included``.
    """
    s = np.asarray(scores, dtype=np.float64).ravel()
    inc = np.asarray(included, dtype=bool).ravel()
    if s.shape != inc.shape:
        raise ValueError(
            f"scores and included must have the same length; found {s.size} and {inc.size}"
        )
    m = s.size
    kp, kn = _resolve_k(k_pos, m, "k_pos"), _resolve_k(k_neg, m, "k_neg")
    g = guess(s, kp, kn, seed=seed)
    r = int((g != 0).sum())
    v = int(((g == 1) & inc).sum() + ((g == -1) & ~inc).sum())
    return OneRunResult(
        epsilon=epsilon_lower_bound(m, r, v, delta=delta, beta=beta),
        ceiling=epsilon_lower_bound(m, r, r, delta=delta, beta=beta),
        confidence=1 - beta,
        delta=delta,
        m=m,
        k_pos=kp,
        k_neg=kn,
        guesses=r,
        correct=v,
        notes=["one-run audit (Steinke, Nasr & Jagielski 2023); k+/k- fixed in advance"],
    )


def one_run_epsilon_grid(
    scores: np.ndarray,
    included: np.ndarray,
    *,
    delta: float,
    grid: list[tuple[int, int]],
    beta: float = 0.05,
    seed=0,
) -> OneRunResult:
    """The best one-run bound over a (k+, k-) grid, each tested at ``beta / len(grid)`` (Bonferroni)."""
    if not grid:
        raise ValueError("grid must contain at least one (k_pos, k_neg) pair; found []")
    results = [
        one_run_audit(
            scores, included, delta=delta, k_pos=kp, k_neg=kn, beta=beta / len(grid), seed=seed
        )
        for kp, kn in grid
    ]
    best = max(results, key=lambda r: r.epsilon)
    best.confidence = 1 - beta
    best.ceiling = max(r.ceiling for r in results)
    best.notes = [f"best of {len(grid)} (k+, k-) pairs, Bonferroni-corrected beta/{len(grid)}"]
    return best
