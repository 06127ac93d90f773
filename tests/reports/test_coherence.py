"""One rule for "formal DP" (reports.guarantee) and a report whose cells agree with it: a delta-only
guarantee with delta >= 1/n is never shown as epsilon 0, the headline empirical epsilon and the
attack named beside it come from the verdict, "not applicable" is grey with its reason, coinciding
curves stay visible."""

from __future__ import annotations

import math

import pytest

from reports import (
    AttackResult,
    AttributeResult,
    MethodReport,
    PaperClaim,
    PrivacyAccounting,
    StageStatus,
    Utility,
    Verdict,
    formal_dp_status,
    render_html,
    render_markdown,
    summary_rows,
)

DONE = {s: StageStatus(state="done") for s in ("train", "account", "audit", "report")}


# ------------------------------------------------------------------------------- the rule
@pytest.mark.parametrize(
    "kwargs, formal, label, words",
    [
        (dict(claims_dp=True, epsilon=1.2), True, "yes", ""),
        (dict(claims_dp=False, epsilon=1.2), False, "no", "no formal DP claim"),
        (
            dict(claims_dp=True, epsilon=math.inf, non_private=["model-update", "model-update"]),
            False,
            "no",
            "without noise is recorded (model-update)",
        ),
        (
            dict(claims_dp=True, epsilon=math.inf, fixed_delta=0.08, n_min=100),
            False,
            "δ ≥ 1/n",
            "permits publishing records",
        ),
        (
            dict(claims_dp=True, epsilon=math.inf, fixed_delta=1e-3, n_min=100),
            False,
            "not at this δ",
            "only at delta >= 0.001",
        ),
        (dict(claims_dp=True, epsilon=math.inf), False, "no", "no finite epsilon at delta 1e-05"),
        (
            dict(claims_dp=True, epsilon=0.0, n_min=8, delta=0.2),
            False,
            "δ ≥ 1/n",
            "finite only because delta = 0.2 >= 1/n",
        ),
        (
            dict(claims_dp=True, epsilon=None, error="event X unsupported"),
            False,
            "not accounted",
            "event X unsupported",
        ),
    ],
)
def test_formal_dp_rule(kwargs, formal, label, words):
    out = formal_dp_status(**{"delta": 1e-5, **kwargs})
    assert (out.formal, out.label) == (formal, label)
    assert words in out.reason


def test_nfdp_ledger_is_delta_only_with_delta_at_least_one_over_n():
    """FedMD-NFDP's subsample release: (0, delta) with delta = 1 - (1 - 1/n)^k (with replacement,
    the paper's Theorem 2), far above 1/n; the ledger spends it as fixed delta."""
    from accountants import Ledger, NfdpSubsampleEvent

    n, k = 160, 16
    ledger = Ledger()
    ledger.add("0", NfdpSubsampleEvent(n=n, k=k, replacement=True), "subsample")
    summary = ledger.summary(1e-5, accountants=["rdp", "pld"])
    fixed = summary["delta_split"]["0"]["fixed_delta"]
    assert fixed == pytest.approx(1 - (1 - 1 / n) ** k, rel=1e-12)  # closed form
    out = formal_dp_status(
        claims_dp=True, epsilon=summary["worst"]["best"], delta=1e-5, fixed_delta=fixed, n_min=n
    )
    assert math.isinf(summary["worst"]["best"])
    assert (out.formal, out.label) == (False, "δ ≥ 1/n")


# ------------------------------------------------------------------------------- the report
def _nfdp_row() -> MethodReport:
    # the sample report's smallest client holds 6 records: 1/n = 0.167 <= 0.2
    rule = formal_dp_status(claims_dp=True, epsilon=math.inf, delta=1e-5, fixed_delta=0.2, n_min=6)
    return MethodReport(
        name="fedmd-nfdp",
        method="fedmd-nfdp",
        formal_dp=rule.formal,
        formal_dp_label=rule.label,
        formal_dp_reason=rule.reason,
        claims_dp=True,
        utility=Utility(test_accuracy=0.38),
        privacy=PrivacyAccounting(
            delta=1e-5,
            accountants=["pld"],
            primary_accountant="pld",
            worst={"pld": math.inf},
            fixed_delta=0.2,
            claim=PaperClaim(epsilon=0.0, delta=0.2, source="Thm 2"),
            epsilon_at_claim_delta=0.0,
        ),
        verdict=Verdict(status="no-claim", message=rule.reason),
        stages=dict(DONE),
    )


