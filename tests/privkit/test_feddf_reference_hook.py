"""FedDF's server step for an audit's reference runs: the clients' (teachers') logits taken
together by ``stacked_teachers`` give the soft labels and the distillation of the single run's hook,
up to float rounding; a run that is not a reference takes each client's own forward."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from privkit.batched.many_fedavg import stacked_teachers
from privkit.data import FederationConfig, build_federation
from privkit.methods.contract import make_config
from privkit.models import build_model
from privkit.trainers.feddf import distillation_hook


@pytest.mark.parametrize("scores", [False, True])
def test_reference_hook_distils_as_the_single_runs_hook(scores, monkeypatch):
    fed = build_federation(FederationConfig(partition="dirichlet", clients=4, seed=0))
    cfg = make_config("feddf", {"arch": "mlp", "feature_dim": 16, "device": "cpu"})
    x, _ = fed.public_arrays("distill")
    assert (np.abs(x.reshape(len(x), -1)).sum(0) == 0).any()  # blank inputs: left out (stacked)
    torch.manual_seed(0)
    shape = tuple(x.shape[1:])
    global_model = build_model("mlp", shape, fed.num_classes, feature_dim=16)
    clients = [build_model("mlp", shape, fed.num_classes, feature_dim=16) for _ in range(3)]
    weights = np.random.default_rng(1).random((4, len(x))) if scores else None
    out, models = {}, {}
    from privkit.trainers import common

    calls = []
    real = common.predict_logits
    monkeypatch.setattr(
        "privkit.trainers.feddf.predict_logits", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    for reference in (False, True):
        store: dict = {}
        teachers = stacked_teachers if reference else None
        hook = distillation_hook(fed, cfg, 7, weights, store=store, teachers=teachers)
        models[reference] = copy.deepcopy(global_model)
        out[reference] = (hook(models[reference], clients, [0, 1, 3], 2), store["soft_labels"])
    assert len(calls) == len(clients)  # the single run's hook only: one forward per client
    (m_single, t_single), (m_ref, t_ref) = out[False], out[True]
    np.testing.assert_allclose(t_ref, t_single, rtol=1e-5, atol=1e-7)
    assert m_ref["distill_kl"] == pytest.approx(m_single["distill_kl"], rel=1e-4)
    for (name, a), (_, b) in zip(models[True].named_parameters(), models[False].named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4, msg=name)


def test_stacked_teachers_decline_models_that_are_not_privkit_mlps():
    """A CNN (or MLPs of several architectures) is declined: the hook then runs each client."""
    import torch

    torch.manual_seed(0)
    cnns = [build_model("cnn", (1, 28, 28), 10) for _ in range(2)]
    assert stacked_teachers(cnns, np.zeros((3, 1, 28, 28), np.float32), torch.device("cpu")) is None
