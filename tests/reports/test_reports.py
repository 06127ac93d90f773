"""Report schema, figures and renderers on a hand-made report (no pipeline involved)."""

from __future__ import annotations

import base64
import json
import math
import shutil
import subprocess
from html.parser import HTMLParser

import pytest
from pydantic import ValidationError

import atomicfiles
from reports import (
    MethodReport,
    PrivacyReport,
    ReportWarning,
    atomic_write_text,
    fmt_eps,
    load_report,
    plots,
    render_html,
    render_markdown,
    summary_rows,
    write_report,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------- schema
def test_json_round_trip_is_identical(sample_report, tmp_path):
    text = sample_report.to_json()
    # strict JSON: no bare Infinity/NaN tokens, infinite epsilon kept as a string
    data = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert data["schema_version"] == 1
    fedavg = next(m for m in data["methods"] if m["name"] == "fedavg")
    assert fedavg["privacy"]["worst"]["pld"] == "Infinity"
    back = PrivacyReport.from_json(text)
    assert back == sample_report
    assert math.isinf(back.method("fedavg").privacy.epsilon)
    # and through files
    write_report(sample_report, tmp_path, formats=["json"])
    assert load_report(tmp_path) == sample_report
    assert load_report(tmp_path / "report.json").to_json() == text


def test_open_records_keep_unknown_keys(sample_report):
    data = json.loads(sample_report.to_json())
    data["methods"][0]["audit"]["attacks"]["loss"]["new_metric"] = 0.25
    back = PrivacyReport.model_validate(data)
    assert back.methods[0].audit.attacks["loss"].model_extra == {"new_metric": 0.25}
    assert (
        json.loads(back.to_json())["methods"][0]["audit"]["attacks"]["loss"]["new_metric"] == 0.25
    )


def test_wrong_schema_version_is_one_line_error(sample_report):
    data = json.loads(sample_report.to_json())
    data["schema_version"] = 7
    with pytest.raises(ValueError, match="schema_version must be 1; found 7"):
        PrivacyReport.from_json(json.dumps(data))
    with pytest.raises(ValueError, match="not valid JSON"):
        PrivacyReport.from_json("{nope")


def test_schema_rejects_bad_values(sample_report):
    with pytest.raises(ValidationError, match="warning code"):
        ReportWarning(code="made_up", message="x")
    with pytest.raises(ValidationError, match="unique"):
        PrivacyReport(
            metadata=sample_report.metadata,
            threat_model=sample_report.threat_model,
            methods=[MethodReport(name="a", method="a"), MethodReport(name="a", method="b")],
        )
    data = json.loads(sample_report.to_json())
    data["threat_model"]["delta"] = 1.5
    with pytest.raises(ValidationError, match="delta"):
        PrivacyReport.model_validate(data)
    data = json.loads(sample_report.to_json())
    data["methods"][0]["typo_field"] = 1
    with pytest.raises(ValidationError, match="typo_field"):
        PrivacyReport.model_validate(data)


def test_best_attack_and_headline_epsilon(sample_report):
    m = sample_report.method("fedauxfdp")
    name, attack = m.audit.best_attack()  # errored 'lira' is never chosen
    assert name == "shadow" and attack.epsilon_lower_bound == 0.1
    assert m.privacy.epsilon == 1.2  # primary accountant pld, not the min/max of the others
    assert sample_report.method("flip-eps8").utility.mean_client_accuracy == pytest.approx(0.8)


def test_summary_rows_cost_is_relative_to_best_non_private(sample_report):
    rows = {r["name"]: r for r in summary_rows(sample_report)}
    assert rows["fedauxfdp"]["cost"]["text"] == "-14.0 pt"  # 0.71 - 0.85
    assert rows["fedavg"]["cost"]["text"] == "reference"
    assert rows["fedavg"]["epsilon"]["text"] == "inf"
    assert rows["fedmd-nfdp"]["stages"] == "train failed"
    assert rows["flip-eps8"]["verdict"] == "not-audited"


def test_summary_shows_the_verdicts_family_wise_numbers(sample_report):
    rows = {r["name"]: r for r in summary_rows(sample_report)}
    # the verdict's family-wise bound, ceiling and detectable epsilon, not the best attack's own
    assert (
        rows["fedauxfdp"]["emp_eps"]["text"],
        rows["fedauxfdp"]["ceiling"],
        rows["fedauxfdp"]["detectable"]["text"],
    ) == ("0.05", "3.81", "1.62")
    # no verdict numbers (older report): the best attack's own bound and ceiling, no detectable
    assert (
        rows["fedavg"]["emp_eps"]["text"] == "0.8" and rows["fedavg"]["detectable"]["text"] == "—"
    )


def test_verdict_rederived_from_report_json(sample_report):
    """Each verdict follows from three numbers of report.json (attacks.audit_scores.decide)."""
    from attacks.audit_scores import decide

    back = PrivacyReport.from_json(sample_report.to_json())
    v = back.method("fedauxfdp").verdict
    assert v.status == decide(v.epsilon_lower_bound, v.epsilon_ceiling, v.accounted_epsilon)


def test_legacy_verdict_names_are_read_as_new_ones(sample_report):
    data = json.loads(sample_report.to_json())
    data["methods"][0]["verdict"]["status"] = "VIOLATION"
    data["methods"][1]["verdict"]["status"] = "no-formal-guarantee"
    back = PrivacyReport.model_validate(data)
    assert [back.methods[0].verdict.status, back.methods[1].verdict.status] == [
        "violation",
        "no-claim",
    ]
    data["methods"][0]["verdict"]["detectable_epsilon"] = "Infinity"  # strict JSON for inf
    assert PrivacyReport.model_validate(data).methods[0].verdict.detectable_epsilon == math.inf


def test_fmt_eps():
    assert fmt_eps(math.inf) == "inf"
    assert fmt_eps(None) == "—"
    assert fmt_eps(0.6) == "0.6"
    assert fmt_eps(2.3817) == "2.382"
    assert fmt_eps(12.345) == "12.3"
    assert fmt_eps(0.00123) == "0.00123"
    assert fmt_eps(54321.0) == "5.43e+04"


# ---------------------------------------------------------------------------------- figures
def test_every_figure_is_a_png(sample_report):
    figs = plots.report_figures(sample_report)
    # ROC only for methods with attack curves; others are left out, not drawn empty
    assert set(figs) == {
        "privacy_utility",
        "epsilon_comparison",
        "epsilon_over_rounds",
        "client_class",
        "roc/fedauxfdp",
        "roc/fedavg",
    }
    for fig in figs.values():
        assert plots.figure_to_png(fig).startswith(PNG_MAGIC)


def test_privacy_utility_shows_infinite_epsilon_in_its_own_band(sample_report):
    fig = plots.privacy_utility_figure(sample_report)
    ax, ax_inf = fig.axes
    finite = [tuple(p) for c in ax.collections for p in c.get_offsets()]
    infinite = [tuple(p) for c in ax_inf.collections for p in c.get_offsets()]
    assert sorted(finite) == [(1.2, 0.71), (8.0, 0.6)]
    assert infinite == [(0.5, 0.85)]  # fedavg, epsilon = inf
    assert "inf" in ax_inf.get_xticklabels()[0].get_text()


def test_client_class_dot_sizes_follow_counts(sample_report):
    fig = plots.client_class_figure(sample_report.dataset)
    sizes = list(fig.axes[0].collections[0].get_sizes())
    counts = [c for row in sample_report.dataset.class_counts for c in row if c > 0]
    assert len(sizes) == len(counts)
    assert sizes == pytest.approx([220.0 * c / 9 for c in counts])


def test_empty_report_draws_nothing(sample_report):
    empty = PrivacyReport(metadata=sample_report.metadata, threat_model=sample_report.threat_model)
    assert plots.report_figures(empty) == {}
    html = render_html(empty)  # still renders, without figures
    assert "<img" not in html


# ---------------------------------------------------------------------------------- HTML
class _Collector(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.imgs: list[str] = []
        self.external: list[str] = []
        self.rows: list[str] = []
        self.scripts = 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.imgs.append(a.get("src", ""))
        for key in ("src", "href"):  # anything fetched or linked must be inline or in-page
            v = a.get(key)
            if v is not None and not (v.startswith("data:") or v.startswith("#")):
                self.external.append(v)
        if tag == "tr" and "data-method" in a:
            self.rows.append(a["data-method"])
        if tag == "table" and "data-method" in a:
            self.rows.append(f"{a.get('class', '')}:{a['data-method']}")
        if tag == "script":
            self.scripts += 1


def test_html_is_self_contained(sample_report):
    html = render_html(sample_report)
    p = _Collector()
    p.feed(html)
    assert p.external == []
    n_figs = len(plots.report_figures(sample_report))
    assert len(p.imgs) == n_figs
    for src in p.imgs:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1]).startswith(PNG_MAGIC)
    # one summary row per method, and the detail tables of each audited/accounted method
    names = [m.name for m in sample_report.methods]
    assert [r for r in p.rows if ":" not in r] == names
    assert "sortable accounting-table:fedauxfdp" in p.rows
    assert "sortable attack-table:fedauxfdp" in p.rows
    assert "sortable attribute-table:fedauxfdp" in p.rows
    assert p.scripts == 1  # the inline sorter


