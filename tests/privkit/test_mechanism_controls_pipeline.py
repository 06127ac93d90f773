"""Mechanism controls in ``privkit run``: every formal-DP method's correct and noise-halved twins,
audited white-box at its DP mechanisms, as a resumable step whose correct twin sets the row's verdict.

dp-fedavg trains for real on a tiny federation (seconds) and its twins are audited for real; the
black-box audit is replaced by a fake whose verdict is ``inconclusive``, the demo's situation (its
ceiling lies below the accounted epsilon, so no outcome could contradict the claim).
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import dp_accounting as dpa
import pytest

import privkit.audit.mechanism_audit as mechanism_audit
import privkit.pipeline as pipeline
from accountants import Ledger, NfdpSubsampleEvent
from privkit.data import build_federation
from privkit.errors import PrivkitError
from privkit.files import write_json
from privkit.pipeline.mechanism_controls import mechanism_controls_stage
from privkit.pipeline.mechanism_report import read_mechanism_controls
from privkit.trainers import REGISTRY, TrainerConfig, TrainResult, register_trainer
from reports import PrivacyReport, load_report

TOML = """
name = "mech"
seed = 0
[federation]
dataset = "digits"
public_dataset = "none"
public_size = 0.1
clients = 2
partition = "iid"
test_size = 0.25
shadow_size = 0.25
[audit]
shadows = 2
[audit.controls]
enabled = false
[audit.mechanism_controls]
canaries = 200
[[methods]]
name = "dp-fedavg"
quick = true
overrides = { rounds = 4 }
"""
CENTRALIZED = '\n[[methods]]\nname = "centralized"\nquick = true\noverrides = { epochs = 1 }\n'
CALLS: list[tuple[str, str]] = []
FAIL: set[str] = set()


def fake_audit(run_dir, *, attacks, shadows, executor, seed, progress, **options):
    """An audit.json whose verdict is inconclusive: ceiling 0.5 below the accounted epsilon."""
    run_dir = Path(run_dir)
    method = json.loads((run_dir / "config.json").read_text())["method"]
    out = {
        "schema_version": 1,
        "method": method,
        "attacks": {},
        "attribute": {},
        "accounted_epsilon": 2.0,
        "delta": 1e-5,
        "shadows": shadows,
        "verdict": {
            "status": "inconclusive",
            "message": "ceiling 0.5 <= accounted 2",
            "epsilon_lower_bound": 0.0,
            "epsilon_ceiling": 0.5,
            "accounted_epsilon": 2.0,
        },
    }
    write_json(run_dir / "audit.json", out)  # a stage stores through privkit.files
    return out


@pytest.fixture(autouse=True)
def _spy(monkeypatch):
    """Count the twins audited (and make them fail on demand); fake the black-box audit."""
    real = mechanism_audit.audit_mechanisms

    def spy(method, federation, trainer_config=None, **kw):
        CALLS.append((method, kw["mutation"]))
        if method in FAIL:
            raise RuntimeError("probes exploded on purpose")
        return real(method, federation, trainer_config, **kw)

    CALLS.clear()
    FAIL.clear()
    monkeypatch.setattr(mechanism_audit, "audit_mechanisms", spy)
    monkeypatch.setattr(pipeline.stages, "run_audit", fake_audit)
    yield


def run(tmp_path: Path, tail: str = "", overrides: list[str] | None = None):
    path = tmp_path / "mech.toml"
    path.write_text(TOML + tail)
    return pipeline.run_pipeline(pipeline.load_run_config(path, overrides or []), tmp_path / "runs")


def test_formal_dp_method_gets_two_twins_and_its_row_rests_on_the_correct_one(tmp_path):
    outcome = run(tmp_path, CENTRALIZED)
    root = outcome.root
    assert outcome.failures == []
    # one step per formal-DP method (centralized claims nothing), two twins each
    status = json.loads((root / "status.json").read_text())
    assert set(status["mechanism_controls"]) == {"dp-fedavg"}
    assert status["mechanism_controls"]["dp-fedavg"]["state"] == "done"
    assert CALLS == [("dp-fedavg", "correct"), ("dp-fedavg", "noise x1/2")]
    rec = json.loads((root / "mechanism-controls" / "dp-fedavg.json").read_text())
    assert rec["schema_version"] == 1 and rec["state"] == "done" and rec["delta"] == 1e-5
    correct, half = rec["twins"]
    assert (correct["twin"], correct["status"], correct["as_expected"]) == (
        "correct",
        "consistent",
        True,
    )
    assert (half["twin"], half["status"], half["as_expected"]) == ("noise x1/2", "violation", True)
    assert half["probes"][0]["rejected"] == ["noise"]  # the bug is named, nothing else
    report = load_report(root)
    m = report.method("dp-fedavg")
    # the measured noise scales are the mutation's: the claim's, and half of it
    assert abs(m.mechanism_controls.correct.noise_ratio - 1) < 0.02
    assert abs(m.mechanism_controls.noise_halved.noise_ratio - 0.5) < 0.01
    # the row's verdict is the correct twin's, the black-box one is kept beside it
    assert (m.verdict.status, m.verdict_basis) == ("consistent", "mechanism")
    assert (
        m.audit.verdict.status == "inconclusive"
        and "black-box audit's verdict: inconclusive" in m.verdict.message
    )
    assert not m.mechanism_controls.lacks_power
    assert report.method("centralized").mechanism_controls is None
    assert report.method("centralized").verdict.status == "no-claim"
    assert (
        "the adversary differential privacy is defined against"
        in report.threat_model.mechanism_audit
    )
    md = (root / "report.md").read_text()
    row = next(ln for ln in md.splitlines() if ln.startswith("| dp-fedavg | yes"))
    assert row.endswith("| consistent | mechanism audit | ok |")
    assert (
        "## Mechanism controls" in md
        and "| dp-fedavg | noise x1/2 | violation | yes | noise | 0.5" in md
    )
    assert rec["catchable"].startswith("dp-fedavg: the mechanism audit catches noise below 0.9")
    assert rec["catchable"] in md and "Mechanism audits: white-box" in md
    assert "Black-box audit verdict: inconclusive" in md
    html = (root / "report.html").read_text()
    assert 'id="mechanism-controls-table"' in html and 'id="threat-mechanism"' in html
    # resumed: the finished step is skipped; changed settings run it again
    CALLS.clear()
    run(tmp_path, CENTRALIZED)
    assert CALLS == []
    run(tmp_path, CENTRALIZED, ["audit.mechanism_controls.canaries=100"])
    assert len(CALLS) == 2
    # a report travels alone: re-rendered from report.json without the run directory
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "report.json").write_text((root / "report.json").read_text())
    pipeline.rerender(lone)
    again = PrivacyReport.from_json((lone / "report.json").read_text())
    assert again.method("dp-fedavg").verdict_basis == "mechanism"
    assert "## Mechanism controls" in (lone / "report.md").read_text()


def test_failing_step_is_reported_and_the_method_goes_on(tmp_path):
    FAIL.add("dp-fedavg")
    outcome = run(tmp_path)
    root = outcome.root
    assert outcome.failures == [
        "dp-fedavg/mechanism-controls: RuntimeError: probes exploded on purpose"
    ]
    status = json.loads((root / "status.json").read_text())
    assert status["mechanism_controls"]["dp-fedavg"]["state"] == "failed"
    assert {s["state"] for s in status["methods"]["dp-fedavg"]["stages"].values()} == {"done"}
    assert "probes exploded" in (root / "mechanism-controls" / "dp-fedavg.errors.log").read_text()
    m = load_report(root).method("dp-fedavg")
    assert m.mechanism_controls.state == "failed"
    assert (m.verdict.status, m.verdict_basis) == (
        "inconclusive",
        "black-box",
    )  # no mechanism verdict
    assert any("mechanism controls failed" in w.message for w in m.warnings)
    assert "| dp-fedavg | — | failed |" in (root / "report.md").read_text()
    FAIL.clear()  # fixed: the re-run runs the failed step only
    CALLS.clear()
    assert run(tmp_path).failures == [] and len(CALLS) == 2
    assert load_report(root).method("dp-fedavg").verdict.status == "consistent"


def test_disabled_mechanism_controls_are_skipped(tmp_path):
    outcome = run(tmp_path, overrides=["audit.mechanism_controls.enabled=false"])
    assert CALLS == []
    status = json.loads((outcome.root / "status.json").read_text())
    assert status["mechanism_controls"]["dp-fedavg"]["state"] == "skipped"
    m = load_report(outcome.root).method("dp-fedavg")
    assert (m.verdict.status, m.verdict_basis, m.mechanism_controls.state) == (
        "inconclusive",
        "black-box",
        "skipped",
    )


def test_probed_clients_must_be_clients_of_the_federation(tmp_path):
    path = tmp_path / "mech.toml"
    path.write_text(TOML)
    with pytest.raises(
        PrivkitError,
        match=r"audit.mechanism_controls.clients must be client ids below "
        r"federation.clients = 2; found \[2\]",
    ):
        pipeline.load_run_config(path, ["audit.mechanism_controls.clients=[0, 2]"])


# ---------------------------------------------------------------------------------- no probes
class GaussConfig(TrainerConfig):
    """No settings of its own."""


if "tiny-gauss" not in REGISTRY:

    @register_trainer(
        "tiny-gauss", GaussConfig, "tiny-gauss: a Gaussian release without probes", formal_dp=True
    )
    def _tiny_gauss(federation, config, seed, progress=False):
        ledger = Ledger()
        for i in range(federation.num_clients):
            ledger.add(i, dpa.GaussianDpEvent(2.0), label="release")
        return TrainResult(
            method="tiny-gauss",
            seed=seed,
            config=config.model_dump(),
            model=None,
            model_spec={},
            ledger=ledger,
            test_accuracy=0.5,
        )


def test_a_method_without_probes_says_why(tmp_path):
    """A formal-DP method whose Gaussian mechanism takes no probes: one training, no crash, the
    verdict stays the black-box audit's and the report says why."""
    data = tomllib.loads(TOML)
    data["methods"] = [{"name": "tiny-gauss"}]
    resolved = pipeline.resolve_config(data)
    root = tmp_path / "run"
    root.mkdir()
    pipeline.stages.FEDERATIONS[str(root / "federation.json")] = build_federation(
        resolved.config.federation
    )
    mechanism_controls_stage(resolved, resolved.methods[0], root, progress=False)
    assert CALLS == [("tiny-gauss", "correct")]  # the noise-halved twin would say the same
    rec = json.loads((root / "mechanism-controls" / "tiny-gauss.json").read_text())
    assert rec["state"] == "unprobed" and "ran no probed DP mechanism" in rec["message"]
    mdir = root / "tiny-gauss"
    mdir.mkdir()
    gauss = Ledger()
    gauss.add(0, dpa.GaussianDpEvent(2.0), "release")
    gauss.save(mdir / "ledger.json")
    mc = read_mechanism_controls(root, "tiny-gauss", {}, mdir)
    assert mc.state == "unprobed" and mc.reason.startswith(
        "its Gaussian mechanism(s) (release) do not take"
    )
    nfdp = Ledger()  # FedMD-NFDP: noise-free subsampling, no Gaussian mechanism to probe
    nfdp.add(0, NfdpSubsampleEvent(n=160, k=16, replacement=True), "subsample")
    nfdp.save(mdir / "ledger.json")
    mc = read_mechanism_controls(root, "tiny-gauss", {}, mdir)
    assert mc.reason.startswith("its ledger records no Gaussian mechanism (NfdpSubsampleEvent)")


