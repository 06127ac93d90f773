"""The privacy report: one versioned pydantic model (JSON) per pipeline run.

A :class:`PrivacyReport` answers, for every method of a run, three questions with numbers a
reviewer can check:

1. what it promises (accounted epsilon at delta per client, the paper's own claim beside it),
2. what the audits found (membership- and attribute-inference attacks, empirical epsilon lower
   bounds with their confidence and ceiling),
3. what it costs (test accuracy of the released model(s)).

It also records the assumptions behind every number (:class:`ThreatModel`) and the run metadata
needed to reproduce it (:class:`RunMetadata`). The report is self-sufficient: every renderer works
from the JSON alone (``PrivacyReport.model_validate_json``).

This module depends on pydantic only; the pipeline (``privkit.pipeline``) fills it.
Infinite epsilons (no formal guarantee) are stored as the JSON string ``"Infinity"`` so the file
stays strict JSON.
"""

from __future__ import annotations

import math
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

SCHEMA_VERSION: Final = 1
"""Version of the :class:`PrivacyReport` JSON schema."""

StageName = Literal["train", "account", "audit", "report"]
StageState = Literal["done", "failed", "skipped", "pending"]
VerdictStatus = Literal["violation", "consistent", "inconclusive", "no-claim", "not-audited"]
#: statuses of reports written before the three-way verdict (issue 11), read as their new names
_LEGACY_STATUS = {"VIOLATION": "violation", "no-formal-guarantee": "no-claim"}

WARNING_CODES = (
    "delta_ge_1_over_n",  # delta >= 1/n: the guarantee allows publishing a record outright
    "classic_gaussian_eps_ge_1",  # classic Gaussian formula used outside its range (epsilon < 1)
    "data_dependent_scaling",  # features normalised by a statistic of the private data
    "adaptive_noise",  # noise adapted on private metrics (not accounted)
    "sampling_mismatch",  # sampling accounted differently from the one run
    "no_formal_dp",  # the method makes no formal DP claim
    "reduced_audit",  # audit reduced (few shadows / trials): bounds are weak
    "audit_size_mismatch",  # audited runs train on less data than the release (pool too small)
    "near_chance",  # the released model ends at or near chance accuracy
    "reproducible_noise",  # DP noise derived from the stored seed: not for release
    "other",
)
"""Warning codes the pipeline attaches (``other`` for free text from a trainer or an audit)."""


class _Strict(BaseModel):
    """Fields are checked; unknown keys are errors (a typo in a report is a bug)."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="strings")


class _Open(BaseModel):
    """For records copied from other packages' files (audit.json, claims): keep unknown keys."""

    model_config = ConfigDict(extra="allow", ser_json_inf_nan="strings")


# ---------------------------------------------------------------------------------- run level
class RunMetadata(_Strict):
    """What ran, where, and with which software: enough to reproduce the run."""

    name: str
    created: str = Field(description="ISO 8601 time the report was built")
    privkit_version: str = ""
    command: str | None = None
    config: dict[str, Any] = Field(default_factory=dict, description="resolved run config")
    seeds: dict[str, int] = Field(default_factory=dict)
    package_versions: dict[str, str] = Field(default_factory=dict)
    hardware: dict[str, Any] = Field(default_factory=dict)
    reduced: list[str] = Field(
        default_factory=list, description="what was scaled down from the papers (demo budget)"
    )
    wall_seconds: float | None = None


class DatasetSummary(_Strict):
    """The federated split shared by every method (and by the audits)."""

    dataset: str
    public_dataset: str | None = None
    num_classes: int
    partition: str
    alpha: float | None = None
    seed: int = 0
    sizes: dict[str, int] = Field(default_factory=dict)
    client_sizes: list[int] = Field(default_factory=list)
    class_counts: list[list[int]] = Field(
        default_factory=list, description="clients x classes record counts"
    )

    @property
    def min_client_size(self) -> int | None:
        return min(self.client_sizes) if self.client_sizes else None


