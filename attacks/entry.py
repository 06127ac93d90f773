"""A family of membership attacks' scores -> audit.json records and the verdict record.

Each attack's scores wait in an :class:`AttackScores` until the whole family is known; then
:func:`analyse` runs :func:`attacks.audit_scores` once over the family (one confidence for the
verdict) and replaces each by its audit.json record.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from attacks.audit_scores import audit_scores


@dataclass
class AttackScores:
    """One membership attack's scores on its audited records, before the family is analysed."""

    scores: np.ndarray
    membership: np.ndarray
    notes: str
    inclusion: str = "unverified"  # "random" when the records were included by fair coins
    extra: dict = field(default_factory=dict)  # more keys for the attack's audit.json record


def analyse(
    results: dict,
    *,
    accounted: float | None,
    delta: float,
    alpha: float,
    seed: int,
    guess_fraction: float,
) -> dict:
    """Replace each :class:`AttackScores` in ``results`` by its audit.json record and return the
    verdict record (:func:`attacks.audit_scores` over the family of attacks that produced scores)."""
    scored = {n: r for n, r in results.items() if isinstance(r, AttackScores)}
    if not scored:
        status = "no-claim" if accounted is None or not np.isfinite(accounted) else "inconclusive"
        return {
            "status": status,
            "message": "no attack produced scores; nothing to compare",
            "epsilon_lower_bound": None,
            "epsilon_ceiling": None,
            "detectable_epsilon": None,
        }
    res = audit_scores(
        {n: s.scores for n, s in scored.items()},
        {n: s.membership for n, s in scored.items()},
        accounted_epsilon=accounted,
        delta=delta,
        confidence=1 - alpha,
        seed=seed,
        guesses=guess_fraction,
        inclusion={n: s.inclusion for n, s in scored.items()},
        notes={n: s.notes for n, s in scored.items()},
    )
    for n, s in scored.items():
        results[n] = {**res.attacks[n].to_dict(), **s.extra}
    return res.to_dict(with_attacks=False)
