"""View model of the mechanism controls: the "Mechanism controls" table and each method's paragraph
on the audit its verdict rests on (templates in ``reports/templates``)."""

from __future__ import annotations

from typing import Any

from reports.formatting import fmt_eps, fmt_num
from reports.schema import MechanismControls, MechanismTwin, MethodReport, PrivacyReport

#: what the mechanism audit tests, in one sentence (method sections and the how-to-read list)
TESTS = (
    "it tests the claimed mechanism where it runs, at each probed DP mechanism: the number of "
    "releases, the noise scale and the influence of one record (sampling rate x clip or "
    "sensitivity) against the ledger, plus a model-free one-run lower bound on epsilon"
)
BASIS = {
    "mechanism": "mechanism audit",
    "black-box": "black-box audit",
    "canary-clients": "canary-client audit (client-level)",
    "canary-records": "canary-record audit (record-level)",
    "canaries": "white-box canary audit",
}


def _fmt(x: float | None) -> str:
    return fmt_num(x, 3)


def _eps(x: float | None) -> str:
    return fmt_eps(x)


def _twin_row(method: str, t: MechanismTwin) -> dict[str, Any]:
    return {
        "method": method,
        "twin": t.twin,
        "description": t.description,
        "status": t.status,
        "expected": t.expected,
        "as_expected": "yes" if t.as_expected else "NO",
        "rejected": ", ".join(t.rejected) or "none",
        "noise": _fmt(t.noise_ratio),
        "bound": _eps(t.epsilon_lower_bound),
        "measured": _eps(t.measured_epsilon),
        "claimed": _eps(t.claimed_epsilon),
        "accounted": _eps(t.accounted_epsilon),
        "message": t.message,
    }


def _state_row(method: str, mc: MechanismControls) -> dict[str, Any]:
    text = {"unprobed": "no probed mechanism", "failed": "failed", "skipped": "skipped"}[mc.state]
    return {
        "method": method,
        "twin": "—",
        "description": "",
        "status": text,
        "expected": "",
        "as_expected": "—",
        "rejected": "—",
        "noise": "—",
        "bound": "—",
        "measured": "—",
        "claimed": "—",
        "accounted": "—",
        "message": mc.reason or mc.error or mc.message,
    }


def mechanism_controls_view(report: PrivacyReport) -> list[dict[str, Any]]:
    """One row per twin of every method with mechanism controls (one row for a method without)."""
    rows = []
    for m in report.methods:
        mc = m.mechanism_controls
        if mc is None:
            continue
        if mc.state == "done":
            rows += [_twin_row(m.name, t) for t in mc.twins]
        else:
            rows.append(_state_row(m.name, mc))
    return rows


def _tests_rows(t: MechanismTwin) -> list[dict[str, Any]]:
    """The correct twin's conformance tests, per probe set."""
    out = []
    for p in t.probes:
        for name, c in p.tests.items():
            out.append(
                {
                    "probe": f"client {p.client} {p.mechanism}",
                    "test": name,
                    "measured": _num(c.measured),
                    "claimed": _num(c.claimed),
                    "limit": _num(c.confidence_limit),
                    "detectable": _num(c.detectable) if c.detectable is not None else "exact",
                    "rejected": "yes" if c.rejected else "no",
                }
            )
    return out


def _num(x: float | None) -> str:
    """A count as an integer, a ratio with 4 significant digits."""
    if x is None:
        return "—"
    return str(int(x)) if float(x).is_integer() and abs(x) >= 1 else f"{x:.4g}"


def method_mechanism_view(m: MethodReport) -> dict[str, Any] | None:
    """What a method's section says about its mechanism controls and the audit its verdict rests on."""
    mc = m.mechanism_controls
    if mc is None:
        return None
    correct, half = mc.correct, mc.noise_halved
    black_box = m.audit.verdict if m.audit else None
    if m.verdict_basis == "mechanism":
        basis = (
            f"The verdict rests on the mechanism audit of the correct twin (white-box): {TESTS}. "
            f"The black-box audit's verdict ({black_box.status if black_box else 'none'}) is kept "
            "in the evidence below."
        )
    elif m.verdict_basis == "black-box" and correct is not None and m.formal_dp:
        basis = (
            "The verdict rests on the black-box audit: its violation stands whatever the "
            f"mechanism audit of the correct twin says ({correct.status})."
        )
    elif m.verdict_basis == "black-box":
        basis = (
            "The verdict rests on the black-box audit: there is no mechanism audit of this method."
        )
    else:
        basis = ""
    lacks = (
        f"WARNING: the mechanism audit lacked power: the {half.twin} twin came out {half.status}, "
        "not violation."
        if half is not None and mc.lacks_power
        else ""
    )
    return {
        "mc": mc,
        "basis": basis,
        "lacks_power": lacks,
        "twins": [_twin_row(m.name, t) for t in mc.twins],
        "tests": _tests_rows(correct) if correct is not None else [],
        "none": mc.reason or mc.error or mc.message if mc.state != "done" else "",
    }
