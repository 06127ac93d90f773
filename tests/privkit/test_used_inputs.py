"""An audit's reference clients train their first layer in the span of their records.

The first layer's weights across the span of a client's records (the inputs 0 in every record
among them) move, under plain SGD, by the sum of the round's noise alone; a reference client
trains the weights in the span (over its used inputs, or in an orthonormal basis of its records
where it has fewer records than used inputs) and draws the sum across it once at the end of its
round (:mod:`privkit.batched.used_inputs`). Checked here, for both: without noise the narrowed
training is the full one; the displacement across the span has the law of the full path's
(two-sample and one-sample tests over many coordinates, with a control whose variance misses
the steps that the same tests must reject); in the span, identical clients' trained weights have
the full path's law (with a control whose noise is halved); an audit's noise mutation
scales the summed noise; and only reference clients without canaries take the narrowed path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from audit_helpers import TINY_DPFED
from scipy import stats

from privkit.batched import used_inputs
from privkit.batched.many import LocalDp, ce_losses, local_dp_sgd, stacked_on, train_many
from privkit.batched.used_inputs import Narrowed, SpanCache, first_layers, narrowable
from privkit.data import FederationConfig, build_federation
from privkit.mechanisms import mutations
from privkit.mechanisms.dp_sgd_step import DpSgdStep
from privkit.mechanisms.stacked import StackedModels
from privkit.models import build_model
from privkit.seeding import noise_generator

STEPS, LR, CLIP = 6, 0.5, 1.0
#: a false alarm of each agreement test at most this often
ALPHA = 1e-3


def _jobs(
    n_models: int, sigma: float, seed: int = 0, records: int = 40
) -> tuple[list, list[LocalDp]]:
    """``n_models`` MLPs (4x4 inputs, 8 hidden units) and their reference jobs: ``records``
    records each, whose inputs are 0 outside a random set of 6 to 12 of the 16 pixels per model
    (with 5 records, fewer than the used inputs: the jobs train in their records' span)."""
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    models, jobs = [], []
    for j in range(n_models):
        model = build_model("mlp", (1, 4, 4), 3, feature_dim=8)
        used = rng.choice(16, size=int(rng.integers(6, 13)), replace=False)
        x = np.zeros((records, 16), np.float32)
        x[:, used] = rng.normal(size=(records, len(used)))
        y = torch.as_tensor(rng.integers(0, 3, size=records))
        jobs.append(_job(torch.as_tensor(x).view(records, 1, 4, 4), y, sigma, seed * 1000 + j))
        models.append(model)
    return models, jobs


def _job(x: torch.Tensor, y: torch.Tensor, sigma: float, seed: int) -> LocalDp:
    """A reference job over records ``x`` (Poisson rate 0.4), its streams seeded by ``seed``."""
    return LocalDp(
        x,
        y,
        DpSgdStep(CLIP, sigma, 0.4, len(x)),
        noise_generator(seed, "poisson", reproducible=True),
        noise_generator(seed, "noise", reproducible=True),
        fast=True,
    )


def _train(models, jobs, narrowed: bool, widen_steps: int = STEPS):
    """The stacked parameters before and after ``STEPS`` local DP-SGD steps of ``jobs``, over
    every input or narrowed (the other weights' noise summed in ``widen``), the first layer's
    weight and the narrowing (None on the full path)."""
    params, buffers = stacked_on(models, torch.device("cpu"))
    before = {k: v.clone() for k, v in params.items()}
    weights = first_layers(models[0], "sgd")
    narrow = Narrowed.of(weights, params, jobs, steps=STEPS) if narrowed else None
    p, js = (narrow.params, narrow.jobs) if narrow is not None else (params, jobs)
    net = StackedModels(models[0], len(models))
    local_dp_sgd(net, p, buffers, js, STEPS, lr=LR, optimizer="sgd", losses=ce_losses)
    after = narrow.widen(before, widen_steps, LR) if narrow is not None else p
    return before, after, weights[0], narrow


def _across_span(jobs, before, after, w, in_units: bool = True) -> np.ndarray:
    """The first layer's displacement over the round across each job's records' span (its
    unused inputs included), in an orthonormal basis of that complement, in units of one step's
    noise (``lr * sigma * C / B``) or as it is."""
    out = []
    for i, job in enumerate(jobs):
        x = job.x.reshape(len(job.x), -1).double()
        _, sv, vt = torch.linalg.svd(x, full_matrices=True)
        across = vt[int((sv > 1e-6 * sv.max()).sum()) :]  # (16 - rank, 16)
        step = job.step
        unit = LR * step.noise_multiplier * step.clip_norm / step.expected_batch_size
        unit = unit if in_units else 1.0
        moved = (after[w][i] - before[w][i]).double() @ across.T
        out.append((moved / unit).flatten().numpy())
    return np.concatenate(out)


#: the jobs' records: as many as the inputs they use at least (trained over the used inputs),
#: or fewer (trained in the records' span)
RECORDS = [pytest.param(40, id="used-inputs"), pytest.param(5, id="records-span")]


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


@pytest.mark.parametrize("records", RECORDS)
def test_without_noise_the_narrowed_training_is_the_full_one(records):
    models, jobs = _jobs(8, 1e-30, records=records)
    _, narrow, w, how = _train(models, jobs, narrowed=True)
    assert (how.basis is not None) == (records < 12)  # which narrowing the jobs took
    models, jobs = _jobs(8, 1e-30, records=records)
    before, full, _, _ = _train(models, jobs, narrowed=False)
    for k in full:
        assert torch.allclose(narrow[k], full[k], atol=1e-5), k
    assert float((full[w] - before[w]).abs().max()) > 1e-2  # the training moved the weights
    # the weights across the records' span did not move in either (their gradient is 0), but
    # for float rounding where they were rebuilt from the span's coordinates
    assert np.abs(_across_span(jobs, before, narrow, w, in_units=False)).max() < 1e-5


@pytest.mark.parametrize("records", RECORDS)
def test_the_weights_across_the_span_move_by_the_law_of_the_steps_noise(records):
    models, jobs = _jobs(48, 1.0, seed=1, records=records)
    before, full, w, _ = _train(models, jobs, narrowed=False)
    ref = _across_span(jobs, before, full, w)  # the sum of STEPS normals, each step's
    models, jobs = _jobs(48, 1.0, seed=2, records=records)
    before, narrow, w, _ = _train(models, jobs, narrowed=True)
    got = _across_span(jobs, before, narrow, w)
    assert len(ref) > 1500 and len(got) > 1500
    assert stats.ks_2samp(ref, got).pvalue > ALPHA
    law = stats.norm(scale=np.sqrt(STEPS))
    assert stats.kstest(got, law.cdf).pvalue > ALPHA
    assert stats.kstest(ref, law.cdf).pvalue > ALPHA
    # the control: one step's variance instead of STEPS' must be told apart
    models, jobs = _jobs(48, 1.0, seed=2, records=records)
    before, wrong, w, _ = _train(models, jobs, narrowed=True, widen_steps=1)
    bad = _across_span(jobs, before, wrong, w)
    assert stats.ks_2samp(ref, bad).pvalue < 1e-6
    assert stats.kstest(bad, law.cdf).pvalue < 1e-6


def _clones(n: int, sigma: float, seed: int) -> tuple[list, list[LocalDp]]:
    """``n`` copies of one MLP and one client (5 records over 14 of the 16 pixels), each job
    with its own streams: ``n`` draws of one client's round."""
    rng = np.random.default_rng(7)
    torch.manual_seed(7)
    model = build_model("mlp", (1, 4, 4), 3, feature_dim=8)
    x = np.zeros((5, 16), np.float32)
    x[:, rng.choice(16, size=14, replace=False)] = rng.normal(size=(5, 14))
    xt, y = torch.as_tensor(x).view(5, 1, 4, 4), torch.as_tensor(rng.integers(0, 3, size=5))
    return [model] * n, [_job(xt, y, sigma, seed * 10_000 + j) for j in range(n)]


def test_in_the_span_identical_clients_train_to_the_full_paths_law():
    """The trained weights in the records' span: each record's first-layer pre-activations after
    the round, over 400 draws of one client's round, on both paths."""

    def activations(narrowed: bool, seed: int, sigma: float = 1.0) -> np.ndarray:
        models, jobs = _clones(400, sigma, seed)
        _, after, w, how = _train(models, jobs, narrowed=narrowed)
        assert (how is not None and how.basis is not None) == narrowed
        x = jobs[0].x.reshape(5, -1)
        return torch.einsum("moi,ni->mno", after[w], x).reshape(400, -1).numpy()

    full, span = activations(False, 1), activations(True, 2)
    wrong = activations(True, 3, sigma=0.5)  # the control: the steps' noise halved
    for k in range(0, full.shape[1], 4):  # 10 of the 40 (record, unit) pairs
        assert stats.ks_2samp(full[:, k], span[:, k]).pvalue > ALPHA / 10, k
    rejected = [stats.ks_2samp(full[:, k], wrong[:, k]).pvalue < ALPHA for k in range(40)]
    assert np.mean(rejected) > 0.5


@pytest.mark.parametrize("records", RECORDS)
def test_an_audits_noise_mutation_scales_the_summed_noise(records):
    models, jobs = _jobs(24, 1.0, seed=3, records=records)
    before, right, w, _ = _train(models, jobs, narrowed=True)
    models, jobs = _jobs(24, 1.0, seed=3, records=records)
    with mutations.mutated(mutations.MUTATIONS["noise x1/2"]):
        _, halved, _, _ = _train(models, jobs, narrowed=True)
    a = _across_span(jobs, before, right, w)
    b = _across_span(jobs, before, halved, w)
    assert np.std(b) / np.std(a) == pytest.approx(0.5, rel=0.05)


def test_a_span_cache_keeps_each_clients_span_and_writes_zero_padded_bases():
    _, jobs = _jobs(3, 1.0, records=5)
    cache = SpanCache()
    spans = cache.spans(jobs)
    assert cache.spans(jobs) == spans and all(a is b for a, b in zip(cache.spans(jobs), spans))
    copy = _job(jobs[0].x.clone(), jobs[0].y, 1.0, 0)  # equal records, another tensor
    assert cache.spans([copy])[0] is not spans[0]
    bases = cache.bases(spans, 6, jobs[0].x)  # one column past every job's rank (5)
    for i, (job, span) in enumerate(zip(jobs, spans)):
        q = bases[i].double()
        x = job.x.reshape(5, -1).double()
        assert torch.allclose(
            q.T @ q, torch.diag(torch.tensor([1.0] * 5 + [0.0])).double(), atol=1e-5
        )
        unused = x.abs().sum(0) == 0
        assert float(q[unused].abs().max()) == 0.0  # no weight of an unused input is trained
        _, coords = span.basis()
        assert torch.allclose(coords.double() @ q[:, :5].T, x, atol=1e-5)  # the records, rebuilt
        padded = span.coords(6)  # coordinates padded like the bases, kept per rank
        assert padded.shape == (5, 6) and torch.equal(padded[:, :5], coords)
        assert float(padded[:, 5].abs().max()) == 0.0 and span.coords(6) is padded
        assert span.coords(5) is coords


def test_dp_fedavg_reference_clients_train_narrowed_and_the_target_in_full(monkeypatch):
    fed = build_federation(FederationConfig(partition="dirichlet", clients=20, seed=0))
    seen: list[list[bool]] = []
    original = Narrowed.of

    def spy(weights, params, jobs, **kw):
        if weights:  # the jobs to narrow (the others are passed none)
            seen.append([j.fast for j in jobs])
        return original(weights, params, jobs, **kw)

    monkeypatch.setattr(used_inputs.Narrowed, "of", staticmethod(spy))
    runs = train_many("dp-fedavg", [fed] * 3, TINY_DPFED, [1, 2, 3], references=[False, True, True])
    assert seen and all(all(fast) for fast in seen)  # only the reference clients
    # a reference run's ledger is its full-width run's (the receipts are the full releases')
    seeded = {**TINY_DPFED, "reproducible_noise": True}
    full = train_many("dp-fedavg", [fed], seeded, [2])
    assert runs[1].ledger.to_dict() == full[0].ledger.to_dict()
    assert not runs[0].reproducible_noise and runs[1].reproducible_noise


@pytest.mark.parametrize("records", RECORDS)
def test_fedkd_pairs_narrow_both_towers_first_layers(monkeypatch, records):
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
        _, jobs = _jobs(6, 1e-30, seed=4, records=records)
        params, buffers = stacked_on(modules, torch.device("cpu"))
        before = {k: v.clone() for k, v in params.items()}
        narrow = Narrowed.of(weights, params, jobs, steps=STEPS) if narrowed else None
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

    def spy(names, params, jobs, **kw):
        if names:
            seen.append(list(names))
        return original(names, params, jobs, **kw)

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
