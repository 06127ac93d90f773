"""End to end: audit_run / `privkit audit` on small runs: one pool, fair coins, matched sizes,
executors, verdicts; and the vectorised recipe privkit hands to the audit layer.

Changed with issues 11/12: audits no longer attack the released model with members from the
clients and non-members from the test set, and the separate "one-run" canary run is gone; the
audited target is a fresh run of the method's recipe whose audited records were included by fair
coins from one pool (clients + shadow pool), so every attack's records have random inclusion.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from audit_helpers import SMALL, make_run, tiny_federation_config
from scipy import stats
from typer.testing import CliRunner

from attacks.audit_scores import decide
from privkit.audit import audit_run
from privkit.batched.batched_sgd import SGDRecipe, reference_models
from privkit.models import model_spec

ENTRY_KEYS = {
    "auc",
    "balanced_accuracy",
    "advantage",
    "tpr_at_fpr",
    "epsilon_lower_bound",
    "ceiling",
    "confidence",
    "delta",
    "n_trials",
    "roc",
    "notes",
    "error",
}
FAST = dict(shadows=4, n_audit=200, shadow_iterations=30)


def test_reference_models_for_a_user_model():
    rng = np.random.default_rng(1)
    x = rng.random((120, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 3, 120)
    logits, keep = reference_models(
        model_spec("mlp", (1, 8, 8), 3, feature_dim=8),
        x,
        y,
        n_models=4,
        recipe=SGDRecipe(epochs=1, batch_size=10, lr=0.1),
    )
    assert logits.shape == (4, 120, 3) and (keep.sum(0) == 2).all()


def test_audit_run_contract_and_isolated_failure(central_run):
    out = audit_run(central_run, **FAST)
    on_disk = json.loads((central_run / "audit.json").read_text())
    assert on_disk == out
    assert {
        "schema_version",
        "method",
        "attacks",
        "attribute",
        "accounted_epsilon",
        "delta",
        "shadows",
        "verdict",
        "experiment",
        "warnings",
    } <= set(out)
    assert set(out["attacks"]) == {
        "threshold",
        "shadow",
        "lira",
        "lira-offline",
        "rmia",
        "rmia-offline",
    }
    for name, e in out["attacks"].items():
        assert set(e) >= ENTRY_KEYS, name
        assert e["error"] is None, (name, e["error"])
        assert set(e["tpr_at_fpr"]) == {"0.001", "0.01"}
        assert 0 <= e["epsilon_lower_bound"] <= e["ceiling"]
    # centralized claims nothing: infinite accounted epsilon, verdict says so
    assert not np.isfinite(out["accounted_epsilon"])
    v = out["verdict"]
    assert v["status"] == "no-claim"
    assert {
        "epsilon_lower_bound",
        "epsilon_ceiling",
        "detectable_epsilon",
        "confidence",
        "correction",
        "m",
        "family",
    } <= set(v)
    # every attack audits the same n_audit records, all included by fair coins: no "not verified" note
    assert v["m"] == FAST["n_audit"] and set(v["inclusion"].values()) == {"random"}
    assert not any("not verified" in n for n in v["notes"])
    # the attribute attack does not apply (no per-client artifacts): said so, not a failure
    attr = out["attribute"]["dominant-class"]
    assert attr["error"] is None and "shares no per-client artifacts" in attr["not_applicable"]


def test_audited_records_come_from_one_pool_by_fair_coins(central_run):
    from privkit.data import Federation

    out = audit_run(central_run, **FAST)
    fed = Federation.load(central_run / "federation.json")
    with np.load(central_run / "shadows.npz") as z:
        pool, audited, included, keep = z["pool"], z["audited"], z["included"], z["keep"]
    # the pool: every client record plus shadow-pool records; never the test set
    assert (
        np.isin(fed.members, pool).all()
        and np.isin(pool, np.r_[fed.members, fed.shadow_pool]).all()
    )
    assert not np.isin(pool, fed.test).any()
    # audited records from both parts; the others always in; references: each audited record in
    # exactly half of them, every other record in all
    assert audited.sum() == FAST["n_audit"]
    assert (
        np.isin(pool[audited], fed.members).any() and np.isin(pool[audited], fed.shadow_pool).any()
    )
    assert included[~audited].all() and keep[:, ~audited].all()
    assert (keep[:, audited].sum(0) == FAST["shadows"] // 2).all()
    # the coins are fair (two-sided binomial test) and are what the attacks were scored against
    k = int(included[audited].sum())
    assert stats.binomtest(k, FAST["n_audit"], 0.5).pvalue > 1e-3
    assert out["n_audit"] == {"members": k, "nonmembers": FAST["n_audit"] - k}


def test_audited_runs_match_the_release_size_or_warn(central_run):
    from privkit.pipeline.report import _read_audit

    out = audit_run(central_run, **FAST)
    exp = out["experiment"]
    # pool = clients + n_audit/2 shadow-pool records: pool - n_audit/2 = the release's data size
    assert exp["audit_train_size_expected"] == exp["release_train_size"] == exp["pool_from_clients"]
    assert exp["pool_from_shadow_pool"] == FAST["n_audit"] // 2
    assert (
        abs(exp["target_train_size"] - exp["release_train_size"]) < 4 * np.sqrt(FAST["n_audit"]) / 2
    )
    assert out["warnings"] == []
    # more audited records than the shadow pool can balance: the audited runs see less data, and
    # the warning with the numbers reaches audit.json and the report
    n = exp["n_audit_matched"] + 100
    big = audit_run(central_run, **{**FAST, "n_audit": n, "attacks": "threshold"})
    (w,) = [w for w in big["warnings"] if w["code"] == "audit_size_mismatch"]
    assert f"the released model on {exp['release_train_size']}" in w["message"]
    assert f"matching needs n_audit <= {exp['n_audit_matched']}" in w["message"]
    report_warnings: list = []
    _read_audit(central_run, {}, report_warnings)
    assert [r.code for r in report_warnings] == ["audit_size_mismatch"]
    assert report_warnings[0].message == w["message"]


def test_audit_same_seed_same_result(central_run):
    a = audit_run(central_run, attacks="threshold,lira", write=False, **FAST)
    b = audit_run(central_run, attacks=["threshold", "lira"], write=False, **FAST)
    assert a["attacks"] == b["attacks"]


@pytest.mark.slow
def test_run_audit_identical_across_executors(central_run):
    """The audited runs go through the audit layer's executors (Ray: tests/attacks/test_recipe_audit.py)."""
    kw = {**FAST, "shadows": 2, "attacks": "threshold,lira", "write": False}
    serial = audit_run(central_run, **kw)
    process = audit_run(central_run, executor="process", workers=2, **kw)
    assert serial["attacks"] == process["attacks"] and serial["verdict"] == process["verdict"]


