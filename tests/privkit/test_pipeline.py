"""The one-command pipeline: validation before work, resume after interruption, failures isolated,
report built from the run directories.

Trainers here are tiny test trainers registered in this module (a one-epoch MLP whose ledger holds
one Gaussian release per client); the audit layer is replaced by a fake that writes an
``audit.json`` in the contract's format, so these tests exercise the orchestration only.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import dp_accounting as dpa
import pytest
from typer.testing import CliRunner

import privkit.pipeline as pipeline
from accountants import gaussian_epsilon
from privkit.cli import app
from privkit.files import write_json
from privkit.trainers import REGISTRY, TrainerConfig, TrainResult, register_trainer
from reports import PrivacyReport, load_report

CALLS: dict[str, int] = {}
FAIL: set[str] = set()  # method keys whose trainer raises
NOISE = 2.0  # noise multiplier of the tiny DP trainer's one Gaussian release per client


class TinyConfig(TrainerConfig):
    epochs: int = 1
    lr: float = 1e-3
    private: bool = True


def _tiny(name: str):
    def fn(federation, config: TinyConfig, seed: int, progress: bool = False) -> TrainResult:
        from accountants import Ledger, NonPrivateEvent
        from privkit.trainers.common import accuracy, new_model, train_supervised

        CALLS[name] = CALLS.get(name, 0) + 1
        if name in FAIL:
            raise RuntimeError(f"{name} exploded on purpose")
        model, spec = new_model(federation, config, seed, arch="mlp", width=8, feature_dim=16)
        x, y = federation.pooled_arrays()
        train_supervised(
            model, x, y, epochs=config.epochs, batch_size=256, lr=config.lr, device="cpu", seed=seed
        )
        ledger = Ledger()
        for i in range(federation.num_clients):
            if config.private:
                for r in (1, 2):
                    ledger.add(i, dpa.GaussianDpEvent(NOISE), label="release", round=r)
            else:
                ledger.add(i, NonPrivateEvent("no noise"), label="release")
        xt, yt = federation.test_arrays()
        acc = accuracy(model, xt, yt, "cpu")
        return TrainResult(
            method=name,
            seed=seed,
            config=config.model_dump(),
            model=model,
            model_spec=spec,
            ledger=ledger,
            rounds=[{"round": 1, "test_accuracy": acc}],
            test_accuracy=acc,
            warnings=["features are normalised by a data-dependent maximum"],
            claims={"epsilon": 0.5, "delta": 1e-4, "source": "tiny paper"},
        )

    return fn


for _name in ("tiny-dp", "tiny-other"):
    if _name not in REGISTRY:
        register_trainer(
            _name, TinyConfig, f"{_name}: test trainer", formal_dp=True, quick={"epochs": 1}
        )(_tiny(_name))


def fake_audit(run_dir, *, attacks, shadows, executor, seed, progress, **options):
    """Writes an audit.json in the contract's format (the real audit layer is tested elsewhere)."""
    CALLS["audit"] = CALLS.get("audit", 0) + 1
    run_dir = Path(run_dir)
    if "audit" in FAIL:
        raise RuntimeError("audit exploded on purpose")
    if "interrupt" in FAIL:
        raise KeyboardInterrupt
    out = {
        "schema_version": 1,
        "method": json.loads((run_dir / "config.json").read_text())["method"],
        "attacks": {
            "loss": {
                "auc": 0.51,
                "balanced_accuracy": 0.505,
                "advantage": 0.01,
                "tpr_at_fpr": {"0.001": 0.001, "0.01": 0.011},
                "epsilon_lower_bound": 0.0,
                "ceiling": 3.3,
                "confidence": 0.95,
                "delta": 1e-5,
                "n_trials": 200,
                "roc": {"fpr": [0, 0.01, 0.5, 1], "tpr": [0, 0.012, 0.51, 1]},
                "notes": "",
                "error": None,
            }
        },
        "attribute": {},
        "accounted_epsilon": 1.0,
        "delta": 1e-5,
        "shadows": shadows,
        "verdict": {"status": "consistent", "message": "0 <= 1"},
    }
    write_json(run_dir / "audit.json", out)  # a stage stores through privkit.files
    return out


