"""torch's own layers without a ghost-clipping rule (privkit.mechanisms.ghost_layer_vjp): their
per-example gradients from torch.func on the layer alone, the model's other layers ghost-clipped.

Against ``torch.func``'s per-example gradients of the whole model (float64, the clip norm between
the examples' norms, every way of the other layers' norms): EmbeddingBag in ``max`` mode, once
and twice, and a stand-in for any other such layer (a gate per channel, in torch's namespace) on
volumes and sequences; clipping off
gives the plain sum; only the layer's own gradients are materialised. A call that cannot be
recomputed as the forward pass made it (keyword arguments, two inputs, a tuple output, buffers
updated in training mode, a call vmap cannot batch) and a layer that mixes examples are refused,
and DP-SGD's clipping
falls back to ``torch.func`` for the whole model; BatchNorm on the batch's statistics is refused
by DP-SGD's step in one line; under autocast and in bfloat16 an example alone contributes the
clip norm.
"""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from privkit.mechanisms import dp_sgd_step, ghost_clipping, ghost_layer_vjp
from privkit.mechanisms.stacked import UnsupportedModelError
from tests.privkit.test_ghost_clipping import (
    Bags,
    _check,
    _example_losses,
    _loss,
    clipping_off_is_the_plain_sum,
    falls_back,
)
from tests.privkit.test_ghost_half_precision import _norm

#: vmap has no batching rule for EmbeddingBag and loops over the examples, saying so
_NO_BATCHING_RULE = "There is a performance drop"


class ChannelGate(nn.Module):
    """``tanh(x) * w`` per channel (dimension 1): a stand-in for a layer of torch's own without a
    rule (torch's namespace, as its layers have; a model's own module would take stand-ins)."""

    __module__ = "torch.nn.modules.gate"

    def __init__(self, channels: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(channels))

    def forward(self, x):
        return torch.tanh(x) * self.weight.view(1, -1, *[1] * (x.dim() - 2))


def _volumes():
    return nn.Sequential(
        nn.Conv3d(2, 4, 3, padding=1, stride=2),
        nn.GroupNorm(2, 4),
        ChannelGate(4),
        nn.ConvTranspose3d(4, 2, 2, stride=2, groups=2, bias=False),
        nn.Flatten(),
        nn.LazyLinear(3),
    ), torch.randn(7, 2, 5, 5, 5)


CASES = {
    "volumes": _volumes,
    "gate-on-sequences": lambda: (
        nn.Sequential(
            nn.Linear(5, 6), nn.Unflatten(1, (2, 3)), ChannelGate(2), nn.Flatten(), nn.Linear(6, 3)
        ),
        torch.randn(7, 5),
    ),
    "bag-max": lambda: (Bags("max"), torch.randint(0, 20, (7, 4))),
    "bag-max-twice": lambda: (Bags("max", twice=True), torch.randint(0, 20, (7, 4))),
}


def _built(case: str):
    torch.manual_seed(sorted(CASES).index(case))
    model, x = CASES[case]()
    model(x)  # a lazy layer's shape
    return model, x, torch.randint(0, 3, (x.shape[0],))


def _taken(model) -> set[str]:
    """The layer types ghost_layer_vjp takes in ``model``."""
    return {type(layer.module).__name__ for layer in ghost_clipping._layers(model) if layer.vjp}


@pytest.mark.parametrize("case", sorted(CASES))
def test_torchs_other_layers_against_torch_func(case, monkeypatch):
    model, x, y = _built(case)
    assert _taken(model), "the layer under test is not taken by ghost_layer_vjp"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=_NO_BATCHING_RULE)
        _check(model, x, y, monkeypatch)
        model = model.float()
        # DP-SGD's step takes this path: no fallback warning, no torch.func
        monkeypatch.setattr(dp_sgd_step, "per_sample_gradients", None)
        dp_sgd_step.clipped_gradient_sum(
            model, x.float() if x.is_floating_point() else x, y, _loss, 1.0
        )


