"""Each method's attack ROCs against its ledger's trade-off curve, from report.json alone.

The audit stores the audited run's ledger as points of its trade-off curve (FPR -> smallest FNR,
:class:`~reports.schema.TradeoffPoints`).  Between two stored FPRs ``a_k < x <= a_{k+1}`` the
curve is read as ``f(a_{k+1})``: a trade-off curve is non-increasing, so that is at most the true
``f(x)``, the drawn forbidden region is never larger than the ledger's, and a point reported inside
it is inside the ledger's own region.

The numbers and sentences live here (no matplotlib); the figure drawn from them is
:func:`reports.plots.ledger_roc_figure`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from reports.schema import MethodReport, TradeoffPoints


def forbidden_roc_points(
    fpr: Sequence[float] | np.ndarray,
    tpr: Sequence[float] | np.ndarray,
    curve: Callable,
    tol: float = 0.0,
) -> np.ndarray:
    """Indices of the ROC points a privacy claim forbids: ``TPR > 1 - f(FPR) + tol``.

    ``curve`` is the claim's trade-off function ``f`` (FPR -> smallest FNR, vectorised), e.g.
    ``accountants.ledger_curve(ledger)``.  A point listed here is an attack doing better than the
    claim allows *on these data*; whether that is a statistically significant violation is the
    audit's lower bound's question, not this one's.
    """
    x = np.asarray(fpr, dtype=np.float64)
    y = np.asarray(tpr, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"fpr and tpr must be 1-D of equal length; found {x.shape} and {y.shape}")
    if np.any((x < 0) | (x > 1) | (y < 0) | (y > 1)) or np.any(np.isnan(x) | np.isnan(y)):
        raise ValueError("fpr and tpr must lie in [0, 1]; found values outside")
    bound = 1.0 - np.asarray(curve(x), dtype=np.float64)
    return np.nonzero(y > bound + tol)[0]


def stored_curve(points: TradeoffPoints) -> Callable[[np.ndarray], np.ndarray]:
    """FPR -> FNR floor read from the stored points (never above the curve they sample)."""
    a = np.asarray(points.fpr, dtype=np.float64)
    f = np.asarray(points.fnr, dtype=np.float64)
    if a.size < 2 or a.size != f.size or a[-1] < 1.0:
        raise ValueError(
            f"tradeoff_curve needs matching fpr/fnr lists reaching FPR 1; found {a.size} "
            f"and {f.size} points up to FPR {a[-1] if a.size else None}"
        )

    def fn(x) -> np.ndarray:
        i = np.searchsorted(a, np.clip(np.asarray(x, dtype=np.float64), 0.0, 1.0), side="left")
        return f[np.minimum(i, a.size - 1)]

    return fn


def rocs_of(m: MethodReport) -> dict[str, tuple[list[float], list[float]]]:
    if m.audit is None:
        return {}
    return {
        n: (a.roc.fpr, a.roc.tpr)
        for n, a in m.audit.attacks.items()
        if not a.error
        and a.roc is not None
        and len(a.roc.fpr) > 1
        and len(a.roc.fpr) == len(a.roc.tpr)
    }


def forbidden_counts(m: MethodReport) -> dict[str, int] | None:
    """Attack -> number of its ROC points inside the region the ledger forbids (None: no curve)."""
    if m.audit is None or m.audit.tradeoff_curve is None:
        return None
    curve = stored_curve(m.audit.tradeoff_curve)
    return {n: int(forbidden_roc_points(f, t, curve).size) for n, (f, t) in rocs_of(m).items()}


def roc_claim_sentence(m: MethodReport) -> str | None:
    """Whether any ROC point lies in the region the ledger forbids, in words (None: no curve)."""
    counts = forbidden_counts(m)
    if not counts or m.audit is None or m.audit.tradeoff_curve is None:
        return None
    tc = m.audit.tradeoff_curve
    eps = (
        f" (accounted epsilon {tc.accounted_epsilon:.4g} at delta {tc.delta:g})"
        if (tc.accounted_epsilon is not None and tc.delta is not None)
        else ""
    )
    bad = {n: c for n, c in counts.items() if c}
    if not bad:
        return (
            f"No ROC point of the {len(counts)} attacks lies in the region the ledger's trade-off "
            f"curve forbids{eps}."
        )
    listed = ", ".join(f"{n} ({c} points)" for n, c in sorted(bad.items()))
    return (
        f"ROC points lie in the region the ledger's trade-off curve forbids{eps}: {listed}. On these "
        "audited records an attack did better than the ledger allows; whether that is a "
        "statistically significant violation is the ledger claim's lower bound's question."
    )
