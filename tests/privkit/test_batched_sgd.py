"""Many models at once (privkit.batched.batched_sgd, privkit.mechanisms.stacked) against independent
references: torch.func per-example gradients, the single-model loop, torch.optim, opacus."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy import stats

from privkit.batched.batched_sgd import BLOCK, SGDRecipe, _StackedOptimizer, train_many, train_one
from privkit.mechanisms import stacked as stacked_module
from privkit.mechanisms.dp_sgd_step import clip_per_sample, per_sample_gradients
from privkit.mechanisms.stacked import StackedModels, clipped_sum_one, layer_sequence
from privkit.models import build_model, model_spec

ARCHS = {
    "mlp": {"feature_dim": 16},
    "cnn": {"width": 4, "feature_dim": 16},
    "mlp-normalized": {"feature_dim": 12, "depth": 2, "normalize": True},
}


def _spec(name: str, shape=(1, 8, 8), classes: int = 4) -> dict:
    return model_spec(name.split("-")[0], shape, classes, **ARCHS[name])


def _three_stacked(name: str):
    """Three models of ``ARCHS[name]`` on 12 x 12 inputs, 5 classes, and their parameters and
    buffers stacked."""
    spec = _spec(name, (1, 12, 12), 5)
    models = [build_model(spec["arch"], (1, 12, 12), 5, **ARCHS[name]) for _ in range(3)]
    params = {
        k: torch.stack([dict(m.named_parameters())[k].detach() for m in models])
        for k, _ in models[0].named_parameters()
    }
    buffers = {
        k: torch.stack([dict(m.named_buffers())[k] for m in models])
        for k, _ in models[0].named_buffers()
    }
    return models, params, buffers


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = rng.random((200, 1, 8, 8)).astype(np.float32)
    return x, rng.integers(0, 4, 200)


@pytest.mark.parametrize("name", list(ARCHS))
def test_stacked_clipped_sums_equal_torch_func_per_example_gradients(name):
    """Norms and clipped sums from layer inputs/output gradients = vmap(grad) per example."""
    torch.manual_seed(0)
    spec = _spec(name, (1, 12, 12), 5)
    models = [build_model(spec["arch"], (1, 12, 12), 5, **ARCHS[name]) for _ in range(3)]
    params = {
        k: torch.stack([dict(m.named_parameters())[k].detach() for m in models]).requires_grad_(
            True
        )
        for k, _ in models[0].named_parameters()
    }
    buffers = {
        k: torch.stack([dict(m.named_buffers())[k] for m in models])
        for k, _ in models[0].named_buffers()
    }
    x, y = torch.randn(3, 7, 1, 12, 12), torch.randint(0, 5, (3, 7))
    stacked = StackedModels(models[0], 3)
    logits, _ = stacked.forward(params, buffers, x)
    sums, norms = stacked.clipped_sums(
        params,
        buffers,
        x,
        lambda lo, mo, s: F.cross_entropy(
            lo.reshape(-1, 5), y[mo, s].reshape(-1), reduction="none"
        ).view(len(mo), -1),
        0.3,
    )
    for j, model in enumerate(models):
        torch.testing.assert_close(logits[j], model(x[j]), rtol=1e-5, atol=1e-5)
        per = per_sample_gradients(model, x[j], y[j], lambda lo, t, _a: F.cross_entropy(lo, t))
        clipped, want_norms = clip_per_sample(per, 0.3)
        assert (want_norms > 0.3).any()  # clipping is active
        torch.testing.assert_close(norms[j], want_norms, rtol=1e-4, atol=1e-6)
        for k, g in clipped.items():
            torch.testing.assert_close(sums[k][j], g.sum(0), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", list(ARCHS))
def test_chunked_clipped_sums_with_pads_equal_torch_func_per_example_gradients(name, monkeypatch):
    """Chunks of three examples; models whose examples run out at different points (their pads hold
    large random inputs with real losses, and must count for nothing); clip at the median norm, so
    some examples are clipped and some not: norms and sums are torch.func's per-example gradients,
    clipped and summed over each model's own examples."""
    torch.manual_seed(1)
    models, params, buffers = _three_stacked(name)
    counts = [7, 2, 5]
    x, y = torch.randn(3, 7, 1, 12, 12), torch.randint(0, 5, (3, 7))
    for j, c in enumerate(counts):
        x[j, c:] = 100 * torch.rand(7 - c, 1, 12, 12)
    stacked = StackedModels(models[0], 3)
    if name == "cnn":  # the largest activation: 4 channels x 12 x 12 floats per model and example
        monkeypatch.setattr(stacked_module, "CHUNK_BYTES", 3 * (4 * 12 * 12) * 4 * 3)
        assert stacked.chunk_size(x) == 3
    per = [
        per_sample_gradients(
            m, x[j, : counts[j]], y[j, : counts[j]], lambda lo, t, _a: F.cross_entropy(lo, t)
        )
        for j, m in enumerate(models)
    ]
    clip = clip_per_sample(per[0], 1.0)[1].median().item()

    def losses(lo, mo, s):
        return F.cross_entropy(lo.reshape(-1, 5), y[mo, s].reshape(-1), reduction="none").view(
            len(mo), -1
        )

    sums, norms = stacked.clipped_sums(params, buffers, x, losses, clip, counts=counts)
    for j, c in enumerate(counts):
        clipped, want_norms = clip_per_sample(per[j], clip)
        torch.testing.assert_close(norms[j, :c], want_norms, rtol=1e-4, atol=1e-6)
        assert (norms[j, c:] == 0).all()
        for k, g in clipped.items():
            torch.testing.assert_close(sums[k][j], g.sum(0), rtol=1e-4, atol=1e-6)
    assert (norms[0] > clip).any() and (norms[0] < clip).any()


