"""Each method's ROC against its ledger's trade-off curve, re-rendered from report.json alone:
stored curve points, the forbidden-point count in words, the figure, and the claims table."""

import math

import numpy as np
import pytest
from scipy import stats

from accountants import gaussian_curve
from reports import Roc, load_report, plots, render_html, render_markdown, write_report
from reports.roc_claims import forbidden_counts, roc_claim_sentence, stored_curve
from reports.schema import TradeoffPoints

EPS, DELTA = 1.2, 1e-5
GRID = np.unique(
    np.r_[np.geomspace(1e-6, 1.0, 241), np.linspace(0.0, 1.0, 101)]
)  # as privkit.audit.claims


def _points(curve) -> TradeoffPoints:
    return TradeoffPoints(
        claim=curve.claim,
        accounted_epsilon=EPS,
        delta=DELTA,
        fpr=GRID.tolist(),
        fnr=np.asarray(curve(GRID)).tolist(),
    )


def _with_curve(report, broken: bool):
    """The DP method of the sample report with its ledger curve (Gaussian at (1.2, 1e-5)) stored,
    both claims' bounds, and optionally an attack whose ROC crosses into the forbidden region."""
    m = report.method("fedauxfdp")
    curve = gaussian_curve(EPS, DELTA)
    m.audit.tradeoff_curve = _points(curve)
    m.audit.claims = {
        "generic": {
            "claim_tested": "(eps, delta)-DP at the accounted epsilon",
            "status": "consistent",
            "epsilon_lower_bound": 0.05,
            "epsilon_ceiling": 3.81,
            "in_verdict": True,
        },
        "ledger": {
            "claim_tested": "as private as its ledger says: " + curve.claim,
            "status": "consistent",
            "epsilon_lower_bound": 0.31,
            "epsilon_ceiling": 5.02,
            "in_verdict": False,
        },
    }
    if broken:
        fpr = [0.0, 1e-3, 1e-2, 0.1, 0.5, 1.0]
        m.audit.attacks["broken"] = m.audit.attacks["loss"].model_copy(
            update={"roc": Roc(fpr=fpr, tpr=[0.0, 0.2, 0.3, 0.5, 0.9, 1.0])}
        )
    return report, curve


def test_stored_curve_never_above_the_curve_and_exact_on_the_grid():
    curve = gaussian_curve(EPS, DELTA)
    f = stored_curve(_points(curve))
    np.testing.assert_allclose(f(GRID), curve(GRID), rtol=0, atol=0)
    x = np.geomspace(1e-7, 1.0, 5000)
    assert np.all(f(x) <= curve(x) + 1e-15)  # the drawn region never exceeds the ledger's
    # and close: at most the curve's fall over one grid cell (log ratio 1.06 or 0.01 wide)
    assert np.max(curve(x) - f(x)) < 0.02
    with pytest.raises(ValueError, match="tradeoff_curve needs"):
        stored_curve(TradeoffPoints(fpr=[0.0, 0.5], fnr=[1.0, 0.2]))


def test_roc_point_inside_the_forbidden_region_is_reported(sample_report):
    report, curve = _with_curve(sample_report, broken=True)
    m = report.method("fedauxfdp")
    counts = forbidden_counts(m)
    # the Gaussian (1.2, 1e-5) curve allows TPR Phi(Phi^-1(FPR) + mu) (closed form, mu = 0.316):
    # 0.0028, 0.022, 0.167, 0.624 at FPR 1e-3, 1e-2, 0.1, 0.5, below TPR 0.2, 0.3, 0.5, 0.9
    fpr = np.array([1e-3, 1e-2, 0.1, 0.5])
    allowed = stats.norm.cdf(stats.norm.ppf(fpr) + curve.mu)
    np.testing.assert_allclose(1 - curve(fpr), allowed, rtol=1e-9)
    assert np.all(allowed < [0.2, 0.3, 0.5, 0.9])
    exact = plots.forbidden_roc_points(
        m.audit.attacks["broken"].roc.fpr, m.audit.attacks["broken"].roc.tpr, curve
    )
    assert counts["broken"] == exact.size == 4  # the stored points flag exactly those four
    # every attack: the stored points agree with the exact curve; the AUC-0.55 "shadow" ROC
    # (TPR = FPR^0.818) crosses at FPR 1e-3 (0.0035 > 0.0028) and 1e-2 (0.0232 > 0.0222)
    for n, a in m.audit.attacks.items():
        if a.error is None:
            assert counts[n] == plots.forbidden_roc_points(a.roc.fpr, a.roc.tpr, curve).size, n
    assert counts["loss"] == 0 and counts["shadow"] == 2 and "lira" not in counts  # lira failed
    text = roc_claim_sentence(m)
    assert text.startswith("ROC points lie in the region the ledger's trade-off curve forbids")
    assert "broken (4 points), shadow (2 points)." in text and "loss" not in text
    md = render_markdown(report)
    assert text in md


