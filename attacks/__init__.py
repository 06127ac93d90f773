"""The audit layer: membership and attribute inference against trained models, and statistically
valid empirical epsilon lower bounds checked against the accounted epsilon.

A library: it imports nothing from the ``privkit`` application, which hands it training recipes.
Numeric core (numpy/scipy only): :mod:`attacks.metrics`, :mod:`attacks.epsilon`,
:mod:`attacks.one_run`. Attacks (scikit-learn estimators): :mod:`attacks.mia`,
:mod:`attacks.attribute`. Recipes (``train_fn(x, y, seed) -> model`` for scikit-learn, torch or
any probability function): :mod:`attacks.recipe`. The experiment (fair-coin inclusion, reference
models on halves of one pool, training on an executor): :mod:`attacks.experiment`,
:mod:`attacks.executor`. Entry points: :func:`audit_recipe` (a recipe, end to end), :func:`audit_model`
(a model trained elsewhere, with its members and non-members);
for scores already computed: :func:`audit_scores` (scores and membership -> family-wise bound,
ceiling, detectable epsilon and verdict); for white-box probes at a DP mechanism:
:func:`conformance_test` (the mechanism against its ledger's claim, :mod:`attacks.conformance`;
the probes themselves, which need torch, are :class:`attacks.whitebox.GradientCanaries`; as
records in the user's own data loader and clipping, :mod:`attacks.canary_records`).
Canary records for black-box audits: :mod:`attacks.canaries`.

Everything public is importable from here. The white-box probes (:mod:`attacks.whitebox`) import
torch, so they load on first use: ``import attacks`` never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from attacks.attribute import AttributeInferenceAttack, AttributeResult, evaluate_predictions
from attacks.audit_scores import AttackAudit, AuditResult, audit_scores, detectable_epsilon
from attacks.canaries import (
    CanaryData,
    audit_canaries,
    canary_scores,
    insert_canaries,
    make_canaries,
)
from attacks.conformance import (
    ConformanceResult,
    MechanismClaim,
    ProbeEvidence,
    claim_from_events,
    conformance_test,
)
from attacks.epsilon import (
    EpsilonBound,
    advantage_upper_bound,
    balanced_accuracy_upper_bound,
    clopper_pearson_interval,
    clopper_pearson_upper,
    empirical_epsilon,
    epsilon_ceiling,
    epsilon_from_rates,
    gdp_epsilon_estimate,
)
from attacks.experiment import (
    Design,
    design_experiment,
    inclusion_coins,
    membership_mask,
    train_models,
)
from attacks.metrics import (
    advantage,
    auc,
    balanced_accuracy,
    loglog_roc,
    roc_points,
    summarize,
    tpr_at_fpr,
)
from attacks.mia import LiRA, ShadowModelAttack, ThresholdAttack, lira_leave_one_out
from attacks.one_run import OneRunResult, one_run_audit, one_run_epsilon_grid
from attacks.one_run import epsilon_lower_bound as one_run_epsilon
from attacks.one_run_fdp import FdpBound, fdp_epsilon_lower_bound, one_run_fdp
from attacks.recipe import Recipe, as_recipe, predict_logits
from attacks.recipe_audit import RecipeAudit, audit_recipe
from attacks.rmia import RMIA
from attacks.sampling_law import SamplingRecord
from attacks.user_model import audit_model

# names whose module imports torch, loaded on first access (PEP 562)
_LAZY = dict.fromkeys(
    ("GradientCanaries", "MechanismAudit", "attach_to_opacus", "claim_optimised_guesses"),
    "attacks.whitebox",
)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'attacks' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "RMIA",
    "AttackAudit",
    "AttributeInferenceAttack",
    "AttributeResult",
    "AuditResult",
    "CanaryData",
    "ConformanceResult",
    "Design",
    "EpsilonBound",
    "FdpBound",
    "GradientCanaries",
    "LiRA",
    "MechanismAudit",
    "MechanismClaim",
    "OneRunResult",
    "ProbeEvidence",
    "Recipe",
    "RecipeAudit",
    "SamplingRecord",
    "ShadowModelAttack",
    "ThresholdAttack",
    "advantage",
    "advantage_upper_bound",
    "as_recipe",
    "attach_to_opacus",
    "auc",
    "audit_canaries",
    "audit_model",
    "audit_recipe",
    "audit_scores",
    "balanced_accuracy",
    "balanced_accuracy_upper_bound",
    "canary_scores",
    "claim_from_events",
    "claim_optimised_guesses",
    "clopper_pearson_interval",
    "clopper_pearson_upper",
    "conformance_test",
    "design_experiment",
    "detectable_epsilon",
    "empirical_epsilon",
    "epsilon_ceiling",
    "epsilon_from_rates",
    "evaluate_predictions",
    "fdp_epsilon_lower_bound",
    "gdp_epsilon_estimate",
    "inclusion_coins",
    "insert_canaries",
    "lira_leave_one_out",
    "loglog_roc",
    "make_canaries",
    "membership_mask",
    "one_run_audit",
    "one_run_epsilon",
    "one_run_epsilon_grid",
    "one_run_fdp",
    "predict_logits",
    "roc_points",
    "summarize",
    "tpr_at_fpr",
    "train_models",
]
