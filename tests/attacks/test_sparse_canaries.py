"""Gradient canaries touch only their own coordinates (issue 32, item 2): what a step adds for them
(:meth:`GradientCanaries.add_to`) and what they observe (``observe``'s gather of the reserved
coordinates) equal the dense path's (``vector`` added everywhere, the whole release on the host),
and DP-SGD released gradients, evidence and audit verdicts on seeds are the same either way."""

import importlib.util
import pickle
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from accountants import dpsgd_epsilon
from attacks import whitebox
from attacks.whitebox import GradientCanaries, add_at, add_in_place
from privkit.mechanisms import dp_sgd_step
from privkit.mechanisms.dp_random import DpRandom
from privkit.mechanisms.dp_sgd_step import DpSgdStep

# the dense path as it was (the benchmark's "before"): the vector added everywhere, the whole
# release and clean sum observed on the host
_spec = importlib.util.spec_from_file_location(
    "canary_overhead", Path(__file__).resolve().parents[2] / "benchmarks" / "canary_overhead.py"
)
_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_bench)
_dense, DenseCanaryStep = _bench.dense_observer, _bench.DenseCanaryStep

SHAPES = [(7, 5), (5,), (3, 4, 2), (1,), (40,)]
DIM = sum(int(np.prod(s)) for s in SHAPES)


def _tensors(seed: int, dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=dtype) for s in SHAPES]


def _canaries(kind="dirac", n=30, **kw) -> GradientCanaries:
    kw = {"clip_norm": 1.5, "sample_rate": 0.5, "noise_multiplier": 1.0, "seed": 4, **kw}
    return GradientCanaries(DIM, n, kind=kind, witness=kw.pop("witness", 25), **kw)


def _observed_as(form, monkeypatch) -> None:
    """The observation's form: ``None`` (one pass per tensor), ``16`` (the noise scale's pass read
    in chunks of 16), ``joined`` (a GPU's form: one vector, one gather, one transfer), ``share``
    (a release past the read limit: a rotating share of 8-coordinate blocks, stride 3) or
    ``share-joined``."""
    if form in ("share", "share-joined"):
        monkeypatch.setattr(whitebox, "NOISE_READ", 40)
        monkeypatch.setattr(whitebox, "NOISE_BLOCK", 8)
    if form in ("joined", "share-joined"):
        monkeypatch.setattr(whitebox, "joined_on", lambda device: True)
    elif form == 16:
        monkeypatch.setattr(whitebox, "SQUARES_CHUNK", form)


@pytest.mark.parametrize("kind", ["dirac", "random"])
def test_add_to_equals_the_dense_vector_added_everywhere(kind):
    a, b = _canaries(kind), _canaries(kind)
    tensors = _tensors(0)
    tensors[2] = tensors[2].transpose(0, 2)  # a non-contiguous parameter
    before = [t.clone() for t in tensors]
    rng = np.random.default_rng(1)
    for _ in range(5):
        w = rng.uniform(0, 2, a.included_ids.size) * (rng.random(a.included_ids.size) < 0.3)
        got = a.add_to(tensors, w)
        vec, at, want = b.vector(w), 0, []
        for t in tensors:
            want.append(t + vec[at : at + t.numel()].reshape(t.shape).to(t))
            at += t.numel()
        for g, x, t in zip(got, want, tensors):
            assert torch.equal(g, x)
            if kind == "dirac" and torch.equal(x, t):  # untouched: the tensor itself
                assert g is t
        np.testing.assert_array_equal(a.appearances, b.appearances)
    for t, t0 in zip(tensors, before):
        assert torch.equal(t, t0)  # the given tensors are never modified


