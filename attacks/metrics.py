"""Membership-inference metrics from scores (higher score = "member").

ROC points, AUC, balanced accuracy, advantage, TPR at a fixed FPR (the largest TPR whose FPR is
``<=`` the level, read at the threshold that realises it: the ``<`` vs ``<=`` and "TPR read at a
lower realised FPR" bugs of peer tools are pinned by tests), and log-log ROC data.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LOW_FPR_LEVELS = (0.001, 0.01)


def _validate(scores: np.ndarray, membership: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    s = np.asarray(scores, dtype=np.float64).ravel()
    m = np.asarray(membership).ravel()
    if s.shape != m.shape:
        raise ValueError(
            f"scores and membership must have the same length; found {s.size} and {m.size}"
        )
    if not np.all(np.isfinite(s)):
        raise ValueError(
            f"scores must be finite; found {int((~np.isfinite(s)).sum())} non-finite values"
        )
    if m.dtype != bool:
        if not np.isin(m, (0, 1)).all():
            raise ValueError(
                f"membership must be boolean or 0/1; found values {np.unique(m)[:5].tolist()}"
            )
        m = m.astype(bool)
    if m.all() or (~m).all():
        raise ValueError(
            f"membership must contain both members and non-members; found "
            f"{int(m.sum())} members of {m.size}"
        )
    return s, m


def roc_points(
    scores: np.ndarray, membership: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All ROC points of the rule "member iff score >= t", t running over every distinct score.

    Returns
    -------
    fpr, tpr, thresholds : arrays of equal length, starting at (0, 0) for ``t = +inf`` and ending
        at (1, 1) for the smallest score. Ties are kept together (one point per distinct score).
    """
    s, m = _validate(scores, membership)
    order = np.argsort(-s, kind="mergesort")
    s_sorted, m_sorted = s[order], m[order]
    # the last index of each run of equal scores: a threshold admits the whole tie group
    last = np.r_[np.nonzero(np.diff(s_sorted))[0], s_sorted.size - 1]
    tp = np.cumsum(m_sorted)[last]
    fp = np.cumsum(~m_sorted)[last]
    fpr = np.r_[0.0, fp / (~m).sum()]
    tpr = np.r_[0.0, tp / m.sum()]
    thresholds = np.r_[np.inf, s_sorted[last]]
    return fpr, tpr, thresholds


def auc(scores: np.ndarray, membership: np.ndarray) -> float:
    """Area under the ROC curve (trapezoidal over the tie-grouped ROC; ties count one half)."""
    fpr, tpr, _ = roc_points(scores, membership)
    return float(np.trapezoid(tpr, fpr))


def tpr_at_fpr(scores: np.ndarray, membership: np.ndarray, level: float) -> float:
    """The largest TPR among thresholds whose realised FPR is ``<=`` ``level``.

    With ``level = 0`` this is the TPR at zero false positives (not "N/A").
    """
    if not 0 <= level <= 1:
        raise ValueError(f"level must be in [0, 1]; found {level}")
    fpr, tpr, _ = roc_points(scores, membership)
    ok = fpr <= level + 1e-15
    return float(tpr[ok].max())


def balanced_accuracy(scores: np.ndarray, membership: np.ndarray) -> float:
    """Best balanced accuracy ``max_t 1 - (FPR + FNR) / 2`` over thresholds (LiRA's definition)."""
    fpr, tpr, _ = roc_points(scores, membership)
    return float(np.max(1 - (fpr + (1 - tpr)) / 2))


def advantage(scores: np.ndarray, membership: np.ndarray) -> float:
    """Membership advantage ``max_t TPR - FPR`` (Yeom et al.), over thresholds, >= 0."""
    fpr, tpr, _ = roc_points(scores, membership)
    return float(np.max(tpr - fpr))


def loglog_roc(scores: np.ndarray, membership: np.ndarray, floor: float | None = None) -> dict:
    """ROC data for a log-log plot: points with FPR and TPR clipped below at ``floor``.

    ``floor`` defaults to ``1 / (2 * n_nonmembers)`` (half of the smallest non-zero FPR), so the
    zero-FPR points stay visible on a log axis and the plot states its own resolution.
    """
    s, m = _validate(scores, membership)
    fpr, tpr, _ = roc_points(s, m)
    lo = floor if floor is not None else 0.5 / (~m).sum()
    return {"fpr": np.maximum(fpr, lo).tolist(), "tpr": np.maximum(tpr, lo).tolist(), "floor": lo}


def downsample_roc(fpr: np.ndarray, tpr: np.ndarray, max_points: int = 400) -> tuple[list, list]:
    """At most ``max_points`` ROC points (log-spaced in FPR so low-FPR detail survives) for JSON."""
    fpr, tpr = np.asarray(fpr), np.asarray(tpr)
    if fpr.size <= max_points:
        return fpr.tolist(), tpr.tolist()
    pos = fpr[fpr > 0]
    grid = np.unique(np.r_[0.0, np.geomspace(pos.min(), 1.0, max_points - 2), 1.0])
    # for each grid FPR, the ROC point with the largest TPR at FPR <= grid value
    idx = np.searchsorted(fpr, grid, side="right") - 1
    keep = np.unique(np.r_[0, idx, fpr.size - 1])
    return fpr[keep].tolist(), tpr[keep].tolist()


@dataclass(frozen=True)
class RocSummary:
    """Scalar metrics of one attack on one labelled set of scores."""

    auc: float
    balanced_accuracy: float
    advantage: float
    tpr_at_fpr: dict[str, float]
    fpr: list[float]
    tpr: list[float]
    n_members: int
    n_nonmembers: int

    def to_dict(self) -> dict:
        return {
            "auc": self.auc,
            "balanced_accuracy": self.balanced_accuracy,
            "advantage": self.advantage,
            "tpr_at_fpr": self.tpr_at_fpr,
            "roc": {"fpr": self.fpr, "tpr": self.tpr},
            "n_members": self.n_members,
            "n_nonmembers": self.n_nonmembers,
        }


def summarize(
    scores: np.ndarray, membership: np.ndarray, levels=LOW_FPR_LEVELS, max_points: int = 400
) -> RocSummary:
    """AUC, balanced accuracy, advantage, TPR at each FPR level, and a down-sampled ROC."""
    s, m = _validate(scores, membership)
    fpr, tpr, _ = roc_points(s, m)
    ok = lambda lv: fpr <= lv + 1e-15
    f, t = downsample_roc(fpr, tpr, max_points)
    return RocSummary(
        auc=float(np.trapezoid(tpr, fpr)),
        balanced_accuracy=float(np.max(1 - (fpr + 1 - tpr) / 2)),
        advantage=float(np.max(tpr - fpr)),
        tpr_at_fpr={str(lv): float(tpr[ok(lv)].max()) for lv in levels},
        fpr=f,
        tpr=t,
        n_members=int(m.sum()),
        n_nonmembers=int((~m).sum()),
    )