def test_report_json_carries_points_and_rerenders_the_figure(sample_report, tmp_path):
    report, curve = _with_curve(sample_report, broken=False)
    paths = write_report(report, tmp_path)
    again = load_report(paths["json"])
    tc = again.method("fedauxfdp").audit.tradeoff_curve
    assert tc.accounted_epsilon == EPS and len(tc.fpr) == len(tc.fnr) == GRID.size
    np.testing.assert_allclose(tc.fnr, curve(GRID), rtol=0, atol=0)
    m = again.method("fedauxfdp")
    assert forbidden_counts(m) == {"loss": 0, "shadow": 2}
    only_loss = m.model_copy(deep=True)
    del only_loss.audit.attacks["shadow"]
    assert roc_claim_sentence(only_loss) == (
        "No ROC point of the 1 attacks lies in the region the ledger's "
        "trade-off curve forbids (accounted epsilon 1.2 at delta 1e-05)."
    )
    # the figure: log-log, the claim's boundary and forbidden region, drawn from report.json alone
    figs = plots.report_figures(again)
    fig = figs["tradeoff_roc/fedauxfdp"]
    ax = fig.axes[0]
    assert ax.get_xscale() == ax.get_yscale() == "log"
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "forbidden by the claim" in labels and any(
        lab.startswith("claim: the ledger") for lab in labels
    )
    assert "tradeoff_roc/fedavg" not in figs  # no curve stored (no claim): no figure
    html = render_html(again)
    assert 'alt="ROC against the ledger fedauxfdp" src="data:image/png;base64,' in html
    # both bounds, each labelled with its claim; the verdict's is the generic one
    md = render_markdown(again)
    assert (
        "| (eps, delta)-DP at the accounted epsilon | 0.05 | 3.81 | consistent | the verdict's claim |"
        in md
    )
    assert (
        f"| as private as its ledger says: {curve.claim} | 0.31 | 5.02 | consistent | shown beside |"
        in md
    )
    # re-rendering from the JSON is identical
    assert write_report(again, tmp_path / "b")["md"].read_text() == paths["md"].read_text()


def test_old_reports_without_curves_still_load(sample_report, tmp_path):
    paths = write_report(sample_report, tmp_path)
    again = load_report(paths["json"])
    m = again.method("fedauxfdp")
    assert m.audit.tradeoff_curve is None and m.audit.claims == {}
    assert forbidden_counts(m) is None and roc_claim_sentence(m) is None
    assert not m.privacy.reproducible_noise and "not for release" not in paths["md"].read_text()
    assert math.isclose(m.privacy.epsilon, 1.2)


def test_adaptive_guarantee_and_stamp_render(sample_report):
    m = sample_report.method("fedauxfdp")
    m.privacy.reproducible_noise = True
    m.privacy.adaptive_composition = {
        "kind": "renyi_filter",
        "source": "Feldman & Zrnic 2021, Thm. 3.1",
        "order": 8.0,
        "epsilon": 3.25,
        "delta": 1e-5,
    }
    md = render_markdown(sample_report)
    assert md.count("**WARNING — reproducible noise: not for release.**") == 1
    assert (
        "Adaptive composition (Feldman & Zrnic 2021, Thm. 3.1, Rényi filter at order 8.0): ε = 3.25 "
        "whatever the adaptive choices, beside the paper's claim ε = 0.6."
    ) in md
    assert "not for release" in render_html(sample_report)
