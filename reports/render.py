"""Renderers: one self-contained HTML page, Markdown, and JSON, all from a :class:`PrivacyReport`.

The HTML page has no external assets: figures are PNG data URIs, styles and the few lines of
table-sorting JavaScript are inline. Templates are jinja2 files shipped in ``reports/templates``.
Files are written atomically (temporary file + rename), so an interrupted write never leaves a
half report behind.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jinja2
from pydantic import ValidationError

import atomicfiles
from reports.formatting import fmt_bracket, fmt_eps, fmt_num, fmt_pct, sort_value
from reports.guarantee import delta_ge_one_over_n
from reports.mechanism_view import BASIS, TESTS, mechanism_controls_view, method_mechanism_view
from reports.schema import AttackResult, MethodReport, PrivacyReport

FORMATS = ("json", "html", "md")
"""The formats :func:`write_report` writes: ``report.json``, ``report.html``, ``report.md``."""
_FILES = {"json": "report.json", "html": "report.html", "md": "report.md"}

HOW_TO_READ = [
    "Promise: the accounted epsilon is a sound upper bound on what any attacker can learn about one "
    "record of the worst-off client, at the stated delta, under the named accountant, from the "
    "mechanisms that actually ran. Smaller is more private; 'inf' means no finite guarantee at "
    "this delta.",
    "Formal DP: 'yes' only when the method claims a guarantee and its ledger gives a finite epsilon "
    "at the report's delta; otherwise the cell says why not: 'no' (no claim, or a release without "
    "noise), 'not at this δ' (finite only at a larger delta) or 'δ ≥ 1/n' (the guarantee needs a "
    "delta of at least one over the smallest client's size, which permits publishing records in "
    "the clear; it is never shown as epsilon 0). The same rule sets the verdict and the charts.",
    "Paper claim: what the method's paper states for the same setting, beside privkit's tight value "
    "at the paper's own delta. A claim below privkit's value is not supported by the mechanisms run.",
    "Evidence: membership-inference audits attack a fresh run of each method's own recipe in which "
    "every audited record was included by a fair coin (reference runs of the same recipe train on "
    "as much data as the release); attribute inference attacks what the released run's clients "
    "share. AUC 0.5 is chance. The empirical epsilon is a statistical lower bound (one-sided, at "
    "the stated confidence): a sound guarantee never lies below it. It cannot exceed the ceiling "
    "set by the number of trials, so a small lower bound from a small audit is weak evidence of "
    "privacy, not proof. 'not applicable' (grey) means the method exposes nothing that attack "
    "needs (the reason is given); it is not a failure.",
    "Verdict: 'violation' means the audit's family-wise lower bound, which holds at the stated "
    "confidence for all attacks together, exceeds the accounted epsilon: the implementation or the "
    "privacy claim is wrong. 'consistent' means no bound exceeded it although this audit's ceiling "
    "(the largest bound any outcome could give) lies above it; the detectable epsilon says how large "
    "the true epsilon must be before this audit flags it at least half the time, so a consistent "
    "verdict is evidence only against a true epsilon of about that size or more. 'inconclusive' means the ceiling is not above the "
    "accounted epsilon, so no outcome of this audit could have contradicted the claim; 'no-claim' "
    "means the formal-DP rule above says no (no finite, meaningful accounted epsilon to check).",
    "Verdict rests on: for a method with a formal guarantee and mechanism controls, the summary's "
    "verdict is the white-box mechanism audit of its correct twin ('mechanism audit'): "
    + TESTS
    + ". "
    "It needs no large ceiling, so it is 'violation' or 'consistent', never 'inconclusive'; a "
    "black-box 'violation' still stands over it. The black-box numbers of the row (AUC, empirical ε, "
    "ceiling, detectable ε) stay the black-box audit's, and its verdict is kept in the method's "
    "section. Each such method also has a noise-halved twin, which its audit must flag "
    "('Mechanism controls').",
    "Cost: test accuracy of the released model on the held-out test set (and per-client accuracy for "
    "personalised models), compared with the best method without a formal guarantee.",
]
"""The report's "How to read this report" paragraphs, one per question (HTML and Markdown)."""