@pytest.mark.parametrize("name", list(ARCHS))
def test_linear_sums_over_chunks_equal_one_chunk(name, monkeypatch):
    """Over several chunks the linear layers' clipped sums wait for the whole batch (one product,
    the chunks' pieces at their examples' places): equal to the batch in one chunk up to float
    rounding, with models whose examples run out mid-chunk, at a chunk's end and before the
    first (count 0: sums and norms 0), and pads of large inputs that must count for nothing."""
    torch.manual_seed(4)
    models, params, buffers = _three_stacked(name)
    params = {k: torch.cat([v, v[:1] * 0.5]) for k, v in params.items()}  # a fourth model
    buffers = {k: torch.cat([v, v[:1]]) for k, v in buffers.items()}
    counts = [7, 3, 0, 5]
    x, y = torch.randn(4, 7, 1, 12, 12), torch.randint(0, 5, (4, 7))
    for j, c in enumerate(counts):
        x[j, c:] = 100 * torch.rand(7 - c, 1, 12, 12)
    stacked = StackedModels(models[0], 4)

    def losses(lo, mo, s):
        return F.cross_entropy(lo.reshape(-1, 5), y[mo, s].reshape(-1), reduction="none").view(
            len(mo), -1
        )

    whole, whole_norms = stacked.clipped_sums(params, buffers, x, losses, 0.5, counts=counts)
    monkeypatch.setattr(StackedModels, "chunk_size", lambda self, x: 3)
    chunked, norms = stacked.clipped_sums(params, buffers, x, losses, 0.5, counts=counts)
    torch.testing.assert_close(norms, whole_norms, rtol=1e-5, atol=1e-6)
    assert (norms[2] == 0).all()
    assert set(chunked) == set(whole)
    for k in whole:
        torch.testing.assert_close(chunked[k], whole[k], rtol=1e-5, atol=1e-6)
        assert (chunked[k][2] == 0).all()
        assert chunked[k][0].abs().sum() > 0