class ThreatModel(_Strict):
    """The assumptions behind every number in the report."""

    neighbouring: str = Field(
        description="neighbouring relation of the guarantee, e.g. "
        "'add/remove one record of one client'"
    )
    unit: str = "one record of one client (record-level DP, per client)"
    delta: float = Field(gt=0, lt=1)
    accountants: list[str] = Field(default_factory=list)
    primary_accountant: str = "best"
    shadows: int | None = Field(default=None, ge=0)
    confidence: float | None = Field(default=None, gt=0, lt=1)
    attacker: str = (
        "black-box access to every released model (per-example logits) and to "
        "records from the same distribution; shadow models re-run the method's own "
        "recipe on disjoint data"
    )
    mechanism_audit: str | None = Field(
        default=None,
        description="the mechanism audits' assumptions (white-box auditor, probe sets, "
        "confidence), when the report has any",
    )
    assumptions: list[str] = Field(default_factory=list)


class ReportWarning(_Strict):
    """A caveat a reviewer must see, with a machine-readable code."""

    code: str = "other"
    message: str
    source: Literal["trainer", "pipeline", "audit", "accountant", "report"] = "pipeline"

    @field_validator("code")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in WARNING_CODES:
            raise ValueError(f"warning code must be one of {', '.join(WARNING_CODES)}; found {v!r}")
        return v


# ---------------------------------------------------------------------------------- per method
class StageStatus(_Strict):
    """One stage of one method: its state, the error if it failed, and how long it took."""

    state: StageState = "pending"
    error: str | None = None
    seconds: float | None = None


class RoundMetric(_Open):
    """Metrics of one communication round (at least the round and its test accuracy)."""

    round: int
    test_accuracy: float | None = None


class Utility(_Strict):
    """What the method costs: accuracy of its released model(s) on the held-out test set."""

    test_accuracy: float | None = None
    client_accuracy: list[float] = Field(
        default_factory=list, description="per-client accuracy of personalised models"
    )
    rounds: list[RoundMetric] = Field(default_factory=list)

    @property
    def mean_client_accuracy(self) -> float | None:
        vals = [a for a in self.client_accuracy if a is not None and not math.isnan(a)]
        return sum(vals) / len(vals) if vals else None


class PaperClaim(_Open):
    """The paper's own privacy statement for this method (as the paper states it)."""

    epsilon: float | None = None
    delta: float | None = None
    composition: str | None = None
    source: str | None = None


class EpsilonBracket(_Strict):
    """A certified interval around a tight accountant's worst-client epsilon."""

    lower: float
    upper: float
    grid: float | None = Field(default=None, description="PLD discretisation of the upper end")
    lower_grid: float | None = Field(
        default=None, description="PLD discretisation of the lower end"
    )
    method: str | None = None