def _cell(text: str, value: float | None = None) -> dict:
    return {"text": text, "value": sort_value(value) if value is not None else ""}


# ---------------------------------------------------------------------------------- view model
def _accuracy(m: MethodReport) -> float | None:
    """A method's test accuracy; None when it has none (or NaN)."""
    acc = m.utility.test_accuracy if m.utility else None
    return None if acc is None or math.isnan(acc) else acc


def non_private_reference(report: PrivacyReport) -> MethodReport | None:
    """The most accurate method without a formal guarantee (the 'cost' reference), if any."""
    cands = [
        (acc, m) for m in report.methods if not m.formal_dp and (acc := _accuracy(m)) is not None
    ]
    return max(cands, key=lambda c: c[0])[1] if cands else None


def formal_dp_label(m: MethodReport) -> str:
    """The formal-DP rule's short answer for a row (older reports: yes/no)."""
    return m.formal_dp_label or ("yes" if m.formal_dp else "no")


def _min_client_size(report: PrivacyReport) -> int | None:
    return report.dataset.min_client_size if report.dataset else None


def claim_view(m: MethodReport, n_min: int | None) -> dict[str, Any]:
    """The paper's claim and privkit's epsilon at its delta, as table cells. A claim whose delta is
    >= 1/n permits publishing records: it is shown as such, never as a small or zero epsilon."""
    p = m.privacy
    claim = p.claim if p else None
    if claim is None:
        return {"claim": _cell("—"), "claim_delta": "", "tight": _cell("—"), "void": False}
    void = claim.delta is not None and claim.delta < 1 and delta_ge_one_over_n(claim.delta, n_min)
    delta_text = f"{claim.delta:.3g}" if claim.delta else ""
    if void:
        return {
            "claim": _cell(fmt_eps(claim.epsilon), math.inf),
            "void": True,
            "claim_delta": f"{delta_text} ≥ 1/n",
            "tight": _cell("none: δ ≥ 1/n", math.inf),
        }
    tight = p.epsilon_at_claim_delta if p else None
    return {
        "claim": _cell(fmt_eps(claim.epsilon) if claim.epsilon is not None else "—", claim.epsilon),
        "claim_delta": delta_text,
        "void": False,
        "tight": _cell(fmt_eps(tight), tight),
    }


def _verdict(m: MethodReport) -> tuple[str, str]:
    v = m.verdict or (m.audit.verdict if m.audit else None)
    if v is None:
        return ("not-audited", "no audit result") if m.audit is None else ("inconclusive", "")
    return v.status, v.message


def _stage_text(m: MethodReport) -> str:
    failed = [f"{k} failed" for k, s in m.stages.items() if s.state == "failed"]
    if failed:
        return "; ".join(failed)
    if m.stages and all(s.state == "done" for s in m.stages.values()):
        return "ok"
    return ", ".join(f"{k} {s.state}" for k, s in m.stages.items()) or "—"


def summary_rows(report: PrivacyReport) -> list[dict[str, Any]]:
    """One row per method for the headline table (display text plus numeric sort keys)."""
    ref = non_private_reference(report)
    n_min = _min_client_size(report)
    rows = []
    for m in report.methods:
        acc = m.utility.test_accuracy if m.utility else None
        eps = m.privacy.epsilon if m.privacy else None
        claim = claim_view(m, n_min)
        best = m.audit.best_attack() if m.audit else None
        lb, ceiling, detectable = m.audit_numbers()
        cost = None
        ref_acc = _accuracy(ref) if ref is not None else None
        if ref_acc is not None and acc is not None and not math.isnan(acc):
            cost = acc - ref_acc
        status, message = _verdict(m)
        rows.append(
            {
                "name": m.name,
                "anchor": anchor(m.name),
                "method": m.method,
                "formal_dp": formal_dp_label(m),
                "formal_dp_reason": m.formal_dp_reason,
                "epsilon": _cell(fmt_eps(eps), eps),
                "claim": claim["claim"],
                "claim_delta": claim["claim_delta"],
                "tight_at_claim": claim["tight"],
                "accuracy": _cell(fmt_pct(acc), acc),
                "cost": _cell(
                    "—" if cost is None else "reference" if m is ref else f"{100 * cost:+.1f} pt",
                    cost,
                ),
                "auc": _cell(fmt_num(best[1].auc) if best else "—", best[1].auc if best else None),
                "attack": best[0] if best else "",
                "emp_eps": _cell(fmt_eps(lb), lb),
                "ceiling": fmt_eps(ceiling),
                "detectable": _cell(fmt_eps(detectable), detectable),
                "verdict": status,
                "verdict_message": message,
                "basis": BASIS.get(m.verdict_basis or "", "—"),
                "stages": _stage_text(m),
                "n_warnings": len(m.warnings),
            }
        )
    return rows


