"""Report assembly: a :class:`reports.PrivacyReport` built from a run directory's files alone."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

from privkit.errors import PrivkitError
from privkit.files import checked, write_text
from privkit.files import now as _now
from privkit.files import one_line as _one_line
from privkit.files import read_json as _read_json
from privkit.pipeline.config import ACCOUNTANTS, STAGES
from privkit.pipeline.mechanism_report import (
    mechanism_threat_text,
    read_mechanism_controls,
    rest_verdict,
)

# first match wins: the stamps come first because their texts mention sampling and accuracy
_WARNING_RULES: list[tuple[str, tuple[str, ...]]] = [
    ("reproducible_noise", ("reproducible noise",)),
    ("near_chance", ("near-chance",)),
    ("delta_ge_1_over_n", ("1/n",)),
    ("classic_gaussian_eps_ge_1", ("classic gaussian", "classic formula", "classic mechanism")),
    (
        "data_dependent_scaling",
        ("data-dependent", "normalis", "normaliz", "feature scal", "scaled by", "max norm"),
    ),
    ("adaptive_noise", ("adaptive", "adapted", "adapts")),
    ("sampling_mismatch", ("sampling", "sample rate", "sampled", "poisson", "shuffl", "partition")),
    (
        "no_formal_dp",
        ("no formal privacy", "no privacy guarantee", "no formal dp", "not differentially private"),
    ),
]


def classify_warning(text: str) -> str:
    """Map a trainer's free-text warning to a report warning code (``other`` if none fits)."""
    low = text.lower()
    for code, needles in _WARNING_RULES:
        if any(n in low for n in needles):
            return code
    return "other"


def _package_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in (
        "privkit",
        "torch",
        "numpy",
        "scipy",
        "dp-accounting",
        "opacus",
        "scikit-learn",
        "pydantic",
        "matplotlib",
        "jinja2",
    ):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            continue
    return out


