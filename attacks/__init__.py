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

Everything public is importable from here. Names resolve on first use (PEP 562): ``import
attacks`` (or one light submodule of it, as a training imports :mod:`attacks.conv_layout`) loads
neither scikit-learn, scipy nor torch (scikit-learn alone took 1.2-1.8 s of every ``privkit
train`` on a 2-core machine); each loads with the first submodule that needs it.
"""

from __future__ import annotations

import importlib
from typing import Any

# ``audit_scores`` and ``one_run_fdp`` name both a submodule and its entry point. Loading a
# submodule binds it to the package's attribute, which a lazy name would then never replace: the
# functions are bound here, after their submodules (numpy, scipy and dp-accounting; neither
# scikit-learn nor torch).
from attacks.audit_scores import audit_scores as audit_scores
from attacks.one_run_fdp import one_run_fdp as one_run_fdp

# submodule -> the public names it exports
_EXPORTS: dict[str, tuple[str, ...]] = {
    "attribute": (
        "AttributeInferenceAttack",
        "AttributeResult",
        "evaluate_predictions",
    ),
    "audit_scores": (
        "AttackAudit",
        "audit_scores",
        "AuditResult",
        "detectable_epsilon",
    ),
    "canaries": (
        "audit_canaries",
        "canary_scores",
        "CanaryData",
        "insert_canaries",
        "make_canaries",
    ),
    "conformance": (
        "claim_from_events",
        "conformance_test",
        "ConformanceResult",
        "MechanismClaim",
        "ProbeEvidence",
    ),
    "epsilon": (
        "advantage_upper_bound",
        "balanced_accuracy_upper_bound",
        "clopper_pearson_interval",
        "clopper_pearson_upper",
        "empirical_epsilon",
        "epsilon_ceiling",
        "epsilon_from_rates",
        "EpsilonBound",
        "gdp_epsilon_estimate",
    ),
    "experiment": (
        "Design",
        "design_experiment",
        "inclusion_coins",
        "membership_mask",
        "train_models",
    ),
    "metrics": (
        "advantage",
        "auc",
        "balanced_accuracy",
        "loglog_roc",
        "roc_points",
        "summarize",
        "tpr_at_fpr",
    ),
    "mia": (
        "LiRA",
        "lira_leave_one_out",
        "ShadowModelAttack",
        "ThresholdAttack",
    ),
    "one_run": (
        "one_run_audit",
        "one_run_epsilon",
        "one_run_epsilon_grid",
        "OneRunResult",
    ),
    "one_run_fdp": (
        "fdp_epsilon_lower_bound",
        "FdpBound",
        "one_run_fdp",
    ),
    "recipe": (
        "as_recipe",
        "predict_logits",
        "Recipe",
    ),
    "recipe_audit": (
        "audit_recipe",
        "RecipeAudit",
    ),
    "rmia": ("RMIA",),
    "sampling_law": ("SamplingRecord",),
    "user_model": ("audit_model",),
    "whitebox": (
        "attach_to_opacus",
        "claim_optimised_guesses",
        "GradientCanaries",
        "MechanismAudit",
    ),
}
#: public names that differ from their name in the submodule
_RENAMED = {"one_run_epsilon": "epsilon_lower_bound"}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = list(_MODULE_OF)  # built from _EXPORTS, the one list of names


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:  # a submodule reached as an attribute (attacks.metrics) loads on first use
        try:
            return importlib.import_module(f"attacks.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"attacks.{name}":  # the submodule exists; one of its imports is missing
                raise
            raise AttributeError(f"module 'attacks' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"attacks.{module}"), _RENAMED.get(name, name))
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