def anchor(name: str) -> str:
    return "m-" + "".join(c if c.isalnum() else "-" for c in name)


def _attack_rows(m: MethodReport) -> list[dict[str, Any]]:
    rows = []
    for name, a in m.audit.attacks.items() if m.audit else []:
        rows.append(
            {
                "name": name,
                "error": a.error,
                "not_applicable": a.not_applicable,
                "notes": a.notes or "",
                **_attack_cells(a),
            }
        )
    return rows


def _attack_cells(a: AttackResult) -> dict[str, Any]:
    t = a.tpr_at_fpr or {}
    keys = sorted(t, key=lambda k: float(k))
    return {
        "auc": _cell(fmt_num(a.auc), a.auc),
        "balanced_accuracy": _cell(fmt_num(a.balanced_accuracy), a.balanced_accuracy),
        "advantage": _cell(fmt_num(a.advantage), a.advantage),
        "tpr": [(f"{float(k):g}", _cell(fmt_num(t[k], 4), t[k])) for k in keys],
        "eps_lb": _cell(fmt_eps(a.epsilon_lower_bound), a.epsilon_lower_bound),
        "ceiling": _cell(fmt_eps(a.ceiling), a.ceiling),
        "confidence": fmt_pct(a.confidence) if a.confidence is not None else "—",
        "n_trials": str(a.n_trials) if a.n_trials is not None else "—",
    }


def _tpr_keys(report: PrivacyReport) -> list[str]:
    keys: set[str] = set()
    for m in report.methods:
        if m.audit:
            for a in m.audit.attacks.values():
                keys.update(a.tpr_at_fpr or {})
    return [f"{float(k):g}" for k in sorted(keys, key=float)]


def _method_view(m: MethodReport, ref: MethodReport | None, n_min: int | None) -> dict[str, Any]:
    p = m.privacy
    acct_rows = []
    client_rows = []
    if p is not None:
        for acct, eps in p.worst.items():
            acct_rows.append(
                {
                    "accountant": acct,
                    "eps": _cell(fmt_eps(eps), eps),
                    "primary": acct == p.primary_accountant,
                    "bracket": fmt_bracket(p.epsilon_bracket.get(acct), p.bracket_reason.get(acct)),
                }
            )
        accts = p.accountants or sorted({a for c in p.clients.values() for a in c})
        for cid, vals in p.clients.items():
            client_rows.append(
                {"client": cid, "cells": [_cell(fmt_eps(vals.get(a)), vals.get(a)) for a in accts]}
            )
    u = m.utility
    client_acc = []
    if u and u.client_accuracy:
        client_acc = [
            {"client": str(i), "acc": _cell(fmt_pct(a), a)} for i, a in enumerate(u.client_accuracy)
        ]
    attribute = [
        {
            "name": n,
            "error": a.error,
            "not_applicable": a.not_applicable,
            "accuracy": _cell(fmt_pct(a.accuracy), a.accuracy),
            "ci": (
                f"[{fmt_pct(a.ci_low)}, {fmt_pct(a.ci_high)}]"
                if a.ci_low is not None and a.ci_high is not None
                else "—"
            ),
            "chance": fmt_pct(a.chance),
            "n_test": str(a.n_test or "—"),
        }
        for n, a in (m.audit.attribute.items() if m.audit else [])
    ]
    status, message = _verdict(m)
    acc = u.test_accuracy if u else None
    return {
        "m": m,
        "anchor": anchor(m.name),
        "accounts": acct_rows,
        "client_accountants": (p.accountants or sorted({a for c in p.clients.values() for a in c}))
        if p
        else [],
        "client_rows": client_rows,
        "client_acc": client_acc,
        "mean_client_acc": fmt_pct(u.mean_client_accuracy) if u else "—",
        "attacks": _attack_rows(m),
        "attribute": attribute,
        "verdict": status,
        "verdict_message": message,
        "mechanism": method_mechanism_view(m),
        "black_box_verdict": m.audit.verdict
        if m.audit and m.verdict_basis == "mechanism"
        else None,
        "accuracy": fmt_pct(acc),
        "ref_name": ref.name if ref is not None and ref.name != m.name else None,
        "ref_accuracy": fmt_pct(_accuracy(ref)) if ref is not None else "—",
        "eps": fmt_eps(p.epsilon) if p else "—",
        "claim": claim_view(m, n_min),
        "formal_dp_label": formal_dp_label(m),
        "config_json": json.dumps(m.config, indent=2, sort_keys=True, default=str),
        "stages": [(k, s) for k, s in m.stages.items()],
        **_accounting_view(m),
    }