class PrivacyAccounting(_Strict):
    """The ledger summary: what the method promises, from the mechanisms that actually ran."""

    delta: float = Field(gt=0, lt=1)
    accountants: list[str] = Field(default_factory=list)
    primary_accountant: str = "best"
    worst: dict[str, float] = Field(
        default_factory=dict, description="worst-client epsilon at delta, per accountant"
    )
    clients: dict[str, dict[str, float]] = Field(
        default_factory=dict, description="client -> accountant -> epsilon"
    )
    epsilon_over_rounds: list[tuple[float, float]] = Field(
        default_factory=list, description="(round, worst-client epsilon) under primary_accountant"
    )
    neighbouring: list[str] = Field(default_factory=list)
    labels: list[str] = Field(default_factory=list, description="mechanism labels in the ledger")
    claim: PaperClaim | None = None
    epsilon_at_claim_delta: float | None = Field(
        default=None, description="privkit's tight worst-client epsilon at the claim's delta"
    )
    errors: dict[str, str] = Field(default_factory=dict, description="accountant -> error")
    fixed_delta: float | None = Field(
        default=None,
        description="worst client: delta spent by mechanisms known only by their "
        "(epsilon, delta); no finite epsilon below it",
    )
    non_private: list[str] = Field(
        default_factory=list, description="labels of releases recorded without noise"
    )
    reproducible_noise: bool = Field(
        default=False, description="DP noise derived from the stored seed: not for release"
    )
    adaptive_composition: dict[str, Any] | None = Field(
        default=None, description="guarantee for adaptive choices (FedKADP's Renyi filter)"
    )
    epsilon_bracket: dict[str, EpsilonBracket | None] = Field(
        default_factory=dict,
        description="accountant -> certified {lower, upper, grid, lower_grid, "
        "method} around its worst-client epsilon (tight accountants "
        "only), or None",
    )
    bracket_reason: dict[str, str] = Field(
        default_factory=dict,
        description="accountant -> why it has no bracket ('not-tight': an upper "
        "bound by construction)",
    )

    @property
    def epsilon(self) -> float | None:
        """Worst-client epsilon under the primary accountant (the headline number)."""
        if self.primary_accountant in self.worst:
            return self.worst[self.primary_accountant]
        finite = [v for v in self.worst.values() if v is not None]
        return min(finite) if finite else None


class Roc(_Open):
    """An ROC curve: false- and true-positive rates at each threshold."""

    fpr: list[float] = Field(default_factory=list)
    tpr: list[float] = Field(default_factory=list)


class AttackResult(_Open):
    """One membership-inference attack (on the audited run of the method's recipe)."""

    auc: float | None = None
    balanced_accuracy: float | None = None
    advantage: float | None = None
    tpr_at_fpr: dict[str, float | None] | None = Field(default_factory=dict)
    epsilon_lower_bound: float | None = None
    ceiling: float | None = Field(
        default=None, description="largest lower bound this many trials can show"
    )
    confidence: float | None = None
    delta: float | None = None
    n_trials: int | None = None
    roc: Roc | None = Field(default_factory=Roc)
    notes: str | None = None
    error: str | None = None
    not_applicable: str | None = Field(default=None, description="why the attack does not apply")


class AttributeResult(_Open):
    """An attribute-inference attack: accuracy with its confidence interval and chance level."""

    accuracy: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    chance: float | None = None
    n_test: int | None = None
    error: str | None = None
    not_applicable: str | None = Field(default=None, description="why the attack does not apply")


class Verdict(_Open):
    """The audit's conclusion (``attacks.audit_scores``); extra keys (the per-attack family, notes)
    are kept. ``status`` follows from three numbers: ``no-claim`` without a finite accounted
    epsilon, ``violation`` if the family-wise bound exceeds it, ``consistent`` if not and the ceiling
    does, else ``inconclusive``."""

    status: VerdictStatus
    message: str = ""
    epsilon_lower_bound: float | None = Field(
        default=None,
        description="family-wise empirical lower bound (at `confidence` for all attacks)",
    )
    epsilon_ceiling: float | None = Field(
        default=None, description="largest family-wise bound any outcome of this audit could give"
    )
    detectable_epsilon: float | None = Field(
        default=None, description="smallest true epsilon this audit flags at least half the time"
    )
    accounted_epsilon: float | None = None
    confidence: float | None = None
    correction: str | None = Field(
        default=None, description="multiplicity correction of the family"
    )
    attack: str | None = Field(default=None, description="the attack giving the family-wise bound")

    @field_validator("status", mode="before")
    @classmethod
    def _legacy(cls, v: Any) -> Any:
        return _LEGACY_STATUS.get(v, v)


class TradeoffPoints(_Open):
    """The audited run's ledger as a trade-off curve: each FPR and the smallest FNR it allows."""

    claim: str = ""
    accounted_epsilon: float | None = None
    delta: float | None = None
    fpr: list[float] = Field(default_factory=list)
    fnr: list[float] = Field(default_factory=list)


