"""Privacy reports: a versioned JSON schema, matplotlib figures, and HTML/Markdown renderers.

``reports`` depends on no other privkit package: the pipeline (``privkit.pipeline``) fills a
:class:`PrivacyReport`; this package only validates, plots and renders it. A report re-renders from
its JSON alone::

    from reports import load_report, write_report
    write_report(load_report("runs/demo/report.json"), "runs/demo")
"""

from reports.formatting import fmt_eps
from reports.guarantee import FormalDP, delta_ge_one_over_n, formal_dp_status
from reports.render import (
    FORMATS,
    HOW_TO_READ,
    atomic_write_text,
    load_report,
    render_html,
    render_json,
    render_markdown,
    summary_rows,
    write_report,
)
from reports.schema import (
    SCHEMA_VERSION,
    WARNING_CODES,
    AttackResult,
    AttributeResult,
    AuditControls,
    AuditSummary,
    ConformanceCheck,
    ControlAudit,
    DatasetSummary,
    EpsilonBracket,
    MechanismControls,
    MechanismProbe,
    MechanismTwin,
    MethodReport,
    PaperClaim,
    PrivacyAccounting,
    PrivacyReport,
    ReportWarning,
    Roc,
    RoundMetric,
    RunMetadata,
    StageStatus,
    ThreatModel,
    Utility,
    Verdict,
)

__all__ = [
    "FORMATS",
    "HOW_TO_READ",
    "SCHEMA_VERSION",
    "WARNING_CODES",
    "AttackResult",
    "AttributeResult",
    "AuditControls",
    "AuditSummary",
    "ConformanceCheck",
    "ControlAudit",
    "DatasetSummary",
    "EpsilonBracket",
    "FormalDP",
    "MechanismControls",
    "MechanismProbe",
    "MechanismTwin",
    "MethodReport",
    "PaperClaim",
    "PrivacyAccounting",
    "PrivacyReport",
    "ReportWarning",
    "Roc",
    "RoundMetric",
    "RunMetadata",
    "StageStatus",
    "ThreatModel",
    "Utility",
    "Verdict",
    "atomic_write_text",
    "delta_ge_one_over_n",
    "fmt_eps",
    "formal_dp_status",
    "load_report",
    "render_html",
    "render_json",
    "render_markdown",
    "summary_rows",
    "write_report",
]