def test_html_escapes_and_shows_failures(sample_report):
    html = render_html(sample_report, figures=False)
    assert "boom &lt;script&gt;" in html  # error text from a failed stage, escaped
    assert "needs &gt;= 4 shadows" in html  # a failed attack is shown, not dropped
    assert "classic_gaussian_eps_ge_1" in html
    assert "2 shadow models instead of 64" in html
    for m in sample_report.methods:
        assert f'id="m-{m.name}"' in html


def test_markdown_has_a_row_per_method(sample_report):
    md = render_markdown(sample_report)
    table = [ln for ln in md.splitlines() if ln.startswith("| ") and "formal DP" not in ln]
    for m in sample_report.methods:
        assert any(ln.startswith(f"| {m.name} |") for ln in table), m.name
    assert "| fedauxfdp | yes | 1.2 | 0.6 (δ=2e-05) | 1.15 | 71.0% |" in md
    assert "Stage **train failed**: ValueError: boom <script>" in md
    # every table row has the same number of cells as its header
    blocks, cur = [], []
    for ln in md.splitlines():
        if ln.startswith("|"):
            cur.append(ln)
        elif cur:
            blocks.append(cur)
            cur = []
    for b in blocks:
        widths = {len(ln.replace("\\|", "").split("|")) for ln in b}
        assert len(widths) == 1, b