def test_add_in_place_touches_its_coordinates_and_restores_them_bit_for_bit():
    a, b = _canaries(), _canaries()
    tensors = _tensors(2)
    tensors[0] = tensors[0].t()  # a non-contiguous one
    tensors[3] = torch.tensor([-0.0])
    before = [t.clone() for t in tensors]
    w = np.full(a.included_ids.size, 1.25)
    restore = add_in_place(tensors, *a.sparse_addition(w))
    for got, want in zip(tensors, b.add_to(before, w)):
        assert torch.equal(got, want)
    restore()
    for t, t0 in zip(tensors, before):  # the same bits, the sign of zero included
        assert torch.equal(t.reshape(-1).view(torch.int32), t0.reshape(-1).view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_method_add_in_place_adds_the_sampled_canaries_and_restores_bit_for_bit(dtype):
    """``GradientCanaries.add_in_place`` (every included canary's coordinate, weight 0 where not
    sampled, through offsets built once per layout) gives the floats of the sampled coordinates
    added alone (:func:`add_in_place` of ``sparse_addition``), counts the same appearances, and
    puts back every bit, negative zeros included, step after step and on a second layout."""
    a, b = _canaries(n=40), _canaries(n=40)
    rng = np.random.default_rng(3)
    for shapes in (SHAPES, [(DIM,)], SHAPES):
        g = torch.Generator().manual_seed(len(shapes))
        mine = [torch.randn(s, generator=g, dtype=dtype) for s in shapes]
        mine[0].view(-1)[::2] = -0.0  # zeros of both signs where canaries may land
        theirs = [t.clone() for t in mine]
        before = [t.clone() for t in mine]
        for _ in range(4):
            w = rng.uniform(0.1, 3, a.included_ids.size) * (rng.random(a.included_ids.size) < 0.4)
            restore_mine = a.add_in_place(mine, torch.as_tensor(w, dtype=torch.float32))
            restore_theirs = add_in_place(theirs, *b.sparse_addition(w))
            for x, y in zip(mine, theirs):
                assert torch.equal(x, y)  # equal values (an unsampled -0 reads +0 in mine)
            changed = sum(int((x != t0).sum()) for x, t0 in zip(mine, before))
            assert changed == int((w != 0).sum()) > 0  # the sampled canaries, and only they
            restore_mine()
            restore_theirs()
            for t, t0 in zip(mine, before):
                assert torch.equal(t.reshape(-1).view(torch.int8), t0.reshape(-1).view(torch.int8))
        np.testing.assert_array_equal(a.appearances, b.appearances)
    assert a.appearances.sum() > 0
    with pytest.raises(ValueError, match="one entry per included canary"):
        a.add_in_place(_tensors(0), torch.ones(3))
    with pytest.raises(ValueError, match="dim"):
        a.add_in_place(_tensors(0)[1:], torch.ones(a.included_ids.size))


@pytest.mark.parametrize("case", ["random", "non-contiguous"])
def test_the_method_add_in_place_falls_back_to_the_sampled_coordinates(case):
    """Random directions (every coordinate) and a non-contiguous tensor take the general path:
    the same floats as ``add_to``, put back bit for bit."""
    a, b = (
        _canaries(case if case == "random" else "dirac"),
        _canaries(case if case == "random" else "dirac"),
    )
    tensors = _tensors(6)
    if case == "non-contiguous":
        tensors[0] = tensors[0].t()
    before = [t.clone() for t in tensors]
    w = np.full(a.included_ids.size, 0.5)
    w[::2] = 0.0
    restore = a.add_in_place(tensors, w)
    for got, want in zip(tensors, b.add_to(before, w)):
        assert torch.equal(got, want)
    restore()
    for t, t0 in zip(tensors, before):
        assert torch.equal(t, t0)
    np.testing.assert_array_equal(a.appearances, b.appearances)


@pytest.mark.parametrize("form", [None, 16, "joined", "share", "share-joined"])
@pytest.mark.parametrize("scale", [1.0, 2.5])
@pytest.mark.parametrize("clean", ["float32", "bfloat16", "none"])
def test_a_bfloat16_release_is_observed_as_its_float32_values(clean, scale, form, monkeypatch):
    """A loop over a bfloat16 model hands its release in bfloat16 (``inject`` and ``observe``,
    or ``watch`` on ``p.grad``): the canaries read it as the same values in float32 (the scaled
    release rounded in bfloat16, as the loop would hold it), against a clean sum of either
    width: the projections equal, the noise statistic within float rounding where half-precision
    squares moved it by about 0.3%; in one pass, in chunks, joined, and read in a share."""
    _observed_as(form, monkeypatch)
    a, b = _canaries(n=40), _canaries(n=40)
    g = torch.Generator().manual_seed(8)
    for _ in range(3):
        released = [torch.randn(s, generator=g).to(torch.bfloat16) for s in SHAPES]
        base = [torch.randn(s, generator=g) for s in SHAPES]
        if clean == "bfloat16":
            base = [t.to(torch.bfloat16) for t in base]
        ref = None if clean == "none" else base
        a.observe(released, clean=ref, scale=scale)
        b.observe(
            [(t * scale).float() for t in released],
            clean=None if ref is None else [t.float() for t in ref],
        )
    a._settle()
    b._settle()
    for x, y in zip(a._proj, b._proj):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_allclose(a._noise_ss, b._noise_ss, rtol=1e-6)
    assert min(a._noise_ss) > 0


def test_probe_sets_sparse_additions_sum_as_their_vectors():
    """privkit's opacus DP-SGD adds several probe sets' canaries at once: summed coordinate by
    coordinate in the sets' order, they equal the dense vectors' sum (shared coordinates too)."""
    from privkit.trainers.dpsgd import _summed_additions

    sets = [_canaries(seed=s, n=60) for s in range(3)]
    dense = [_canaries(seed=s, n=60) for s in range(3)]
    rng = np.random.default_rng(0)
    ws = [rng.uniform(0.1, 3, c.included_ids.size) for c in sets]
    clean = _tensors(5)
    got = add_at(clean, *_summed_additions([c.sparse_addition(w) for c, w in zip(sets, ws)]))
    extra, at = sum(c.vector(w) for c, w in zip(dense, ws)), 0
    for g, t in zip(got, clean):
        assert torch.equal(g, t + extra[at : at + t.numel()].reshape(t.shape))
        at += t.numel()
    idx, val = _summed_additions([])
    assert idx.numel() == 0 and add_at(clean, idx, val)[0] is clean[0]


def test_sparse_addition_is_the_vector_s_support():
    a, b = _canaries(), _canaries()
    w = np.zeros(a.included_ids.size)
    w[::3] = 0.75
    idx, val = a.sparse_addition(w)
    dense = torch.zeros(DIM)
    dense[idx] = val
    assert torch.equal(dense, b.vector(w))
    assert idx.numel() == int((w != 0).sum()) and idx.dtype == torch.long
    with pytest.raises(ValueError, match="one entry per included canary"):
        a.sparse_addition(np.ones(3))


@pytest.mark.parametrize("know_batch", [True, False])
@pytest.mark.parametrize("clean", ["list", "flat", "none"])
@pytest.mark.parametrize("scale", [1.0, 2.5])
@pytest.mark.parametrize("records", [False, True])
@pytest.mark.parametrize("chunk", [None, 16, "joined", "share", "share-joined"])
def test_sparse_observation_equals_the_dense_one(
    know_batch, clean, scale, records, chunk, monkeypatch
):
    _observed_as(chunk, monkeypatch)
    sparse, dense = _canaries(know_batch=know_batch), _dense(_canaries(know_batch=know_batch))
    for c in (sparse, dense):
        if records:  # canary records: only the reserved coordinates are scored
            c.records_state = object()
    for step in range(4):
        released = _tensors(10 + step)
        base = _tensors(20 + step)
        given = {"list": base, "flat": torch.cat([t.reshape(-1) for t in base]), "none": None}
        for c in (sparse, dense):
            c.observe(released, clean=given[clean], scale=scale)
    assert sparse.steps == dense.steps == 4
    sparse._settle()  # a joined observation's copy is recorded at the next one, or when read
    for key in ("_proj", "_witness_rows"):
        got, want = getattr(sparse, key), getattr(dense, key)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)  # the same floats: gathered, then the same ops
    np.testing.assert_allclose(sparse._noise_ss, dense._noise_ss, rtol=2.5e-7)
    assert sparse._noise_dof == dense._noise_dof
    assert sparse._clean_known == dense._clean_known