def controls_view(report: PrivacyReport) -> dict[str, Any] | None:
    """The "Audit controls" section: one row per audit of a twin (None if the report has none)."""
    c = report.controls
    if c is None:
        return None
    rows = []
    for a in c.controls:
        v = a.verdict
        best = ((v.model_extra or {}).get("attacks") or {}).get(v.attack) or {}
        right = (
            f"{best['correct']}/{best['guesses']}"
            if "correct" in best and "guesses" in best
            else "—"
        )
        rows.append(
            {
                "name": a.name,
                "mode": a.audit_mode,
                "expected": a.expected,
                "status": v.status,
                "bound": fmt_eps(v.epsilon_lower_bound),
                "ceiling": fmt_eps(v.epsilon_ceiling),
                "right": right,
                "accuracy": fmt_pct(a.test_accuracy),
                "mechanism": a.mechanism,
                "passed": "yes" if a.passed else "NO",
                "message": v.message,
            }
        )
    return {
        "c": c,
        "rows": rows,
        "banner": c.message if c.lacks_power else None,
        "claimed": fmt_eps(c.claimed_epsilon),
    }


def _accounting_view(m: MethodReport) -> dict[str, Any]:
    """Which claim each audit bound tests, the ROC-vs-ledger sentence, and the noise/adaptivity notes."""
    from reports.roc_claims import roc_claim_sentence

    claims = []
    for key, c in m.audit.claims.items() if m.audit else []:
        lb, ceil = c.get("epsilon_lower_bound"), c.get("epsilon_ceiling")
        claims.append(
            {
                "key": key,
                "claim": c.get("claim_tested", key),
                "error": c.get("error"),
                "lb": fmt_eps(_float(lb)),
                "ceiling": fmt_eps(_float(ceil)),
                "status": c.get("status", "—"),
                "in_verdict": bool(c.get("in_verdict")),
            }
        )
    p = m.privacy
    adaptive = p.adaptive_composition if p else None
    return {
        "claims": claims,
        "roc_claim": roc_claim_sentence(m),
        "not_for_release": bool(p and p.reproducible_noise),
        "adaptive": (
            {
                "epsilon": fmt_eps(_float(adaptive.get("epsilon"))),
                "source": adaptive.get("source", ""),
                "order": adaptive.get("order"),
            }
            if isinstance(adaptive, dict)
            else None
        ),
    }


def _float(x: Any) -> float | None:
    if x in ("Infinity", "inf"):
        return math.inf
    return float(x) if isinstance(x, (int, float)) else None