class AuditSummary(_Strict):
    """What the audits found (copied from the method's ``audit.json``)."""

    attacks: dict[str, AttackResult] = Field(default_factory=dict)
    attribute: dict[str, AttributeResult] = Field(default_factory=dict)
    accounted_epsilon: float | None = None
    delta: float | None = None
    shadows: int | None = None
    verdict: Verdict | None = None
    claims: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="claim key (generic, ledger) -> its bound and the claim tested",
    )
    tradeoff_curve: TradeoffPoints | None = None
    extra: dict[str, Any] = Field(default_factory=dict, description="other audit.json keys")

    def best_attack(self) -> tuple[str, AttackResult] | None:
        """The successful attack with the largest family-wise (then own) empirical epsilon, then
        AUC: the attack behind the verdict's bound, named beside it in the summary."""
        ok = [(n, a) for n, a in self.attacks.items() if not a.error and not a.not_applicable]
        if not ok:
            return None
        return max(
            ok,
            key=lambda na: (
                _family_bound(na[1]) or 0.0,
                na[1].epsilon_lower_bound or 0.0,
                na[1].auc or 0.0,
            ),
        )


def _family_bound(a: AttackResult) -> float | None:
    """The attack's bound at the verdict's family-wise confidence (audits before the family-wise
    verdict have none)."""
    v = (a.model_extra or {}).get("family_epsilon_lower_bound")
    return float(v) if isinstance(v, (int, float)) else None


class MethodReport(_Strict):
    """Everything the report says about one method."""

    name: str = Field(description="label in this run (unique)")
    method: str = Field(description="registered trainer name")
    summary: str = ""
    paper: str | None = None
    formal_dp: bool = Field(
        default=True,
        description="the report's one rule "
        "(reports.guarantee.formal_dp_status) applied to this run",
    )
    formal_dp_label: str = Field(default="", description="short form of the rule's answer")
    formal_dp_reason: str = Field(default="", description="why not, in words")
    claims_dp: bool | None = Field(
        default=None, description="the method claims a formal DP guarantee (its registration)"
    )
    seed: int = 0
    config: dict[str, Any] = Field(default_factory=dict)
    quick: bool = False
    utility: Utility | None = None
    privacy: PrivacyAccounting | None = None
    audit: AuditSummary | None = None
    verdict: Verdict | None = None
    verdict_basis: (
        Literal["mechanism", "black-box", "canary-clients", "canary-records", "canaries"] | None
    ) = Field(
        default=None,
        description="the audit the verdict rests on: the white-box mechanism audit "
        "of the correct twin, the black-box membership audit, or a Flower run's white-box audit "
        "by canary clients (client-level), canary records (record-level) or canaries of an "
        "unstated level",
    )
    mechanism_controls: MechanismControls | None = Field(
        default=None,
        description="the method's twins audited at its DP mechanisms (formal-DP "
        "methods; absent in reports written before them)",
    )
    warnings: list[ReportWarning] = Field(default_factory=list)
    stages: dict[str, StageStatus] = Field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return any(s.state == "failed" for s in self.stages.values())

    def audit_numbers(self) -> tuple[float | None, float | None, float | None]:
        """(family-wise lower bound, ceiling, detectable epsilon) of the black-box audit's verdict
        (the row's verdict unless that rests on the mechanism audit); reports written before the
        verdict carried them fall back to the best attack's own bound and ceiling."""
        v = self.verdict if self.verdict_basis != "mechanism" else None
        v = v or (self.audit.verdict if self.audit else None)
        if v is not None and v.epsilon_ceiling is not None:
            return v.epsilon_lower_bound, v.epsilon_ceiling, v.detectable_epsilon
        best = self.audit.best_attack() if self.audit else None
        return (best[1].epsilon_lower_bound, best[1].ceiling, None) if best else (None, None, None)


