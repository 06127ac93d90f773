"""End to end: audit_run / `privkit audit` on small runs, executors, fast path, verdicts."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from audit_helpers import SMALL, make_run, tiny_federation_config
from typer.testing import CliRunner

from attacks.audit import audit_run
from privkit.trainers.batched_sgd import SGDRecipe, reference_models
from attacks.shadows import train_shadows
from privkit.models import model_spec

ENTRY_KEYS = {"auc", "balanced_accuracy", "advantage", "tpr_at_fpr", "epsilon_lower_bound", "ceiling",
              "confidence", "delta", "n_trials", "roc", "notes", "error"}
FAST = dict(shadows=4, n_audit=100, shadow_iterations=30, canaries=100)


def test_reference_models_for_a_user_model():
    rng = np.random.default_rng(1)
    x = rng.random((120, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 3, 120)
    logits, keep = reference_models(model_spec("mlp", (1, 8, 8), 3, feature_dim=8), x, y, n_models=4,
                                    recipe=SGDRecipe(epochs=1, batch_size=10, lr=0.1))
    assert logits.shape == (4, 120, 3) and (keep.sum(0) == 2).all()


def test_audit_run_contract_and_isolated_failure(central_run):
    out = audit_run(central_run, **FAST)
    on_disk = json.loads((central_run / "audit.json").read_text())
    assert on_disk == out
    assert {"schema_version", "method", "attacks", "attribute", "accounted_epsilon", "delta", "shadows",
            "verdict"} <= set(out)
    assert set(out["attacks"]) == {"threshold", "shadow", "lira", "lira-offline", "one-run"}
    for name, e in out["attacks"].items():
        assert ENTRY_KEYS <= set(e), name
        assert e["error"] is None, (name, e["error"])
        assert set(e["tpr_at_fpr"]) == {"0.001", "0.01"}
        assert 0 <= e["epsilon_lower_bound"] <= e["ceiling"]
    # centralized claims nothing: infinite accounted epsilon, verdict says so
    assert out["accounted_epsilon"] == float("inf") or out["accounted_epsilon"] is None or \
        not np.isfinite(out["accounted_epsilon"])
    assert out["verdict"]["status"] == "no-formal-guarantee"
    # the attribute attack fails (no per-client artifacts) without losing the others
    assert out["attribute"]["dominant-class"]["error"].startswith("ValueError")
    assert (central_run / "shadows.npz").is_file()
    with np.load(central_run / "shadows.npz") as z:
        assert (z["mask"].sum(0) == 2).all()


def test_audit_same_seed_same_result(central_run):
    a = audit_run(central_run, attacks="threshold,lira", write=False, **FAST)
    b = audit_run(central_run, attacks=["threshold", "lira"], write=False, **FAST)
    assert a["attacks"] == b["attacks"]


@pytest.mark.slow
def test_shadows_identical_across_executors(central_run, tmp_path):
    from privkit.data import Federation

    fed = Federation.load(central_run / "federation.json")
    cfg = json.loads((central_run / "config.json").read_text())
    uni = fed.shadow_pool[:60]
    runs = {ex: train_shadows(fed, "centralized", cfg["trainer"], uni, n_models=2, seed=3, executor=ex,
                              workers=2) for ex in ("serial", "process")}
    np.testing.assert_array_equal(runs["serial"].logits, runs["process"].logits)
    np.testing.assert_array_equal(runs["serial"].mask, runs["process"].mask)


@pytest.mark.slow
def test_shadows_identical_on_ray(central_run):
    ray = pytest.importorskip("ray")
    from privkit.data import Federation

    fed = Federation.load(central_run / "federation.json")
    cfg = json.loads((central_run / "config.json").read_text())
    uni = fed.shadow_pool[:40]
    serial = train_shadows(fed, "centralized", cfg["trainer"], uni, n_models=2, seed=1)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        on_ray = train_shadows(fed, "centralized", cfg["trainer"], uni, n_models=2, seed=1, executor="ray")
    finally:
        ray.shutdown()
    np.testing.assert_array_equal(serial.logits, on_ray.logits)


@pytest.mark.slow
def test_dpsgd_bound_never_exceeds_accounted(tmp_path):
    run = make_run(tmp_path, "dpsgd", tiny_federation_config(), {"arch": "mlp", "epochs": 1})
    out = audit_run(run, shadows=2, n_audit=100, shadow_iterations=30, canaries=100)
    acc = out["accounted_epsilon"]
    assert acc is not None and np.isfinite(acc) and acc > 0
    for name, e in out["attacks"].items():
        assert e["error"] is None, (name, e["error"])
        assert e["epsilon_lower_bound"] <= acc, name
    assert out["verdict"]["status"] == "consistent"
    assert out["delta"] == pytest.approx(json.loads((run / "config.json").read_text())["trainer"]["delta"])


@pytest.mark.parametrize("method", ["fedauxfdp", "fedmd-nfdp",
                                    pytest.param("flip", marks=pytest.mark.slow)])
def test_attribute_inference_on_shared_artifacts(tmp_path, method):
    fed_cfg = tiny_federation_config(clients=4, partition="dirichlet", alpha=0.1, public_size=0.2)
    run = make_run(tmp_path, method, fed_cfg)
    out = audit_run(run, attacks="attribute,threshold", shadows=4, n_audit=50)
    r = out["attribute"]["dominant-class"]
    assert r["error"] is None, r["error"]
    assert r["n_test"] == 4 and 0 <= r["ci_low"] <= r["accuracy"] <= r["ci_high"] <= 1
    assert out["attacks"]["threshold"]["error"] is None


@pytest.mark.slow
def test_overfit_model_leaks_and_lira_beats_threshold(tmp_path):
    """A deliberately overfit non-private model on mnist5k: clear signal, LiRA strongest at low FPR."""
    from privkit.data import FederationConfig

    fed_cfg = FederationConfig(dataset="mnist5k", clients=2, partition="iid", test_size=0.2,
                               shadow_size=0.85, seed=0)  # 600 members: easy to overfit
    run = make_run(tmp_path, "centralized", fed_cfg,
                   {"arch": "mlp", "feature_dim": 256, "epochs": 40, "lr": 0.1, "batch_size": 32})
    out = audit_run(run, attacks="threshold,lira", shadows=8 if SMALL else 16, n_audit=300)
    thr, lira = out["attacks"]["threshold"], out["attacks"]["lira"]
    # measured (seed 0, 8 shadows): threshold AUC 0.60, LiRA 0.70; TPR@1%FPR 0.02 vs 0.06
    assert thr["auc"] > 0.55 and lira["auc"] > 0.62
    assert lira["tpr_at_fpr"]["0.01"] > thr["tpr_at_fpr"]["0.01"]
    assert lira["tpr_at_fpr"]["0.001"] > thr["tpr_at_fpr"]["0.001"]


# ------------------------------------------------------------------------------------- CLI
def test_cli_json(central_run):
    from privkit.cli import app

    res = CliRunner().invoke(app, ["audit", str(central_run), "--attacks", "threshold", "--shadows", "2",
                                   "--n-audit", "50", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert set(data["attacks"]) == {"threshold"} and data["schema_version"] == 1


def test_cli_table(central_run):
    from privkit.cli import app

    res = CliRunner().invoke(app, ["audit", str(central_run), "--attacks", "threshold", "--shadows", "2",
                                   "--n-audit", "50"])
    assert res.exit_code == 0, res.output
    assert "verdict" in res.output and "no-formal-guarantee" in res.output


@pytest.mark.parametrize("args,needle", [(["--attacks", "bogus"], "attacks must be a subset"),
                                         (["--shadows", "3"], "shadows must be an even number")])
def test_cli_bad_input_one_line_exit_2(central_run, args, needle):
    proc = subprocess.run([sys.executable, "-c", "from privkit.cli import main; main()", "audit",
                           str(central_run), *args], capture_output=True, text=True)
    assert proc.returncode == 2
    assert needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_cli_missing_run_dir(tmp_path):
    proc = subprocess.run([sys.executable, "-c", "from privkit.cli import main; main()", "audit",
                           str(tmp_path / "nope")], capture_output=True, text=True)
    assert proc.returncode == 2 and "run_dir" in proc.stderr


@pytest.mark.slow
def test_flip_table2_protocol_runs_and_reports_chance_interval():
    from attacks.instantiations import binary_federation, flip_table2_attack
    from privkit.data import build_federation
    from privkit.trainers import get_trainer

    fed = build_federation(tiny_federation_config(clients=2))
    binfed = binary_federation(fed, 1, 3, "b")
    assert binfed.num_classes == 2 and set(np.unique(binfed.private.y)) == {0, 1}
    res = flip_table2_attack(fed, get_trainer("flip").quick_config(), p1=0, p2=1, s1=3, s2=8)
    assert res.chance == 0.5 and res.n_test > 0 and res.ci_low <= res.accuracy <= res.ci_high
    with pytest.raises(ValueError, match="four distinct"):
        flip_table2_attack(fed, {}, p1=0, p2=0, s1=3, s2=8)