@pytest.mark.parametrize("case", ["volumes", "bag-max-twice", "gate-on-sequences"])
def test_clipping_off_is_the_plain_sum(case):
    model, x, y = _built(case)
    model = model.double()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_BATCHING_RULE)
        clipping_off_is_the_plain_sum(model, x.double() if x.is_floating_point() else x, y)


def test_only_the_layers_own_gradients_are_materialised(monkeypatch):
    """A wide linear layer after an EmbeddingBag (its largest values, ``max`` mode: no rule of its
    own): the bag's per-example gradients are formed, the
    linear layer's norms by its Gram matrices (over a sequence, past the materialise limit),
    never per example."""
    torch.manual_seed(3)
    model = nn.Sequential(
        nn.EmbeddingBag(20, 64, mode="max"),
        nn.Unflatten(1, (4, 16)),
        nn.Linear(16, 16),
        nn.Flatten(),
        nn.Linear(64, 3),
    )
    formed = []
    per_example = ghost_layer_vjp.per_example
    monkeypatch.setattr(
        ghost_layer_vjp,
        "per_example",
        lambda m, keys, *a: formed.append((type(m).__name__, keys)) or per_example(m, keys, *a),
    )
    monkeypatch.setattr(ghost_clipping, "MATERIALISE_LIMIT", 0)
    x, y = torch.randint(0, 20, (5, 6)), torch.randint(0, 3, (5,))
    layers = ghost_clipping._layers(model)
    norms = ghost_clipping.per_example_norms(model, x, _example_losses(y))
    assert formed == [("EmbeddingBag", ["weight"])]
    assert sum(layer.vjp for layer in layers) == 1
    per = dp_sgd_step.per_sample_gradients(model, x, y, _loss)
    want = sum(g.reshape(5, -1).pow(2).sum(1) for g in per.values()).sqrt()
    torch.testing.assert_close(norms, want, rtol=1e-5, atol=0)


