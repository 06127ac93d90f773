"""attacks.audit_recipe: scikit-learn, plain PyTorch and opacus recipes audited end to end."""

import json

import pytest
from recipes_for_tests import (
    DP_DELTA,
    DP_EPSILON,
    digits,
    forest,
    logreg,
    opacus_dpsgd,
    prior_only,
    torch_loop,
)

from attacks import AuditResult, audit_recipe


@pytest.fixture(scope="module")
def data():
    return digits()


def test_scikit_learn_recipe_memorising_is_caught(data):
    x, y = data
    res = audit_recipe(forest, x, y, accounted_epsilon=0.5, delta=1e-5, shadows=4)
    assert isinstance(res, AuditResult)
    assert set(res.attacks) == {
        "threshold",
        "shadow",
        "lira",
        "lira-offline",
        "rmia",
        "rmia-offline",
    }
    assert res.inclusion == "random" and not any("not verified" in n for n in res.notes)
    # fully grown trees memorise: no 0.5-DP mechanism gives these guesses
    assert res.verdict == "violation" and res.epsilon_lower_bound > 0.5
    assert res.attacks["lira"].auc > 0.6
    exp = res.experiment
    assert exp["pool"] == exp["audited"] == len(y) and exp["references"] == 4
    assert exp["target_train_size"] == int(res.design.included.sum()) == exp["audited_members"]
    d = res.to_dict()
    assert json.loads(json.dumps(d)) == d and d["experiment"] == exp and d["status"] == "violation"


def test_a_null_recipe_is_not_flagged(data):
    x, y = data
    res = audit_recipe(prior_only, x, y, accounted_epsilon=0.5, delta=1e-5, shadows=4)
    assert res.verdict in ("consistent", "inconclusive")
    assert all(abs(a.auc - 0.5) < 0.05 for a in res.attacks.values())


def test_plain_pytorch_loop(data):
    x, y = data
    res = audit_recipe(torch_loop, x, y, accounted_epsilon=0.1, delta=1e-5, shadows=4)
    assert {"lira", "lira-offline"} <= set(res.attacks)
    assert res.attacks["lira-offline"].auc > 0.55  # fitted to its own half: members' losses lower
    assert res.verdict == "violation"  # a model fitted this hard is not 0.1-DP
    assert res.experiment["target_accuracy_unseen"] > 0.9


def test_opacus_dpsgd_recipe(data):
    x, y = data
    res = audit_recipe(opacus_dpsgd, x, y, accounted_epsilon=DP_EPSILON, delta=DP_DELTA, shadows=4)
    assert set(res.attacks) == {
        "threshold",
        "shadow",
        "lira",
        "lira-offline",
        "rmia",
        "rmia-offline",
    }
    # correctly implemented DP-SGD at epsilon 2: the family-wise bound stays below the claim, and the
    # audit could have shown more (its ceiling is above 2), so the verdict is "consistent"
    assert res.epsilon_lower_bound <= DP_EPSILON and res.epsilon_ceiling > DP_EPSILON
    assert res.verdict == "consistent"
    assert res.attacks["lira"].auc < 0.6


def _recording(calls):
    def train_fn(x, y, seed):
        calls.append((len(y), seed))
        return logreg(x, y, seed)

    return train_fn


def test_the_auditor_chooses_records_and_seeds(data):
    x, y = data
    calls: list = []
    res = audit_recipe(
        _recording(calls), x, y, delta=1e-5, shadows=2, attacks=["threshold", "lira"]
    )
    d = res.design
    # the recipe was called once per model, on the design's sets, with the design's seeds
    assert calls == [(len(ix), s) for ix, s in zip(d.index_sets(), d.seeds())]
    # another recipe, same audit seed: the same coins (they come from the audit's own stream)
    other = audit_recipe(prior_only, x, y, delta=1e-5, shadows=2, attacks=["threshold"])
    assert (other.design.included == d.included).all()
    assert set(res.attacks) == {"threshold", "lira"} and res.verdict == "no-claim"


def test_executors_give_identical_audits(data):
    x, y = data
    kw = dict(accounted_epsilon=1.0, delta=1e-5, shadows=2, seed=3)
    serial = audit_recipe(logreg, x, y, **kw).to_dict()
    process = audit_recipe(logreg, x, y, executor="process", workers=2, **kw).to_dict()
    assert process.pop("experiment")["executor"] == "process"
    assert serial.pop("experiment")["executor"] == "serial"
    assert serial == process


@pytest.mark.slow
def test_ray_gives_the_same_audit(data):
    ray = pytest.importorskip("ray")
    x, y = data
    kw = dict(accounted_epsilon=1.0, delta=1e-5, shadows=2, seed=3, attacks=["threshold", "lira"])
    serial = audit_recipe(logreg, x, y, **kw).to_dict()
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": _pythonpath()}},
    )
    try:
        on_ray = audit_recipe(logreg, x, y, executor="ray", **kw).to_dict()
    finally:
        ray.shutdown()
    serial.pop("experiment"), on_ray.pop("experiment")
    assert serial == on_ray


def _pythonpath() -> str:
    import os
    import sys
    from pathlib import Path

    here = str(Path(__file__).resolve().parent)  # recipes_for_tests must import in Ray's workers
    return os.pathsep.join([here, *[p for p in sys.path if p], os.environ.get("PYTHONPATH", "")])


def test_bad_input(data):
    x, y = data
    with pytest.raises(ValueError, match="x and y must have equal lengths; found 1797 and 10"):
        audit_recipe(logreg, x, y[:10], delta=1e-5)
    with pytest.raises(ValueError, match="y must hold integer class labels"):
        audit_recipe(logreg, x, y.astype(float), delta=1e-5)
    with pytest.raises(ValueError, match=r"delta must be in \[0, 1\); found 2"):
        audit_recipe(logreg, x, y, delta=2)
    with pytest.raises(
        ValueError, match="attacks lira need >= 2 reference models; found shadows=0"
    ):
        audit_recipe(logreg, x, y, delta=1e-5, shadows=0, attacks=["lira"])
    with pytest.raises(ValueError, match="recipe must be a callable train_fn"):
        audit_recipe("logreg", x, y, delta=1e-5)
    # no reference models: the threshold attack alone
    only = audit_recipe(logreg, x, y, delta=1e-5, shadows=0)
    assert list(only.attacks) == ["threshold"] and only.experiment["references"] == 0


def test_docs_recipe_examples_are_short():
    """scikit-learn, PyTorch and opacus recipes, each audited in 15 lines or fewer (the page's
    examples run in tests/test_docs_examples.py)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "auditing-a-recipe.md").read_text()
    section = text.split("## A model trained elsewhere")[0]
    _setup, *examples = [b.split("```")[0] for b in section.split("```python\n")[1:]]
    assert len(examples) == 3 and all(len(b.strip().splitlines()) <= 15 for b in examples)
