"""Convolutional clients' local training on stacked parameters (an audit's reference clients,
:mod:`privkit.batched.stacked_local`): each model trains as the single run's ``local_update``
trains it, up to float rounding; the runs that are not reference runs keep their own path bit for
bit (:func:`privkit.batched.many_fedavg.local_epochs`)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from privkit.batched.exact_mlp import model_for
from privkit.batched.stacked_local import stacked_form, train_stacked
from privkit.data import FederationConfig, build_federation
from privkit.mechanisms.stacked import UnsupportedModelError
from privkit.models import build_model
from privkit.trainers.fedavg import local_update

SIZES = (7, 12, 3, 12, 9)  # step counts differ; the last batches are partial


def _cnn(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model("cnn", (1, 8, 8), 4, width=2, feature_dim=6)


def _records(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 1, 8, 8)).astype(np.float32), rng.integers(0, 4, n)


@pytest.mark.parametrize("optimizer,lr", [("adam", 0.01), ("sgd", 0.1)])
@pytest.mark.parametrize("mu", [0.0, 0.1])
@pytest.mark.parametrize("group", [2, 8])
def test_each_stacked_model_trains_as_its_local_update(optimizer, lr, mu, group, monkeypatch):
    """Five CNNs of different record counts, each from its own start, two epochs of batch 4, in
    groups of 2 or all at once: every model's parameters and last-epoch mean loss are its own
    ``local_update``'s (the single run's client training: ``train_supervised``, FedProx's term
    where ``mu > 0``) up to float rounding; each model moved from its start."""
    from privkit.batched import stacked_local

    monkeypatch.setattr(stacked_local, "MODELS_PER_GROUP", group)
    cfg = SimpleNamespace(local_epochs=2, batch_size=4, lr=lr, optimizer=optimizer)
    device = torch.device("cpu")
    starts = [_cnn(s) for s in range(len(SIZES))]
    data = [_records(10 + j, n) for j, n in enumerate(SIZES)]
    want = [
        local_update(g, x, y, cfg, mu=mu, seed=100 + j, device=device)
        for j, (g, (x, y)) in enumerate(zip(starts, data))
    ]
    anchors = [{k: v.detach().clone() for k, v in g.named_parameters()} for g in starts]
    locals_ = [copy.deepcopy(g) for g in starts]
    for m in locals_:  # the stacked models start from ``start``, whatever their modules hold
        with torch.no_grad():
            for p in m.parameters():
                p.zero_()
    models = [
        model_for(m, x, y, epochs=2, batch_size=4, seed=100 + j, device=device, start=a)
        for j, (m, (x, y), a) in enumerate(zip(locals_, data, anchors))
    ]
    totals = train_stacked(
        starts[0],
        models,
        optimizer=optimizer,
        lr=lr,
        mu=[mu] * len(models),
        anchors=anchors,
        loss_from=[m.steps // 2 for m in models],
    )
    for (ref, loss), local, total, n, a in zip(want, locals_, totals, SIZES, anchors):
        assert total / n == pytest.approx(loss, rel=1e-4)
        got, exp = dict(local.named_parameters()), dict(ref.named_parameters())
        for k in exp:
            torch.testing.assert_close(got[k], exp[k], rtol=1e-4, atol=1e-5)
        assert max(float((got[k].detach() - a[k]).abs().max()) for k in a) > 1e-3


def test_models_it_does_not_cover_are_refused():
    """A model with buffers (a unit-normalised one) or frozen layers is refused, so that its
    clients train alone."""
    with pytest.raises(UnsupportedModelError, match="buffers"):
        stacked_form(build_model("mlp", (1, 8, 8), 4, normalize=True), 2)
    frozen = _cnn(0)
    frozen.features.requires_grad_(False)
    with pytest.raises(UnsupportedModelError, match="trainable"):
        stacked_form(frozen, 2)
    assert stacked_form(_cnn(0), 3).m == 3


def test_cnn_reference_clients_train_stacked_and_others_alone(monkeypatch):
    """``local_epochs`` on CNN runs: the run that is not a reference run trains each client
    alone, bit for bit as its twin's ``train_local``; the reference runs' clients train stacked,
    equal to their twins' own training up to float rounding, over two rounds with averaging."""
    from privkit.batched.many_fedavg import local_epochs
    from privkit.methods import make_config
    from privkit.trainers.fedavg import FederatedRun

    fed = build_federation(FederationConfig(clients=4, alpha=1.0, seed=5))
    fed = fed.with_clients([c[:24] for c in fed.clients], "small")
    cfg = make_config(
        "fedprox",
        {
            "arch": "cnn",
            "width": 2,
            "feature_dim": 8,
            "rounds": 2,
            "participation": 0.5,
            "local_epochs": 1,
            "batch_size": 8,
            "lr": 0.01,
            "pretrain": False,
            "device": "cpu",
        },
    )

    def runs():
        return [FederatedRun(fed, cfg, s, mu=cfg.mu) for s in (1, 2, 3)]

    from privkit.batched import many_fedavg

    stacked_calls = []
    real = many_fedavg.train_stacked
    monkeypatch.setattr(
        many_fedavg, "train_stacked", lambda *a, **k: stacked_calls.append(1) or real(*a, **k)
    )
    batched, alone = runs(), runs()
    fast = frozenset({id(batched[1]), id(batched[2])})
    for _ in range(cfg.rounds):
        sel = [r.next_round() for r in batched]
        assert [r.next_round() for r in alone] == sel
        got = local_epochs(batched, sel, fast=fast, scratch={})
        want = [[r.train_local(i) for i in ids] for r, ids in zip(alone, sel)]
        for n, (g, w) in enumerate(zip(got, want)):
            for (local, loss), (ref, ref_loss) in zip(g, w):
                a, b = local.state_dict(), ref.state_dict()
                if n == 0:  # the run trained alone: its single run's path
                    assert loss == ref_loss
                    assert all(torch.equal(a[k], b[k]) for k in b)
                else:
                    assert loss == pytest.approx(ref_loss, rel=1e-4)
                    for k in b:
                        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
        for r, g in zip(batched, got):
            r.finish_round(g)
        for r, w in zip(alone, want):
            r.finish_round(w)
    assert len(stacked_calls) == cfg.rounds  # the reference runs' clients, once a round


