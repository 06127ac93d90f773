"""privkit's audit layer: membership and attribute inference against released models, and
statistically valid empirical epsilon lower bounds checked against the accounted epsilon.

Numeric core (numpy/scipy only): :mod:`attacks.metrics`, :mod:`attacks.epsilon`,
:mod:`attacks.one_run`. Attacks (scikit-learn estimators): :mod:`attacks.mia`,
:mod:`attacks.attribute`. Targets and shadows: :mod:`attacks.target`, :mod:`attacks.shadows`,
:mod:`privkit.trainers.batched_sgd` (vectorised training of many small models). Entry points:
:func:`audit_scores` (scores and membership -> family-wise bound, ceiling, detectable epsilon and
verdict), :func:`audit_run` (a run directory), :func:`audit_model` (a user's torch model).
"""

from attacks.audit_scores import AttackAudit, AuditResult, audit_scores, detectable_epsilon
from attacks.attribute import AttributeInferenceAttack, AttributeResult, evaluate_predictions
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
from attacks.rmia import RMIA

ATTACKS = ("threshold", "shadow", "lira", "one-run", "attribute")
MEMBERSHIP_ATTACKS = ("threshold", "shadow", "lira", "one-run")
ATTRIBUTE_ATTACKS = ("attribute",)


def audit_run(run_dir, **kwargs):
    """Audit a run directory and write ``audit.json`` (see :func:`attacks.audit.audit_run`)."""
    from attacks.audit import audit_run as _audit_run

    return _audit_run(run_dir, **kwargs)


def __getattr__(name):  # torch-dependent pieces load lazily: the numeric core needs numpy/scipy only
    if name == "audit_model":
        from attacks.user_model import audit_model

        return audit_model
    if name == "Target":
        from attacks.target import Target

        return Target
    if name in ("train_shadows", "membership_mask", "ShadowSet"):
        from attacks import shadows

        return getattr(shadows, name)
    raise AttributeError(f"module 'attacks' has no attribute {name!r}")


__all__ = [
    "ATTACKS",
    "AttributeInferenceAttack",
    "AttackAudit",
    "AttributeResult",
    "AuditResult",
    "EpsilonBound",
    "FdpBound",
    "LiRA",
    "OneRunResult",
    "RMIA",
    "ShadowModelAttack",
    "Target",
    "ThresholdAttack",
    "advantage",
    "advantage_upper_bound",
    "auc",
    "audit_run",
    "audit_scores",
    "balanced_accuracy",
    "balanced_accuracy_upper_bound",
    "clopper_pearson_interval",
    "clopper_pearson_upper",
    "detectable_epsilon",
    "empirical_epsilon",
    "epsilon_ceiling",
    "epsilon_from_rates",
    "evaluate_predictions",
    "fdp_epsilon_lower_bound",
    "gdp_epsilon_estimate",
    "lira_leave_one_out",
    "loglog_roc",
    "membership_mask",
    "one_run_audit",
    "one_run_epsilon",
    "one_run_epsilon_grid",
    "one_run_fdp",
    "roc_points",
    "summarize",
    "tpr_at_fpr",
    "train_shadows",
]
