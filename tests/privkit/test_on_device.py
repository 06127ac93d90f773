"""The accelerator path of the batched trainer, run on PRIVKIT_TEST_DEVICE (default: the CPU).

On a machine without a GPU these tests run the device-agnostic code on the CPU (with the ChaCha20
release stream forced on, as a GPU would use it); on a GPU, ``PRIVKIT_TEST_DEVICE=cuda`` runs them
there (benchmarks/run_gpu.sh does).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from audit_helpers import TINY_DPFED

from privkit.batched.batched_sgd import SGDRecipe, train_many, train_one
from privkit.models import model_spec

DEVICE = os.environ.get("PRIVKIT_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    return rng.random((200, 1, 8, 8)).astype(np.float32), rng.integers(0, 4, 200)


@pytest.mark.parametrize(
    "arch",
    [{"arch": "mlp", "feature_dim": 16}, {"arch": "cnn", "width": 4, "feature_dim": 16}],
    ids=["mlp", "cnn"],
)
def test_batched_equals_loop_on_the_device(data, arch):
    x, y = data
    spec = model_spec(arch["arch"], (1, 8, 8), 4, **{k: v for k, v in arch.items() if k != "arch"})
    recipe = SGDRecipe(
        epochs=2, batch_size=16, lr=0.2, clip=1.0, noise_multiplier=0.8, sampling="poisson"
    )
    idx = [np.arange(0, 100), np.arange(50, 170)]
    many = train_many(spec, x, y, idx, recipe, [1, 2], device=DEVICE)
    for j, seed in enumerate([1, 2]):
        one = train_one(spec, x, y, idx[j], recipe, seed, device=DEVICE)
        for k in one:
            torch.testing.assert_close(many[j][k], one[k], rtol=1e-5, atol=1e-5)


def test_a_seeded_generator_on_the_device_draws_masks_and_permutations():
    """Reproducible mode on a GPU: the seeded generator lives there and torch draws from it only
    on its own device (a CPU draw from it raised); results come back as CPU tensors, the same for
    the same seed."""
    from privkit.mechanisms.dp_random import DpRandom

    def draws(seed):
        src = DpRandom(torch.Generator(device=DEVICE).manual_seed(seed))
        return src.mask(4000, rate=0.25), src.randperm(50)

    mask, perm = draws(3)
    assert mask.device.type == "cpu" and mask.dtype == torch.bool
    assert abs(mask.float().mean().item() - 0.25) < 0.03  # 4000 draws: 4.5 standard errors
    assert sorted(perm.tolist()) == list(range(50)) and perm.device.type == "cpu"
    again = draws(3)
    assert torch.equal(mask, again[0]) and torch.equal(perm, again[1])


def test_unfolded_convolution_input_on_the_device_is_f_unfold():
    """The GPU form's unfolded input (a strided view copied once; ``F.unfold`` launches one
    kernel per example there) on the device equals ``F.unfold`` on the CPU."""
    import torch.nn.functional as F
    from torch import nn

    from privkit.mechanisms import ghost_clipping

    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3, stride=2, padding=1).to(DEVICE)
    a = torch.randn(6, 3, 9, 9)
    on = a.to(DEVICE)
    got = ghost_clipping._unfolded(*ghost_clipping._conv_of(conv, on, conv(on).detach()))
    if DEVICE == "cpu":  # the CPU keeps the offset-by-offset form
        assert got is None
        return
    assert got is not None
    assert torch.equal(got.cpu(), F.unfold(a, 3, 1, 1, 2))


def _transformer_layer():
    from torch import nn

    model = nn.Sequential(
        nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True), nn.Flatten()
    )
    return model, torch.randn(6, 5, 16), 80


def _grouped_convolutions():
    from torch import nn

    model = nn.Sequential(
        nn.Conv2d(4, 8, 3, padding=1, groups=4),
        nn.Conv2d(8, 8, 3, stride=2, groups=2),
        nn.Flatten(2),
        nn.Conv1d(8, 8, 3, groups=8),
        nn.Flatten(),
    )
    return model, torch.randn(6, 4, 7, 7), 8


def _vision_transformer():
    from tests.privkit.test_ghost_parameters import VisionTransformer

    return VisionTransformer(), torch.randn(6, 3, 8, 8), 3


def _tied_language_model():
    from tests.privkit.test_ghost_tied import NextToken, V

    return NextToken(), torch.randint(0, V, (6, 6)), V


def _recurrent():
    from tests.privkit.test_ghost_calls import Recurrent

    return Recurrent(), torch.randint(0, 7, (6, 4)), 3


def _gpt2():
    from tests.privkit.test_ghost_transformers import (  # skips without transformers
        V,
        gpt2_predicting_the_last_token,
    )

    return gpt2_predicting_the_last_token(), torch.randint(0, V, (6, 8)), V


def _relative_bias():
    from tests.privkit.test_ghost_broadcast import TinyT5, V

    return TinyT5("sdpa"), torch.randint(0, V, (5, 6)), 3


def _bias_table():
    from tests.privkit.test_ghost_broadcast import TinySwin

    return TinySwin(), torch.randn(5, 4, 4, 3), 3


@pytest.mark.parametrize(
    "build",
    [
        _transformer_layer,
        _grouped_convolutions,
        _vision_transformer,
        _tied_language_model,
        _recurrent,
        _gpt2,
        _relative_bias,
        _bias_table,
    ],
    ids=[
        "attention",
        "grouped-conv",
        "vision-transformer",
        "tied-head",
        "dplstm",
        "gpt2",
        "relative-bias",
        "bias-table",
    ],
)
def test_ghost_clipping_norms_on_the_device_are_torch_funcs(build):
    """Ghost clipping on the device of torch's transformer layer (``nn.MultiheadAttention`` with
    its linear maps in the open), of grouped and depthwise convolutions, 2-d and 1-d (on a GPU
    their per-example gradients by one product group by group), of a vision transformer's
    bare parameters (stand-ins on the device; the check of its outputs replays the device's
    random state), of a language model's output layer tied to its embedding, of opacus'
    DPLSTM (its cells run once per step), of HF's GPT-2 (its Conv1D layers' layout checked
    on the device) and of a T5-style relative bias and a Swin-style bias table followed to the
    batch on the device (``ghost_broadcast``): the per-example norms of
    ``torch.func``'s per-example gradients in float64 on the CPU, to float32's accuracy."""
    import torch.nn.functional as F

    from privkit.mechanisms import dp_sgd_step, ghost_clipping

    torch.manual_seed(0)
    model, x, classes = build()
    y = torch.randint(0, classes, (x.shape[0],))
    x_cpu = x.double() if x.is_floating_point() else x  # tokens stay integers

    def loss(logits, target, _aux):
        return F.cross_entropy(logits, target)

    per = dp_sgd_step.per_sample_gradients(model.double(), x_cpu, y, loss)
    want = dp_sgd_step.clip_per_sample(per, 1.0)[1]
    got = ghost_clipping.per_example_norms(
        model.float().to(DEVICE),
        x.to(DEVICE),
        lambda logits, s: F.cross_entropy(logits, y.to(DEVICE)[s], reduction="none"),
    )
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=0)


def test_canaries_read_a_release_on_the_device_as_on_the_cpu():
    """The canaries' joined read of a release on the device (one gather, one transfer) gives the
    CPU's projections bit for bit and its noise scale up to float rounding."""
    from attacks.whitebox import GradientCanaries

    sizes = [(40, 30), (30,), (10, 30), (10,)]
    g = torch.Generator().manual_seed(1)
    released = [torch.randn(s, generator=g) for s in sizes]
    clean = [torch.randn(s, generator=g) for s in sizes]
    dim = sum(t.numel() for t in released)
    cpu, dev = (
        GradientCanaries(dim, 40, clip_norm=1.0, sample_rate=0.5, witness=64, seed=3)
        for _ in range(2)
    )
    cpu.observe(released, clean=clean)
    dev.observe([t.to(DEVICE) for t in released], clean=[t.to(DEVICE) for t in clean])
    assert dev.steps == 1
    dev._settle()  # on a GPU the copy is queued: recorded at the next observation, or when read
    np.testing.assert_array_equal(dev._proj[0], cpu._proj[0])
    np.testing.assert_allclose(dev._noise_ss, cpu._noise_ss, rtol=2.5e-7)


