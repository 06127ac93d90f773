"""One attack's metrics and one-run epsilon lower bound on audited records (an audit.json entry)."""

from __future__ import annotations

import math

import numpy as np

from attacks.epsilon import gdp_epsilon_estimate
from attacks.metrics import summarize
from attacks.one_run import one_run_audit


def membership_entry(scores: np.ndarray, membership: np.ndarray, *, delta: float, alpha: float,
                     guess_fraction: float, notes: str) -> dict:
    """Metrics + one-run epsilon lower bound for one attack's scores on the audit points."""
    summ = summarize(scores, membership).to_dict()
    k = max(1, int(math.floor(guess_fraction * len(scores))))
    orr = one_run_audit(scores, membership, delta=delta, k_pos=k, k_neg=k, beta=alpha)
    # GDP extrapolation from the rates at the pre-registered guess counts: an ESTIMATE only
    fpr = float((~membership[np.argsort(-scores)[:k]]).sum()) / max((~membership).sum(), 1)
    fnr = 1.0 - float(membership[np.argsort(-scores)[:k]].sum()) / max(membership.sum(), 1)
    return {**{k_: summ[k_] for k_ in ("auc", "balanced_accuracy", "advantage", "tpr_at_fpr", "roc")},
            "epsilon_lower_bound": orr.epsilon, "ceiling": orr.ceiling, "confidence": 1 - alpha,
            "delta": delta, "n_trials": len(scores), "guesses": orr.guesses, "correct": orr.correct,
            "bound": "one-run (Steinke, Nasr & Jagielski 2023), k+ = k- fixed in advance",
            "gdp_epsilon_estimate": gdp_epsilon_estimate(max(fpr, 1e-12), max(fnr, 1e-12), delta),
            "notes": notes, "error": None}