def test_a_joined_observation_is_recorded_later_as_it_was_observed(monkeypatch):
    """The joined read (a GPU's form) queues its copy to the host: the release counts at once,
    its evidence is recorded at the next observation, when the evidence is asked for or when
    the canaries are pickled, and it is the release as it was when observed (its tensors
    changed afterwards, canary records counted for the next release meanwhile)."""
    monkeypatch.setattr(whitebox, "joined_on", lambda device: True)
    queued, plain = _canaries(), _canaries()
    for c in (queued, plain):
        # canary records (their appearances per release), with no sampler's record
        c.records_state = SimpleNamespace(batch_sizes=[])
    for step in range(3):
        released = _tensors(50 + step)
        for c in (queued, plain):
            c.count_appearances(np.array([step, step + 1, step + 1]))
            c.observe([t.clone() for t in released] if c is plain else released)
            if c is plain:
                c._settle()
        assert queued.steps == plain.steps == step + 1
        assert queued._queued is not None and len(queued._proj) == step
        for t in released:  # the release's tensors reused once observed
            t.zero_()
        queued.count_appearances(np.array([7]))  # the next release's batch, before it is recorded
        plain.count_appearances(np.array([7]))
    ev, want = queued.evidence(), plain.evidence()
    assert queued._queued is None and len(queued._proj) == 3
    np.testing.assert_array_equal(ev.projections, want.projections)
    np.testing.assert_array_equal(ev.appearances, want.appearances)
    assert ev.appearances[:, 7].tolist() == [0, 1, 1]
    np.testing.assert_array_equal(ev.noise_squares, want.noise_squares)
    np.testing.assert_array_equal(ev.witness, want.witness)
    released = _tensors(60)
    queued.observe(released)
    state = pickle.loads(pickle.dumps(queued))  # pickled: recorded first
    assert queued._queued is None and state.steps == 4 and len(state._proj) == 4


