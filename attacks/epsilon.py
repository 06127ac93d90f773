"""Empirical epsilon lower bounds from independent IN/OUT trials (Clopper-Pearson), and their ceilings.

Maths (see notes/auditing.md §4). (epsilon, delta)-DP implies, for every test "member iff
score >= t" (Kairouz et al. 2015)::

    FPR + e^eps * FNR >= 1 - delta      and      e^eps * FPR + FNR >= 1 - delta

so with one-sided Clopper-Pearson upper bounds FPR+ and FNR+ that hold simultaneously with
probability >= 1 - alpha::

    eps >= max( ln((1 - delta - FNR+) / FPR+),  ln((1 - delta - FPR+) / FNR+) ).

Multiplicity. The threshold is chosen after looking at the scores, so the bounds must hold for
every threshold at once. ``method="bonferroni"`` uses the order-statistic form of the union bound:
whatever data-dependent threshold is used, the FPR over all thresholds with FP = k false positives
is at most the tail mass above the (k+1)-th largest non-member score, which is Beta(k+1, n0-k)
distributed, so ``P[FPR > U(k, n0, a)] <= a`` for each k and a union over the n0 + 1 possible
counts costs ``a = alpha / (2 (n0 + 1))`` (likewise for FNR with n1). This is never looser than a
union over every distinct score (jax_privacy's ``epsilon_lower_bound``). ``method="heldout"``
chooses the threshold on a random half of the trials and bounds it on the other half with
``a = alpha / 2``.

Ties. A threshold admits a whole group of tied scores at once (thresholds run over the distinct
scores), so no tie is ever counted as a correct decision because of where it sits in the input:
for ``bonferroni`` and ``single`` the result does not depend on the input order at all, for
``heldout`` only through the random split (whose distribution does not).

The formulas need *independent trials* (independent training runs, one IN/OUT trial each). The
records scored against one trained model are not: for them use :func:`attacks.audit_scores`
(the one-run bound of Steinke, Nasr & Jagielski 2023), which is what privkit's verdicts rest on.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np
from scipy import stats

from attacks.metrics import _validate


def _check_alpha_delta(alpha: float, delta: float) -> None:
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1); found {alpha}")
    if not 0 <= delta < 1:
        raise ValueError(f"delta must be in [0, 1); found {delta}")


def clopper_pearson_upper(k, n, a) -> np.ndarray:
    """One-sided Clopper-Pearson upper bound ``U(k, n, a)``: ``P[p > U] <= a`` for k ~ Bin(n, p).

    ``U = BetaInv(1 - a; k + 1, n - k)``, and 1 when ``k = n``. Vectorised over ``k``.
    """
    k = np.asarray(k, dtype=np.float64)
    n = np.broadcast_to(np.asarray(n, dtype=np.float64), k.shape)
    if np.any(k < 0) or np.any(k > n):
        raise ValueError(f"counts must be in [0, n]; found k={k.min()}..{k.max()}, n={n.max()}")
    out = np.ones_like(k)
    ok = k < n
    out[ok] = stats.beta.ppf(1 - a, k[ok] + 1, n[ok] - k[ok])
    return out


def clopper_pearson_interval(k: int, n: int, alpha: float = 0.05) -> tuple[float, float]:
    """Two-sided (1 - alpha) Clopper-Pearson interval for a binomial proportion ``k / n``."""
    if n < 1 or not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n and n >= 1; found k={k}, n={n}")
    lo = 0.0 if k == 0 else float(stats.beta.ppf(alpha / 2, k, n - k + 1))
    hi = 1.0 if k == n else float(stats.beta.ppf(1 - alpha / 2, k + 1, n - k))
    return lo, hi


def epsilon_from_rates(fpr_upper, fnr_upper, delta: float, two_sided: bool = True) -> np.ndarray:
    """``max(ln((1-delta-FNR+)/FPR+), ln((1-delta-FPR+)/FNR+))``, clipped at 0 (vectorised).

    ``two_sided=False`` keeps only the first term (the rule's direction fixed in advance).
    """
    fpr_u = np.asarray(fpr_upper, dtype=np.float64)
    fnr_u = np.asarray(fnr_upper, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        t1 = np.where(
            (1 - delta - fnr_u > 0) & (fpr_u > 0),
            np.log(np.maximum(1 - delta - fnr_u, 1e-300) / fpr_u),
            0.0,
        )
        if not two_sided:
            return np.maximum(t1, 0.0)
        t2 = np.where(
            (1 - delta - fpr_u > 0) & (fnr_u > 0),
            np.log(np.maximum(1 - delta - fpr_u, 1e-300) / fnr_u),
            0.0,
        )
    return np.maximum(np.maximum(t1, t2), 0.0)


@dataclass
class EpsilonBound:
    """An empirical epsilon lower bound and what it rests on."""

    epsilon: float
    ceiling: float
    confidence: float
    delta: float
    method: str
    n_members: int
    n_nonmembers: int
    threshold: float
    fpr_upper: float
    fnr_upper: float
    gdp_estimate: float
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _counts(
    s_in: np.ndarray, s_out: np.ndarray, thresholds: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """FP(t) = #{out >= t}, FN(t) = #{in < t} for each threshold (sorted search, O(n log n))."""
    so, si = np.sort(s_out), np.sort(s_in)
    fp = so.size - np.searchsorted(so, thresholds, side="left")
    fn = np.searchsorted(si, thresholds, side="left")
    return fp, fn


def epsilon_ceiling(
    n_members: int, n_nonmembers: int, delta: float, alpha: float = 0.05, method: str = "bonferroni"
) -> float:
    """The largest bound this procedure can print for ``n`` trials (a perfect attack, FP = FN = 0).

    With one fixed threshold (``method="single"``) and alpha = 0.05 this is ``ln((1-u)/u)``,
    ``u = 1 - (alpha/2)^(1/n)``: 3.28 for n = 100, 5.60 for 1 000 (notes §4).
    """
    _check_alpha_delta(alpha, delta)
    if method == "bonferroni":
        a_fp, a_fn = alpha / (2 * (n_nonmembers + 1)), alpha / (2 * (n_members + 1))
    elif method == "heldout":
        n_members, n_nonmembers = n_members - n_members // 2, n_nonmembers - n_nonmembers // 2
        a_fp = a_fn = alpha / 2
    elif method == "single":
        a_fp = a_fn = alpha / 2
    else:
        raise ValueError(f"method must be bonferroni, heldout or single; found {method!r}")
    fpr_u = clopper_pearson_upper(0, n_nonmembers, a_fp)
    fnr_u = clopper_pearson_upper(0, n_members, a_fn)
    return float(epsilon_from_rates(fpr_u, fnr_u, delta))


def gdp_epsilon_estimate(fpr_upper: float, fnr_upper: float, delta: float) -> float:
    """ESTIMATE (not a bound): epsilon of the Gaussian-DP curve through (FPR+, FNR+).

    ``mu = Phi^-1(1 - FPR+) - Phi^-1(FNR+)``, then solve
    ``delta = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)`` (Nasr et al. 2023). It
    extrapolates a trade-off curve the mechanism need not have; never report it as a bound.
    """
    from scipy.optimize import brentq

    mu = stats.norm.ppf(1 - fpr_upper) - stats.norm.ppf(fnr_upper)
    if not np.isfinite(mu) or mu <= 0:
        return 0.0

    def gap(eps: float) -> float:
        return (
            stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2)
        ) - delta

    if gap(0.0) <= 0:
        return 0.0
    hi = 1.0
    while gap(hi) > 0 and hi < 1e3:
        hi *= 2
    return float(brentq(gap, 0.0, hi))


