"""DP-SGD's clipped sum in half precision: under autocast (mixed precision) and of a model held in
bfloat16, on the CPU's bfloat16.

Under ``torch.autocast`` a layer's output, and so its output gradient, is half precision while
its parameters are float32; a model held in bfloat16 has all three in it. An example's norm and
its contribution to the sum must come from the same values, in float32 or wider, or the
contribution exceeds the clip norm that calibrates the noise: in half precision the norms missed
by up to 0.4% (autocast) and 0.7% (a bfloat16 model), and convolutions did not run. Here, for
the models of ``benchmarks/dpsgd_step.py`` (book-keeping ghost clipping), privkit's own models
(the stacked layers) and a model only ``torch.func`` clips: each example alone contributes at
most the clip norm (up to float32 rounding), the sums come in float32 (the parameters' dtype
under autocast) and agree with the float32 step's to half precision, a model that mixes its
examples is still refused under autocast, the first pass's checks, taken in full precision on a
pass of their own, leave the random state as they found it, and whole steps (release noise,
canaries, an empty batch) keep each parameter's dtype.
"""

import importlib.util
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from privkit.mechanisms import dp_sgd_step, ghost_clipping
from privkit.mechanisms.dp_sgd_step import clipped_gradient_sum
from privkit.mechanisms.stacked import UnsupportedModelError
from privkit.models import build_model

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
from dpsgd_step import _per_example_loss, batch, build  # noqa: E402  (the benchmarks folder)

MODELS = ["resnet_small", "transformer", "encoder", "vit", "lm", "lstm", "gpt2"]
#: every model in the CPU's forms, and the models with convolutions (the GPU forms differ from
#: the CPU's for convolutions only) in a GPU's too
FORMS = [
    *(pytest.param(n, False, id=f"{n}-cpu-form") for n in MODELS),
    *(pytest.param(n, True, id=f"{n}-gpu-form") for n in ("resnet_small", "vit")),
]


def _bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _model(name: str):
    if name == "gpt2" and importlib.util.find_spec("transformers") is None:
        pytest.skip("HF transformers is not installed")
    torch.manual_seed(0)
    model, _, _ = build(name)
    x, y = batch(name, 6, torch.device("cpu"))
    return model, x, y


def _norm(sums: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(v.double().pow(2).sum()) for v in sums.values()))


@pytest.mark.parametrize("name, gpu_form", FORMS)
def test_one_example_contributes_at_most_the_clip_norm(name, gpu_form, monkeypatch):
    if gpu_form:
        monkeypatch.setattr(ghost_clipping, "_offsets_on", lambda device: True)
    model, x, y = _model(name)
    clip = 1e-3  # below every example's norm: each is scaled to the clip norm
    dtypes = {p.dtype for p in model.parameters()}
    for i in range(4):
        with _bf16():
            got = clipped_gradient_sum(model, x[i : i + 1], y[i : i + 1], _per_example_loss, clip)
        assert {v.dtype for v in got.values()} == dtypes
        assert _norm(got) <= clip * (1 + 1e-5)
        assert _norm(got) >= clip * (1 - 1e-5)  # clipped, not lost


def _sgd_gradient(model, x, y, amp: bool) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        loss = _per_example_loss(model(x), y, None)
    loss.backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("name", MODELS)
def test_the_sum_is_the_full_precision_one_as_sgd_s_gradient_is(name):
    """The batch's clipped sum under autocast against the float32 step's: as close as plain
    training's gradient under autocast is to its float32 one (bfloat16's 8 bits through the
    model: 0.4% for the transformer block, 3.5% for the GroupNorm ResNet), within a factor 2."""
    model, x, y = _model(name)
    want = clipped_gradient_sum(model, x, y, _per_example_loss, 1.0)
    with _bf16():
        got = clipped_gradient_sum(model, x, y, _per_example_loss, 1.0)
    assert list(got) == list(want)
    plain, half = _sgd_gradient(model, x, y, False), _sgd_gradient(model, x, y, True)
    sgd_error = _norm({k: half[k] - plain[k] for k in plain}) / _norm(plain)
    assert _norm({k: got[k] - want[k] for k in want}) < (2 * sgd_error + 1e-3) * _norm(want)


def _own_loss(logits, y, _aux):
    return F.cross_entropy(logits, y)


@pytest.mark.parametrize("arch, shape", [("mlp", (1, 8, 8)), ("cnn", (1, 28, 28))])
def test_privkit_s_own_models_clip_in_full_precision_under_autocast(arch, shape):
    """The stacked layers run with autocast off: the float32 step's sums, bit for bit."""
    torch.manual_seed(1)
    model = build_model(arch, shape, 10)
    x, y = torch.randn(5, *shape), torch.randint(0, 10, (5,))
    want = clipped_gradient_sum(model, x, y, _own_loss, 0.5)
    with _bf16():
        got = clipped_gradient_sum(model, x, y, _own_loss, 0.5)
    assert all(torch.equal(got[k], want[k]) for k in want)