# ---------------------------------------------------------------------------------- the row's verdict
def _method(black_box: str, correct: str, half: str, formal: bool = True):
    from reports import AuditSummary, MechanismControls, MechanismTwin, MethodReport, Verdict

    def twin(name, status, expected):
        return MechanismTwin(
            twin=name,
            expected=expected,
            status=status,
            as_expected=status == expected,
            message=f"{name}: {status}",
            description=name,
        )

    bb = Verdict(status=black_box, message="black-box")
    return MethodReport(
        name="m",
        method="m",
        formal_dp=formal,
        audit=AuditSummary(verdict=bb),
        verdict=bb if formal else Verdict(status="no-claim"),
        mechanism_controls=MechanismControls(
            confidence=0.95,
            twins=[twin("correct", correct, "consistent"), twin("noise x1/2", half, "violation")],
        ),
    )


@pytest.mark.parametrize(
    "black_box, correct, half, status, basis",
    [
        ("inconclusive", "consistent", "violation", "consistent", "mechanism"),
        (
            "inconclusive",
            "violation",
            "violation",
            "violation",
            "mechanism",
        ),  # a bug of the method itself
        ("consistent", "consistent", "violation", "consistent", "mechanism"),
        (
            "violation",
            "consistent",
            "violation",
            "violation",
            "black-box",
        ),  # a valid violation stands
    ],
)
def test_row_verdict_rests_on_the_strongest_valid_audit(black_box, correct, half, status, basis):
    from privkit.pipeline.mechanism_report import rest_verdict

    m = _method(black_box, correct, half)
    rest_verdict(m)
    assert (m.verdict.status, m.verdict_basis) == (status, basis)
    assert m.audit.verdict.status == black_box  # kept for the method's section
    assert m.warnings == []