def control_record(power: bool = True) -> dict:
    """A controls.json in the contract's format (the real controls are tested in test_controls)."""

    def entry(name, mode, status):
        expected = "no violation" if name == "correct" else "violation"
        caught = status == "violation"
        return {
            "name": name,
            "expected": expected,
            "audit_mode": mode,
            "mechanism": "m",
            "verdict": {
                "status": status,
                "message": "x",
                "epsilon_lower_bound": 3.6 if caught else 0.3,
                "epsilon_ceiling": 3.6,
                "detectable_epsilon": 2.0,
                "accounted_epsilon": 3.0,
                "attack": "a",
                "attacks": {"a": {"correct": 200, "guesses": 200}},
            },
            "caught": caught,
            "passed": caught == (expected == "violation"),
            "test_accuracy": 0.7,
        }

    bb = "violation" if power else "consistent"
    return {
        "schema_version": 1,
        "method": "dpsgd",
        "claimed_epsilon": 3.0,
        "delta": 1e-5,
        "seed": 0,
        "controls": [
            entry("correct", "white-box", "consistent"),
            entry("correct", "black-box", "consistent"),
            entry("noise removed", "white-box", "violation"),
            entry("clipping and noise removed", "black-box", bb),
        ],
        "power": power,
        "false_alarm": False,
        "message": (
            "Every positive control was caught (twins)."
            if power
            else "This audit lacked the power to see a violation: clipping and noise removed."
        ),
    }


CONTROL_POWER = {"power": True}


def fake_controls(run, target, root, progress):
    CALLS["controls"] = CALLS.get("controls", 0) + 1
    if "controls" in FAIL:
        raise RuntimeError("controls exploded on purpose")
    write_json(root / "audit-controls" / "controls.json", control_record(CONTROL_POWER["power"]))


def fake_mechanism_controls(run, m, root, progress):
    """Writes an 'unprobed' mechanism-controls record (the real step is tested in
    test_mechanism_controls_pipeline)."""
    CALLS["mechanism-controls"] = CALLS.get("mechanism-controls", 0) + 1
    rec = {
        "schema_version": 1,
        "method": m.key,
        "trainer": m.method,
        "state": "unprobed",
        "twins": [],
        "message": f"method {m.method!r} ran no probed DP mechanism",
        "catchable": None,
    }
    write_json(root / "mechanism-controls" / f"{m.key}.json", rec)


@pytest.fixture(autouse=True)
def _reset(monkeypatch):
    CALLS.clear()
    FAIL.clear()
    CONTROL_POWER["power"] = True
    monkeypatch.setattr(pipeline.stages, "run_audit", fake_audit)
    monkeypatch.setattr(pipeline.controls, "controls_stage", fake_controls)
    monkeypatch.setattr(
        pipeline.mechanism_controls, "mechanism_controls_stage", fake_mechanism_controls
    )
    yield


def config(tmp_path: Path, **extra) -> Path:
    text = """
name = "t"
seed = 3
delta = 1e-5

[federation]
clients = 4
partition = "iid"

[audit]
shadows = 2

[[methods]]
name = "tiny-dp"
quick = true

[[methods]]
name = "tiny-other"
overrides = { private = false }
""" + extra.get("tail", "")
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def run(path: Path, out: Path, overrides: list[str] | None = None):
    resolved = pipeline.load_run_config(path, overrides or [])
    return pipeline.run_pipeline(resolved, out)


