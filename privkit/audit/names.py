"""Names of the attacks a run audit runs, importable without the audit layer (scikit-learn,
CatBoost, dp-accounting) so that a run config's ``[audit].attacks`` is checked before any work."""

from __future__ import annotations

MEMBERSHIP_ATTACKS = ("threshold", "shadow", "lira", "rmia")  # lira and rmia: online and offline
ATTRIBUTE_ATTACKS = ("attribute",)
ATTACKS = MEMBERSHIP_ATTACKS + ATTRIBUTE_ATTACKS