@pytest.mark.slow
def test_dpsgd_bound_never_exceeds_accounted(tmp_path):
    run = make_run(tmp_path, "dpsgd", tiny_federation_config(), {"arch": "mlp", "epochs": 1})
    out = audit_run(run, shadows=2, n_audit=200, shadow_iterations=30)
    acc = out["accounted_epsilon"]
    assert acc is not None and np.isfinite(acc) and acc > 0
    # the verdict checks the audited target run's own ledger; it trains on as many records as the
    # release (up to the coins), so its epsilon is close to the release's
    exp = out["experiment"]
    assert acc == exp["audit_target_accounted_epsilon"]
    assert acc == pytest.approx(exp["release_accounted_epsilon"], rel=0.05)
    for name, e in out["attacks"].items():
        assert e["error"] is None, (name, e["error"])
        assert e["epsilon_lower_bound"] <= acc, name
    # the verdict follows from three numbers of audit.json: 200 audited records and six attacks
    # (Bonferroni) cap the bound below the accounted epsilon, so "inconclusive"
    v = out["verdict"]
    assert (
        v["status"] == decide(v["epsilon_lower_bound"], v["epsilon_ceiling"], acc) == "inconclusive"
    )
    assert v["epsilon_ceiling"] < acc and "can detect at most epsilon" in v["message"]
    assert v["confidence"] == 0.95 and v["correction"] == "Bonferroni over 6 attack(s)"
    assert out["delta"] == pytest.approx(
        json.loads((run / "config.json").read_text())["trainer"]["delta"]
    )
    _check_both_claims(out, run)


