"""The second claim an audit tests: "this run is as private as its ledger says".

:func:`privkit.audit.audit_run`'s verdict tests the bare (epsilon, delta) claim with Steinke et
al.'s bound.  Where the audited target run's ledger is known, the same guesses also test the
stronger claim that the run is as private as the ledger's own trade-off curve (its PLD, built by
:func:`accountants.ledger_curve`), with the f-DP analysis of one-run audits (Mahloujifar, Melis &
Chaudhuri 2024; ``attacks.audit_scores(..., curve=...)``).  That bound is valid for the mechanism
exactly when the ledger describes what ran, which is what it tests.

The curve's points (FPR -> smallest FNR the ledger allows) are stored too, so a report can draw
every attack's ROC over the region the ledger forbids from report.json alone.
"""

from __future__ import annotations

import functools
import json

import numpy as np

from accountants.tradeoff import ledger_curve

#: FPRs at which the ledger's curve is stored (log-spaced for the log-log ROC, plus an even grid for large FPRs)
CURVE_FPR = np.unique(np.r_[np.geomspace(1e-6, 1.0, 241), np.linspace(0.0, 1.0, 101)])


@functools.lru_cache(maxsize=16)
def _curve_from_json(ledger_json: str):
    # building a ledger's curve costs 1-4 s: an audit asks for it twice, a report stage again
    from accountants import Ledger

    return ledger_curve(Ledger.from_dict(json.loads(ledger_json)))


def ledger_tradeoff(ledger):
    """The trade-off curve of ``ledger`` (cached by the ledger's content)."""
    return _curve_from_json(json.dumps(ledger.to_dict(), sort_keys=True, default=str))


def curve_points(curve, accounted_epsilon: float | None, delta: float) -> dict:
    """The curve's points for audit.json / report.json: FPR and the smallest FNR allowed."""
    fnr = np.clip(np.asarray(curve(CURVE_FPR), dtype=np.float64), 0.0, 1.0)
    return {
        "claim": curve.claim,
        "accounted_epsilon": accounted_epsilon,
        "delta": delta,
        "fpr": [float(x) for x in CURVE_FPR],
        "fnr": [float(x) for x in fnr],
    }


def ledger_claim_bound(
    scores: dict,
    membership: dict,
    curve,
    *,
    accounted: float | None,
    delta: float,
    alpha: float,
    seed: int,
    guess_fraction: float,
) -> dict:
    """The family-wise bound of the same guesses against the ledger's curve, with the claim it tests.

    Same attacks, guesses, confidence and tie-break as the verdict's generic bound; its status
    (``violation`` etc.) says whether the ledger's own curve is rejected at ``1 - alpha``.
    """
    from attacks.audit_scores import _strict, audit_scores

    res = audit_scores(
        scores,
        membership,
        accounted_epsilon=accounted,
        delta=delta,
        confidence=1 - alpha,
        seed=seed,
        guesses=guess_fraction,
        curve=curve,
    )
    d = res.to_dict(with_attacks=False)
    keep = (
        "status",
        "message",
        "epsilon_lower_bound",
        "epsilon_ceiling",
        "detectable_epsilon",
        "confidence",
        "attack",
        "claim_tested",
        "curve",
    )
    out = {k: d[k] for k in keep if k in d}
    out["per_attack"] = _strict({n: res.attacks[n].epsilon_lower_bound for n in res.attacks})
    return out