def test_queued_copies_to_and_from_the_device_are_plain_copies():
    """:mod:`attacks.transfers` on the device: what arrives is what was sent, and a copy back
    keeps the values its tensor had when it was made."""
    from attacks.transfers import HostCopy, to_device

    host = torch.arange(1000, dtype=torch.float64)
    there = to_device(host, torch.device(DEVICE))
    assert there.device.type == torch.device(DEVICE).type and torch.equal(there.cpu(), host)
    back = HostCopy(there * 2)
    source = there.clone()
    copy = HostCopy(source)
    source.zero_()  # queued after the copy: not in it
    assert torch.equal(back.result(), host * 2) and torch.equal(copy.result(), host)
    assert back.result().device.type == "cpu"


def test_privkit_train_on_the_device_trains_through_the_batched_engine():
    """``privkit train``'s engine on the device trains a batched method's single run through
    the batched engine: the single run's result, up to float rounding (seeded noise)."""
    from privkit.batched.many import trains_batched_alone
    from privkit.data import FederationConfig, build_federation
    from privkit.flower_engine import engine
    from privkit.trainers import train

    cfg = {**TINY_DPFED, "rounds": 2, "device": DEVICE, "reproducible_noise": True}
    assert trains_batched_alone("dp-fedavg", cfg)
    fed = build_federation(FederationConfig(partition="dirichlet", clients=20, seed=0))
    one = engine.train("dp-fedavg", fed, cfg, seed=5)
    alone = train("dp-fedavg", fed, cfg, seed=5)
    for p, q in zip(one.model.state_dict().values(), alone.model.state_dict().values()):
        torch.testing.assert_close(p.cpu(), q.cpu(), rtol=1e-4, atol=1e-5)
    assert one.ledger.to_dict() == alone.ledger.to_dict()