@pytest.mark.parametrize("normalize", [False, True])
def test_stacked_logits_are_each_models_own(normalize):
    """FedDF's and FedAUX's reference runs' teachers for a CNN: every model's logits on shared
    records in one stacked pass per chunk equal its own forward pass up to float rounding (a
    unit-normalised CNN's buffers included), across chunk boundaries; models of different shapes
    are refused."""
    from privkit.batched import stacked_local
    from privkit.batched.many_fedavg import stacked_teachers
    from privkit.trainers.common import predict_logits

    torch.manual_seed(7)
    models = [
        build_model("cnn", (1, 8, 8), 4, width=2, feature_dim=6, normalize=normalize)
        for _ in range(3)
    ]
    x = np.random.default_rng(8).normal(size=(2 * stacked_local.LOGITS_CHUNK + 5, 1, 8, 8))
    device = torch.device("cpu")
    got = stacked_teachers(models, x.astype(np.float32), device)
    assert got is not None and got.dtype == np.float32 and got.shape == (3, len(x), 4)
    for m, g in zip(models, got):
        np.testing.assert_allclose(g, predict_logits(m, x, device), rtol=1e-5, atol=1e-6)
    assert stacked_teachers(models, x[:0], device) is None  # no records: the models' own passes
    other = build_model("cnn", (1, 8, 8), 4, width=3, feature_dim=6, normalize=normalize)
    with pytest.raises(UnsupportedModelError, match="one architecture"):
        stacked_local.stacked_logits_on([models[0], other], x, device)


def test_stacked_distillation_is_each_models_own(monkeypatch):
    """FedDF's server step for a CNN's reference runs: each model distilled towards its own soft
    labels (``KL(targets || softmax)``, Adam) on stacked parameters equals ``distill``'s model and
    last-epoch mean KL up to float rounding, with records shared and of different counts."""
    from privkit.batched.many_fedavg import distil_together
    from privkit.trainers.common import distill
    from privkit.trainers.feddf import DistillJob

    device = torch.device("cpu")
    rng = np.random.default_rng(9)
    shared = rng.normal(size=(10, 1, 8, 8)).astype(np.float32)
    xs = [shared, shared, rng.normal(size=(7, 1, 8, 8)).astype(np.float32)]
    targets = [rng.dirichlet(np.ones(4), size=len(x)).astype(np.float32) for x in xs]
    starts = [_cnn(20 + j) for j in range(3)]
    want = []
    for j, (g, x, t) in enumerate(zip(starts, xs, targets)):
        ref = copy.deepcopy(g)
        kl = distill(ref, x, t, epochs=2, batch_size=4, lr=0.01, device=device, seed=50 + j)
        want.append((ref, kl))
    models = [copy.deepcopy(g) for g in starts]
    jobs = [
        DistillJob(m, x, t, 2, 4, 0.01, 50 + j, device)
        for j, (m, x, t) in enumerate(zip(models, xs, targets))
    ]
    monkeypatch.setattr(DistillJob, "run", lambda self: pytest.fail("distilled alone"))
    got = distil_together(jobs)
    for m, kl, (ref, want_kl), g in zip(models, got, want, starts):
        assert kl == pytest.approx(want_kl, rel=1e-4)
        a, b, s = (
            dict(m.named_parameters()),
            dict(ref.named_parameters()),
            dict(g.named_parameters()),
        )
        for k in b:
            torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
        assert max(float((a[k] - s[k]).abs().max().detach()) for k in s) > 1e-3


def test_records_per_chunk_bound_a_gpu_pass_by_model_records():
    """The stacked logits' records per chunk: LOGITS_CHUNK on the CPU; on a GPU as many as keep
    models x records within GPU_MODEL_RECORDS, at least one, at most the records there are."""
    from privkit.batched.stacked_local import (
        GPU_MODEL_RECORDS,
        LOGITS_CHUNK,
        records_per_chunk,
    )

    assert records_per_chunk(112, 1000, "cpu") == LOGITS_CHUNK
    assert records_per_chunk(112, 1000, "cuda") == GPU_MODEL_RECORDS // 112
    assert 112 * records_per_chunk(112, 1000, "cuda") <= GPU_MODEL_RECORDS
    assert records_per_chunk(8, 100, "cuda") == 100  # the whole set in one pass
    assert records_per_chunk(GPU_MODEL_RECORDS * 2, 100, "cuda") == 1