@pytest.mark.parametrize("form", [None, 16, "joined", "share", "share-joined"])
@pytest.mark.parametrize("given", ["list", "flat"])
@pytest.mark.parametrize("know_batch", [True, False])
def test_inject_then_sparse_observe_equals_the_dense_one(form, given, know_batch, monkeypatch):
    """``inject`` adds the sampled Dirac canaries at their coordinates and keeps of the clean
    sum only what the observation reads (:class:`whitebox._CleanShare`): the same sums as the
    dense vector added to every tensor, and the same evidence as the whole clean sum kept, in
    one pass, in chunks, joined and in a share; the loop's sum is left as it was, and a loop
    that then changes it in place does not change what the canaries compare against."""
    _observed_as(form, monkeypatch)
    sparse, dense = _canaries(know_batch=know_batch), _dense(_canaries(know_batch=know_batch))
    for step in range(5):
        summed = _tensors(30 + step)
        if given == "flat":
            summed = torch.cat([t.reshape(-1) for t in summed])
        before = [t.clone() for t in whitebox._pieces(summed)]
        noise = [
            torch.randn(t.shape, generator=torch.Generator().manual_seed(step)) for t in before
        ]
        released = {}
        for c in (sparse, dense):
            out = whitebox._pieces(c.inject(summed))
            for t, t0 in zip(whitebox._pieces(summed), before):
                assert torch.equal(t, t0)  # the loop's sum untouched
            released[id(c)] = [o + z for o, z in zip(out, noise)]
        for a, b in zip(released[id(sparse)], released[id(dense)]):
            assert torch.equal(a, b)
        for t in whitebox._pieces(summed):
            t.add_(100.0)  # the loop reuses its sum before the release is observed
        for c in (sparse, dense):
            c.observe(released[id(c)])
    sparse._settle()
    assert sparse.steps == dense.steps == 5
    for g, w in zip(sparse._proj + sparse._witness_rows, dense._proj + dense._witness_rows):
        np.testing.assert_array_equal(g, w)
    assert len(sparse._witness_rows) == len(dense._witness_rows)
    np.testing.assert_allclose(sparse._noise_ss, dense._noise_ss, rtol=2.5e-7)
    np.testing.assert_array_equal(sparse.appearances, dense.appearances)
    assert sparse.appearances.sum() > 0


