"""The mechanism controls in a report: the row's verdict basis, the "Mechanism controls" table,
each method's paragraph, the threat-model sentence, and a report that travels as JSON alone."""

from __future__ import annotations

from reports import (
    MechanismControls,
    MechanismProbe,
    MechanismTwin,
    PrivacyReport,
    Verdict,
    render_html,
    render_markdown,
    summary_rows,
)


def _twin(name: str, status: str, expected: str, noise: float) -> MechanismTwin:
    probe = MechanismProbe(
        client=0,
        mechanism="dp-sgd",
        status=status,
        rejected=["noise"] if status == "violation" else [],
        tests={
            "releases": {
                "name": "releases",
                "rejected": False,
                "measured": 20,
                "claimed": 20,
                "confidence_limit": 20,
                "detectable": None,
            },
            "noise": {
                "name": "noise",
                "rejected": status == "violation",
                "measured": noise,
                "claimed": 1.0,
                "confidence_limit": noise + 0.002,
                "detectable": 0.998,
            },
        },
        epsilon_lower_bound=0.9,
        epsilon_ceiling=3.4,
        measured_epsilon=6.6 / noise**2,
        claimed_epsilon=6.6,
        canaries=1000,
        releases=20,
    )
    return MechanismTwin(
        twin=name,
        expected=expected,
        status=status,
        as_expected=status == expected,
        message=f"{name} audited",
        accounted_epsilon=6.6,
        epsilon_lower_bound=0.9,
        measured_epsilon=probe.measured_epsilon,
        probes=[probe],
    )


def _with_mechanism(report: PrivacyReport, half_status: str = "violation") -> PrivacyReport:
    dp = report.methods[0]
    dp.mechanism_controls = MechanismControls(
        confidence=0.95,
        canaries=1000,
        clients=[0],
        delta=1e-5,
        twins=[
            _twin("correct", "consistent", "consistent", 1.001),
            _twin(
                "noise x1/2", half_status, "violation", 0.5 if half_status == "violation" else 0.99
            ),
        ],
        catchable="fedauxfdp: the mechanism audit catches noise below 0.998 of the claimed scale, any "
        "release the ledger does not count.",
    )
    dp.audit.verdict = Verdict(status="inconclusive", message="ceiling below")
    dp.verdict = Verdict(
        status="consistent", message="mechanism audit of the correct twin (white-box)"
    )
    dp.verdict_basis = "mechanism"
    report.methods[2].mechanism_controls = MechanismControls(
        state="unprobed", reason="its ledger records no Gaussian mechanism (NfdpSubsampleEvent)"
    )
    report.threat_model.mechanism_audit = (
        "white-box ... the adversary differential privacy is defined "
        "against ... Bonferroni over its probe sets."
    )
    return report


def test_summary_row_says_which_audit_its_verdict_rests_on(sample_report):
    report = _with_mechanism(sample_report)
    rows = {r["name"]: r for r in summary_rows(report)}
    assert (rows["fedauxfdp"]["verdict"], rows["fedauxfdp"]["basis"]) == (
        "consistent",
        "mechanism audit",
    )
    assert rows["fedavg"]["basis"] == "—"
    # the black-box columns stay the black-box audit's (its best attack here), not the mechanism
    # audit's bound 0.9
    best = report.methods[0].audit.best_attack()[1]
    assert (
        report.methods[0].audit_numbers()
        == (best.epsilon_lower_bound, best.ceiling, None)
        == (0.1, best.ceiling, None)
    )


def test_markdown_and_html_show_the_mechanism_controls(sample_report):
    report = _with_mechanism(sample_report)
    md = render_markdown(report)
    assert "## Mechanism controls" in md
    assert "| fedauxfdp | correct | consistent | yes | none | 1.001 | 0.9 | 6.587 | 6.6 |" in md
    assert "| fedauxfdp | noise x1/2 | violation | yes | noise | 0.500 | 0.9 | 26.4 | 6.6 |" in md
    assert "| flip-eps8 | — | no probed mechanism |" in md
    assert "- flip-eps8: its ledger records no Gaussian mechanism (NfdpSubsampleEvent)" in md
    assert (
        "- Mechanism audits: white-box ... the adversary differential privacy is defined against"
        in md
    )
    assert report.methods[0].mechanism_controls.catchable in md
    assert "The verdict rests on the mechanism audit of the correct twin (white-box)" in md
    assert "- Black-box audit verdict: inconclusive (ceiling below)." in md
    assert "| client 0 dp-sgd | noise | 1.001 | 1 | 1.003 | 0.998 | no |" in md
    html = render_html(report, figures=False)
    assert 'id="mechanism-controls-table"' in html and "verdict rests on" in html
    assert 'class="catchable"' in html and 'id="threat-mechanism"' in html


def test_uncaught_noise_halved_twin_is_a_warning_in_the_method_section(sample_report):
    report = _with_mechanism(sample_report, half_status="consistent")
    assert report.methods[0].mechanism_controls.lacks_power
    md = render_markdown(report)
    assert (
        "**WARNING: the mechanism audit lacked power: the noise x1/2 twin came out consistent" in md
    )
    assert "| fedauxfdp | noise x1/2 | consistent | NO |" in md


def test_report_with_mechanism_controls_travels_as_json(sample_report):
    report = _with_mechanism(sample_report)
    again = PrivacyReport.from_json(report.to_json())
    assert again == report
    assert again.methods[0].mechanism_controls.noise_halved.rejected == ["noise"]
    assert render_markdown(again) == render_markdown(report)
