"""FedMD's CNN parties in an audit's reference runs (:mod:`privkit.batched.many_fedmd` with
:mod:`privkit.batched.stacked_local`): their revisits and digests train stacked, their shared
logits and final evaluation run stacked, each equal to the party's own up to float rounding; the
parties of a run that is not a reference run train on their own, bit for bit."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from privkit.batched import many_fedmd
from privkit.data import FederationConfig, build_federation
from privkit.methods.contract import make_config
from privkit.models import build_model
from privkit.trainers.common import predict_logits
from privkit.trainers.fedmd import FedMDRun, PartyJob

CPU = torch.device("cpu")


def _party(width: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model("cnn", (1, 8, 8), 4, width=width, feature_dim=6)


def _jobs(knowledge: str) -> list[PartyJob]:
    """Revisits (labels, record counts that leave partial batches) and digests (soft targets on
    one shared public subset) of parties of two architectures."""
    rng = np.random.default_rng(3)
    public = rng.normal(size=(11, 1, 8, 8)).astype(np.float32)
    consensus = (
        rng.normal(size=(11, 4)) if knowledge == "logits" else rng.dirichlet(np.ones(4), size=11)
    ).astype(np.float32)
    jobs = []
    for p, (width, n) in enumerate([(2, 7), (3, 12), (2, 10), (3, 5), (2, 12)]):
        x = rng.normal(size=(n, 1, 8, 8)).astype(np.float32)
        y = rng.integers(0, 4, n)
        jobs.append(PartyJob(_party(width, p), x, y, False, 2, 4, 40 + p))
        jobs.append(PartyJob(_party(width, 10 + p), public, consensus, True, 2, 4, 60 + p))
    return jobs


def _stacked_calls(monkeypatch) -> list[int]:
    """The number of models of each ``train_stacked`` call FedMD's batched phases make."""
    sizes: list[int] = []
    real = many_fedmd.train_stacked
    monkeypatch.setattr(
        many_fedmd,
        "train_stacked",
        lambda template, models, **k: sizes.append(len(models)) or real(template, models, **k),
    )
    return sizes


@pytest.mark.parametrize("knowledge", ["softmax", "logits"])
def test_reference_parties_train_stacked_and_others_alone(knowledge, monkeypatch):
    """``run_jobs`` on CNN parties: the jobs of an audit's reference runs (``fast``) train
    stacked, grouped by architecture and phase, each equal to its own ``PartyJob.run`` up to float
    rounding; the other jobs, and every digest towards shared logits (an L1 regression, no stacked
    kernel), train on their own, bit for bit."""
    cfg = make_config("fedmd-np", {"arch": "cnn", "lr": 0.01, "knowledge": knowledge})
    jobs, twins = _jobs(knowledge), _jobs(knowledge)
    fast = frozenset(id(j) for j in jobs[:6])  # three parties' revisits and digests
    starts = [copy.deepcopy(j.model.state_dict()) for j in jobs]
    sizes = _stacked_calls(monkeypatch)
    many_fedmd.run_jobs(jobs, cfg, CPU, fast)
    for j in twins:
        j.run(cfg, CPU)
    for n, (got, want) in enumerate(zip(jobs, twins)):
        a, b = got.model.state_dict(), want.model.state_dict()
        assert any(not torch.equal(a[k], starts[n][k]) for k in a)  # it trained
        stacked = id(got) in fast and not (got.digest and knowledge == "logits")
        for k in b:
            if stacked:
                torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
            else:
                assert torch.equal(a[k], b[k])
    # the fast revisits: widths 2 (2 jobs) and 3 (1 job); with softmax the digests the same
    assert sorted(sizes) == ([1, 1, 2, 2] if knowledge == "softmax" else [1, 2])


def test_stacked_party_logits_of_cnns_are_each_partys_own():
    """The shared logits of CNN parties of two architectures (and an MLP) are each party's own
    forward pass up to float rounding; without records each runs its own pass."""
    models = [_party(w, s) for s, w in enumerate((2, 3, 2, 3, 2))]
    torch.manual_seed(9)
    models.append(build_model("mlp", (1, 8, 8), 4, feature_dim=5))
    x = np.random.default_rng(4).normal(size=(45, 1, 8, 8)).astype(np.float32)
    got = many_fedmd.stacked_party_logits(models, x)
    for m, g in zip(models, got):
        assert g.dtype == np.float32 and g.shape == (45, 4)
        np.testing.assert_allclose(g, predict_logits(m, x, CPU), rtol=1e-5, atol=1e-6)
    empty = many_fedmd.stacked_party_logits(models, x[:0])
    assert [len(e) for e in empty] == [0] * len(models)


def _runs(cfg, fed, seeds) -> list[FedMDRun]:
    out = [FedMDRun(fed, cfg, s, "np", pretrain=False) for s in seeds]
    for r in out:
        r.start()
    return out


def test_reference_cnn_parties_are_evaluated_stacked_as_one_by_one():
    """FedMD's record of reference runs with CNN parties after their last round (one stacked
    pass per architecture and test set) gives each party's own accuracy."""
    fed = build_federation(FederationConfig(partition="dirichlet", clients=4, seed=0))
    cfg = make_config(
        "fedmd-np",
        {"arch": "cnn", "width": 2, "feature_dim": 8, "rounds": 0, "device": "cpu"},
    )
    one_by_one, stacked = _runs(cfg, fed, (1, 2)), _runs(cfg, fed, (1, 2))
    for r in one_by_one:
        r.record()
    many_fedmd.record(stacked, [True, True])
    for a, b in zip(one_by_one, stacked):
        np.testing.assert_allclose(
            b.rounds[0]["client_accuracy"], a.rounds[0]["client_accuracy"], atol=1e-9
        )


def test_cnn_federation_reference_runs_train_close_to_their_own(monkeypatch):
    """A whole batched FedMD training of CNN parties: the run that is not a reference run comes
    out bit for bit as the single run; the reference run's parties within float rounding of its
    single run (Adam over a few epochs), each having trained."""
    from privkit.methods.contract import train

    fed = build_federation(FederationConfig(partition="dirichlet", clients=3, seed=1))
    fed = fed.with_clients([c[:30] for c in fed.clients], "small")
    cfg = make_config(
        "fedmd-np",
        {
            "arch": "cnn",
            "width": 2,
            "feature_dim": 8,
            "rounds": 2,
            "init_epochs": 2,
            "pretrain_epochs": 1,
            "public_subset": 40,
            "revisit_batch_size": 8,
            "labels": "shared",  # every client's few records are private ones
            "device": "cpu",
            "reproducible_noise": True,
        },
    )
    seeds = [5, 6]
    trained = _stacked_calls(monkeypatch)
    got = many_fedmd.train_fedmd_many("fedmd-np", [fed, fed], [cfg, cfg], seeds, [False, True])
    want = [train("fedmd-np", fed, cfg, seed=s) for s in seeds]
    for n, (g, w) in enumerate(zip(got, want)):
        for gm, wm in zip(g.client_models, w.client_models):
            a, b = gm.state_dict(), wm.state_dict()
            for k in b:
                if n == 0:
                    assert torch.equal(a[k], b[k])
                else:
                    torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=1e-4)
    # the reference run's three parties (three architectures): their pretraining, their
    # initialisation, and each round's digests and revisits, stacked
    assert trained == [1] * 3 * (2 + 2 * cfg.rounds)