def test_a_dp_sgd_step_with_canaries_on_the_device_releases_as_on_the_cpu():
    """Canaries added to the joined clipped sum on the device (no restore) release what the
    CPU's in-place addition releases (no noise, so the two devices' releases compare), and the
    clipped sum given to the canaries is left as it was."""
    from torch import nn
    from torch.nn import functional as F

    from attacks.whitebox import GradientCanaries
    from privkit.mechanisms.dp_random import DpRandom
    from privkit.mechanisms.dp_sgd_step import DpSgdStep

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 6, generator=g), torch.randint(0, 3, (40,), generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    released = []
    for device in ("cpu", DEVICE):
        m = model.to(device)
        can = GradientCanaries.for_parameters(
            list(m.parameters()), 40, clip_norm=1.0, sample_rate=1.0, noise_multiplier=1.0, seed=2
        )
        step = DpSgdStep(1.0, 0.0, 1.0, 40)
        out = step.noisy_gradient(
            m,
            x.to(device),
            y.to(device),
            lambda lo, t, aux: F.cross_entropy(lo, t),
            DpRandom(torch.Generator().manual_seed(3)),
            canaries=can,
        )
        released.append({k: v.cpu() for k, v in out.items()})
        assert can.steps == 1
    for k in released[0]:
        torch.testing.assert_close(released[1][k], released[0][k], rtol=1e-5, atol=1e-6)


def test_canaries_coins_drawn_on_the_device_release_and_count_as_read_back(monkeypatch):
    """A seeded generator on the device: the canaries' coins kept there (added with zero weight
    where unsampled, counted with the release's copy) give the releases, the evidence and the
    appearances of the coins read back at once."""
    from torch import nn
    from torch.nn import functional as F

    from attacks import whitebox
    from attacks.whitebox import GradientCanaries
    from privkit.mechanisms import dp_sgd_step
    from privkit.mechanisms.dp_random import DpRandom
    from privkit.mechanisms.dp_sgd_step import DpSgdStep

    monkeypatch.setattr(whitebox, "joined_on", lambda device: True)  # the device's forms anywhere
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(60, 6, generator=g), torch.randint(0, 3, (60,), generator=g)
    runs = []
    for kept in (True, False):
        monkeypatch.setattr(dp_sgd_step, "_coins_on_device", lambda source, canaries, k=kept: k)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).to(DEVICE)
        can = GradientCanaries.for_parameters(
            list(model.parameters()), 40, clip_norm=1.0, sample_rate=0.3, noise_multiplier=1.0
        )
        step = DpSgdStep(1.0, 1.0, 0.3, 60)
        noise = DpRandom(torch.Generator(device=DEVICE).manual_seed(3), DEVICE)
        out = []
        for t in range(4):
            b = torch.arange(t * 10, t * 10 + 15)
            got = step.noisy_gradient(
                model,
                x[b].to(DEVICE),
                y[b].to(DEVICE),
                lambda lo, yy, aux: F.cross_entropy(lo, yy),
                noise,
                canaries=can,
            )
            out.append({k: v.cpu() for k, v in got.items()})
        runs.append((out, can.evidence(), can.appearances.copy()))
    (kept_out, kept_ev, kept_app), (back_out, back_ev, back_app) = runs
    for a, b in zip(kept_out, back_out):
        assert all(torch.equal(a[k], b[k]) for k in a)
    np.testing.assert_array_equal(kept_ev.projections, back_ev.projections)
    np.testing.assert_array_equal(kept_app, back_app)
    assert kept_app.sum() > 0