class Keyword(nn.Module):
    """An EmbeddingBag called with per-sample weights by keyword."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 4, mode="sum")
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.bag(x, per_sample_weights=(x % 2 + 1).to(torch.float64)))


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.mix = nn.Bilinear(4, 4, 3)

    def forward(self, x):
        return self.mix(x, torch.tanh(x))


class PairGate(ChannelGate):
    """A gate whose call returns a pair (as an LSTM cell's ``(h, c)``)."""

    __module__ = ChannelGate.__module__

    def forward(self, x):
        out = super().forward(x)
        return out, 2 * out


class CellStates(nn.Module):
    """A pair-returning layer's first output to a linear head."""

    def __init__(self):
        super().__init__()
        self.gate = PairGate(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.gate(x)[0])


class ZeroStart(ChannelGate):
    """A gate writing its output into zeros it makes in its call (as an RNN cell called on its
    input alone makes its zero state): vmap cannot write a batched value into them."""

    __module__ = ChannelGate.__module__

    def forward(self, x):
        out = torch.zeros(x.shape, dtype=x.dtype)
        return out.copy_(super().forward(x))


class BatchMeanGate(ChannelGate):
    """A gate that centres its input on the batch's mean: it mixes examples."""

    __module__ = ChannelGate.__module__

    def forward(self, x):
        return super().forward(x - x.mean(0, keepdim=True))


class CountingGate(ChannelGate):
    """A gate counting its calls in a buffer in training mode: its call is not recomputed."""

    __module__ = ChannelGate.__module__

    def __init__(self, channels: int):
        super().__init__(channels)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        if self.training:
            self.calls += 1
        return super().forward(x)


@pytest.mark.parametrize(
    "build, x, why",
    [
        (Keyword, torch.randint(0, 10, (6, 3)), "keyword arguments"),
        (TwoInputs, torch.randn(6, 4), "without its one positional input"),
        (CellStates, torch.randn(6, 4), "returns tuple, not one tensor"),
        (
            lambda: nn.Sequential(CountingGate(2), nn.Flatten(), nn.Linear(8, 3)),
            torch.randn(6, 2, 4),
            "training mode with buffers",
        ),
        (
            lambda: nn.Sequential(
                nn.Conv2d(2, 3, 2),
                nn.InstanceNorm2d(3, affine=True, track_running_stats=True),
                nn.Flatten(),
            ),
            torch.randn(6, 2, 3, 3),
            "training mode with running statistics",
        ),
        (
            # first: no layer before it, whose output rows the mixing would show to the rows check
            lambda: nn.Sequential(BatchMeanGate(2), nn.Flatten(), nn.Linear(8, 3)),
            torch.randn(6, 2, 4),
            "mixes examples",
        ),
    ],
    ids=[
        "keyword",
        "two-inputs",
        "tuple-output",
        "buffers",
        "running-statistics",
        "mixes-examples",
    ],
)
def test_calls_it_cannot_recompute_are_refused_and_fall_back(build, x, why):
    torch.manual_seed(4)
    model = build().double()
    x = x.double() if x.is_floating_point() else x
    y = torch.randint(0, 3, (6,))
    for _ in range(2):  # the row and output checks' refusal is remembered for the model
        with pytest.raises(UnsupportedModelError, match=why):
            ghost_clipping.clipped_sum(model, x, _example_losses(y), 1.0)
    # torch.func clips the first two (the others: the statistics it would update are the step's
    # own, a batch of one each; an LSTM cell's zero state, made inside its call, is not vmap's;
    # the mixing layer on one example alone gives every example the same norm)
    if why in ("keyword arguments", "without its one positional input"):
        falls_back(model, x, y, why)


def each_record_alone_is_clipped_to_the_norm(model, x, y, precision: str) -> None:
    """Under bfloat16 autocast (``precision`` "autocast") or with the model and inputs in
    bfloat16: each of three records alone gives a float32 clipped sum of the clip norm, its norm
    and its contribution formed from the same float32 values."""
    if precision == "bfloat16":
        model = model.to(torch.bfloat16)
        x = x.to(torch.bfloat16) if x.is_floating_point() else x
    for i in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
            got = dp_sgd_step.clipped_gradient_sum(
                model,
                x[i : i + 1],
                y[i : i + 1],
                lambda lo, t, _a: F.cross_entropy(lo.float(), t),
                1e-3,
            )
        assert {v.dtype for v in got.values()} == {torch.float32}
        assert 1e-3 * (1 - 1e-5) <= _norm(got) <= 1e-3 * (1 + 1e-5)


@pytest.mark.parametrize("precision", ["autocast", "bfloat16"])
def test_an_example_alone_contributes_the_clip_norm_in_half_precision(precision):
    """The layer's per-example gradients and their sum from the same float32 values."""
    each_record_alone_is_clipped_to_the_norm(*_built("volumes"), precision)


@pytest.mark.parametrize(
    "training, running",
    [(True, True), (True, False), (False, False)],
    ids=["train", "train-no-stats", "eval-no-stats"],
)
def test_batch_norm_on_the_batchs_statistics_is_refused(training, running):
    """BatchNorm normalising by the batch's statistics (training mode, or eval mode without
    running statistics) mixes the examples: ghost clipping refuses it, and DP-SGD's step refuses
    the model in one line rather than clipping each example's gradient of another function
    (``torch.func`` on one example alone); in eval mode on running statistics it is taken."""
    from privkit.errors import PrivkitError

    torch.manual_seed(5)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3),
        nn.BatchNorm2d(3, track_running_stats=running),
        nn.Flatten(),
        nn.Linear(27, 3),
    ).train(training)
    x, y = torch.randn(6, 2, 5, 5), torch.randint(0, 3, (6,))
    with pytest.raises(UnsupportedModelError, match=r"BatchNorm2d .*mixes the examples"):
        ghost_clipping.clipped_sum(model, x, _example_losses(y), 1.0)
    with pytest.raises(
        PrivkitError, match=r"1 BatchNorm layer\(s\) using batch statistics \(1 \(BatchNorm2d\)\)"
    ):
        dp_sgd_step.clipped_gradient_sum(model, x, y, _loss, 1.0)
    if running:
        model.eval()
        assert ghost_clipping._layers(model)  # taken (by a rule of its own)
        dp_sgd_step.clipped_gradient_sum(model, x, y, _loss, 1.0)