def test_uncaught_noise_halved_twin_warns_and_no_claim_stays():
    from privkit.pipeline.mechanism_report import rest_verdict

    m = _method("inconclusive", "consistent", "consistent")
    rest_verdict(m)
    assert m.verdict.status == "consistent"
    assert [w.code for w in m.warnings] == ["reduced_audit"]
    assert "mechanism audit lacked power: the noise x1/2 twin" in m.warnings[0].message
    m = _method("consistent", "consistent", "violation", formal=False)
    rest_verdict(m)
    assert (m.verdict.status, m.verdict_basis) == ("no-claim", None)


class Killed(BaseException):
    """The process dies here (as a SIGKILL would: nothing after it runs)."""


def test_a_step_killed_after_its_first_twin_trains_the_second_alone(tmp_path, monkeypatch):
    """Each twin (one training with its probe sets) is a checkpoint: killed while the noise-halved
    twin trains, the step re-run trains that twin alone and writes the record an uninterrupted
    step writes; a corrupted twin checkpoint is named and that twin trained again."""
    data = tomllib.loads(TOML)
    data["methods"][0]["overrides"]["rounds"] = 2  # the records' numbers, not their power, matter
    resolved = pipeline.resolve_config(data)
    m = resolved.methods[0]
    fed = build_federation(resolved.config.federation)
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    for root in (whole, killed):
        root.mkdir()
        pipeline.stages.FEDERATIONS[str(root / "federation.json")] = fed
    mechanism_controls_stage(resolved, m, whole, progress=False)
    spy = mechanism_audit.audit_mechanisms

    def dying(method, federation, trainer_config=None, **kw):
        if kw["mutation"] != "correct":
            raise Killed
        return spy(method, federation, trainer_config, **kw)

    monkeypatch.setattr(mechanism_audit, "audit_mechanisms", dying)
    CALLS.clear()
    with pytest.raises(Killed):
        mechanism_controls_stage(resolved, m, killed, progress=False)
    assert CALLS == [("dp-fedavg", "correct")]
    assert not (killed / "mechanism-controls" / "dp-fedavg.json").exists()
    monkeypatch.setattr(mechanism_audit, "audit_mechanisms", spy)
    CALLS.clear()
    mechanism_controls_stage(resolved, m, killed, progress=False)
    assert CALLS == [("dp-fedavg", "noise x1/2")]  # the finished twin was not trained again
    record = "mechanism-controls/dp-fedavg.json"
    assert json.loads((killed / record).read_text()) == json.loads((whole / record).read_text())
    CALLS.clear()
    mechanism_controls_stage(resolved, m, killed, progress=False)
    assert CALLS == []  # both twins stored: nothing trained
    twin = killed / "mechanism-controls" / "dp-fedavg.twins" / "correct.json"
    twin.write_text(twin.read_text().replace('"consistent"', '"violation!"'))
    with pytest.warns(UserWarning, match=r"correct.json: checksum mismatch; treated as absent"):
        mechanism_controls_stage(resolved, m, killed, progress=False)
    assert CALLS == [("dp-fedavg", "correct")]
    assert json.loads((killed / record).read_text()) == json.loads((whole / record).read_text())
