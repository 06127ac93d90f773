"""Names of the attacks a run audit runs, importable without the audit layer (scikit-learn,
CatBoost, dp-accounting) so that a run config's ``[audit].attacks`` is checked before any work."""

from __future__ import annotations

MEMBERSHIP_ATTACKS = ("threshold", "shadow", "lira", "rmia")  # lira and rmia: online and offline
"""Membership-inference attacks a run audit can run (LiRA and RMIA each online and offline)."""
ATTRIBUTE_ATTACKS = ("attribute",)
"""Attribute-inference attacks a run audit can run."""
ATTACKS = MEMBERSHIP_ATTACKS + ATTRIBUTE_ATTACKS
"""Every attack name ``[audit].attacks`` accepts."""
