"""Auditing a user's own torch model (attacks.audit_model)."""

import numpy as np
import pytest

from attacks import audit_model
from privkit.batched.batched_sgd import SGDRecipe, batched_recipe, load_states, train_one
from privkit.data import load_dataset
from privkit.models import model_spec


@pytest.fixture(scope="module")
def overfit_digits():
    d = load_dataset("digits")
    rng = np.random.default_rng(0)
    idx = rng.permutation(len(d))
    mem, non = idx[:150], idx[150:300]
    spec = model_spec("mlp", (1, 8, 8), 10, feature_dim=128)
    recipe = SGDRecipe(epochs=60, batch_size=16, lr=0.1)  # many epochs on few records: memorises
    model = load_states(spec, [train_one(spec, d.x, d.y, mem, recipe, seed=1)])[0]
    return d, mem, non, spec, recipe, model


def test_overfit_user_model_leaks_and_lira_runs(overfit_digits):
    d, mem, non, spec, recipe, model = overfit_digits
    out = audit_model(
        model,
        d.x[mem],
        d.y[mem],
        d.x[non],
        d.y[non],
        recipe=batched_recipe(spec, recipe),
        n_reference=4,
    )
    assert set(out["attacks"]) == {
        "threshold",
        "shadow",
        "lira",
        "lira-offline",
        "rmia",
        "rmia-offline",
    }
    assert out["attacks"]["threshold"]["auc"] > 0.6  # memorised members have lower loss
    assert out["attacks"]["lira"]["auc"] > 0.6
    assert out["verdict"]["status"] == "no-claim"  # no accounted epsilon given
    for entry in out["attacks"].values():
        assert 0 <= entry["epsilon_lower_bound"] <= entry["ceiling"]


def test_a_false_claim_is_flagged(overfit_digits):
    d, mem, non, _, _, model = overfit_digits
    out = audit_model(model, d.x[mem], d.y[mem], d.x[non], d.y[non], accounted_epsilon=1e-3)
    # a memorising model cannot be 0.001-DP: the audit proves a larger epsilon and says so
    assert out["attacks"]["threshold"]["epsilon_lower_bound"] > 1e-3
    assert out["verdict"]["status"] == "violation" and "VIOLATION" in out["verdict"]["message"]


def test_bad_arguments(overfit_digits):
    d, mem, non, spec, _, model = overfit_digits
    with pytest.raises(ValueError, match="recipe must be a callable train_fn"):
        audit_model(model, d.x[mem], d.y[mem], d.x[non], d.y[non], recipe=spec)
    with pytest.raises(ValueError, match="delta must be in \\(0, 1\\); found 2"):
        audit_model(model, d.x[mem], d.y[mem], d.x[non], d.y[non], delta=2)
