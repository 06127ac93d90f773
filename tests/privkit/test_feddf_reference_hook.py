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


def test_stacked_teachers_decline_models_they_do_not_cover():
    """CNNs of several architectures are declined (the hook then runs each client); CNNs of one
    get their logits from one stacked pass, each client's own up to float rounding."""
    import torch

    from privkit.trainers.common import predict_logits

    torch.manual_seed(0)
    cnns = [build_model("cnn", (1, 28, 28), 10, width=w) for w in (4, 4, 6)]
    x = np.random.default_rng(2).random((3, 1, 28, 28)).astype(np.float32)
    cpu = torch.device("cpu")
    assert stacked_teachers(cnns, x, cpu) is None
    got = stacked_teachers(cnns[:2], x, cpu)
    for m, g in zip(cnns, got):
        np.testing.assert_allclose(g, predict_logits(m, x, cpu), rtol=1e-5, atol=1e-6)


def _jobs(n_runs: int, arch: str = "mlp"):
    """``n_runs`` FedDF server steps of one round (their own global models, teachers and seeds)."""
    from privkit.trainers.feddf import DistillationStep

    fed = build_federation(FederationConfig(partition="dirichlet", clients=4, seed=0))
    cfg = make_config(
        "feddf", {"arch": arch, "feature_dim": 16, "device": "cpu", "distill_epochs": 2}
    )
    x, _ = fed.public_arrays("distill")
    shape = tuple(x.shape[1:])
    jobs = []
    for r in range(n_runs):
        torch.manual_seed(10 + r)
        model = build_model(arch, shape, fed.num_classes, feature_dim=16)
        clients = [build_model(arch, shape, fed.num_classes, feature_dim=16) for _ in range(3)]
        step = DistillationStep(fed, cfg, 100 + r, None, {}, None)
        jobs.append(step.job(model, clients, [0, 1, 2], 3))
    return jobs


def _distill_alone(job) -> float:
    """``job`` distilled by :func:`privkit.trainers.common.distill` itself (the reference)."""
    from privkit.trainers.common import distill

    return distill(
        job.model,
        job.x,
        job.targets,
        epochs=job.epochs,
        batch_size=job.batch_size,
        lr=job.lr,
        device=job.device,
        seed=job.seed,
    )


def test_reference_runs_distil_together_as_each_alone():
    """``distil_together`` (one stacked Adam over the runs' models, soft targets) gives each run's
    weights and last-epoch KL of ``distill`` up to float rounding."""
    from privkit.batched.many_fedavg import distil_together

    together, alone, fresh = _jobs(3), _jobs(3), _jobs(3)
    kls = distil_together(together)
    for job, kl, solo, start in zip(together, kls, alone, fresh):
        want = _distill_alone(solo)
        assert kl == pytest.approx(want, rel=1e-4)
        for (name, a), (_, b) in zip(job.model.named_parameters(), solo.model.named_parameters()):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4, msg=name)
        assert not torch.equal(job.model.head.weight, start.model.head.weight)  # it trained


def test_exact_kernels_with_soft_targets_return_distill_s_kl_bit_for_bit():
    """``train_exact`` (one model after the other, the single run's kernels) with soft targets
    and ``loss_from``: the weights and the KL ``distill`` gives, exactly."""
    from privkit.batched.exact_mlp import model_for, train_exact

    (job,), (solo,) = _jobs(1), _jobs(1)
    m = model_for(
        job.model,
        job.x,
        job.targets,
        epochs=2,
        batch_size=job.batch_size,
        seed=job.seed,
        device=job.device,
        soft=True,
    )
    (total,) = train_exact(
        job.model, [m], optimizer="adam", lr=job.lr, loss_from=[len(m.batches) // 2]
    )
    want = _distill_alone(solo)  # 2 epochs, as the model_for above
    assert total / len(job.x) == pytest.approx(want, rel=1e-6)
    for a, b in zip(job.model.parameters(), solo.model.parameters()):
        assert torch.equal(a, b)


def test_a_cnn_s_reference_runs_distil_together():
    """A CNN's reference runs distil together on stacked parameters
    (:func:`~privkit.batched.stacked_local.train_stacked`): each model and its KL are
    ``distill``'s own up to float rounding."""
    from privkit.batched.many_fedavg import distil_together

    together, alone = _jobs(2, "cnn"), _jobs(2, "cnn")
    kls = distil_together(together)
    for job, kl, solo in zip(together, kls, alone):
        want = _distill_alone(solo)
        assert kl == pytest.approx(want, rel=1e-4)
        for a, b in zip(job.model.parameters(), solo.model.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_teachers_read_each_distillation_set_once(monkeypatch):
    """The runs of an audit each hold an equal copy of the distillation records and distil on it
    every round: ``same`` narrows each content once, equal copies included, and gives the logits
    of a fresh call bit for bit, for those records and for others; a CNN's stacked pass reads the
    records as they are, narrowing none."""
    from privkit.batched import exact_mlp
    from privkit.batched.many_fedavg import SameRecords

    torch.manual_seed(1)
    clients = [build_model("mlp", (1, 6, 6), 4, feature_dim=8) for _ in range(3)]
    rng = np.random.default_rng(4)
    x1 = rng.normal(size=(11, 1, 6, 6)).astype(np.float32)
    x1[:, :, 0] = 0.0  # a blank row of inputs: narrowed away
    copy1, x2 = x1.copy(), rng.normal(size=(11, 1, 6, 6)).astype(np.float32)
    cpu = torch.device("cpu")
    fresh = {id(x): stacked_teachers(clients, x, cpu) for x in (x1, copy1, x2)}
    scans = []
    real = exact_mlp.Inputs.of
    monkeypatch.setattr(exact_mlp.Inputs, "of", lambda x, d: scans.append(1) or real(x, d))
    same = SameRecords()
    for x in (x1, copy1, x2, x1, copy1, x2):
        np.testing.assert_array_equal(stacked_teachers(clients, x, cpu, same), fresh[id(x)])
    assert len(scans) == 2
    assert same.first(copy1) is x1 and same.first(x2) is x2
    cnns = [build_model("cnn", (1, 28, 28), 10) for _ in range(2)]
    blank = np.zeros((3, 1, 28, 28), np.float32)
    assert stacked_teachers(cnns, blank, cpu, same).shape == (2, 3, 10) and len(scans) == 2


def test_runs_with_equal_distillation_records_distil_on_one_copy(monkeypatch):
    """Each run holds its own copy of the distillation records: with ``same`` the stacked
    distillation gathers and scans one copy for all of them, bit for bit as with each run's own,
    and a run with other records keeps its own."""
    from privkit.batched import exact_mlp
    from privkit.batched.many_fedavg import SameRecords, distil_together

    shared, own = _jobs(3), _jobs(3)
    assert len({id(j.x) for j in shared}) == 3  # three equal copies
    other = shared[2].x.copy()
    other[:5] = 0.0
    for jobs in (shared, own):
        jobs[2].x = other
    scans = []
    real = exact_mlp._inputs_in_use
    monkeypatch.setattr(exact_mlp, "_inputs_in_use", lambda r: scans.append(1) or real(r))
    kls = distil_together(shared, SameRecords())
    assert len(scans) == 2  # the copies of one content once, the other records once
    scans.clear()
    assert distil_together(own) == kls and len(scans) == 3
    for a, b in zip(shared, own):
        assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))