def test_grid_draws_made_ahead_on_the_device_are_rounded_gaussians():
    """The grid's draws made one release ahead on the device (its open draws' positions compacted
    there, copied to the host and back queued) equal rounded_gaussian's on a twin stream."""
    from privkit.mechanisms.device_random import ChaChaStream
    from privkit.mechanisms.dp_random import DpRandom, aes_generator
    from privkit.mechanisms.gaussian import gaussian_release
    from privkit.mechanisms.grid_noise import Grid, WordBits, rounded_gaussian, snap_add

    n = 200_000
    clean = torch.linspace(-1, 1, n, device=DEVICE)
    source = DpRandom(aes_generator(key=1), DEVICE, normals=ChaChaStream(DEVICE, key=4))
    twin = WordBits(ChaChaStream(DEVICE, key=4))
    grid = Grid.for_release(1.0, 1.0, n)
    for _ in range(3):
        got, _ = gaussian_release(clean, std=1.0, sensitivity=1.0, source=source)
        want = snap_add(clean, rounded_gaussian(grid.scale, n, twin), grid.gamma)
        assert torch.equal(got.cpu(), want.cpu())


@pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="CUDA's synchronisation check")
@pytest.mark.parametrize("noise", ["release", "seeded"])
def test_a_dp_sgd_step_with_canaries_never_waits_for_the_device(noise):
    """Past its first steps, a DP-SGD step on the GPU (ghost clipping, canaries, release noise
    drawn a release ahead or seeded noise with the canaries' coins kept there, the optimiser)
    makes no synchronising call: torch's synchronisation check set to raise."""
    from torch import nn
    from torch.nn import functional as F

    from attacks.whitebox import GradientCanaries
    from privkit.mechanisms.dp_random import DpRandom
    from privkit.mechanisms.dp_sgd_step import DpSgdStep

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 8, 8, generator=g).to(DEVICE)
    y = torch.randint(0, 4, (64,), generator=g).to(DEVICE)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.GroupNorm(2, 8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(512, 4),
    ).to(DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    can = GradientCanaries.for_parameters(
        list(model.parameters()), 100, clip_norm=1.0, sample_rate=0.1, noise_multiplier=1.0
    )
    source = (
        DpRandom.secret(DEVICE)
        if noise == "release"
        else DpRandom(torch.Generator(device=DEVICE).manual_seed(1), DEVICE)
    )
    step = DpSgdStep(1.0, 1.0, 0.1, 640)

    def one():
        step.apply(
            model, opt, x, y, lambda lo, t, aux: F.cross_entropy(lo, t), source, canaries=can
        )

    for _ in range(3):  # first passes: the row checks, the first draw, caches
        one()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            one()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert can.steps == 6


class _GramLayers(torch.nn.Module):
    """Layers whose norms ghost clipping takes by Gram matrices (few positions, wide maps), so
    that the clipped sum is formed by another kernel than the norms (a convolution's weight
    gradient by cuDNN, a linear map's by a matrix product): the case where a GPU's TF32 (cuDNN's
    default for float32 convolutions) could make the two disagree."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.conv = nn.Sequential(
            nn.Conv2d(3, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.ReLU(),
            nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
        )  # fmt: skip
        self.seq = nn.Linear(64, 256)
        self.head = nn.Linear(256, 4)

    def forward(self, x):
        h = self.conv(x).flatten(2).transpose(1, 2)  # (B, 16 positions, 64)
        return self.head(torch.relu(self.seq(h)).mean(1))


@pytest.mark.parametrize("precision", ["float32", "bfloat16-autocast", "bfloat16-model"])
def test_one_example_s_clipped_gradient_stays_within_the_clip_norm_on_the_device(precision):
    """On the device with torch's precision settings as they are (TF32 for cuDNN's float32
    convolutions by default on a GPU), in float32, under bfloat16 autocast and for a model held in
    bfloat16: each example alone contributes the clip norm (all are clipped), within float32
    rounding."""
    from torch.nn import functional as F

    from privkit.mechanisms import ghost_clipping
    from privkit.mechanisms.dp_sgd_step import clipped_gradient_sum

    torch.manual_seed(0)
    dtype = torch.bfloat16 if precision == "bfloat16-model" else torch.float32
    model = _GramLayers().to(DEVICE, dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 4, 4, generator=g).to(DEVICE, dtype)
    y = torch.randint(0, 4, (4,), generator=g).to(DEVICE)
    assert ghost_clipping._ghost(True, 1, 16, 64 * 9, 64)  # the conv's norms by Gram matrices
    autocast = torch.autocast(
        torch.device(DEVICE).type, dtype=torch.bfloat16, enabled=precision == "bfloat16-autocast"
    )
    for i in range(4):
        with autocast:
            got = clipped_gradient_sum(
                model,
                x[i : i + 1],
                y[i : i + 1],
                lambda lo, t, aux: F.cross_entropy(lo.float(), t),
                1e-3,
            )
        norm = float(torch.sqrt(sum(v.double().pow(2).sum() for v in got.values())))
        assert 1e-3 * (1 - 1e-5) <= norm <= 1e-3 * (1 + 1e-5)


@pytest.mark.parametrize("precision", ["float32", "bfloat16-autocast"])
def test_a_replayed_clipped_sum_on_the_device_is_the_step_s(precision):
    """``StepReplay`` on the device: Poisson-sized batches padded and replayed give the step's
    sums (up to float rounding: a GPU's atomic additions), and one record moves the replayed sum
    by the clip norm (every record clipped), under autocast too."""
    from torch.nn import functional as F

    from privkit.mechanisms.dp_sgd_step import clipped_gradient_sum
    from privkit.mechanisms.step_replay import StepReplay

    torch.manual_seed(0)
    model = _GramLayers().to(DEVICE)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(20, 3, 4, 4, generator=g).to(DEVICE)
    y = torch.randint(0, 4, (20,), generator=g).to(DEVICE)

    def loss(lo, t, aux):
        return F.cross_entropy(lo.float(), t)

    replay, clip = StepReplay(patience=0), 1e-3  # both sizes traced at their second steps
    autocast = torch.autocast(
        torch.device(DEVICE).type, dtype=torch.bfloat16, enabled=precision != "float32"
    )
    with autocast:
        for n in (17, 18, 17, 18, 17, 18):
            got = replay.clipped_sum(model, x[:n], y[:n], loss, clip)
            want = clipped_gradient_sum(model, x[:n], y[:n], loss, clip)
            assert all(torch.allclose(got[k], want[k], rtol=1e-4, atol=1e-7) for k in want)
        with_i = replay.clipped_sum(model, x[:18], y[:18], loss, clip)
        without = replay.clipped_sum(model, x[:17], y[:17], loss, clip)
    assert replay.replayed >= 4 and not replay.refused
    d = float(torch.sqrt(sum((with_i[k] - without[k]).double().pow(2).sum() for k in with_i)))
    assert clip * 0.9 < d <= clip * (1 + 1e-5)
