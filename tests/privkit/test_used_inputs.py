"""An audit's reference clients train their first layer over the inputs their records use.

The weights of inputs that are 0 in every record of a client move, under plain SGD, by the sum
of the round's noise alone; a reference client draws that sum once at the end of its round
(:mod:`privkit.batched.used_inputs`). Checked here: without noise the narrowed training is the
full one; the unused weights' displacement has the law of the full path's (two-sample and
one-sample tests over many coordinates, with a control whose variance misses the steps that the
same tests must reject); an audit's noise mutation scales it; and only reference clients without
canaries take the narrowed path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from audit_helpers import TINY_DPFED
from scipy import stats

from privkit.batched import used_inputs
from privkit.batched.many import LocalDp, ce_losses, local_dp_sgd, stacked_on, train_many
from privkit.batched.used_inputs import Narrowed, first_layers, narrowable
from privkit.data import FederationConfig, build_federation
from privkit.mechanisms import mutations
from privkit.mechanisms.dp_sgd_step import DpSgdStep
from privkit.mechanisms.stacked import StackedModels
from privkit.models import build_model
from privkit.seeding import noise_generator

STEPS, LR, CLIP = 6, 0.5, 1.0
#: a false alarm of each agreement test at most this often
ALPHA = 1e-3


def _jobs(n_models: int, sigma: float, seed: int = 0) -> tuple[list, list[LocalDp]]:
    """``n_models`` MLPs (4x4 inputs, 8 hidden units) and their reference jobs: 40 records each,
    whose inputs are 0 outside a random set of 6 to 12 of the 16 pixels per model."""
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    models, jobs = [], []
    for j in range(n_models):
        model = build_model("mlp", (1, 4, 4), 3, feature_dim=8)
        used = rng.choice(16, size=int(rng.integers(6, 13)), replace=False)
        x = np.zeros((40, 16), np.float32)
        x[:, used] = rng.normal(size=(40, len(used)))
        y = rng.integers(0, 3, size=40)
        step = DpSgdStep(CLIP, sigma, 16 / 40, 40)
        jobs.append(
            LocalDp(
                torch.as_tensor(x).view(40, 1, 4, 4),
                torch.as_tensor(y),
                step,
                noise_generator(seed * 1000 + j, "poisson", reproducible=True),
                noise_generator(seed * 1000 + j, "noise", reproducible=True),
                fast=True,
            )
        )
        models.append(model)
    return models, jobs


def _train(models, jobs, narrowed: bool, widen_steps: int = STEPS):
    """The stacked first-layer weights before and after ``STEPS`` local DP-SGD steps of ``jobs``,
    over every input or over the used ones (the other weights' noise summed in ``widen``)."""
    params, buffers = stacked_on(models, torch.device("cpu"))
    before = {k: v.clone() for k, v in params.items()}
    weights = first_layers(models[0], "sgd")
    narrow = Narrowed.of(weights, params, jobs) if narrowed else None
    p, js = (narrow.params, narrow.jobs) if narrow is not None else (params, jobs)
    net = StackedModels(models[0], len(models))
    local_dp_sgd(net, p, buffers, js, STEPS, lr=LR, optimizer="sgd", losses=ce_losses)
    after = narrow.widen(before, widen_steps, LR) if narrow is not None else p
    w = weights[0]
    return before, after, w


def _unused_moves(models, jobs, before, after, w) -> np.ndarray:
    """The unused inputs' weights' displacement over the round, in units of one step's noise
    (``lr * sigma * C / B``)."""
    out = []
    for i, job in enumerate(jobs):
        unused = job.x.reshape(len(job.x), -1).abs().sum(0) == 0
        step = job.step
        unit = LR * step.noise_multiplier * step.clip_norm / step.expected_batch_size
        out.append(((after[w][i] - before[w][i])[:, unused] / unit).flatten().numpy())
    return np.concatenate(out)


def test_only_plain_sgd_mlps_and_canary_free_reference_jobs_narrow():
    mlp = build_model("mlp", (1, 4, 4), 3, feature_dim=8)
    assert first_layers(mlp, "sgd") == ["features.1.weight"]
    assert first_layers(mlp, "adam") == []  # Adam's moments are not linear in the noise
    assert first_layers(build_model("cnn", (1, 8, 8), 3, width=2, feature_dim=4), "sgd") == []
    _, jobs = _jobs(2, 1.0)
    assert narrowable(jobs[0])
    assert not narrowable(LocalDp(**{**jobs[0].__dict__, "fast": False}))
    assert not narrowable(LocalDp(**{**jobs[0].__dict__, "canaries": object()}))
    release = noise_generator(0, "noise", reproducible=False)
    assert not narrowable(LocalDp(**{**jobs[0].__dict__, "noise_gen": release}))


def test_nothing_is_narrowed_where_a_job_uses_every_input():
    models, jobs = _jobs(2, 1.0)
    jobs[1].x[:, 0, :, :] += 1.0  # every pixel nonzero in some record
    params, _ = stacked_on(models, torch.device("cpu"))
    assert Narrowed.of(["features.1.weight"], params, jobs) is None


def test_without_noise_the_narrowed_training_is_the_full_one():
    models, jobs = _jobs(8, 1e-30)
    _, narrow, w = _train(models, jobs, narrowed=True)
    models, jobs = _jobs(8, 1e-30)
    before, full, _ = _train(models, jobs, narrowed=False)
    for k in full:
        assert torch.allclose(narrow[k], full[k], atol=1e-5), k
    assert float((full[w] - before[w]).abs().max()) > 1e-2  # the training moved the weights
    # the unused inputs' weights did not move in either (their gradient is 0)
    assert np.abs(_unused_moves(models, jobs, before, narrow, w)).max() < 1e-6


def test_the_unused_weights_move_by_the_law_of_the_steps_noise():
    models, jobs = _jobs(48, 1.0, seed=1)
    before, full, w = _train(models, jobs, narrowed=False)
    ref = _unused_moves(models, jobs, before, full, w)  # the sum of STEPS normals, each step's
    models, jobs = _jobs(48, 1.0, seed=2)
    before, narrow, w = _train(models, jobs, narrowed=True)
    got = _unused_moves(models, jobs, before, narrow, w)
    assert len(ref) > 1500 and len(got) > 1500
    assert stats.ks_2samp(ref, got).pvalue > ALPHA
    law = stats.norm(scale=np.sqrt(STEPS))
    assert stats.kstest(got, law.cdf).pvalue > ALPHA
    assert stats.kstest(ref, law.cdf).pvalue > ALPHA
    # the control: one step's variance instead of STEPS' must be told apart
    models, jobs = _jobs(48, 1.0, seed=2)
    before, wrong, w = _train(models, jobs, narrowed=True, widen_steps=1)
    bad = _unused_moves(models, jobs, before, wrong, w)
    assert stats.ks_2samp(ref, bad).pvalue < 1e-6
    assert stats.kstest(bad, law.cdf).pvalue < 1e-6


def test_an_audits_noise_mutation_scales_the_summed_noise():
    models, jobs = _jobs(24, 1.0, seed=3)
    before, right, w = _train(models, jobs, narrowed=True)
    models, jobs = _jobs(24, 1.0, seed=3)
    with mutations.mutated(mutations.MUTATIONS["noise x1/2"]):
        _, halved, _ = _train(models, jobs, narrowed=True)
    a = _unused_moves(models, jobs, before, right, w)
    b = _unused_moves(models, jobs, before, halved, w)
    assert np.std(b) / np.std(a) == pytest.approx(0.5, rel=0.05)


def test_dp_fedavg_reference_clients_train_narrowed_and_the_target_in_full(monkeypatch):
    fed = build_federation(FederationConfig(partition="dirichlet", clients=20, seed=0))
    seen: list[list[bool]] = []
    original = Narrowed.of

    def spy(weights, params, jobs):
        if weights:  # the jobs to narrow (the others are passed none)
            seen.append([j.fast for j in jobs])
        return original(weights, params, jobs)

    monkeypatch.setattr(used_inputs.Narrowed, "of", staticmethod(spy))
    runs = train_many("dp-fedavg", [fed] * 3, TINY_DPFED, [1, 2, 3], references=[False, True, True])
    assert seen and all(all(fast) for fast in seen)  # only the reference clients
    # a reference run's ledger is its full-width run's (the receipts are the full releases')
    seeded = {**TINY_DPFED, "reproducible_noise": True}
    full = train_many("dp-fedavg", [fed], seeded, [2])
    assert runs[1].ledger.to_dict() == full[0].ledger.to_dict()
    assert not runs[0].reproducible_noise and runs[1].reproducible_noise


def test_fedkd_pairs_narrow_both_towers_first_layers(monkeypatch):
    """FedKD+DP's reference pairs narrow the mentor's and the mentee's first layers (both read the
    inputs); without noise that is the full training, and the runs' ledgers are the full ones'."""
    from privkit.mechanisms.stacked_pairs import StackedPairs
    from privkit.trainers.fedkd import MentorMentee

    def pairs(n: int) -> list[MentorMentee]:
        torch.manual_seed(5)
        return [
            MentorMentee(
                build_model("mlp", (1, 4, 4), 3, feature_dim=10),
                build_model("mlp", (1, 4, 4), 3, feature_dim=8),
            )
            for _ in range(n)
        ]

    weights = first_layers(pairs(1)[0], "sgd")
    assert weights == ["mentor.features.1.weight", "mentee.features.1.weight"]
    assert first_layers(pairs(1)[0], "adam") == []
    out = {}
    for narrowed in (False, True):
        modules = pairs(6)
        _, jobs = _jobs(6, 1e-30, seed=4)
        params, buffers = stacked_on(modules, torch.device("cpu"))
        before = {k: v.clone() for k, v in params.items()}
        narrow = Narrowed.of(weights, params, jobs) if narrowed else None
        p, js = (narrow.params, narrow.jobs) if narrow is not None else (params, jobs)
        net = StackedPairs(modules[0], 6)
        local_dp_sgd(net, p, buffers, js, STEPS, lr=LR, optimizer="sgd", losses=_pair_losses)
        out[narrowed] = narrow.widen(before, STEPS, LR) if narrow is not None else p
    assert out[True].keys() == out[False].keys()
    for k in out[False]:
        assert torch.allclose(out[True][k], out[False][k], atol=1e-5), k
    assert all(float((out[False][w] - before[w]).abs().max()) > 1e-3 for w in weights)

    fed = build_federation(FederationConfig(partition="dirichlet", clients=20, seed=0))
    seen: list[list[str]] = []
    original = Narrowed.of

    def spy(names, params, jobs):
        if names:
            seen.append(list(names))
        return original(names, params, jobs)

    monkeypatch.setattr(used_inputs.Narrowed, "of", staticmethod(spy))
    cfg = {**TINY_DPFED, "mentor_feature_dim": 24, "rounds": 2}
    runs = train_many("fedkd-dp", [fed] * 2, cfg, [1, 2], references=[False, True])
    assert ["mentor.features.1.weight", "mentee.features.1.weight"] in seen
    full = train_many("fedkd-dp", [fed], {**cfg, "reproducible_noise": True}, [2])
    assert runs[1].ledger.to_dict() == full[0].ledger.to_dict()


def _pair_losses(out, models, s, y, aux):
    """Cross-entropy of both towers' logits (3 classes) of :class:`MentorMentee`'s output."""
    return ce_losses(out[..., :3], models, s, y, None) + ce_losses(
        out[..., 3:6], models, s, y, None
    )