@pytest.mark.parametrize("name", list(ARCHS))
def test_input_norms_kept_by_the_caller_give_the_same_clipped_sums(name, monkeypatch):
    """A caller that keeps its records' squared norms passes them (``input_norms``): an MLP's
    clipped sums and norms come out bit for bit, in chunks of three with models whose examples
    run out (the pads' norms are anything); norms that are not the inputs' move them (the first
    layer reads them); a model whose first layer is not linear on its input refuses them."""
    torch.manual_seed(3)
    models, params, buffers = _three_stacked(name)
    counts = [7, 2, 5]
    x, y = torch.randn(3, 7, 1, 12, 12), torch.randint(0, 5, (3, 7))
    stacked = StackedModels(models[0], 3)
    monkeypatch.setattr(StackedModels, "chunk_size", lambda self, x: 3)

    def losses(lo, mo, s):
        return F.cross_entropy(lo.reshape(-1, 5), y[mo, s].reshape(-1), reduction="none").view(
            len(mo), -1
        )

    norms = x.flatten(2).pow(2).sum(-1)
    for j, c in enumerate(counts):
        norms[j, c:] = 1e6  # pads: read by nothing

    def run(given):
        return stacked.clipped_sums(
            params, buffers, x, losses, 0.5, counts=counts, input_norms=given
        )

    if name == "cnn":
        assert not stacked.linear_on_input
        with pytest.raises(ValueError, match="input_norms"):
            run(norms)
        return
    assert stacked.linear_on_input
    (want, want_norms), (got, got_norms) = run(None), run(norms)
    assert torch.equal(got_norms, want_norms)
    assert all(torch.equal(got[k], want[k]) for k in want)
    _, moved = run(norms * 4)
    assert not torch.equal(moved, want_norms)


@pytest.mark.parametrize("frozen", [False, True], ids=["all-trainable", "features-frozen"])
def test_single_model_clipped_sum_in_chunks_equals_torch_func(frozen, monkeypatch):
    """The single-model form DpSgdStep uses (clipped_sum_one), four examples per chunk, with and
    without frozen features: torch.func's clipped per-example gradients of the trainable parameters."""
    torch.manual_seed(2)
    model = build_model("cnn", (1, 12, 12), 5, width=4, feature_dim=16)
    if frozen:
        model.features.requires_grad_(False)
    monkeypatch.setattr(stacked_module, "CHUNK_BYTES", 4 * (4 * 12 * 12) * 4)
    x, y = torch.randn(9, 1, 12, 12), torch.randint(0, 5, (9,))
    per = per_sample_gradients(model, x, y, lambda lo, t, _a: F.cross_entropy(lo, t))
    clip = clip_per_sample(per, 1.0)[1].median().item()
    clipped, norms = clip_per_sample(per, clip)
    assert (norms > clip).any() and (norms < clip).any()
    got = clipped_sum_one(model, x, lambda lo, s: F.cross_entropy(lo, y[s], reduction="none"), clip)
    assert set(got) == set(clipped)
    for k, g in clipped.items():
        torch.testing.assert_close(got[k], g.sum(0), rtol=1e-4, atol=1e-6)


CASES = [
    {"sampling": s, "clip": c, "drop_last": d}
    for s, c, d in itertools.product(["shuffle", "poisson"], [None, 1.0], [True, False])
]