def test_rerender_from_json_alone(sample_report, tmp_path):
    first = write_report(sample_report, tmp_path / "a")
    again = write_report(load_report(first["json"]), tmp_path / "b")
    assert first["md"].read_text() == again["md"].read_text()
    assert first["json"].read_text() == again["json"].read_text()
    assert not list((tmp_path / "a").glob("*.tmp"))  # atomic writes leave no temp files


# ---------------------------------------------------------------------------------- browser
def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.mark.skipif(
    _chromium() is None,
    reason="headless Chromium not installed (Debian package `chromium`; .ci/run installs it)",
)
def test_chromium_renders_without_console_errors(sample_report, tmp_path):
    paths = write_report(sample_report, tmp_path / "report", formats=["html"])
    shot = tmp_path / "report.png"
    cmd = [
        _chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--enable-logging=stderr",
        "--v=0",
        "--window-size=1280,2400",
        f"--screenshot={shot}",
        paths["html"].resolve().as_uri(),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert shot.is_file() and shot.read_bytes().startswith(PNG_MAGIC), proc.stderr[-2000:]
    console = [ln for ln in proc.stderr.splitlines() if "CONSOLE" in ln]
    assert console == []


def test_figures_drawn_in_two_processes_are_the_figures_drawn_in_one(sample_report):
    """report_pngs shares the figures out between processes: the same PNG bytes, in the same
    order, as drawing them all here."""
    from reports.plots import report_figures, report_pngs

    one, two = report_pngs(sample_report, 1), report_pngs(sample_report, workers=2)
    assert list(one) == list(report_figures(sample_report)) and len(one) >= 4
    assert list(two) == list(one)
    assert all(two[k] == one[k] and one[k].startswith(b"\x89PNG") for k in one)


# ---------------------------------------------------------------------------------- files
def test_report_files_are_checksummed_and_a_corrupted_one_refused(tmp_path, sample_report):
    paths = write_report(sample_report, tmp_path, formats=["json", "md"])
    for p in paths.values():
        assert atomicfiles.verify(p, required=True) is None
    assert load_report(tmp_path) == sample_report
    _damage_one_byte(paths["json"])
    with pytest.raises(ValueError, match=r"report file .*report.json is corrupted") as err:
        load_report(tmp_path)
    assert "\n" not in str(err.value)
    again = atomic_write_text(paths["json"], sample_report.to_json())  # rewritten: trusted again
    assert load_report(again) == sample_report


def _damage_one_byte(path):
    """Change one digit, keeping the file parseable (a silent corruption)."""
    data = bytearray(path.read_bytes())
    i = data.index(b"1")
    data[i : i + 1] = b"2"
    path.write_bytes(bytes(data))