# ---------------------------------------------------------------------------------- audit controls
class ControlAudit(_Open):
    """One audit of one control twin (a deliberately broken or a correct copy of a DP method)."""

    name: str = Field(description="'correct', 'noise removed' or 'clipping and noise removed'")
    expected: Literal["violation", "no violation"]
    audit_mode: Literal["white-box", "black-box"]
    mechanism: str = ""
    verdict: Verdict
    caught: bool = Field(description="the audit said 'violation'")
    passed: bool = Field(description="the outcome is the expected one")
    test_accuracy: float | None = None


class AuditControls(_Open):
    """The run's audit controls: twins of one DP method, each claiming its accounted epsilon.

    Not methods of the summary. ``power`` is False when a positive control (a twin that must come
    out ``violation``) was not caught, or when the controls could not run (``state`` failed):
    the report then cannot show that its audit could see a violation.
    """

    state: Literal["done", "failed", "skipped"] = "done"
    error: str | None = None
    method: str | None = Field(default=None, description="the DP method the twins copy")
    claimed_epsilon: float | None = None
    delta: float | None = None
    power: bool = False
    false_alarm: bool = False
    message: str = ""
    controls: list[ControlAudit] = Field(default_factory=list)
    recipes: dict[str, Any] = Field(default_factory=dict)

    @property
    def lacks_power(self) -> bool:
        return self.state != "skipped" and not self.power


# ---------------------------------------------------------------------------------- mechanism controls
class ConformanceCheck(_Open):
    """One part of a mechanism's conformance test (``attacks.conformance``): its measured value
    (as a multiple of the claim, or a count), the confidence limit on the side the test rejects, and
    the departure it flags at least half the time (``detectable``; ``None`` for an exact test)."""

    name: str
    rejected: bool
    measured: float | None = None
    confidence_limit: float | None = None
    claimed: float | None = None
    detectable: float | None = None
    detail: str = ""


class MechanismProbe(_Open):
    """One probe set: the canaries of one client's DP mechanism, audited against its ledger entries."""

    client: int | str
    mechanism: str = Field(description="the mechanism's label in the ledger (e.g. 'dp-sgd')")
    status: str
    rejected: list[str] = Field(default_factory=list, description="conformance tests that rejected")
    failed: list[str] = Field(
        default_factory=list,
        description="the rejected parts with their failed subtests (e.g. 'sampling: regularity')",
    )
    holds_epsilon: float | None = Field(
        default=None,
        description="the epsilon that holds instead of the claim's where the failed part has a "
        "measured size (inf: none can be vouched for)",
    )
    holds_note: str = ""
    tests: dict[str, ConformanceCheck] = Field(default_factory=dict)
    epsilon_lower_bound: float | None = Field(default=None, description="model-free one-run bound")
    epsilon_ceiling: float | None = None
    measured_epsilon: float | None = Field(
        default=None,
        description="epsilon of the claimed mechanism at the measured noise and releases",
    )
    claimed_epsilon: float | None = None
    canaries: int | None = None
    releases: int | None = Field(default=None, description="releases the probes observed")