def test_delta_only_guarantee_is_never_shown_as_epsilon_zero(sample_report):
    report = sample_report
    report.methods[3] = _nfdp_row()
    row = next(r for r in summary_rows(report) if r["name"] == "fedmd-nfdp")
    assert row["formal_dp"] == "δ ≥ 1/n" and "permits publishing" in row["formal_dp_reason"]
    assert row["tight_at_claim"]["text"] == "none: δ ≥ 1/n"
    assert row["claim_delta"].endswith("≥ 1/n")
    assert row["verdict"] == "no-claim"
    md = render_markdown(report)
    line = next(ln for ln in md.splitlines() if ln.startswith("| fedmd-nfdp |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1] == "δ ≥ 1/n" and cells[4] == "none: δ ≥ 1/n" and cells[2] == "inf"
    assert "privkit at that δ: ε = 0" not in md
    html = render_html(report, figures=False)
    assert (
        "not a meaningful guarantee" in html and "privkit at the same δ: <b>ε = 0</b>" not in html
    )


def test_headline_bound_and_attack_come_from_the_verdict(sample_report):
    """The summary's empirical epsilon is the verdict's family-wise bound, and the attack named
    beside it is the one whose family-wise bound that is (not the largest unadjusted bound)."""
    report = sample_report
    dp = report.methods[0]
    for name, fam in (("loss", 0.0), ("shadow", 0.05)):
        dp.audit.attacks[name].__pydantic_extra__["family_epsilon_lower_bound"] = fam
    dp.audit.attacks["loss"].epsilon_lower_bound = 0.3  # larger own bound, smaller family-wise one
    row = next(r for r in summary_rows(report) if r["name"] == "fedauxfdp")
    assert (row["attack"], row["emp_eps"]["text"]) == ("shadow", "0.05")
    assert dp.audit_numbers()[0] == dp.verdict.epsilon_lower_bound == 0.05


def test_not_applicable_is_grey_with_its_reason_and_no_failure(sample_report):
    report = sample_report
    dp = report.methods[0]
    reason = "method fedauxfdp shares no per-client artifacts to attack"
    dp.audit.attribute["dominant-class"] = AttributeResult(not_applicable=reason)
    dp.audit.attacks["lira"] = AttackResult(not_applicable="needs per-example logits")
    html = render_html(report, figures=False)
    assert f'<td class="na" colspan="4">not applicable: {reason}</td>' in html
    assert "not applicable: needs per-example logits" in html
    assert f"failed: {reason}" not in html
    row = next(r for r in summary_rows(report) if r["name"] == "fedauxfdp")
    assert row["stages"] == "ok" and row["attack"] == "shadow"


def test_coinciding_curves_stay_visible(sample_report):
    """fedkd-dp and dp-fedavg spend the same epsilon every round: both curves are drawn with
    different markers and the legend says they coincide."""
    from reports.plots import epsilon_over_rounds_figure

    report = sample_report
    same = [(1, 0.3), (2, 0.6), (3, 0.9), (4, 1.2)]
    report.methods[1].privacy = PrivacyAccounting(
        delta=1e-5, worst={"pld": 1.2}, primary_accountant="pld", epsilon_over_rounds=same
    )
    fig = epsilon_over_rounds_figure(report)
    lines = {ln.get_label(): ln for ln in fig.axes[0].get_lines()}
    assert set(lines) == {"fedauxfdp", "fedavg (= fedauxfdp)", "flip-eps8"}
    a, b = lines["fedauxfdp"], lines["fedavg (= fedauxfdp)"]
    assert list(a.get_ydata()) == list(b.get_ydata())
    assert (a.get_marker(), a.get_linestyle()) != (b.get_marker(), b.get_linestyle())


def test_privacy_utility_places_rows_by_the_rule(sample_report):
    """A row the rule calls not formal sits in the 'no formal DP' band even with a finite
    epsilon (no claim), and its band label carries the rule's label."""
    from reports.plots import privacy_utility_figure

    report = sample_report
    report.methods[3] = _nfdp_row()
    report.methods[2].formal_dp = False  # flip-eps8: finite epsilon 8, but no formal claim
    fig = privacy_utility_figure(report)
    ax, ax_inf = fig.axes[0], fig.axes[1]
    finite = sorted(tuple(map(float, p)) for c in ax.collections for p in c.get_offsets())
    band = sorted(float(p[1]) for c in ax_inf.collections for p in c.get_offsets())
    assert finite == [(1.2, 0.71)]
    assert band == [0.38, 0.6, 0.85]
    assert any(t.get_text() == "fedmd-nfdp (δ ≥ 1/n)" for t in ax_inf.texts)