def _check_both_claims(out: dict, run) -> None:
    """audit.json carries the generic bound (the verdict's) and the ledger-curve bound, each with
    its claim; the curve's points are the audited target ledger's trade-off curve."""
    from accountants import Ledger, ledger_curve

    acc, v = out["accounted_epsilon"], out["verdict"]
    gen, led = out["claims"]["generic"], out["claims"]["ledger"]
    assert gen["in_verdict"] and not led["in_verdict"]
    assert gen["claim_tested"].startswith("(eps, delta)-DP")
    assert led["claim_tested"].startswith(
        "as private as its ledger says: as private as the ledger's PLD"
    )
    assert gen["epsilon_lower_bound"] == v["epsilon_lower_bound"]
    assert gen["epsilon_ceiling"] == v["epsilon_ceiling"]
    # same guesses against a stronger claim: the curve's ceiling is at least the generic one (f-DP
    # with the ledger's curve is never weaker than Steinke et al. at the same epsilon); measured
    # here 3.65 against 2.05, so the ledger claim can be "consistent" where the generic one is
    # "inconclusive"
    assert led["epsilon_ceiling"] >= gen["epsilon_ceiling"] - 1e-9
    assert led["status"] == decide(led["epsilon_lower_bound"], led["epsilon_ceiling"], acc)
    assert 0.0 <= led["epsilon_lower_bound"] <= led["epsilon_ceiling"]
    # the stored curve: the ledger's own curve at the stored FPRs; at the accounted epsilon it
    # satisfies the generic (eps, delta) curve's inequality FNR >= 1 - delta - e^eps FPR
    pts = out["tradeoff_curve"]
    fpr, fnr = np.array(pts["fpr"]), np.array(pts["fnr"])
    assert pts["accounted_epsilon"] == acc and fpr.size == fnr.size > 100 and fpr[0] == 0.0
    assert np.all(np.diff(fnr) <= 1e-12) and fnr[-1] == 0.0
    assert np.all(fnr >= 1 - pts["delta"] - np.exp(acc) * fpr - 1e-6)
    assert fnr[0] == pytest.approx(1 - pts["delta"], abs=1e-3)
    release = ledger_curve(
        Ledger.load(run / "ledger.json")
    )  # the release's curve: epsilon within 5%
    assert release.epsilon(pts["delta"]) == pytest.approx(acc, rel=0.05)
    # each attack's own bound against the ledger curve is at most the curve's ceiling at its
    # (higher, per-attack) confidence, which is below the accounted epsilon here
    assert set(led["per_attack"]) == set(out["attacks"])
    assert all(0.0 <= b < acc for b in led["per_attack"].values())
    # the report reads both from audit.json: curve points and every attack's ROC reach report.json,
    # and the ROC-vs-ledger figure draws from them
    from privkit.pipeline.report import _read_audit
    from reports.plots import ledger_roc_figure
    from reports.roc_claims import forbidden_counts

    summary = _read_audit(run, {}, [])
    assert summary.claims["ledger"]["epsilon_lower_bound"] == led["epsilon_lower_bound"]
    assert summary.tradeoff_curve.fnr == pts["fnr"] and summary.extra.get("tradeoff_curve") is None
    from reports import MethodReport

    mr = MethodReport(name="dpsgd", method="dpsgd", audit=summary)
    counts = forbidden_counts(mr)
    assert set(counts) == {n for n, e in out["attacks"].items() if len(e["roc"]["fpr"]) > 1}
    assert ledger_roc_figure(mr).axes[0].get_xscale() == "log"