class Mixing(nn.Module):
    """Subtracts the batch's mean: each example's output depends on the others."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h - 0.05 * h.mean(0, keepdim=True))


def test_a_model_mixing_its_examples_is_refused_under_autocast():
    """The row check runs in full precision: a mean over the batch weighted 5% still fails it
    (half precision's own tolerance, 8 units of bfloat16 or 6%, would have let it pass)."""
    torch.manual_seed(2)
    model, x, y = Mixing(), torch.randn(32, 6), torch.randint(0, 3, (32,))
    with _bf16(), pytest.raises(UnsupportedModelError, match="rows are not the batch"):
        ghost_clipping.clipped_sum(
            model, x, lambda lo, s: F.cross_entropy(lo.float(), y[s], reduction="none"), 1.0
        )


class Dropping(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.b(F.dropout(torch.relu(self.a(x)), 0.5, training=True))


def test_the_full_precision_checks_leave_the_random_state_as_they_found_it():
    """The first step (its checks on a pass of their own) and a later one from the same random
    state draw the same dropout: the same sums, the same state after."""
    torch.manual_seed(3)
    model, x, y = Dropping(), torch.randn(8, 6), torch.randint(0, 3, (8,))
    runs = []
    for _ in range(2):
        torch.manual_seed(4)
        with _bf16():
            sums = clipped_gradient_sum(model, x, y, _own_loss, 0.5)
        runs.append((sums, torch.get_rng_state()))
    (first, state1), (second, state2) = runs
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert torch.equal(state1, state2)


class TorchFuncOnly(nn.Module):
    """A weight read twice by the model's own code: ghost clipping refuses it, torch.func clips."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(10, 6) * 0.3)
        self.head = nn.Linear(10, 3)

    def forward(self, x):
        return self.head(torch.tanh(x @ self.w.T * self.w.sum()))


def test_the_torch_func_fallback_under_autocast_stays_within_the_clip_norm():
    torch.manual_seed(5)
    model, x, y = TorchFuncOnly(), torch.randn(4, 6), torch.randint(0, 3, (4,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dp_sgd_step.ClippingFallbackWarning)
        for i in range(4):
            with _bf16():
                got = clipped_gradient_sum(model, x[i : i + 1], y[i : i + 1], _own_loss, 1e-3)
            assert {v.dtype for v in got.values()} == {torch.float32}
            assert _norm(got) <= 1e-3 * (1 + 1e-5)


def test_a_dp_sgd_step_with_canaries_under_autocast_keeps_float32():
    """A whole step (release noise, white-box canaries) under autocast: the parameters stay
    float32, the canaries observe every release."""
    from attacks.whitebox import GradientCanaries
    from privkit.mechanisms.dp_random import DpRandom

    model, x, y = _model("transformer")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = dp_sgd_step.DpSgdStep(1.0, 1.0, 6 / 1000, 1000)
    canaries = GradientCanaries.for_parameters(
        list(model.parameters()), 20, clip_norm=1.0, sample_rate=6 / 1000, noise_multiplier=1.0
    )
    source = DpRandom.secret("cpu")
    for _ in range(3):
        with _bf16():
            step.apply(model, opt, x, y, _per_example_loss, source, canaries=canaries)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert canaries.steps == 3


def _bf16_model(name: str):
    model, x, y = _model(name)
    model = model.to(torch.bfloat16)
    return model, (x.to(torch.bfloat16) if x.is_floating_point() else x), y


def _float_loss(logits, y, aux):
    return _per_example_loss(logits.float(), y, aux)


@pytest.mark.parametrize("name, gpu_form", FORMS)
def test_a_bfloat16_model_s_example_contributes_at_most_the_clip_norm(name, gpu_form, monkeypatch):
    """Norms and sums in float32 from the bfloat16 inputs and output gradients: the sums come in
    float32 (the noise is added there; the optimiser's gradient is rounded to bfloat16 after)."""
    if gpu_form:
        monkeypatch.setattr(ghost_clipping, "_offsets_on", lambda device: True)
    model, x, y = _bf16_model(name)
    for i in range(3):
        got = clipped_gradient_sum(model, x[i : i + 1], y[i : i + 1], _float_loss, 1e-3)
        assert {v.dtype for v in got.values()} == {torch.float32}
        assert 1e-3 * (1 - 1e-5) <= _norm(got) <= 1e-3 * (1 + 1e-5)


def test_a_bfloat16_model_only_torch_func_clips_stays_within_the_clip_norm():
    torch.manual_seed(6)
    model = TorchFuncOnly().to(torch.bfloat16)
    x, y = torch.randn(3, 6, dtype=torch.bfloat16), torch.randint(0, 3, (3,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dp_sgd_step.ClippingFallbackWarning)
        for i in range(3):
            got = clipped_gradient_sum(model, x[i : i + 1], y[i : i + 1], _float_loss, 1e-3)
            assert {v.dtype for v in got.values()} == {torch.float32}
            assert _norm(got) <= 1e-3 * (1 + 1e-5)


@pytest.mark.parametrize("noise", ["release", "seeded"])
def test_a_dp_sgd_step_of_a_bfloat16_model_keeps_bfloat16(noise):
    """Release or seeded noise, canaries, an empty batch (noise alone, drawn in float32): the
    parameters stay bfloat16 and finite, the canaries observe every release."""
    from attacks.whitebox import GradientCanaries
    from privkit.mechanisms.dp_random import DpRandom

    model, x, y = _bf16_model("lm")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = dp_sgd_step.DpSgdStep(1.0, 1.0, 6 / 1000, 1000)
    canaries = GradientCanaries.for_parameters(
        list(model.parameters()), 20, clip_norm=1.0, sample_rate=6 / 1000, noise_multiplier=1.0
    )
    source = (
        DpRandom.secret("cpu")
        if noise == "release"
        else DpRandom(torch.Generator().manual_seed(1), torch.device("cpu"))
    )
    for batch_ in (slice(None), slice(0), slice(None)):
        step.apply(model, opt, x[batch_], y[batch_], _float_loss, source, canaries=canaries)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert canaries.steps == 3