@pytest.mark.parametrize("kind", ["dirac", "random"])
@pytest.mark.parametrize("given", ["list", "flat", "non-contiguous"])
def test_inject_in_place_adds_what_inject_returns(kind, given):
    """``inject(summed, in_place=True)`` leaves in ``summed`` itself the sums ``inject``
    returns, and the canaries observe the same evidence either way."""
    mine, theirs = _canaries(kind), _canaries(kind)
    for step in range(4):
        summed = _tensors(60 + step)
        if given == "flat":
            summed = torch.cat([t.reshape(-1) for t in summed])
        elif given == "non-contiguous":
            summed[0] = summed[0].t()
        copy = summed.clone() if isinstance(summed, torch.Tensor) else [t.clone() for t in summed]
        want = whitebox._pieces(theirs.inject(copy))
        assert mine.inject(summed, in_place=True) is summed
        for got, w in zip(whitebox._pieces(summed), want):
            assert torch.equal(got, w)
        noise = [torch.full(t.shape, 0.5) for t in want]
        mine.observe([t + z for t, z in zip(whitebox._pieces(summed), noise)])
        theirs.observe([t + z for t, z in zip(want, noise)])
    assert mine.appearances.sum() > 0
    for g, w in zip(mine._proj + mine._witness_rows, theirs._proj + theirs._witness_rows):
        np.testing.assert_array_equal(g, w)
    np.testing.assert_array_equal(mine._noise_ss, theirs._noise_ss)


def test_opacus_with_injected_canaries_steps_as_with_the_dense_inject():
    """``attach_to_opacus`` without a loader (the sparse ``inject`` in place on opacus'
    ``summed_grad``) trains opacus' model as the dense ``inject`` it replaced did, and its
    canaries see the same releases: parameters and projections within float rounding (the dense
    path added ``(s + c) - s``, the sparse one ``c``), the same appearances."""
    import warnings

    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    from attacks.whitebox import attach_to_opacus

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 12, generator=g), torch.randint(0, 3, (256,), generator=g)
    runs = []
    for dense in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, opt, loader = PrivacyEngine(accountant="rdp").make_private(
                module=model,
                optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                data_loader=DataLoader(TensorDataset(x, y), batch_size=32),
                noise_multiplier=1.0,
                max_grad_norm=1.0,
                poisson_sampling=False,
                noise_generator=torch.Generator().manual_seed(1),
            )
        can = GradientCanaries.for_parameters(
            opt.params, 60, clip_norm=1.0, sample_rate=0.5, noise_multiplier=1.0, seed=2
        )
        attach_to_opacus(opt, _bench.dense_injector(can) if dense else can)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for xb, yb in loader:
                opt.zero_grad()
                F.cross_entropy(model(xb), yb).backward()
                opt.step()
        runs.append((model, can))
    (a, ca), (b, cb) = runs
    assert ca.steps == cb.steps == 8 and ca.appearances.sum() > 0
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.array(ca._proj), np.array(cb._proj), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(ca.appearances, cb.appearances)
    np.testing.assert_allclose(ca._noise_ss, cb._noise_ss, rtol=1e-6)


