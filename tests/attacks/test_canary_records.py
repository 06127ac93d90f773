"""Canary records through the user's own pipeline (attacks.canary_records): the user's sampler
draws them, the user's clipping clips them, the user's noise hides them.

Exactness first (no noise): what the auditor observes on an included canary's coordinate is the
number of times the user's sampler drew it times what the user's clipping left of it, and every
other record is zeroed on the reserved coordinates only. Then verdicts of a torch.func DP-SGD loop
and of opacus (hooks and ghost clipping) as users write them, over several seeds: the correct loop
is flagged at most at the nominal rate, its shuffled twin and its twin that divides by the
realised batch size are caught every time, by the part that names the bug.
"""

import warnings

import numpy as np
import pytest
import torch
from scipy import stats
from torch.func import functional_call, grad, vmap
from torch.utils.data import (
    DataLoader,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from attacks.whitebox import GradientCanaries, attach_to_opacus

Q, SIGMA, C, N = 0.05, 1.5, 1.0, 600


def _data(n=N):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _poisson_loader(ds, seed, q=Q):
    from opacus.utils.uniform_sampler import UniformWithReplacementSampler

    g = torch.Generator().manual_seed(seed)
    return DataLoader(
        ds,
        batch_sampler=UniformWithReplacementSampler(
            num_samples=len(ds), sample_rate=q, generator=g
        ),
    )


def _canaries(model, seed, steps, n=60, **kw):
    kw = {"clip_norm": C, "sample_rate": Q, "noise_multiplier": SIGMA, "steps": steps, **kw}
    return GradientCanaries.for_parameters(list(model.parameters()), n, seed=seed, witness=64, **kw)


def user_loop(seed=0, steps=80, sampler="poisson", sigma=SIGMA, clip=True, by_batch=False):
    """A DP-SGD loop as a user writes it with torch.func: per-example gradients, flat clipping,
    Gaussian noise, a fixed normaliser; audited with canary records (two added lines)."""
    ds, model = _data(), _model(seed)
    loader = (
        _poisson_loader(ds, seed)
        if sampler == "poisson"
        else DataLoader(
            ds, batch_size=int(Q * N), shuffle=True, generator=torch.Generator().manual_seed(seed)
        )
    )
    canaries = _canaries(model, seed, steps)
    loader = canaries.records(loader)  # canary records join what the sampler draws
    params = {k: v.detach() for k, v in model.named_parameters()}
    opt = torch.optim.SGD(params.values(), lr=0.1)
    expected = Q * N
    canaries.watch(opt, batch_size=expected)  # each step's release, times the normaliser

    def loss(p, xb, yb):
        return torch.nn.functional.cross_entropy(functional_call(model, p, (xb[None],)), yb[None])

    per_example = vmap(grad(loss), in_dims=(None, 0, 0))
    noise = torch.Generator().manual_seed(seed + 10_000)
    step = 0
    while step < steps:
        for xb, yb in loader:
            if step == steps:
                break
            g = canaries.through(per_example(params, xb, yb))  # the one call in the loop
            norms = torch.sqrt(sum(v.reshape(len(xb), -1).pow(2).sum(1) for v in g.values()))
            bound = C * (clip if clip is not True else 1.0)  # clip: True, False or a factor
            factor = (bound / (norms + 1e-6)).clamp(max=1.0) if clip else torch.ones_like(norms)
            for k, p in params.items():
                summed = torch.einsum("b,b...->...", factor, g[k])
                noisy = summed + sigma * C * torch.randn(summed.shape, generator=noise)
                p.grad = noisy / (max(len(xb), 1) if by_batch else expected)
            opt.step()
            step += 1
    return canaries


def _at_most(k, n, level=0.05):
    return stats.binomtest(k, n, level, alternative="greater").pvalue > 1e-3


def test_without_noise_the_auditor_sees_the_user_s_sampling_and_clipping_exactly():
    for clip, per_draw in ((True, C), (False, 4 * C)):  # clipped to C; unclipped: raw_norm 4 C
        can = user_loop(seed=1, steps=40, sigma=0.0, clip=clip)
        ev = can.evidence()
        inc = ev.included
        # an included canary's coordinate: the times the user's sampler drew it, x its clipped norm
        np.testing.assert_allclose(
            ev.projections[:, inc].sum(0), can.appearances[inc] * per_draw, atol=1e-5
        )
        assert np.all(ev.projections[:, ~inc] == 0) and np.all(ev.witness == 0)
        st = can.records_state
        assert st.counts[N:].tolist() == can.appearances[can.included_ids].tolist()
        assert sum(st.batch_sizes) == st.counts.sum() and len(st.batch_sizes) == 40


def test_rows_are_replaced_and_reserved_coordinates_zeroed_in_place():
    ds, model = _data(), _model(0)
    can = _canaries(model, 0, 10, n=20)
    loader = can.records(DataLoader(ds, batch_size=len(ds) + 20))  # one batch: every record
    xb, _ = next(iter(loader))
    dim = can.dim
    g = torch.ones(len(xb), dim)
    out = can.through(g)
    assert out is g
    reserved = can.reserved_coordinates
    canary_rows = np.arange(N, len(xb))
    other = np.ones(dim, dtype=bool)
    other[reserved] = False
    assert torch.all(g[:N][:, torch.as_tensor(reserved)] == 0)
    assert torch.all(g[:N][:, torch.as_tensor(np.flatnonzero(other))] == 1)
    coords = can.coordinates_of(can.included_ids)
    expected = torch.zeros(len(canary_rows), dim)
    expected[torch.arange(len(canary_rows)), torch.as_tensor(coords)] = can.raw_norm
    assert torch.equal(g[N:], expected)
    # the canary records' inputs are copies of the user's records
    src = can.record_sources(N)
    assert torch.equal(xb[N:], ds.tensors[0][torch.as_tensor(src)])


@pytest.mark.parametrize(
    "make, kind",
    [
        (lambda ds: RandomSampler(ds), RandomSampler),
        (lambda ds: SequentialSampler(ds), SequentialSampler),
        (lambda ds: SubsetRandomSampler(range(100)), SubsetRandomSampler),
        (lambda ds: WeightedRandomSampler(torch.ones(len(ds)), 200), WeightedRandomSampler),
    ],
)
def test_the_rebuilt_loader_keeps_the_user_s_sampler(make, kind):
    ds, model = _data(), _model(0)
    can = _canaries(model, 0, 10)
    loader = can.records(DataLoader(ds, sampler=make(ds), batch_size=10))
    assert type(loader.batch_sampler.inner.sampler) is kind
    assert len(loader.dataset) == N + can.included_ids.size


def test_unsupported_loaders_and_canaries_are_refused_with_the_value_found():
    ds, model = _data(), _model(0)
    can = _canaries(model, 0, 10)

    class MySampler(SequentialSampler):
        pass

    with pytest.raises(ValueError, match="found MySampler"):
        can.records(DataLoader(ds, sampler=MySampler(ds), batch_size=10))
    rand = GradientCanaries(can.dim, 10, clip_norm=C, sample_rate=Q, kind="random")
    with pytest.raises(ValueError, match=r"kind='dirac'.*found 'random'"):
        rand.records(DataLoader(ds, batch_size=10))
    with pytest.raises(RuntimeError, match="iterate the loader"):
        can.records(DataLoader(ds, batch_size=10))
        can.through(torch.zeros(10, can.dim))


def test_a_user_loop_is_flagged_at_the_nominal_rate_and_its_bugs_every_time():
    seeds = range(8)
    correct = [user_loop(s).audit(delta=1e-5) for s in seeds]
    assert _at_most(sum(r.verdict == "violation" for r in correct), len(seeds))
    shuffled = [user_loop(s, sampler="shuffle").audit(delta=1e-5) for s in seeds]
    assert all("sampling: regularity" in r.conformance.failed for r in shuffled)
    # the epsilon that holds instead: privkit's shuffle accounting, above the Poisson claim
    assert all(r.conformance.holds_epsilon > r.conformance.claimed_epsilon for r in shuffled)
    by_batch = [user_loop(s, by_batch=True).audit(delta=1e-5) for s in seeds[:5]]
    assert all("normalisation" in r.conformance.rejected for r in by_batch)
    # clipping at twice the claimed norm: caught per appearance, the epsilon that holds computed
    wide = [user_loop(s, clip=2.0).audit(delta=1e-5).conformance for s in seeds]
    assert all(r.failed == ["influence"] for r in wide), [r.failed for r in wide]
    assert all(r.claimed_epsilon < r.holds_epsilon < float("inf") for r in wide)


def _opacus_run(seed, *, poisson=True, ghost=False, steps=60):
    from opacus import PrivacyEngine

    ds, model = _data(), _model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(ds, batch_size=int(Q * N), shuffle=True)
    crit = torch.nn.CrossEntropyLoss()
    kw = {"grad_sample_mode": "ghost", "criterion": crit} if ghost else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = PrivacyEngine().make_private(
            module=model,
            optimizer=opt,
            data_loader=loader,
            noise_multiplier=SIGMA,
            max_grad_norm=C,
            poisson_sampling=poisson,
            **kw,
        )
    model, opt, loader = (out[0], out[1], out[3]) if ghost else out
    if ghost:
        crit = out[2]
    canaries = _canaries(model, seed, steps)
    loader = attach_to_opacus(opt, canaries, data_loader=loader, module=model if ghost else None)
    torch.manual_seed(seed)  # opacus draws its noise from torch's global generator
    step = 0
    while step < steps:
        for xb, yb in loader:
            if step == steps:
                break
            opt.zero_grad()
            crit(model(xb), yb).backward()
            opt.step()
            step += 1
    return canaries


def test_opacus_hooks_and_ghost_clipping_release_the_same_canaries():
    hooks, ghost = _opacus_run(3), _opacus_run(3, ghost=True)
    a, b = hooks.evidence(), ghost.evidence()
    assert hooks.records_state.counts.tolist() == ghost.records_state.counts.tolist()
    np.testing.assert_allclose(a.projections, b.projections, atol=2e-5)
    np.testing.assert_allclose(a.witness, b.witness, atol=2e-5)


@pytest.mark.parametrize("ghost", [False, True])
def test_opacus_poisson_is_consistent_and_its_shuffled_twin_is_caught(ghost):
    seeds = range(5)
    correct = [_opacus_run(s, ghost=ghost).audit(delta=1e-5) for s in seeds]
    assert _at_most(sum(r.verdict == "violation" for r in correct), len(seeds))
    shuffled = [_opacus_run(s, poisson=False, ghost=ghost).audit(delta=1e-5) for s in seeds]
    assert all("sampling: regularity" in r.conformance.failed for r in shuffled)