# ---------------------------------------------------------------------------------- end to end
def test_tiny_end_to_end(tmp_path):
    outcome = run(config(tmp_path), tmp_path / "runs")
    root = tmp_path / "runs" / "t"
    assert outcome.failures == []
    for f in (
        "config.resolved.json",
        "status.json",
        "report.json",
        "report.html",
        "report.md",
        "federation.json",
        "dataset.json",
    ):
        assert (root / f).is_file(), f
    for key in ("tiny-dp", "tiny-other"):
        for f in (
            "config.json",
            "federation.json",
            "ledger.json",
            "metrics.json",
            "train.json",
            "privacy.json",
            "audit.json",
            "checkpoints/model.pt",
        ):
            assert (root / key / f).is_file(), f"{key}/{f}"
    report = load_report(root)
    dp = report.method("tiny-dp")
    # accounted epsilon pinned to dp-accounting's PLD on the same composition (2 Gaussian releases)
    acc = dpa.pld.PLDAccountant(
        dpa.NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=1e-4
    )
    acc.compose(dpa.GaussianDpEvent(NOISE), 2)
    assert dp.privacy.worst["pld"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-3)
    assert dp.privacy.epsilon <= dp.privacy.worst["pld"] + 1e-12  # 'best' is the minimum
    # the certified bracket holds the exact value: 2 Gaussians = one with NOISE / sqrt(2) (analytic)
    bracket = dp.privacy.epsilon_bracket["pld"].model_dump()
    exact = gaussian_epsilon(NOISE / math.sqrt(2), 1e-5, method="analytic")
    assert (
        bracket["lower"] <= exact <= bracket["upper"] * (1 + 1e-9)
        and bracket["upper"] == dp.privacy.worst["pld"]
    )
    assert (
        dp.privacy.epsilon_bracket["rdp"] is None
        and dp.privacy.bracket_reason["rdp"] == "not-tight"
    )
    assert f"[{bracket['lower']:.6g}, {bracket['upper']:.6g}]" in (root / "report.md").read_text()
    assert "certified bracket" in (root / "report.html").read_text()
    assert [r for r, _ in dp.privacy.epsilon_over_rounds] == [1.0, 2.0]
    assert dp.privacy.claim.epsilon == 0.5 and dp.privacy.epsilon_at_claim_delta is not None
    assert dp.utility.test_accuracy > 0.3  # one epoch on MNIST digits beats chance (0.1)
    assert dp.audit.attacks["loss"].auc == 0.51 and dp.verdict.status == "consistent"
    assert [w.code for w in dp.warnings] == ["data_dependent_scaling"]
    assert math.isinf(report.method("tiny-other").privacy.epsilon)
    # one formal-DP rule for every cell: tiny-other claims DP but releases without noise
    assert (dp.formal_dp, dp.formal_dp_label, dp.claims_dp) == (True, "yes", True)
    other = report.method("tiny-other")
    assert other.privacy.non_private == ["release"] and other.privacy.fixed_delta == 0.0
    assert (other.formal_dp, other.formal_dp_label, other.claims_dp) == (False, "no", True)
    assert other.verdict.status == "no-claim"  # not the audit file's "consistent"
    assert "without noise is recorded (release)" in other.verdict.message
    assert report.dataset.client_sizes and len(report.dataset.client_sizes) == 4
    assert report.threat_model.shadows == 2 and report.threat_model.confidence == 0.95
    assert report.metadata.seeds["method:tiny-dp"] == 3
    status = json.loads((root / "status.json").read_text())
    assert {s["state"] for m in status["methods"].values() for s in m["stages"].values()} == {
        "done"
    }


# ---------------------------------------------------------------------------------- resume
def test_rerun_skips_completed_stages(tmp_path):
    path = config(tmp_path)
    run(path, tmp_path / "runs")
    model = tmp_path / "runs" / "t" / "tiny-dp" / "checkpoints" / "model.pt"
    mtime = model.stat().st_mtime_ns
    CALLS.clear()
    run(path, tmp_path / "runs")
    assert CALLS == {}  # nothing trained, audited or controlled again
    assert model.stat().st_mtime_ns == mtime
    # a changed trainer config re-runs that method only (all its stages)
    path.write_text(
        path.read_text().replace(
            "overrides = { private = false }", "overrides = { private = false, lr = 0.002 }"
        )
    )
    run(path, tmp_path / "runs")
    # ... and its mechanism controls (their twins use the method's trainer config)
    assert CALLS == {"tiny-other": 1, "audit": 1, "mechanism-controls": 1}
    assert model.stat().st_mtime_ns == mtime