def _view(report: PrivacyReport, figures: dict[str, str]) -> dict[str, Any]:
    ref = non_private_reference(report)
    confidences = sorted(
        {
            a.confidence
            for m in report.methods
            if m.audit
            for a in m.audit.attacks.values()
            if a.confidence is not None
        }
    )
    return {
        "r": report,
        "rows": summary_rows(report),
        "methods": [_method_view(m, ref, _min_client_size(report)) for m in report.methods],
        "tpr_keys": _tpr_keys(report),
        "figures": figures,
        "how_to_read": HOW_TO_READ,
        "controls": controls_view(report),
        "mechanism_rows": mechanism_controls_view(report),
        "ref": ref,
        "audit_confidences": [fmt_pct(c) for c in confidences],
        "fmt_eps": fmt_eps,
        "fmt_pct": fmt_pct,
        "config_json": json.dumps(report.metadata.config, indent=2, sort_keys=True, default=str),
    }


# ---------------------------------------------------------------------------------- renderers
def _env(autoescape: bool) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("reports", "templates"),
        autoescape=autoescape,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["md"] = _md_escape
    return env


def _md_escape(text: Any) -> str:
    """Make a value safe inside a Markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_html(report: PrivacyReport, *, figures: bool = True, workers: int = 1) -> str:
    """One self-contained HTML page (figures embedded as PNG data URIs, inline CSS/JS).

    ``workers > 1`` draws the figures in that many processes (:func:`reports.plots.report_pngs`).
    """
    uris: dict[str, str] = {}
    if figures:
        from reports.plots import png_data_uri, report_pngs

        uris = {k: png_data_uri(png) for k, png in report_pngs(report, workers).items()}
    return _env(True).get_template("report.html.j2").render(**_view(report, uris))


def render_markdown(report: PrivacyReport) -> str:
    """A Markdown summary (tables only; figures live in the HTML page)."""
    return _env(False).get_template("report.md.j2").render(**_view(report, {}))


def render_json(report: PrivacyReport) -> str:
    """The report as JSON text (what ``report.json`` holds; :func:`load_report` reads it back)."""
    return report.to_json()


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically with its checksum sidecar (:mod:`atomicfiles`: a
    temporary file in the same folder, fsync, a rename; ``.<name>.sha256`` beside it)."""
    return atomicfiles.write_text(path, text)


def write_report(
    report: PrivacyReport,
    out_dir: str | Path,
    formats: Iterable[str] = FORMATS,
    write: Callable[[Path, str], Path] = atomic_write_text,
    figure_workers: int = 1,
) -> dict[str, Path]:
    """Write ``report.json`` / ``report.html`` / ``report.md`` into ``out_dir`` (atomically).

    ``write(path, text)`` stores one file (an application may add its checksums);
    ``figure_workers`` processes draw the HTML page's figures. Returns the written paths keyed by
    format.
    """
    formats = list(formats)
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise ValueError(f"formats must be among {', '.join(FORMATS)}; found {bad}")
    render = {
        "json": render_json,
        "html": lambda r: render_html(r, workers=figure_workers),
        "md": render_markdown,
    }
    out = Path(out_dir)
    return {f: write(out / _FILES[f], render[f](report)) for f in formats}


def load_report(path: str | Path) -> PrivacyReport:
    """Read a report from ``report.json`` or from a folder holding one."""
    p = Path(path)
    if p.is_dir():
        p = p / _FILES["json"]
    if not p.is_file():
        raise FileNotFoundError(f"report not found: {p}")
    try:  # a file whose checksum sidecar disagrees is refused before it is parsed
        return PrivacyReport.from_json(atomicfiles.read_verified(p, "report file").decode("utf-8"))
    except atomicfiles.CorruptFileError:
        raise
    except (ValueError, OSError) as exc:  # pydantic's ValidationError is a ValueError
        detail = " ".join(str(exc).split())
        if isinstance(exc, ValidationError):  # pydantic: the first bad field, not the whole dump
            err = exc.errors()[0]
            detail = f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}"
        raise ValueError(f"report file {p} is unreadable or corrupted: {detail}") from None
