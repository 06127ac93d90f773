"""One-command pipeline: train -> account -> audit -> report, for every method of a run config.

``privkit run CONFIG.toml`` writes ``<out>/<name>/``::

    config.resolved.json   the validated config, every method's full trainer config
    federation.json        the split shared by every method and every audit
    dataset.json           its summary (sizes, client x class counts)
    status.json            per method and stage: done / failed (with the error) / skipped
    <method>/              a run directory (config.json, federation.json, checkpoints, ledger.json,
                           metrics.json, train.json, privacy.json, audit.json)
    audit-controls/         controls.json: broken twins of a DP-SGD method, audited (the report's
                           "Audit controls"; :mod:`~privkit.pipeline.controls`)
    mechanism-controls/    <method>.json per formal-DP method: its correct and noise-halved twins,
                           audited white-box at its DP mechanisms (the report's verdicts and
                           "Mechanism controls"; :mod:`~privkit.pipeline.mechanism_controls`)
    report.json / report.html / report.md

Every stage is keyed by a hash of what it depends on (method, trainer config, seed, federation;
plus delta/accountant for accounting and the audit settings for audits). Re-running skips stages
that are complete for the same hash, so an interrupted run resumes where it stopped. A failing
stage is recorded with its error and the other methods go on. Files are written atomically (a
method's training output goes to a staging folder renamed into place), each with a sha256
sidecar verified on load, so nothing completed earlier is lost, left half-written, or read back
damaged; a second run on a directory in use is refused (:func:`~privkit.files.run_lock`).
See :mod:`~privkit.files` and docs/faults.md.

The package holds one job per module: :mod:`~privkit.pipeline.config` (run config and its
validation), :mod:`~privkit.pipeline.state` (stage hashes and ``status.json``),
:mod:`~privkit.pipeline.stages` (train / account / audit of one method),
:mod:`~privkit.pipeline.workers` (methods in parallel processes),
:mod:`~privkit.pipeline.steps` (a resumable step beside the methods: the audit controls,
:mod:`~privkit.pipeline.controls`, and each method's mechanism controls,
:mod:`~privkit.pipeline.mechanism_controls`), :mod:`~privkit.pipeline.runner`
(``run_pipeline``) and :mod:`~privkit.pipeline.report` (report assembly and re-rendering).
"""

from privkit.files import atomic_write_json
from privkit.pipeline.config import (
    ACCOUNTANTS,
    SCHEMA_VERSION,
    STAGES,
    AuditSettings,
    MethodEntry,
    ReportSettings,
    ResolvedMethod,
    ResolvedRun,
    RunConfig,
    bundled_config,
    load_run_config,
    resolve_config,
)
from privkit.pipeline.report import build_report, classify_warning, rerender
from privkit.pipeline.runner import RunOutcome, run_pipeline
from privkit.pipeline.stages import account_method, run_audit
from privkit.pipeline.state import Status, stage_hashes

__all__ = [
    "ACCOUNTANTS",
    "SCHEMA_VERSION",
    "STAGES",
    "AuditSettings",
    "MethodEntry",
    "ReportSettings",
    "ResolvedMethod",
    "ResolvedRun",
    "RunConfig",
    "RunOutcome",
    "Status",
    "account_method",
    "atomic_write_json",
    "build_report",
    "bundled_config",
    "classify_warning",
    "load_run_config",
    "rerender",
    "resolve_config",
    "run_audit",
    "run_pipeline",
    "stage_hashes",
]