def _best(s_in, s_out, delta, a_fp, a_fn, two_sided):
    thresholds = np.unique(np.r_[s_in, s_out, np.inf])
    fp, fn = _counts(s_in, s_out, thresholds)
    fpr_u = clopper_pearson_upper(fp, s_out.size, a_fp)
    fnr_u = clopper_pearson_upper(fn, s_in.size, a_fn)
    eps = epsilon_from_rates(fpr_u, fnr_u, delta, two_sided)
    i = int(np.argmax(eps))
    return float(eps[i]), float(thresholds[i]), float(fpr_u[i]), float(fnr_u[i])


def empirical_epsilon(
    scores: np.ndarray,
    membership: np.ndarray,
    *,
    delta: float,
    alpha: float = 0.05,
    method: str = "bonferroni",
    two_sided: bool = True,
    threshold: float | None = None,
    random_state: int = 0,
) -> EpsilonBound:
    """A (1 - alpha) lower bound on epsilon from scores of *independent* IN/OUT trials.

    Parameters
    ----------
    scores : one score per trial (higher = "member").
    membership : True for IN trials (trained with the target record), False for OUT trials.
    delta : the delta of the guarantee being tested (the accounted release's delta).
    alpha : 1 - confidence.
    method : ``"bonferroni"`` (every threshold examined, order-statistic union bound) or
        ``"heldout"`` (threshold chosen on a random half, bounded on the other half) or
        ``"single"`` (one ``threshold`` fixed before seeing the scores, no multiplicity cost).
    two_sided : also use the symmetric inequality (rule direction not fixed in advance is fine:
        both terms share the same simultaneous rate bounds).
    threshold : the pre-registered threshold (``method="single"`` only).
    random_state : seed of the held-out split.

    Returns
    -------
    EpsilonBound with the bound, the ceiling the trial counts allow, and a GDP *estimate*.
    """
    _check_alpha_delta(alpha, delta)
    s, m = _validate(scores, membership)
    s_in, s_out = s[m], s[~m]
    notes = ["trials are assumed to be independent training runs (IN/OUT)"]
    if method == "bonferroni":
        a_fp, a_fn = alpha / (2 * (s_out.size + 1)), alpha / (2 * (s_in.size + 1))
        eps, thr, fpr_u, fnr_u = _best(s_in, s_out, delta, a_fp, a_fn, two_sided)
        notes.append("union bound over every threshold (order statistics of FP and FN counts)")
    elif method == "heldout":
        if s_in.size < 2 or s_out.size < 2:
            raise ValueError(
                f"heldout needs >= 2 IN and OUT trials; found {s_in.size} and {s_out.size}"
            )
        rng = np.random.default_rng(random_state)
        pin, pout = rng.permutation(s_in.size), rng.permutation(s_out.size)
        hin, hout = pin[: s_in.size // 2], pout[: s_out.size // 2]
        ein, eout = pin[s_in.size // 2 :], pout[s_out.size // 2 :]
        _, thr, _, _ = _best(s_in[hin], s_out[hout], delta, alpha / 2, alpha / 2, two_sided)
        fp = int((s_out[eout] >= thr).sum())
        fn = int((s_in[ein] < thr).sum())
        fpr_u = float(clopper_pearson_upper(fp, eout.size, alpha / 2))
        fnr_u = float(clopper_pearson_upper(fn, ein.size, alpha / 2))
        eps = float(epsilon_from_rates(fpr_u, fnr_u, delta, two_sided))
        notes.append("threshold chosen on a random half of the trials, bounded on the other half")
    elif method == "single":
        if threshold is None:
            raise ValueError(
                "threshold must be given (fixed in advance) for method='single'; found None"
            )
        thr = float(threshold)
        fpr_u = float(clopper_pearson_upper(int((s_out >= thr).sum()), s_out.size, alpha / 2))
        fnr_u = float(clopper_pearson_upper(int((s_in < thr).sum()), s_in.size, alpha / 2))
        eps = float(epsilon_from_rates(fpr_u, fnr_u, delta, two_sided))
        notes.append(f"one threshold {thr:g} fixed in advance")
    else:
        raise ValueError(f"method must be bonferroni, heldout or single; found {method!r}")
    return EpsilonBound(
        epsilon=eps,
        ceiling=epsilon_ceiling(s_in.size, s_out.size, delta, alpha, method),
        confidence=1 - alpha,
        delta=delta,
        method=method,
        n_members=int(s_in.size),
        n_nonmembers=int(s_out.size),
        threshold=thr,
        fpr_upper=fpr_u,
        fnr_upper=fnr_u,
        gdp_estimate=gdp_epsilon_estimate(fpr_u, fnr_u, delta),
        notes=notes,
    )


# ------------------------------------------------------------------------------ scalar bounds
def advantage_upper_bound(epsilon: float, delta: float) -> float:
    """Largest membership advantage TPR - FPR that (epsilon, delta)-DP allows: (e^eps-1+2delta)/(e^eps+1)."""
    return (math.expm1(epsilon) + 2 * delta) / (math.exp(epsilon) + 1)


def balanced_accuracy_upper_bound(epsilon: float, delta: float) -> float:
    """Largest balanced accuracy that (epsilon, delta)-DP allows: (e^eps + delta) / (e^eps + 1)."""
    return (math.exp(epsilon) + delta) / (math.exp(epsilon) + 1)