def test_failing_method_is_recorded_and_others_go_on(tmp_path):
    path = config(tmp_path)
    FAIL.add("tiny-dp")
    outcome = run(path, tmp_path / "runs")
    root = tmp_path / "runs" / "t"
    assert outcome.failures == ["tiny-dp/train: RuntimeError: tiny-dp exploded on purpose"]
    status = json.loads((root / "status.json").read_text())["methods"]
    assert status["tiny-dp"]["stages"]["train"]["state"] == "failed"
    assert status["tiny-dp"]["stages"]["audit"]["state"] == "skipped"
    assert status["tiny-other"]["stages"]["audit"]["state"] == "done"
    assert "exploded on purpose" in (root / "tiny-dp" / "errors.log").read_text()
    report = load_report(root)
    assert report.method("tiny-dp").failed and report.method("tiny-dp").utility is None
    assert report.method("tiny-other").utility.test_accuracy > 0
    assert "exploded on purpose" in (root / "report.html").read_text()
    # fixed: the re-run trains only the failed method
    FAIL.clear()
    CALLS.clear()
    outcome = run(path, tmp_path / "runs")
    assert outcome.failures == [] and CALLS == {"tiny-dp": 1, "audit": 1}
    assert not load_report(root).method("tiny-dp").failed


def test_interrupted_stage_resumes_and_loses_nothing(tmp_path):
    path = config(tmp_path)
    FAIL.add("interrupt")  # Ctrl-C during the first audit
    with pytest.raises(KeyboardInterrupt):
        run(path, tmp_path / "runs")
    root = tmp_path / "runs" / "t"
    status = json.loads((root / "status.json").read_text())["methods"]
    assert status["tiny-dp"]["stages"]["train"]["state"] == "done"
    assert status["tiny-dp"]["stages"]["account"]["state"] == "done"
    assert "audit" not in status["tiny-dp"]["stages"]  # never completed
    trained = {p.name: p.read_bytes() for p in (root / "tiny-dp").rglob("*") if p.is_file()}
    assert not list(root.glob(".staging-*")) and not list(root.rglob("*.tmp"))
    FAIL.clear()
    CALLS.clear()
    outcome = run(path, tmp_path / "runs")
    assert outcome.failures == []
    # tiny-dp resumes at its audit; the mechanism controls (after the methods) never ran
    assert CALLS == {"tiny-other": 1, "audit": 2, "mechanism-controls": 2}
    for name, data in trained.items():  # files written before the interruption are untouched
        assert (next((root / "tiny-dp").rglob(name))).read_bytes() == data
    assert load_report(root).method("tiny-dp").audit is not None


def test_interrupted_training_keeps_previous_results(tmp_path):
    path = config(tmp_path)
    run(path, tmp_path / "runs")
    root = tmp_path / "runs" / "t"
    before = (root / "tiny-dp" / "metrics.json").read_text()
    FAIL.add("tiny-dp")  # a re-train (new config) that fails leaves the old folder intact
    path.write_text(
        path.read_text().replace(
            'name = "tiny-dp"\nquick = true',
            'name = "tiny-dp"\nquick = true\noverrides = { lr = 0.01 }',
        )
    )
    outcome = run(path, tmp_path / "runs")
    assert outcome.failures and (root / "tiny-dp" / "metrics.json").read_text() == before
    assert not list(root.glob(".staging-*"))
    # the report does not pass the old results off as the new config's
    assert load_report(root).method("tiny-dp").utility is None


# ---------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "tail, needle",
    [
        ('\n[[methods]]\nname = "no-such-method"\n', "method must be one of"),
        ('\n[[methods]]\nname = "tiny-dp"\n', "unique"),
        (
            '\n[[methods]]\nname = "tiny-dp"\nlabel = "x"\noverrides = { epochs = "many" }\n',
            "methods[2] (x) trainer config: epochs",
        ),
        ('\n[[methods]]\nname = "tiny-dp"\nlabel = "y"\noverrides = { nope = 1 }\n', "nope"),
    ],
)
def test_bad_config_fails_before_any_work(tmp_path, tail, needle):
    path = config(tmp_path, tail=tail)
    with pytest.raises(
        ValueError, match=needle.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")
    ):
        pipeline.load_run_config(path)
    result = CliRunner().invoke(app, ["run", str(path), "--out", str(tmp_path / "runs")])
    assert result.exit_code != 0
    assert not (tmp_path / "runs").exists() and CALLS == {}