@pytest.mark.parametrize(
    "method", ["fedauxfdp", "fedmd-nfdp", pytest.param("flip", marks=pytest.mark.slow)]
)
def test_attribute_inference_on_shared_artifacts(tmp_path, method):
    fed_cfg = tiny_federation_config(clients=4, partition="dirichlet", alpha=0.1, public_size=0.2)
    run = make_run(tmp_path, method, fed_cfg)
    out = audit_run(run, attacks="attribute,threshold", shadows=4, n_audit=50)
    assert out["experiment"]["references"] == 4
    r = out["attribute"]["dominant-class"]
    assert r["error"] is None, r["error"]
    assert r["n_test"] == 4 and 0 <= r["ci_low"] <= r["accuracy"] <= r["ci_high"] <= 1
    assert out["attacks"]["threshold"]["error"] is None


@pytest.mark.slow
def test_overfit_model_leaks_and_lira_beats_threshold(tmp_path):
    """A deliberately overfit non-private model on mnist5k: clear signal, LiRA strongest at low FPR."""
    from privkit.data import FederationConfig

    fed_cfg = FederationConfig(
        dataset="mnist5k", clients=2, partition="iid", test_size=0.2, shadow_size=0.85, seed=0
    )  # 600 members: easy to overfit
    run = make_run(
        tmp_path,
        "centralized",
        fed_cfg,
        {"arch": "mlp", "feature_dim": 256, "epochs": 40, "lr": 0.1, "batch_size": 32},
    )
    out = audit_run(run, attacks="threshold,lira", shadows=8 if SMALL else 16)
    thr, lira = out["attacks"]["threshold"], out["attacks"]["lira"]
    # measured (seed 0, 8 reference runs, 1200 audited records): threshold AUC 0.60, LiRA 0.73;
    # TPR@1%FPR 0.023 vs 0.120, TPR@0.1%FPR 0.010 vs 0.054
    assert thr["auc"] > 0.55 and lira["auc"] > 0.62
    assert lira["tpr_at_fpr"]["0.01"] > thr["tpr_at_fpr"]["0.01"]
    assert lira["tpr_at_fpr"]["0.001"] > thr["tpr_at_fpr"]["0.001"]
    # 3400 shadow-pool records: the pool takes 600 of them, so the audited runs also see ~600
    assert out["experiment"]["audit_train_size_expected"] == 600 and out["warnings"] == []