@pytest.mark.parametrize("n", [1, 63, 64, 65, 64 * 5, 64 * 5 + 17])
@pytest.mark.parametrize("scale", [1.0, 2.5])
@pytest.mark.parametrize("with_ref", [True, False])
def test_chunked_sum_of_squares_is_the_one_pass_sum(n, scale, with_ref, monkeypatch):
    """The noise scale's sum of squares of a CPU tensor: up to a chunk, the very float of
    ``mse_loss(t * scale, ref, reduction="sum")``; longer, chunk by chunk (a dot product in float32 within a
    chunk, float64 across) as close to the exact float64 sum as the one-pass float32 sum's
    bound (2.5e-7 relative); the chunk's scratch buffer reused, not grown."""
    monkeypatch.setattr(whitebox, "SQUARES_CHUNK", 64)
    g = torch.Generator().manual_seed(n)
    sizes = (n, 1000)
    c = GradientCanaries(sum(sizes), 10, clip_norm=1.0, sample_rate=0.5, witness=0)
    layout = whitebox._Layout.of(c, sizes)
    for _ in range(2):
        t = torch.randn(n, generator=g) * 3 + 1
        ref = torch.randn(n, generator=g) if with_ref else None
        got = layout.squared_difference(t, ref, scale)
        v = t * scale
        one_pass = F.mse_loss(v, ref, reduction="sum") if with_ref else v.square().sum()
        exact = float(((v.double() - (ref.double() if with_ref else 0)) ** 2).sum())
        if n <= 64:
            assert got.dtype == torch.float32 and float(got) == float(one_pass)
        else:
            assert got.dtype == torch.float64
            assert abs(float(got) - exact) <= 2.5e-7 * exact
    if n > 64:
        assert layout._scratch[(torch.device("cpu"), torch.float32)].numel() == 64


def test_observe_checks_the_release_s_size():
    with pytest.raises(ValueError, match="dim = "):
        _canaries().observe(_tensors(0)[:-1])


def test_cached_layouts_are_not_pickled():
    c = _canaries()
    c.observe(_tensors(0), clean=_tensors(1))
    assert c._layouts
    back = pickle.loads(pickle.dumps(c))
    assert "_layouts" not in back.__dict__
    back.observe(_tensors(2), clean=_tensors(3))
    c.observe(_tensors(2), clean=_tensors(3))
    np.testing.assert_array_equal(back._proj[-1], c._proj[-1])


# ------------------------------------------------------------------ DP-SGD: the step as before
def _loss(logits, target, aux):
    return F.cross_entropy(logits, target)