@pytest.mark.parametrize(
    "override, needle",
    [
        ("delta=1.5", "delta"),
        ("federation.dataset=nope", "federation.dataset must be one of"),
        ("audit.shadows=3", "shadows must be an even number"),
        ("name=../evil", "name must be"),
        ("federation.partition=zipf", "federation.partition"),
    ],
)
def test_bad_override_is_one_line_exit_2(tmp_path, override, needle):
    path = config(tmp_path)
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from privkit.cli import main; main()",
            "run",
            str(path),
            "--set",
            override,
            "--out",
            str(tmp_path / "runs"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], proc.stderr
    assert not (tmp_path / "runs").exists()


def test_missing_config_file_is_one_line(tmp_path):
    result = CliRunner().invoke(app, ["run", str(tmp_path / "nope.toml")])
    assert result.exit_code != 0 and "config file not found" in str(result.exception)


# ---------------------------------------------------------------------------------- report command
def test_report_command_rerenders_and_rebuilds(tmp_path):
    run(config(tmp_path), tmp_path / "runs")
    root = tmp_path / "runs" / "t"
    (root / "report.html").unlink()
    (root / "report.md").unlink()
    original = (root / "report.json").read_text()
    result = CliRunner().invoke(app, ["report", str(root), "--json"])
    assert result.exit_code == 0, result.output
    assert (root / "report.html").is_file() and (root / "report.md").is_file()
    assert (root / "report.json").read_text() == original  # re-rendered, not rebuilt
    # rebuilt from the run directories: same methods and numbers
    result = CliRunner().invoke(app, ["report", str(root), "--rebuild"])
    assert result.exit_code == 0, result.output
    a = PrivacyReport.from_json(original)
    b = load_report(root)
    assert [m.name for m in a.methods] == [m.name for m in b.methods]
    assert a.method("tiny-dp").privacy == b.method("tiny-dp").privacy
    assert a.method("tiny-dp").utility == b.method("tiny-dp").utility
    # a report travels alone: re-render a copy of report.json without the run directory
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "report.json").write_text(original)
    result = CliRunner().invoke(app, ["report", str(lone)])
    assert result.exit_code == 0 and (lone / "report.html").is_file()