@pytest.mark.parametrize("name", ["mlp", "cnn"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_many_equals_loop_including_noise(data, name, case):
    """Same seeds -> the same batches, the same noise and the same weights as the loop."""
    x, y = data
    recipe = SGDRecipe(
        epochs=2, batch_size=16, lr=0.2, noise_multiplier=0.8 if case["clip"] else 0.0, **case
    )
    rng = np.random.default_rng(1)
    idx = [
        rng.choice(200, n, replace=False) for n in (100, 90, 120)
    ]  # unequal: models idle at the end
    spec = _spec(name)
    many = train_many(spec, x, y, idx, recipe, [5, 6, 7])
    chunked = train_many(spec, x, y, idx, recipe, [5, 6, 7], chunk_size=2)
    for j, s in enumerate([5, 6, 7]):
        one = train_one(spec, x, y, idx[j], recipe, s)
        for k in one:
            torch.testing.assert_close(many[j][k], one[k], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(chunked[j][k], one[k], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(many[0]["head.weight"], many[1]["head.weight"])
    assert not torch.allclose(many[0]["head.weight"], _init_head(spec, 5))  # it trained


@pytest.mark.parametrize("clip", [None, 0.5])
def test_many_equals_loop_in_chunks_of_three_examples(data, monkeypatch, clip):
    """Each step's gradients (clipped sums, or mean gradients) formed three examples at a time,
    models dropping out of the last chunks as their Poisson batches run out: the loop's weights."""
    x, y = data
    monkeypatch.setattr(
        stacked_module, "CHUNK_BYTES", 3 * (4 * 8 * 8) * 4 * 3
    )  # cnn conv1: 4 x 8 x 8
    recipe = SGDRecipe(
        epochs=1,
        batch_size=16,
        lr=0.2,
        clip=clip,
        noise_multiplier=0.8 if clip else 0.0,
        sampling="poisson",
    )
    idx = [np.arange(0, 100), np.arange(40, 130), np.arange(80, 200)]
    many = train_many(_spec("cnn"), x, y, idx, recipe, [5, 6, 7])
    for j, s in enumerate([5, 6, 7]):
        one = train_one(_spec("cnn"), x, y, idx[j], recipe, s)
        for k in one:
            torch.testing.assert_close(many[j][k], one[k], rtol=1e-5, atol=1e-5)


def _init_head(spec, seed):
    torch.manual_seed(seed)
    return build_model(
        spec["arch"],
        tuple(spec["input_shape"]),
        spec["num_classes"],
        **{k: v for k, v in spec.items() if k not in ("arch", "input_shape", "num_classes")},
    ).head.weight.detach()


@pytest.mark.parametrize("clip", [None, 1.0])
def test_many_equals_loop_with_adam(data, clip):
    x, y = data
    recipe = SGDRecipe(
        epochs=1,
        batch_size=16,
        lr=0.01,
        clip=clip,
        noise_multiplier=0.5 if clip else 0.0,
        sampling="poisson",
        optimizer="adam",
    )
    idx = [np.arange(0, 80), np.arange(50, 150)]
    many = train_many(_spec("mlp"), x, y, idx, recipe, [1, 2])
    for j in range(2):
        one = train_one(_spec("mlp"), x, y, idx[j], recipe, [1, 2][j])
        for k in one:
            torch.testing.assert_close(many[j][k], one[k], rtol=1e-4, atol=1e-4)


def test_stacked_adam_is_torch_adam_per_model_and_idle_models_stay_put():
    torch.manual_seed(0)
    grads = [torch.randn(3, 4, 5) for _ in range(6)]
    active = [torch.tensor([1.0, 1.0, 1.0])] * 4 + [torch.tensor([1.0, 0.0, 1.0])] * 2
    p = {"w": torch.randn(3, 4, 5)}
    start = p["w"].clone()
    opt = _StackedOptimizer(p, SGDRecipe(lr=0.05, optimizer="adam"))
    for g, a in zip(grads, active):
        opt.step(p, {"w": g}, a)
    for j in range(3):
        w = torch.nn.Parameter(start[j].clone())
        ref = torch.optim.Adam([w], lr=0.05)
        for g, a in zip(grads, active):
            if a[j]:
                w.grad = g[j].clone()
                ref.step()
        torch.testing.assert_close(p["w"][j], w.detach(), rtol=1e-6, atol=1e-6)


def test_noise_is_sigma_c_gaussian_independent_across_models(data):
    """The noise of one step, recovered as (noisy - noise-free weights): N(0, (sigma C / B)^2 lr^2)
    per coordinate, mean 0, uncorrelated across models (batches use their own generator, so the
    two runs see the same batches and clipped sums)."""
    x, y = data
    sigma, clip, lr = 2.0, 0.5, 0.1
    # one step: Poisson with q = 1 (batch_size >= n), expected batch size q n = 200
    one_step = {"epochs": 1, "batch_size": 200, "lr": lr, "clip": clip, "sampling": "poisson"}
    idx, seeds = [np.arange(200)] * 8, list(range(20, 28))
    spec = model_spec("mlp", (1, 8, 8), 4, feature_dim=64)
    assert SGDRecipe(**one_step).steps(200) == 1
    noisy = train_many(spec, x, y, idx, SGDRecipe(**one_step, noise_multiplier=sigma), seeds)
    clean = train_many(spec, x, y, idx, SGDRecipe(**one_step, noise_multiplier=0.0), seeds)
    scale = sigma * clip / 200 * lr  # std of the noise's effect on the weights after one step
    z = (
        torch.stack(
            [
                torch.cat([((noisy[j][k] - clean[j][k]) / -scale).flatten() for k in noisy[j]])
                for j in range(8)
            ]
        )
        .double()
        .numpy()
    )
    p = z.shape[1]
    assert p > 4000
    # per model: variance 1 (chi-square) and mean 0 (z-test), two-sided, family-wise level 1e-3
    # (Bonferroni over the 8 models)
    a = 1e-3 / 8
    lo, hi = stats.chi2.ppf([a / 2, 1 - a / 2], p) / p
    for row in z:
        assert lo < (row**2).mean() < hi
        assert abs(row.mean()) < stats.norm.ppf(1 - a / 2) / np.sqrt(p)
    # all models together: variance within 1 +- 3%
    assert (z**2).mean() == pytest.approx(1.0, abs=0.03)
    # across models: the 28 pairwise correlations in the band of independent samples (level 1e-3)
    corr = np.corrcoef(z)[np.triu_indices(8, 1)]
    assert np.abs(corr).max() < stats.norm.ppf(1 - 1e-3 / 28 / 2) / np.sqrt(p)
    # and Gaussian: Kolmogorov-Smirnov against N(0, 1)
    assert stats.kstest(z.ravel(), "norm").pvalue > 1e-3


def test_noise_streams_are_the_loops_own(data):
    """Model j's noise is its own generator's stream: changing model 0's seed leaves model 1 alone."""
    x, y = data
    recipe = SGDRecipe(
        epochs=1, batch_size=16, lr=0.1, clip=1.0, noise_multiplier=1.0, sampling="poisson"
    )
    a = train_many(_spec("mlp"), x, y, [np.arange(100)] * 2, recipe, [3, 4])
    b = train_many(_spec("mlp"), x, y, [np.arange(100)] * 2, recipe, [9, 4])
    torch.testing.assert_close(a[1]["head.weight"], b[1]["head.weight"], rtol=0, atol=0)
    assert not torch.allclose(a[0]["head.weight"], b[0]["head.weight"])


def test_poisson_sampling_rate_and_steps(data):
    from privkit.batched.batched_sgd import _one_batches
    from privkit.mechanisms.dp_random import DpRandom

    recipe = SGDRecipe(epochs=3, batch_size=16, sampling="poisson")
    n = 100
    assert recipe.sample_rate(n) == pytest.approx(1 / 7) and recipe.steps(n) == 21 > BLOCK
    sizes = [len(b) for b in _one_batches(n, recipe, DpRandom(torch.Generator().manual_seed(0)))]
    assert len(sizes) == 21
    many = [
        len(b)
        for _ in range(20)
        for b in _one_batches(n, recipe, DpRandom(torch.Generator().manual_seed(_)))
    ]
    # Binomial(100, 1/7): mean 14.29, variance 12.24; 420 draws
    assert np.mean(many) == pytest.approx(100 / 7, abs=4 * np.sqrt(12.24 / 420))
    assert len(set(many)) > 5


def test_matches_opacus_without_noise():
    """Clipping and normalisation by the expected batch size as opacus does them (q = 1: every
    record in every batch, so both see the same batches; noise 0)."""
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    rng = np.random.default_rng(2)
    x = rng.random((40, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 3, 40)
    spec = model_spec("cnn", (1, 8, 8), 3, width=2, feature_dim=8)
    recipe = SGDRecipe(
        epochs=3, batch_size=40, lr=0.5, clip=0.05, noise_multiplier=0.0, sampling="poisson"
    )
    ours = train_many(spec, x, y, [np.arange(40)], recipe, [11])[0]
    torch.manual_seed(11)
    model = build_model("cnn", (1, 8, 8), 3, width=2, feature_dim=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = DataLoader(TensorDataset(torch.as_tensor(x), torch.as_tensor(y)), batch_size=40)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        private, dp_opt, dp_loader = PrivacyEngine().make_private(
            module=model,
            optimizer=opt,
            data_loader=loader,
            noise_multiplier=0.0,
            max_grad_norm=0.05,
            poisson_sampling=True,
        )
        for _ in range(3):
            for xb, yb in dp_loader:
                assert len(yb) == 40
                dp_opt.zero_grad()
                F.cross_entropy(private(xb), yb).backward()
                dp_opt.step()
    for k, v in model.named_parameters():
        torch.testing.assert_close(ours[k], v.detach(), rtol=1e-4, atol=1e-6)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="clip must be > 0; found -1"):
        SGDRecipe(clip=-1)
    with pytest.raises(ValueError, match="noise_multiplier needs clip"):
        SGDRecipe(noise_multiplier=1.0)
    with pytest.raises(ValueError, match="sampling must be shuffle or poisson; found 'x'"):
        SGDRecipe(sampling="x")
    with pytest.raises(ValueError, match="model must be a privkit FeatureClassifier"):
        layer_sequence(torch.nn.Linear(2, 2))
    model = build_model("mlp", (1, 4, 4), 2, feature_dim=4)
    model.features.append(torch.nn.Tanh())
    with pytest.raises(ValueError, match=r"layer features\.3 \(Tanh\) is not supported"):
        layer_sequence(model)
    with pytest.raises(ValueError, match="every model needs at least one record"):
        train_many(
            _spec("mlp"),
            np.zeros((4, 1, 8, 8), np.float32),
            np.zeros(4, int),
            [np.arange(0)],
            SGDRecipe(),
            [0],
        )


def test_release_mode_noise_is_not_derived_from_the_seed(data):
    x, y = data
    recipe = SGDRecipe(
        epochs=1, batch_size=16, lr=0.1, clip=1.0, noise_multiplier=1.0, sampling="poisson"
    )
    idx = [np.arange(100)]
    a, b = (
        train_many(_spec("mlp"), x, y, idx, recipe, [3], reproducible=False)[0] for _ in range(2)
    )
    assert not torch.allclose(a["head.weight"], b["head.weight"])  # fresh OS entropy per run
    c, d = (train_many(_spec("mlp"), x, y, idx, recipe, [3])[0] for _ in range(2))
    torch.testing.assert_close(c["head.weight"], d["head.weight"], rtol=0, atol=0)


def test_unsupported_model_falls_back_but_a_bug_propagates(monkeypatch):
    """clipped_gradient_sum uses torch.func only for models the stacked path does not cover; any
    other error inside the fast path is raised, not hidden behind the slower fallback."""
    from torch import nn

    from privkit.mechanisms import dp_sgd_step, stacked

    def loss(logits, y, _aux):
        return F.cross_entropy(logits, y)

    torch.manual_seed(0)
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    plain = nn.Sequential(
        nn.Linear(5, 3)
    )  # not a FeatureClassifier: torch.func per-example gradients
    got = dp_sgd_step.clipped_gradient_sum(plain, x, y, loss, 0.5)
    clipped, _ = dp_sgd_step.clip_per_sample(
        dp_sgd_step.per_sample_gradients(plain, x, y, loss), 0.5
    )
    for k, g in clipped.items():
        torch.testing.assert_close(got[k], g.sum(0))

    def broken(*_a, **_k):
        raise ValueError("a bug in the fast path")

    monkeypatch.setattr(stacked, "clipped_sum_one", broken)
    with pytest.raises(ValueError, match="a bug in the fast path"):
        dp_sgd_step.clipped_gradient_sum(plain, x, y, loss, 0.5)


@pytest.mark.parametrize("hidden", [False, True])
def test_mentor_mentee_pair_clipped_sum_equals_torch_func(hidden, monkeypatch):
    """FedKD's pair (mentor, mentee and W_h clipped jointly) takes its stacked form with one model
    in a DP-SGD step: torch.func's clipped per-example gradients of the whole pair."""
    from privkit.mechanisms import dp_sgd_step
    from privkit.trainers.fedkd import MentorMentee, mutual_loss

    torch.manual_seed(3)
    pair = MentorMentee(
        build_model("mlp", (1, 8, 8), 4, feature_dim=12, depth=2),
        build_model("cnn", (1, 8, 8), 4, width=3, feature_dim=6),
    )
    loss = mutual_loss(4, hidden)
    x, y = torch.randn(11, 1, 8, 8), torch.randint(0, 4, (11,))
    per = dp_sgd_step.per_sample_gradients(pair, x, y, loss)
    clip = dp_sgd_step.clip_per_sample(per, 1.0)[1].median().item()
    clipped, norms = dp_sgd_step.clip_per_sample(per, clip)
    assert (norms > clip).any() and (norms < clip).any()
    monkeypatch.setattr(dp_sgd_step, "per_sample_gradients", None)  # no torch.func fallback
    got = dp_sgd_step.clipped_gradient_sum(pair, x, y, loss, clip)
    assert set(got) == set(clipped) and "w_h.weight" in got
    for k, g in clipped.items():
        torch.testing.assert_close(got[k], g.sum(0), rtol=1e-4, atol=1e-6)