def test_instance_norm_keeping_running_statistics_is_refused():
    """InstanceNorm in training mode with running statistics normalises each example by its own
    statistics but averages the batch's into buffers released with the model: DP-SGD's step
    refuses the model in one line (torch.func would clip right and leave them in the model), and
    the buffers it refuses to train are the ones a step would have moved; in eval mode, or
    without running statistics, it is taken and the buffers stay as they were."""
    from privkit.errors import PrivkitError

    torch.manual_seed(8)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3),
        nn.InstanceNorm2d(3, affine=True, track_running_stats=True),
        nn.Flatten(),
        nn.Linear(27, 3),
    )
    x, y = torch.randn(6, 2, 5, 5), torch.randint(0, 3, (6,))
    before = model[1].running_mean.clone()
    model(x)  # a plain forward pass moves the buffers: the batch's statistics kept
    assert not torch.equal(model[1].running_mean, before)
    moved = model[1].running_mean.clone()
    with pytest.raises(
        PrivkitError,
        match=r"Sequential: 1 InstanceNorm layer\(s\) keeping running statistics in training "
        r"mode \(1 \(InstanceNorm2d\)\)",
    ):
        dp_sgd_step.clipped_gradient_sum(model, x, y, _loss, 1.0)
    model.eval()
    dp_sgd_step.clipped_gradient_sum(model, x, y, _loss, 1.0)
    assert torch.equal(model[1].running_mean, moved)
    free = nn.Sequential(nn.Conv2d(2, 3, 3), nn.InstanceNorm2d(3, affine=True), nn.Flatten())
    free.append(nn.Linear(27, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # taken by ghost clipping's rule, no fallback
        dp_sgd_step.clipped_gradient_sum(free, x, y, _loss, 1.0)


def test_a_call_vmap_cannot_batch_is_refused_and_remembered(monkeypatch):
    """A layer writing into zeros it makes inside its call, which vmap cannot batch: the first
    pass's check of its rows refuses the model, and later steps refuse it at once (no pass taken);
    a layer whose vjp cannot be batched (the check passed) is refused by the norms and, clipping
    off, by the batched vjp, and remembered too."""
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(5, 4), ZeroStart(4), nn.Linear(4, 3))
    x, y = torch.randn(7, 5), torch.randint(0, 3, (7,))
    with pytest.raises(UnsupportedModelError, match=r"ZeroStart does not take torch\.func's vmap"):
        ghost_clipping.per_example_norms(model, x, _example_losses(y))
    passes = []
    monkeypatch.setattr(ghost_clipping, "_forward_backward", lambda *a: passes.append(a))
    with pytest.raises(UnsupportedModelError, match="ZeroStart does not take"):
        ghost_clipping.clipped_sum(model, x, _example_losses(y), 1.0)
    assert not passes
    monkeypatch.undo()

    def failing(*_args, **_kwargs):
        raise RuntimeError("no batching rule")

    monkeypatch.setattr(ghost_layer_vjp, "vjp", failing)
    gated, xt, yt = _built("gate-on-sequences")
    with pytest.raises(ghost_layer_vjp.NotPerExample, match="ChannelGate does not take"):
        ghost_clipping.per_example_norms(gated, xt, _example_losses(yt))
    gated, xt, yt = _built("gate-on-sequences")
    with pytest.raises(ghost_layer_vjp.NotPerExample, match="ChannelGate does not take"):
        ghost_clipping.clipped_sum(gated, xt, _example_losses(yt), math.inf)
    with pytest.raises(UnsupportedModelError, match="ChannelGate does not take"):
        ghost_clipping.clipped_sum(gated, xt, _example_losses(yt), math.inf)
    with pytest.raises(UnsupportedModelError, match="ChannelGate does not take"):
        ghost_clipping.clipped_sum(gated, xt, _example_losses(yt), math.inf)