def _hardware() -> dict[str, Any]:
    hw: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    try:
        import torch

        hw["torch_threads"] = torch.get_num_threads()
        hw["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    except Exception:  # pragma: no cover - torch is a hard dependency
        pass
    return hw


def _neighbouring_text(relations: set[str]) -> str:
    words = {
        "add_remove": "add/remove one record (add_remove)",
        "replace_one": "replace one record (replace_one)",
    }
    if not relations:
        return "add/remove one record (add_remove) unless a method's ledger says otherwise"
    return "; ".join(words.get(r, r) for r in sorted(relations)) + (
        " (per method, as recorded in its ledger)" if len(relations) > 1 else ""
    )


def _method_report(key: str, info: dict, st: dict, mdir: Path):
    """Build one :class:`reports.MethodReport` from a method's run directory and status.

    A file that cannot be read becomes a warning on that method; the report is still written.
    """
    from reports import MethodReport, ReportWarning, StageStatus, Verdict, formal_dp_status

    stages = {
        s: StageStatus(
            state=(st.get(s) or {}).get("state", "pending"),
            error=(st.get(s) or {}).get("error"),
            seconds=(st.get(s) or {}).get("seconds"),
        )
        for s in STAGES
    }
    parts: dict[str, Any] = {"utility": None, "privacy": None, "audit": None}
    warnings: list = []
    readers = (
        ("train", "metrics.json", "utility", _read_utility),
        ("account", "privacy.json", "privacy", _read_privacy),
        ("audit", "audit.json", "audit", _read_audit),
    )
    for stage, fname, part, reader in readers:
        path = mdir / fname
        # with a status file, only results of completed stages; without one, whatever exists
        if not path.is_file() or (st and stages[stage].state != "done"):
            continue
        try:
            parts[part] = reader(mdir, info, warnings)
        except Exception as exc:  # a damaged file must not cost the whole report
            warnings.append(
                ReportWarning(
                    code="other",
                    source="report",
                    message=f"{fname} could not be read: {_one_line(exc)}",
                )
            )
    audit, privacy = parts["audit"], parts["privacy"]
    claims_dp = info.get("formal_dp", True)
    rule = formal_dp_status(
        claims_dp=claims_dp,
        epsilon=privacy.epsilon if privacy else None,
        delta=privacy.delta if privacy else info.get("delta", 1e-5),
        fixed_delta=privacy.fixed_delta if privacy else None,
        non_private=privacy.non_private if privacy else (),
        n_min=info.get("min_client_size"),
        error="; ".join(privacy.errors.values()) if privacy and privacy.errors else None,
    )
    verdict = audit.verdict if audit is not None else None
    if not rule.formal and (verdict is None or verdict.status in ("consistent", "inconclusive")):
        # the verdict follows the same rule as every other cell of the row
        verdict = Verdict(status="no-claim", message=rule.reason)
    return MethodReport(
        name=key,
        method=info.get("method", key),
        summary=info.get("summary", ""),
        paper=info.get("paper"),
        formal_dp=rule.formal,
        formal_dp_label=rule.label,
        formal_dp_reason=rule.reason,
        claims_dp=claims_dp,
        seed=info.get("seed", 0),
        config=info.get("trainer", {}),
        quick=info.get("quick", False),
        utility=parts["utility"],
        privacy=parts["privacy"],
        audit=audit,
        verdict=verdict,
        warnings=warnings,
        stages=stages,
    )


def _read_utility(mdir: Path, info: dict, warnings: list):
    from reports import ReportWarning, Utility

    met = _read_json(mdir / "metrics.json")
    meta = _read_json(mdir / "train.json")
    warnings += [
        ReportWarning(code=classify_warning(w), message=w, source="trainer")
        for w in meta.get("warnings", [])
    ]
    return Utility(
        test_accuracy=_num(met.get("test_accuracy")),
        client_accuracy=[_num(a) for a in met.get("client_accuracy", [])],  # type: ignore[misc]
        rounds=[r for r in met.get("rounds", []) if "round" in r],
    )


def _read_privacy(mdir: Path, info: dict, warnings: list):
    from reports import PrivacyAccounting, ReportWarning, delta_ge_one_over_n

    p = _read_json(mdir / "privacy.json")
    s = p["summary"]
    claim = p.get("claim") or {}
    cd = claim.get("delta")
    n_min = info.get("min_client_size")
    if (
        isinstance(cd, (int, float))
        and cd < 1
        and delta_ge_one_over_n(cd, n_min)
        and not any(w.code == "delta_ge_1_over_n" for w in warnings)
    ):
        warnings.append(
            ReportWarning(
                code="delta_ge_1_over_n",
                source="pipeline",
                message=f"the paper's delta = {cd:.3g} >= 1/n = {1.0 / n_min:.3g} (smallest client, "  # type: ignore[operator]  # n is known here
                f"n = {n_min}): such a guarantee allows publishing a record in the clear",
            )
        )
    return PrivacyAccounting(
        delta=p["delta"],
        accountants=p.get("accountants") or list(s.get("worst", {})),
        primary_accountant=p.get("accountant", "best"),
        worst=s.get("worst", {}),
        clients=s.get("clients", {}),
        epsilon_over_rounds=p.get("epsilon_over_rounds", []),
        neighbouring=p.get("neighbouring", []),
        labels=p.get("labels", []),
        claim=p.get("claim"),
        epsilon_at_claim_delta=p.get("epsilon_at_claim_delta"),
        errors=p.get("errors", {}),
        fixed_delta=p.get("fixed_delta"),
        non_private=p.get("non_private", []),
        reproducible_noise=bool(p.get("reproducible_noise", False)),
        adaptive_composition=p.get("adaptive_composition"),
        epsilon_bracket={k: _worst_bracket(v) for k, v in (p.get("epsilon_bracket") or {}).items()},  # type: ignore[misc]  # pydantic validates the dicts
        bracket_reason=p.get("bracket_reason") or {},
    )


def _worst_bracket(bracket: dict | None) -> dict | None:
    """The worst client's bracket from privacy.json's (per-client ones stay there)."""
    if not bracket:
        return None
    return {
        **bracket["worst"],
        **{k: bracket[k] for k in ("grid", "lower_grid", "method") if k in bracket},
    }


def _read_audit(mdir: Path, info: dict, warnings: list):
    from reports import AuditSummary, ReportWarning
    from reports.schema import WARNING_CODES

    a = _read_json(mdir / "audit.json")
    known = {
        "attacks",
        "attribute",
        "accounted_epsilon",
        "delta",
        "shadows",
        "verdict",
        "schema_version",
        "method",
        "warnings",
        "claims",
        "tradeoff_curve",
    }

    def clean(entries: dict | None) -> dict:  # tracebacks stay in audit.json, not the report
        return {
            k: {f: v for f, v in e.items() if f != "traceback"} for k, e in (entries or {}).items()
        }

    audit = AuditSummary(
        attacks=clean(a.get("attacks")),
        attribute=clean(a.get("attribute")),
        accounted_epsilon=_num(a.get("accounted_epsilon")),
        delta=a.get("delta"),
        shadows=a.get("shadows"),
        verdict=a.get("verdict"),
        claims=a.get("claims") or {},
        tradeoff_curve=a.get("tradeoff_curve"),
        extra={k: v for k, v in a.items() if k not in known},
    )
    for name, res in audit.attacks.items():
        if res.error:
            warnings.append(
                ReportWarning(
                    code="other", source="audit", message=f"attack {name} failed: {res.error}"
                )
            )
    if a.get("shadow_error"):
        warnings.append(
            ReportWarning(
                code="other", source="audit", message=f"shadow training failed: {a['shadow_error']}"
            )
        )
    for w in (
        a.get("warnings") or []
    ):  # e.g. audited runs on less data than the release, with numbers
        code = w.get("code", "other") if isinstance(w, dict) else "other"
        warnings.append(
            ReportWarning(
                code=code if code in WARNING_CODES else "other",
                source="audit",
                message=w.get("message", "") if isinstance(w, dict) else str(w),
            )
        )
    return audit


def _record_audit_of_client_claim():
    """The warning on a record-level membership audit of a client-level method's epsilon."""
    from reports import ReportWarning

    return ReportWarning(
        code="other",
        source="audit",
        message=(
            "the membership audit tests records against a client-level epsilon (add/remove one "
            "client): a record's own guarantee is its client's replacement, (2 epsilon, "
            "(1 + e^epsilon) delta) by group privacy, so a lower bound above the accounted epsilon "
            "does not by itself contradict the client-level claim"
        ),
    )


def _num(x: Any) -> float | None:
    if x is None:
        return None
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def _read_controls(root: Path, status: dict):
    """The run's audit controls (``audit-controls/controls.json`` and its status), if any."""
    from privkit.pipeline.controls import CONTROLS_DIR
    from reports import AuditControls

    st = status.get("controls") or {}
    if st.get("state") == "skipped":
        return AuditControls(state="skipped", message=st.get("error") or "audit controls disabled")
    if st.get("state") == "failed":
        return AuditControls(
            state="failed",
            error=st.get("error"),
            power=False,
            message=(
                f"The audit controls failed ({st.get('error')}): this report cannot show that its audit "
                "had the power to see a violation."
            ),
        )
    path = root / CONTROLS_DIR / "controls.json"
    if not path.is_file() or (st and st.get("state") != "done"):
        return None
    rec = _read_json(path)
    return AuditControls(
        state="done", **{k: v for k, v in rec.items() if k not in ("state", "schema_version")}
    )


def _add_mechanism_controls(method, root: Path, status: dict) -> None:
    """Attach the method's mechanism controls and rest its verdict on its strongest valid audit."""
    from reports import ReportWarning

    try:
        method.mechanism_controls = read_mechanism_controls(
            root, method.name, status, root / method.name
        )
    except Exception as exc:  # a damaged record must not cost the whole report
        method.warnings.append(
            ReportWarning(
                code="other",
                source="report",
                message=(f"mechanism controls could not be read: {_one_line(exc)}"),
            )
        )
    rest_verdict(method)


def build_report(
    root: str | Path, *, command: str | None = None, wall_seconds: float | None = None
):
    """Assemble a :class:`reports.PrivacyReport` from a pipeline run directory (files only).

    Parameters
    ----------
    root : str or pathlib.Path
        The run directory (``config.resolved.json``, ``status.json`` and one subdirectory per method).
    command : str, optional
        The command line that made the run, recorded in the report's metadata.
    wall_seconds : float, optional
        The run's wall-clock time, recorded in the report's metadata.

    Returns
    -------
    reports.PrivacyReport
    """
    import privkit
    from reports import (
        DatasetSummary,
        PrivacyReport,
        ReportWarning,
        RunMetadata,
        ThreatModel,
        delta_ge_one_over_n,
    )

    root = Path(root)
    cfg_path = root / "config.resolved.json"
    if not cfg_path.is_file():
        raise PrivkitError(f"not a pipeline run directory: {cfg_path} not found")
    resolved = _read_json(cfg_path)
    status = _read_json(root / "status.json") if (root / "status.json").is_file() else {}
    dataset = None
    if (root / "dataset.json").is_file():
        d = _read_json(root / "dataset.json")
        dataset = DatasetSummary(
            dataset=d["dataset"],
            public_dataset=d.get("public_dataset"),
            num_classes=d["num_classes"],
            partition=d["partition"],
            alpha=d.get("alpha"),
            seed=d.get("seed", 0),
            sizes=d.get("sizes", {}),
            client_sizes=[c["size"] for c in d.get("clients", [])],
            class_counts=[c["class_counts"] for c in d.get("clients", [])],
        )
    n_min = dataset.min_client_size if dataset else None
    methods = []
    for rm in resolved.get("resolved_methods", []):
        info = {**rm, "min_client_size": n_min, "delta": resolved["delta"]}
        st = (status.get("methods", {}).get(rm["key"]) or {}).get("stages", {})
        method = _method_report(rm["key"], info, st, root / rm["key"])
        _add_mechanism_controls(method, root, status)
        if rm.get("level") == "client" and method.verdict_basis == "black-box":
            method.warnings.append(_record_audit_of_client_claim())
        methods.append(method)
    delta = resolved["delta"]
    warnings = []
    if delta_ge_one_over_n(delta, n_min):
        warnings.append(
            ReportWarning(
                code="delta_ge_1_over_n",
                source="pipeline",
                message=f"delta = {delta:g} >= 1/n = {1.0 / n_min:.3g} for the smallest client "  # type: ignore[operator]  # n is known here
                f"(n = {n_min}): the guarantee would allow publishing a record in the clear",
            )
        )
    relations = {r for m in methods if m.privacy for r in m.privacy.neighbouring}
    confidences = {
        a.confidence
        for m in methods
        if m.audit
        for a in m.audit.attacks.values()
        if a.confidence is not None
    }
    audit_cfg = resolved.get("audit", {})
    seed = resolved.get("seed", 0)
    audit_notes: list[str] = []
    for m in methods:  # the audit layer states its design in every audit.json
        for k, v in ((m.audit.extra.get("assumptions") or {}) if m.audit else {}).items():
            label = {
                "audit_points": "Audit points",
                "shadows": "Shadow models",
                "bound": "Empirical bounds",
            }.get(k, k)
            note = f"{label}: {v}."
            if k in ("audit_points", "shadows", "bound") and note not in audit_notes:
                audit_notes.append(note)
    # a Flower app accounted by privkit.flower.Accounted records client-level events (one client's
    # whole update, Flower's central DP), and so does a method registered with level "client"
    # (dp-fedavg-client); privkit's other methods record record-level ones
    client_keys = {
        rm["key"]
        for rm in resolved.get("resolved_methods", [])
        if rm.get("method") == "flower" or rm.get("level") == "client"
    }
    client_level = sorted(m.name for m in methods if m.name in client_keys)
    flower = any(m.method == "flower" for m in methods if m.name in client_keys)
    central = "Flower's central DP" if flower else "central DP at a trusted server"
    unit_text = (
        {"unit": f"one client's whole data (client-level DP: {central}, per client)"}
        if client_level and len(client_level) == len(methods)
        else {}
    )
    level_text = (
        f"Client-level (user-level) epsilons for {', '.join(client_level)} ({central}: a "
        "client's whole update is the unit); every other epsilon is per client and record-level."
        if client_level
        else "Every epsilon is per client and record-level: the worst client's guarantee is the "
        "headline; client-level (user-level) privacy is not claimed."
    )
    threat = ThreatModel(
        **unit_text,
        neighbouring=_neighbouring_text(relations).replace(
            "one record", "one client's data" if unit_text else "one record"
        ),
        delta=delta,
        mechanism_audit=mechanism_threat_text(methods),
        accountants=[*resolved.get("accountants", ACCOUNTANTS), "best"],
        primary_accountant=resolved.get("accountant", "best"),
        shadows=audit_cfg.get("shadows") if audit_cfg.get("enabled", True) else None,
        confidence=confidences.pop() if len(confidences) == 1 else None,
        assumptions=[
            level_text,
            "The server, the public/auxiliary data and the test set are not private; only the "
            "clients' records are protected.",
            "Accounted epsilons are upper bounds from the mechanisms recorded in each method's "
            "ledger; empirical epsilons are statistical lower bounds from the audits.",
            "Membership audits attack a fresh run of each method's recipe whose audited records were "
            "included by fair coins from one pool, with reference runs of the same recipe on data of "
            "the same size; attribute audits attack the released run's shared artifacts.",
            *audit_notes,
            *(
                [
                    f"PLD accountant on a value grid of {resolved['pld_grid']:g} (coarser than the "
                    "default 1e-4: faster, still a pessimistic upper bound)."
                ]
                if resolved.get("pld_grid")
                else []
            ),
            f"Epsilon over rounds: {resolved.get('curve_accountant', 'rdp')} accountant, for the "
            "client with the largest final epsilon.",
        ],
    )
    meta = RunMetadata(
        name=resolved["name"],
        created=_now(),
        privkit_version=privkit.__version__,
        command=command,
        config=resolved,
        seeds={
            "run": seed,
            "federation": resolved.get("federation", {}).get("seed", 0),
            "audit": audit_cfg.get("seed") if audit_cfg.get("seed") is not None else seed,
            **{f"method:{m['key']}": m["seed"] for m in resolved.get("resolved_methods", [])},
        },
        package_versions=_package_versions(),
        hardware=_hardware(),
        reduced=list(resolved.get("report", {}).get("reduced", [])),
        wall_seconds=wall_seconds,
    )
    controls = _read_controls(root, status)
    if controls is not None and controls.lacks_power:
        warnings.append(
            ReportWarning(code="reduced_audit", source="audit", message=controls.message)
        )
    return PrivacyReport(
        title=resolved.get("report", {}).get("title", "privkit privacy report"),
        metadata=meta,
        threat_model=threat,
        dataset=dataset,
        methods=methods,
        warnings=warnings,
        controls=controls,
    )


def rerender(root: str | Path, *, rebuild: bool = False, formats: list[str] | None = None):
    """``privkit report``: re-render ``report.json`` (or rebuild it from the run directories).

    Parameters
    ----------
    root : str or pathlib.Path
        The run directory.
    rebuild : bool
        Rebuild ``report.json`` from the run's files even where it exists (it is rebuilt anyway when
        missing).
    formats : list of str, optional
        The formats to write (default: every one of ``reports.FORMATS``); ``json`` is written only
        when the report is rebuilt.

    Returns
    -------
    tuple
        The report and what ``reports.write_report`` returns (the paths written).
    """
    from reports import FORMATS, load_report, write_report

    root = Path(root)
    if not root.is_dir():
        raise PrivkitError(f"run directory not found: {root}")
    if rebuild or not (root / "report.json").is_file():
        report = build_report(root)
        formats = list(formats or FORMATS)
        if "json" not in formats:
            formats.append("json")
    else:
        report = load_report(checked(root / "report.json", "report"))
        formats = [f for f in (formats or FORMATS) if f != "json"]
    cfg_path = root / "config.resolved.json"
    workers = int(_read_json(cfg_path).get("workers", 1)) if cfg_path.is_file() else 1
    return report, write_report(
        report, root, formats=formats, write=write_text, figure_workers=workers
    )
