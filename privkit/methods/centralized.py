"""Non-private centralised training (:mod:`privkit.trainers.centralized`): its registration (its
settings are DP-SGD's training settings, :class:`~privkit.methods.dpsgd.CentralConfig`)."""

from __future__ import annotations

from privkit.methods.dpsgd import CentralConfig
from privkit.methods.registry import declare

declare(
    "centralized",
    CentralConfig,
    "privkit.trainers.centralized:train_centralized",
    "Non-private centralised training on the pooled client data (no guarantee; reference for "
    "utility and audits)",
    formal_dp=False,
    quick={"epochs": 6, "width": 8, "feature_dim": 32, "lr": 0.1, "batch_size": 64},
    batched="privkit.batched.many_central:train_centralized_many",
    batched_references_only=True,
)