def _train(sigma, claimed, seed, *, dense, release=False, steps=40, q=0.05):
    """``steps`` DP-SGD steps with 300 canaries; the canaries and each step's released gradient."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (256,), generator=g)
    x = torch.randn(256, 12, generator=g) + y[:, None].float()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    step = (DenseCanaryStep if dense else DpSgdStep)(1.0, sigma, q, len(y))
    can = GradientCanaries.for_parameters(
        list(model.parameters()),
        300,
        clip_norm=1.0,
        sample_rate=q,
        noise_multiplier=claimed,
        seed=seed,
    )
    if dense:
        _dense(can)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    gen = torch.Generator().manual_seed(seed + 1)
    if release:  # the release stream: the grid's noise from a fixed AES key
        from privkit.mechanisms.dp_random import aes_generator

        noise = DpRandom(aes_generator(key=seed + 2))
    else:
        noise = torch.Generator().manual_seed(seed + 2)
    grads = []
    for _ in range(steps):
        b = step.sample(gen)
        got = step.noisy_gradient(model, x[b], y[b], _loss, noise, canaries=can)
        grads.append({k: v.clone() for k, v in got.items()})
        for k, p in model.named_parameters():
            p.grad = got[k]
        opt.step()
        opt.zero_grad(set_to_none=True)
    return can, grads


@pytest.mark.parametrize("release", [False, True])
@pytest.mark.parametrize("chunk", [None, 64, "joined", "joined-coins", "share"])
def test_dp_sgd_step_releases_and_audits_exactly_as_the_dense_path(release, chunk, monkeypatch):
    if chunk in ("joined", "joined-coins"):
        # a GPU's forms: canaries added to the joined sum, the release read joined
        monkeypatch.setattr(whitebox, "joined_on", lambda device: True)
    if chunk == "joined-coins":  # and a seeded generator's coins kept where it draws them
        monkeypatch.setattr(
            dp_sgd_step,
            "_coins_on_device",
            lambda source, canaries: isinstance(source.source, torch.Generator),
        )
    elif chunk == "share":  # the release (515 entries) read in a share of 32-entry blocks
        monkeypatch.setattr(whitebox, "NOISE_READ", 200)
        monkeypatch.setattr(whitebox, "NOISE_BLOCK", 32)
    elif chunk is not None:  # the noise scale read in chunks (the model's weights have 384 entries)
        monkeypatch.setattr(whitebox, "SQUARES_CHUNK", chunk)
    claimed = 1.5
    eps = dpsgd_epsilon(0.05, claimed, 40, 1e-5, accountant="pld")
    verdicts = []
    for sigma in (0.0, claimed):
        for seed in range(2):
            can, grads = _train(sigma, claimed, seed, dense=False, release=release)
            old, old_grads = _train(sigma, claimed, seed, dense=True, release=release)
            for g, o in zip(grads, old_grads):
                assert all(torch.equal(g[k], o[k]) for k in g)
            new_ev, old_ev = can.evidence(), old.evidence()
            np.testing.assert_array_equal(new_ev.projections, old_ev.projections)
            np.testing.assert_allclose(
                new_ev.noise_squares, old_ev.noise_squares, rtol=2.5e-7, atol=1e-5
            )
            np.testing.assert_array_equal(can.appearances, old.appearances)
            a = can.audit(accounted_epsilon=eps, delta=1e-5)
            b = old.audit(accounted_epsilon=eps, delta=1e-5)
            assert a.verdict == b.verdict
            assert a.conformance.verdict == b.conformance.verdict
            assert a.epsilon_lower_bound == b.epsilon_lower_bound
            verdicts.append(a.verdict)
    if not release:  # the positive control is caught, the correct step is not
        assert verdicts == ["violation", "violation", "consistent", "consistent"]


class _Sizes(torch.utils._python_dispatch.TorchDispatchMode):
    """Every aten op's output sizes and dtypes while active (``written``: the outputs that are
    not views of, or written into, a tensor the op was given)."""

    def __init__(self):
        super().__init__()
        self.outputs: list[tuple[str, int, torch.dtype]] = []
        self.written: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {
            a.untyped_storage().data_ptr()
            for a in torch.utils._pytree.tree_leaves((args, kwargs or {}))
            if isinstance(a, torch.Tensor)
        }
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.outputs.append((str(func), t.numel(), t.dtype))
                if t.untyped_storage().data_ptr() not in given:
                    self.written.append((str(func), t.numel()))
        return out


@pytest.mark.parametrize("dense", [False, True])
def test_a_step_s_canaries_form_no_vector_of_the_whole_release(dense):
    """Adding the canaries, putting them back and observing form no tensor as large as the
    release (no dense vector, no flat copy for the host) and nothing in float64 beyond the
    reserved coordinates; the dense path it replaced does both."""
    shapes = [(300, 400), (400,), (10, 400), (10,)]
    dim = sum(int(np.prod(s)) for s in shapes)
    can = GradientCanaries(dim, 500, clip_norm=1.0, sample_rate=0.5, noise_multiplier=1.0)
    if dense:
        _dense(can)
    step = (DenseCanaryStep if dense else DpSgdStep)(1.0, 1.0, 0.5, 1000)
    g = torch.Generator().manual_seed(0)
    total = {str(i): torch.randn(s, generator=g) for i, s in enumerate(shapes)}
    clean = list(total.values())
    released = [t + 1.0 for t in clean]
    src = DpRandom(torch.Generator().manual_seed(1))
    with _Sizes() as mode:
        restore = step._with_canaries(total, list(total), can, src)
        restore()
        can.observe(released, clean=clean)
    largest = max(int(np.prod(s)) for s in shapes)
    big = [(f, n) for f, n, _ in mode.outputs if n > largest]
    wide = [
        (f, n)
        for f, n, d in mode.outputs
        if d == torch.float64 and n > len(can.reserved_coordinates)
    ]
    if dense:
        assert big and wide
    else:
        assert not big, big
        assert not wide, wide
        # the noise scale's pass forms no tensor longer than a chunk (no squared difference as
        # large as the parameter tensor: it is read through the chunk's buffer)
        assert largest > whitebox.SQUARES_CHUNK
        long = [(f, n) for f, n in mode.written if n > whitebox.SQUARES_CHUNK]
        assert not long, long
    assert can.steps == 1