def test_report_command_on_missing_dir(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from privkit.cli import main; main()",
            "report",
            str(tmp_path / "nope"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "run directory not found" in proc.stderr


# ---------------------------------------------------------------------------------- bundled configs
def test_quickstart_covers_every_registered_method():
    resolved = pipeline.load_run_config(pipeline.bundled_config("quickstart"))
    listed = {m.method for m in resolved.methods}
    shipped = {n for n in REGISTRY if not n.startswith("tiny-")}
    # left out of the demo on purpose (its time is tight): client-level DP-FedAvg, whose quick
    # run is `privkit train dp-fedavg-client --quick`
    not_in_demo = {"dp-fedavg-client"}
    assert shipped - listed == not_in_demo, "add new methods to privkit/configs/quickstart.toml"
    assert all(m.quick for m in resolved.methods)
    assert resolved.config.federation.dataset == "mnist5k"
    assert resolved.config.report.reduced  # the report says what was scaled down


def test_full_config_validates():
    resolved = pipeline.load_run_config(pipeline.bundled_config("full"))
    assert not any(m.quick for m in resolved.methods)
    assert resolved.config.federation.dataset in ("cifar10", "cifar100")


def test_warning_classifier():
    c = pipeline.classify_warning
    assert c("3 of 20 parties have delta >= 1/n") == "delta_ge_1_over_n"
    assert (
        c("classic Gaussian mechanism used at epsilon = 1 (valid for epsilon < 1)")
        == "classic_gaussian_eps_ge_1"
    )
    assert c("noise multiplier adapted on the validation loss") == "adaptive_noise"
    assert c("accounted with Poisson sampling, but batches are shuffled") == "sampling_mismatch"
    assert c("something else") == "other"
    # the trainers' own stamps, verbatim, keep their codes (both mention sampling or accuracy)
    from accountants import Ledger
    from privkit.methods.chance import chance_warning
    from privkit.methods.contract import TrainResult, stamp_noise

    assert c(chance_warning("fedavg", 0.1, 0.1)) == "near_chance"
    result = TrainResult("dpsgd", 0, {}, None, {}, Ledger())
    stamp_noise(result, True)
    assert c(result.warnings[0]) == "reproducible_noise"


# ---------------------------------------------------------------------------------- parallel
@pytest.mark.slow
def test_parallel_workers_match_serial(tmp_path):
    """Methods in 2 worker processes give the same results as in this process (same seeds)."""
    text = """
name = "par"
seed = 1
workers = {workers}
[federation]
clients = 4
partition = "iid"
[audit]
enabled = false
[[methods]]
name = "centralized"
quick = true
overrides = {{ epochs = 1 }}
[[methods]]
name = "dpsgd"
quick = true
overrides = {{ epochs = 1, reproducible_noise = true }}
"""
    results = {}
    for workers in (1, 2):
        path = tmp_path / f"w{workers}.toml"
        path.write_text(text.format(workers=workers))
        outcome = run(path, tmp_path / f"runs{workers}")
        assert outcome.failures == []
        report = load_report(outcome.root)
        results[workers] = {
            m.name: (m.utility.test_accuracy, m.privacy.epsilon) for m in report.methods
        }
        status = json.loads((outcome.root / "status.json").read_text())["methods"]
        assert status["dpsgd"]["stages"]["audit"]["state"] == "skipped"
        assert status["dpsgd"]["stages"]["train"]["state"] == "done"
    assert results[1] == results[2]
    assert math.isinf(results[1]["centralized"][1]) and results[1]["dpsgd"][1] < math.inf


# ---------------------------------------------------------------------------------- audit controls
def test_controls_are_a_resumable_step_with_their_own_report_section(tmp_path):
    path = config(tmp_path)
    run(path, tmp_path / "runs")
    root = tmp_path / "runs" / "t"
    assert CALLS["controls"] == 1
    status = json.loads((root / "status.json").read_text())
    assert status["controls"]["state"] == "done" and set(status["methods"]) == {
        "tiny-dp",
        "tiny-other",
    }
    report = load_report(root)
    assert [m.name for m in report.methods] == ["tiny-dp", "tiny-other"]  # controls are not methods
    assert report.controls.power and len(report.controls.controls) == 4
    md = (root / "report.md").read_text()
    assert "## Audit controls" in md and md.startswith("# ")
    assert "| noise removed | white-box | violation | violation | 3.6 | 3.6 | 200/200 |" in md
    assert 'id="audit-controls"' in (root / "report.html").read_text()
    CALLS.clear()
    run(path, tmp_path / "runs")
    assert "controls" not in CALLS  # same hash: skipped
    run(path, tmp_path / "runs", ["audit.controls.black_box_epochs=5"])
    assert CALLS["controls"] == 1  # changed settings: re-run


def test_uncaught_positive_control_is_the_reports_first_line(tmp_path):
    CONTROL_POWER["power"] = False
    run(config(tmp_path), tmp_path / "runs")
    root = tmp_path / "runs" / "t"
    first = (root / "report.md").read_text().splitlines()[0]
    assert first.startswith("**This audit lacked the power to see a violation")
    html = (root / "report.html").read_text()
    assert html.index("controls-banner") < html.index("<h1>")
    report = load_report(root)
    assert report.controls.lacks_power
    assert any(
        w.code == "reduced_audit" and "lacked the power" in w.message for w in report.warnings
    )


def test_failed_or_disabled_controls(tmp_path):
    FAIL.add("controls")
    outcome = run(config(tmp_path), tmp_path / "runs")
    root = tmp_path / "runs" / "t"
    assert outcome.failures == ["audit-controls: RuntimeError: controls exploded on purpose"]
    report = load_report(root)
    assert report.controls.state == "failed" and report.controls.lacks_power
    assert (root / "report.md").read_text().startswith("**The audit controls failed")
    assert report.method("tiny-dp").utility is not None  # the methods went on
    FAIL.clear()
    run(config(tmp_path), tmp_path / "runs", ["audit.controls.enabled=false"])
    report = load_report(root)
    assert report.controls.state == "skipped" and not report.controls.lacks_power
    assert not (root / "report.md").read_text().startswith("**")


def test_controls_method_must_be_a_dpsgd_method_of_the_run(tmp_path):
    from privkit.errors import PrivkitError

    with pytest.raises(
        PrivkitError, match=r"audit\.controls\.method must be the label of a dpsgd method"
    ):
        pipeline.load_run_config(config(tmp_path), ["audit.controls.method=tiny-dp"])


def test_old_reports_without_controls_still_load(tmp_path):
    run(config(tmp_path), tmp_path / "runs")
    data = json.loads((tmp_path / "runs" / "t" / "report.json").read_text())
    data.pop("controls")
    old = PrivacyReport.model_validate(data)
    assert old.controls is None


# ---------------------------------------------------------------------------------- release mode
def test_reproducible_noise_flag_stamps_report_not_for_release(tmp_path):
    """`privkit run --reproducible-noise` stamps ledger, privacy.json and report; the default does not."""
    tail = '\n[report]\nformats = ["json", "md"]\n'
    path = config(tmp_path, tail=tail)
    stamp = "reproducible noise: not for release"
    for flag, out in ((["--reproducible-noise"], "seeded"), ([], "release")):
        res = CliRunner().invoke(
            app,
            [
                "run",
                str(path),
                "--out",
                str(tmp_path / out),
                "--quiet",
                "--set",
                "audit.enabled=false",
                *flag,
            ],
        )
        assert res.exit_code == 0, res.output
        root = tmp_path / out / "t"
        seeded = bool(flag)
        resolved = json.loads((root / "config.resolved.json").read_text())
        assert resolved["reproducible_noise"] is seeded
        assert all(
            m["trainer"]["reproducible_noise"] is seeded for m in resolved["resolved_methods"]
        )
        ledger = json.loads((root / "tiny-dp" / "ledger.json").read_text())
        assert ledger.get("reproducible_noise", False) is seeded
        privacy = json.loads((root / "tiny-dp" / "privacy.json").read_text())
        assert privacy["reproducible_noise"] is seeded and (privacy.get("noise") == stamp) is seeded
        report = load_report(root)
        assert report.method("tiny-dp").privacy.reproducible_noise is seeded
        md = (root / "report.md").read_text()
        # one prominent stamp per method when seeded (tiny-dp and tiny-other); in release mode the
        # words appear nowhere (neither the stamp nor the trainers' warning)
        assert md.count(f"**WARNING — {stamp}.**") == (2 if seeded else 0)
        assert (stamp in md) is seeded


def test_a_damaged_file_reruns_its_stage_and_the_stages_after_it(tmp_path):
    """A file whose checksum fails is treated as absent (with a warning naming it): its stage
    runs again, and so do the stages that read its output; nothing else does."""
    path = config(tmp_path)
    run(path, tmp_path / "runs")
    root = tmp_path / "runs" / "t"
    privacy = root / "tiny-dp" / "privacy.json"
    privacy.write_text(privacy.read_text().replace("{", "{ ", 1))  # still JSON, not what was stored
    CALLS.clear()
    logs: list[str] = []
    pipeline.run_pipeline(pipeline.load_run_config(path, []), tmp_path / "runs", log=logs.append)
    assert CALLS == {"audit": 1}  # account again (no call to count), then the audit it feeds
    assert any("privacy.json: checksum mismatch; treated as absent" in line for line in logs)
    model = root / "tiny-other" / "checkpoints" / "model.pt"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte changed
    model.write_bytes(bytes(data))
    CALLS.clear()
    pipeline.run_pipeline(pipeline.load_run_config(path, []), tmp_path / "runs", log=logs.append)
    assert CALLS == {"tiny-other": 1, "audit": 1}
    assert any("model.pt: checksum mismatch" in line for line in logs)