# ------------------------------------------------------------------------------------- CLI
def test_cli_json(central_run):
    from privkit.cli import app

    res = CliRunner().invoke(
        app,
        [
            "audit",
            str(central_run),
            "--attacks",
            "threshold",
            "--shadows",
            "2",
            "--n-audit",
            "50",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert set(data["attacks"]) == {"threshold"} and data["schema_version"] == 1


def test_cli_table(central_run):
    from privkit.cli import app

    res = CliRunner().invoke(
        app,
        ["audit", str(central_run), "--attacks", "threshold", "--shadows", "2", "--n-audit", "50"],
    )
    assert res.exit_code == 0, res.output
    assert "verdict" in res.output and "no-claim" in res.output


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--attacks", "bogus"], "attacks must be a subset"),
        (["--shadows", "3"], "shadows must be an even number"),
    ],
)
def test_cli_bad_input_one_line_exit_2(central_run, args, needle):
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from privkit.cli import main; main()",
            "audit",
            str(central_run),
            *args,
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_cli_missing_run_dir(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from privkit.cli import main; main()",
            "audit",
            str(tmp_path / "nope"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "run_dir" in proc.stderr


@pytest.mark.slow
def test_flip_table2_protocol_runs_and_reports_chance_interval():
    from privkit.audit.instantiations import binary_federation, flip_table2_attack
    from privkit.data import build_federation
    from privkit.trainers import get_trainer

    fed = build_federation(tiny_federation_config(clients=2))
    binfed = binary_federation(fed, 1, 3, "b")
    assert binfed.num_classes == 2 and set(np.unique(binfed.private.y)) == {0, 1}
    res = flip_table2_attack(fed, get_trainer("flip").quick_config(), p1=0, p2=1, s1=3, s2=8)
    assert res.chance == 0.5 and res.n_test > 0 and res.ci_low <= res.accuracy <= res.ci_high
    with pytest.raises(ValueError, match="four distinct"):
        flip_table2_attack(fed, {}, p1=0, p2=0, s1=3, s2=8)


# ------------------------------------------------------------------------------- CLI: --recipe
RECIPE_MODULE = """
from sklearn.ensemble import RandomForestClassifier


def train_fn(x, y, seed):
    return RandomForestClassifier(n_estimators=10, random_state=seed).fit(x, y)
"""


@pytest.fixture()
def recipe_dir(tmp_path, monkeypatch):
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    (tmp_path / "my_recipe.py").write_text(RECIPE_MODULE)
    np.savez(tmp_path / "pool.npz", x=x[:600], y=y[:600])
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_cli_audits_a_recipe(recipe_dir):
    from privkit.cli import app

    res = CliRunner().invoke(
        app,
        [
            "audit",
            "--recipe",
            "my_recipe:train_fn",
            "--data",
            "pool.npz",
            "--shadows",
            "2",
            "--epsilon",
            "0.5",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data == json.loads((recipe_dir / "audit.json").read_text())
    assert data["recipe"] == "my_recipe:train_fn" and data["schema_version"] == 1
    assert set(data["attacks"]) == {
        "threshold",
        "shadow",
        "lira",
        "lira-offline",
        "rmia",
        "rmia-offline",
    }
    assert data["experiment"]["pool"] == 600 and data["experiment"]["references"] == 2
    assert data["inclusion"] == "random" and data["accounted_epsilon"] == 0.5
    # the same audit through the library gives the same numbers
    from my_recipe import train_fn

    from attacks import audit_recipe

    with np.load(recipe_dir / "pool.npz") as z:
        lib = audit_recipe(train_fn, z["x"], z["y"], accounted_epsilon=0.5, delta=1e-5, shadows=2)
    assert lib.epsilon_lower_bound == data["epsilon_lower_bound"] and lib.verdict == data["status"]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--recipe", "my_recipe", "--data", "pool.npz"], "recipe must be module:function"),
        (
            ["--recipe", "nope:train_fn", "--data", "pool.npz"],
            "recipe module 'nope' cannot be imported",
        ),
        (["--recipe", "my_recipe:missing", "--data", "pool.npz"], "has no callable 'missing'"),
        (["--recipe", "my_recipe:train_fn"], "--recipe needs --data"),
        (
            ["--recipe", "my_recipe:train_fn", "--data", "none.npz"],
            "data must be an existing .npz file",
        ),
        ([], "give either RUN_DIR or --recipe"),
    ],
)
def test_cli_recipe_bad_input_one_line_exit_2(recipe_dir, args, needle, monkeypatch, capsys):
    from privkit.cli import main

    monkeypatch.setattr(
        sys, "argv", ["privkit", "audit", *args]
    )  # main() as the console script runs it
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert needle in err and len(err.strip().splitlines()) == 1


def test_audit_accounts_on_the_headline_grid_and_distrusts_a_corrupted_record(tmp_path):
    """The audit's claim is the headline's accountant: on the PLD grid the account stage recorded
    in privacy.json (a corrupted privacy.json is not trusted: the ledger's own grid answers)."""
    import atomicfiles
    from accountants import Ledger, dpsgd_event
    from privkit.audit.run import _accounting, _headline_grid

    assert _headline_grid(tmp_path) is None  # no privacy.json
    atomicfiles.write_text(tmp_path / "privacy.json", json.dumps({"pld_grid": 1e-3}))
    assert _headline_grid(tmp_path) == 1e-3
    ledger = Ledger()
    ledger.add(0, dpsgd_event(0.05, 1.1, 200), "dp-sgd")
    coarse = Ledger.from_dict(ledger.to_dict())
    coarse.value_discretization_interval = 1e-3
    acc, error = _accounting(None, ledger, 1e-5, _headline_grid(tmp_path))
    assert error is None and acc["release_accounted_epsilon"] == coarse.epsilon(1e-5)
    (tmp_path / "privacy.json").write_text(json.dumps({"pld_grid": 0.5}))  # checksum now wrong
    assert _headline_grid(tmp_path) is None


def test_audit_takes_the_releases_epsilon_the_account_stage_recorded(tmp_path):
    """privacy.json's worst client under its best accountant, where it accounted at the audit's
    delta on the audit's grid, is the release's epsilon (equal to the ledger's own); at another
    delta, on another grid, or from a corrupted file, the release's ledger is accounted."""
    import atomicfiles
    from accountants import Ledger, dpsgd_event
    from privkit.audit.run import _accounting, _privacy_record, _recorded_release_epsilon

    ledger = Ledger()
    ledger.add(0, dpsgd_event(0.05, 1.1, 200), "dp-sgd")
    ledger.add(1, dpsgd_event(0.05, 1.1, 120), "dp-sgd")
    ledger.value_discretization_interval = 1e-3
    summary = ledger.summary(1e-5)
    record = {"delta": 1e-5, "pld_grid": 1e-3, "summary": {"worst": summary["worst"]}}
    atomicfiles.write_text(tmp_path / "privacy.json", json.dumps(record))
    read = _privacy_record(tmp_path)
    assert read == record
    recorded = _recorded_release_epsilon(read, 1e-5, 1e-3)
    assert recorded == summary["worst"]["best"] == ledger.epsilon(1e-5)

    class Unused:  # the release's ledger, which must not be accounted again
        def epsilon(self, delta):
            raise AssertionError("the release's ledger was accounted again")

    acc, error = _accounting(None, Unused(), 1e-5, 1e-3, recorded)
    assert error is None and acc["release_accounted_epsilon"] == recorded
    assert acc["release_epsilon_source"] == "privacy.json"
    # another delta or grid: not the recorded one
    assert _recorded_release_epsilon(read, 1e-6, 1e-3) is None
    assert _recorded_release_epsilon(read, 1e-5, 1e-4) is None
    assert _recorded_release_epsilon(read, 1e-5, None) is None
    acc, _ = _accounting(None, ledger, 1e-6, 1e-3, _recorded_release_epsilon(read, 1e-6, 1e-3))
    assert acc["release_accounted_epsilon"] == ledger.epsilon(1e-6)
    assert acc["release_epsilon_source"] == "ledger"
    (tmp_path / "privacy.json").write_text(json.dumps({**record, "delta": 1e-6}))  # checksum wrong
    assert _privacy_record(tmp_path) == {}


@pytest.mark.parametrize("size", [5, 64, 65, 640, 1000, 15680])
def test_artifact_chunk_means_are_the_array_split_chunks_means(size):
    """The attribute audit's artifact summary: the means of np.array_split's 64 chunks (the first
    size % 64 one longer), taken in one reduceat; arrays of at most 64 values are kept whole."""
    from privkit.audit.instantiations import _chunk_mean

    v = np.random.default_rng(size).normal(size=size)
    want = v if size <= 64 else np.array([c.mean() for c in np.array_split(v, 64)])
    got = _chunk_mean(v.reshape(-1, 5) if size % 5 == 0 else v)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