class MechanismTwin(_Open):
    """One twin of a method (``correct`` or a bug of ``privkit.mechanisms.mutations``) audited at its mechanisms."""

    twin: str = Field(description="the mutation: 'correct' or e.g. 'noise x1/2'")
    description: str = ""
    expected: Literal["consistent", "violation"]
    status: Literal["violation", "consistent", "not-applicable"]
    message: str = ""
    as_expected: bool
    accounted_epsilon: float | None = None
    measured_epsilon: float | None = None
    epsilon_lower_bound: float | None = None
    test_accuracy: float | None = None
    probes: list[MechanismProbe] = Field(default_factory=list)

    @property
    def rejected(self) -> list[str]:
        """Every conformance test any probe set rejected (one-run bound: ``one-run bound``)."""
        out = sorted({t for p in self.probes for t in (p.failed or p.rejected)})
        if self.status == "violation" and not out:
            out = ["one-run bound"]
        return out

    @property
    def claimed_epsilon(self) -> float | None:
        """The largest epsilon the probed mechanisms' own ledger entries claim (the one the measured
        epsilon is compared with; the method's accounted epsilon is its worst client's, all
        mechanisms together)."""
        vals = [p.claimed_epsilon for p in self.probes if p.claimed_epsilon is not None]
        return max(vals) if vals else None

    @property
    def noise_ratio(self) -> float | None:
        """The smallest measured noise scale, as a multiple of the claimed one, over the probe sets."""
        vals = [
            p.tests["noise"].measured
            for p in self.probes
            if "noise" in p.tests and p.tests["noise"].measured is not None
        ]
        return min(vals) if vals else None


class MechanismControls(_Open):
    """A formal-DP method's mechanism controls: its correct and noise-halved twins, each audited
    white-box at the method's DP mechanisms against its ledger.

    ``state``: ``done``; ``unprobed`` (no mechanism of the method takes probes: ``reason`` says why);
    ``failed`` (``error``); ``skipped`` (disabled). ``catchable`` is the sentence saying which bug
    sizes the audit catches (from the correct twin's conformance tests).
    """

    state: Literal["done", "unprobed", "failed", "skipped"] = "done"
    error: str | None = None
    message: str = ""
    reason: str | None = Field(default=None, description="why the method has no mechanism audit")
    delta: float | None = None
    confidence: float | None = None
    canaries: int | None = None
    clients: list[int] = Field(default_factory=list)
    twins: list[MechanismTwin] = Field(default_factory=list)
    catchable: str | None = None

    def twin(self, name: str) -> MechanismTwin | None:
        return next((t for t in self.twins if t.twin == name), None)

    @property
    def correct(self) -> MechanismTwin | None:
        return self.twin("correct")

    @property
    def noise_halved(self) -> MechanismTwin | None:
        return next((t for t in self.twins if t.twin.startswith("noise x1/2")), None)

    @property
    def lacks_power(self) -> bool:
        """The noise-halved twin was audited and not caught."""
        half = self.noise_halved
        return half is not None and half.status != "violation"


class PrivacyReport(_Strict):
    """One pipeline run: metadata, threat model, and one :class:`MethodReport` per method."""

    schema_version: Literal[1] = SCHEMA_VERSION
    title: str = "privkit privacy report"
    metadata: RunMetadata
    threat_model: ThreatModel
    dataset: DatasetSummary | None = None
    methods: list[MethodReport] = Field(default_factory=list)
    warnings: list[ReportWarning] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
    controls: AuditControls | None = Field(
        default=None,
        description="audit controls (broken twins of a DP method); absent in reports "
        "written before them",
    )

    @field_validator("methods")
    @classmethod
    def _unique(cls, v: list[MethodReport]) -> list[MethodReport]:
        names = [m.name for m in v]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"method names must be unique; found duplicates {dup}")
        return v

    def method(self, name: str) -> MethodReport:
        for m in self.methods:
            if m.name == name:
                return m
        raise KeyError(f"no method {name!r} in report; found {[m.name for m in self.methods]}")

    def to_json(self) -> str:
        """Strict JSON (infinite epsilons as the string ``"Infinity"``)."""
        return self.model_dump_json(indent=2)

    @classmethod
    def from_json(cls, text: str) -> PrivacyReport:
        """Parse and validate a report; a wrong ``schema_version`` is a one-line error."""
        import json

        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"report is not valid JSON: {exc}") from exc
        version = data.get("schema_version") if isinstance(data, dict) else None
        if version != SCHEMA_VERSION:
            raise ValueError(f"report schema_version must be {SCHEMA_VERSION}; found {version!r}")
        return cls.model_validate(data)
