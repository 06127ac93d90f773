"""FLiP's and centralised training's batched forms (privkit.batched.many_flip, many_central).

A run that is not an audit's reference run is its single run bit for bit (its own client updates
or its own training, the single run's code); the reference runs (``references``) train together
and equal their single runs up to float rounding. Both methods amplify rounding (FLiP's clients
run Adam through an unroll, SGD on the quick CNN crosses ReLU kinks): a relative change of 1e-7
in the initial state moves a quick run's weights by up to 3e-2, so the comparisons here use
configurations short enough to stay close, and the FLiP client updates are also checked in float64
(tests/privkit/test_flip.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from audit_helpers import max_diff, subset_federations

from privkit.audit.recipes import FederationRecipe
from privkit.batched.many import has_batched, train_many
from privkit.data import FederationConfig, build_federation
from privkit.methods import get_trainer
from privkit.trainers import train

FLIP = {"k": 1, "rounds": 2, "local_epochs": 2, "feature_dim": 16, "device": "cpu"}
CENTRAL_MLP = {"arch": "mlp", "feature_dim": 16, "epochs": 2, "batch_size": 64, "device": "cpu"}
CENTRAL_CNN = {"width": 4, "feature_dim": 16, "epochs": 1, "batch_size": 64, "device": "cpu"}


@pytest.fixture(scope="module")
def fed():
    return build_federation(FederationConfig(partition="dirichlet", clients=6, seed=0))


def _federations(fed, n: int) -> list:
    return subset_federations(fed, n, 0.5)


_max_diff = max_diff


def _same(a, b) -> None:
    """Two results of one run agree bit for bit: weights, rounds, artifacts, ledger, warnings."""
    assert _max_diff(a.model, b.model) == 0
    assert a.rounds == b.rounds and a.test_accuracy == b.test_accuracy
    assert a.artifacts.keys() == b.artifacts.keys()
    assert all(np.array_equal(a.artifacts[k], b.artifacts[k]) for k in a.artifacts)
    assert a.ledger.to_dict() == b.ledger.to_dict() and a.warnings == b.warnings


@pytest.mark.parametrize(
    "method, config, tol",
    [("flip", FLIP, 1e-4), ("centralized", CENTRAL_MLP, 1e-5), ("centralized", CENTRAL_CNN, 1e-4)],
)
def test_reference_runs_batched_target_runs_bit_for_bit(fed, method, config, tol, monkeypatch):
    from privkit.batched import many_central, many_flip

    assert has_batched(method) and get_trainer(method).batched is not None
    torch.set_num_threads(1)
    feds, seeds = _federations(fed, 3), [11, 12, 13]
    alone = [train(method, f, config, seed=s) for f, s in zip(feds, seeds)]
    # the batched engine's calls: how many runs' models (or clients) each took
    batched: list[int] = []
    module, name = (
        (many_flip, "runs_round_updates") if method == "flip" else (many_central, "_train_batched")
    )
    engine = getattr(module, name)

    def spy(*args, **kwargs):
        batched.append(len(args[1] if method == "flip" else args[0]))
        return engine(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    many = train_many(method, feds, config, seeds, references=[False, True, True])
    clients = sum(len(f.clients) for f in feds[1:]) if method == "flip" else 2
    # the two reference runs, together (FLiP: every round, all their clients with data)
    assert batched and set(batched) <= {clients} and (method == "flip" or batched == [2])
    monkeypatch.undo()
    _same(alone[0], many[0])  # the target run: its single run's code
    assert not many[0].reproducible_noise and all(r.reproducible_noise for r in many[1:])
    # a reference run trains with reproducible_noise (these methods draw no noise: the same run)
    seeded = {**config, "reproducible_noise": True}
    refs = [train(method, f, seeded, seed=s) for f, s in zip(feds[1:], seeds[1:])]
    for a, b in zip(refs, many[1:]):
        # the reference runs: batched (other kernels), their single runs up to float rounding
        assert _max_diff(a.model, b.model) <= tol
        if method == "centralized":  # a reference run records its last epoch only
            assert [r["round"] for r in b.rounds] == [a.rounds[-1]["round"]]
            pairs = [(a.rounds[-1], b.rounds[0])]
        else:  # FLiP's reference runs skip every round's evaluation (never reported)
            assert [r["round"] for r in a.rounds] == [r["round"] for r in b.rounds]
            assert np.isnan([r["test_accuracy"] for r in b.rounds]).all()
            pairs = list(zip(a.rounds, b.rounds))
        for ra, rb in pairs:
            if method == "centralized":
                assert ra["test_accuracy"] == pytest.approx(rb["test_accuracy"], abs=2e-3)
            loss = "loss" if method == "centralized" else "mean_client_loss"
            assert ra[loss] == pytest.approx(rb[loss], rel=1e-4)
        assert a.ledger.to_dict() == b.ledger.to_dict()
        assert a.artifacts.keys() == b.artifacts.keys()
        assert a.test_accuracy == pytest.approx(b.test_accuracy, abs=2e-3)
        # the released model is the last round's (epoch's), as in the single run
        assert method == "flip" or b.test_accuracy == b.rounds[-1]["test_accuracy"]
        assert a.test_accuracy == a.rounds[-1]["test_accuracy"]
    # without references every run is its single run
    for a, b in zip(alone, train_many(method, feds, config, seeds)):
        _same(a, b)


def test_centralized_with_adam_trains_one_run_after_the_other(fed):
    cfg = {**CENTRAL_MLP, "optimizer": "adam", "lr": 0.01}
    feds = _federations(fed, 2)
    alone = [train("centralized", f, cfg, seed=s) for f, s in zip(feds, [1, 2])]
    many = train_many("centralized", feds, cfg, [1, 2], references=[True, True])
    assert all(_max_diff(a.model, b.model) == 0 for a, b in zip(alone, many))


@pytest.mark.parametrize("method, config", [("flip", FLIP), ("centralized", CENTRAL_MLP)])
def test_audit_recipe_takes_the_batched_form(fed, method, config):
    recipe = FederationRecipe(fed, method, config, release_seeds=[1])
    assert recipe.batched
    x, y = fed.private.x[fed.members], fed.private.y[fed.members]
    rng = np.random.default_rng(1)
    sets = [np.sort(rng.choice(len(y), int(0.5 * len(y)), replace=False)) for _ in range(3)]
    runs = recipe.fit_many(x, y, sets, [1, 2, 3])
    _same(runs[0].result, recipe(x[sets[0]], y[sets[0]], 1).result)  # the target, bit for bit
    for run, ix, seed in zip(runs[1:], sets[1:], [2, 3]):  # the references, up to rounding
        assert _max_diff(run.result.model, recipe(x[ix], y[ix], seed).result.model) <= 1e-4


@pytest.mark.parametrize("chunk", [None, 5, 64])
def test_centralizedstep_gradients_in_chunks_are_each_models_own(fed, chunk):
    """The batched step's gradient of each model's mean cross-entropy, taken ``chunk`` examples
    per model at a time (None: the CPU's cache-sized default; 5: a partial last chunk), is each
    model's own autograd gradient on its own rows; a padded model's pads and a model without rows
    contribute nothing."""
    import torch.nn.functional as F

    from privkit.batched.many import stacked_on
    from privkit.batched.many_central import step_gradients
    from privkit.mechanisms.stacked import StackedModels
    from privkit.methods.dpsgd import CentralConfig
    from privkit.trainers.common import new_model

    cfg = CentralConfig(**CENTRAL_CNN)
    models = [new_model(fed, cfg, seed)[0] for seed in (1, 2, 3)]
    net = StackedModels(models[0], 3)
    params, buffers = stacked_on(models, torch.device("cpu"))
    x, y = fed.pooled_arrays()
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, len(y), (3, 64), generator=gen)
    xb = torch.as_tensor(x, dtype=torch.float32)[idx]
    yb = torch.as_tensor(y, dtype=torch.long)[idx]
    counts = torch.tensor([64, 37, 0])
    xb[1, 37:] = 1e3  # pads: large values that would show in any gradient they leaked into
    grads, losses = step_gradients(net, params, buffers, xb, yb, counts, chunk=chunk)
    for m, (model, n) in enumerate(zip(models, counts.tolist())):
        if n == 0:
            assert all(float(g[m].abs().max()) == 0 for g in grads.values())
            assert float(losses[m]) == 0
            continue
        model.zero_grad()
        loss = F.cross_entropy(model(xb[m, :n]), yb[m, :n])
        loss.backward()
        assert float(losses[m]) == pytest.approx(float(loss.detach()), rel=1e-5)
        for k, q in model.named_parameters():
            assert torch.allclose(grads[k][m], q.grad, rtol=1e-4, atol=1e-6), k
