"""Book-keeping ghost clipping (privkit.mechanisms.ghost_clipping) against torch.func.

For every layer it covers (linear on rows and on sequences, by the Gram matrices and by the
materialised per-example gradient; 2-d and 1-d convolutions of both kinds, grouped and depthwise
ones, and their paddings, chosen by hand and sixty of random geometry; GroupNorm, LayerNorm,
RMSNorm, embeddings with repeated and padding tokens) and for whole models (a GroupNorm ResNet, a
transformer block, forty-five random stacks of sequence layers), the per-example norms and the
flat-clipped sum equal ``torch.func``'s per-example gradients clipped by ``clip_per_sample``
(float64, clip norm between the examples' norms). A layer it does not cover raises
``UnsupportedModelError`` and ``clipped_gradient_sum`` falls back to ``torch.func``; so does a
model whose layer outputs' rows are not its examples (the row check).
"""

import math
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from privkit.mechanisms import dp_sgd_step, ghost_clipping, mutations
from privkit.mechanisms.stacked import UnsupportedModelError


def _loss(logits, y, _aux):
    return F.cross_entropy(logits, y)


def _example_losses(y):
    return lambda logits, s: F.cross_entropy(logits, y[s], reduction="none")


def _reference(model, x, y, loss=_loss):
    per = dp_sgd_step.per_sample_gradients(model, x, y, loss)
    norms = dp_sgd_step.clip_per_sample(per, 1.0)[1]
    # the clip norm at the geometric middle of the widest gap between consecutive norms: some
    # examples clipped and some not, with the most room either side (a median can sit within 1%
    # of its neighbour)
    ordered = norms.sort().values
    widest = int((ordered[1:] / ordered[:-1]).argmax())
    clip = math.sqrt(ordered[widest].item() * ordered[widest + 1].item())
    clipped, _ = dp_sgd_step.clip_per_sample(per, clip)
    assert (norms > clip * 1.01).any() and (norms < clip * 0.99).any()
    return norms, clip, {k: g.sum(0) for k, g in clipped.items()}


def falls_back(model, x, y, why):
    """DP-SGD's clipping of ``model`` falls back to ``torch.func`` (its warning naming ``why``),
    with ``torch.func``'s clipped sum."""
    _, clip, want = _reference(model, x, y)
    with pytest.warns(dp_sgd_step.ClippingFallbackWarning, match=why):
        got = dp_sgd_step.clipped_gradient_sum(model, x, y, _loss, clip)
    for k in want:
        torch.testing.assert_close(got[k], want[k])


def _check(model, x, y, monkeypatch, loss=_loss, example_losses=_example_losses):
    """Both ways of every weight's norms: materialised per-example gradients (the default for
    these small layers; a convolution's by one grouped convolution, the CPU's form, and by a GPU's
    forms: its input unfolded, or offset by offset past the unfold limit) and the ghost norm
    (wherever its Gram matrices are the smaller), on the CPU's form and a GPU's. ``loss`` is one
    record's loss (for torch.func), ``example_losses(y)`` the batch's per-record losses."""
    model = model.double()
    x = x.double() if x.is_floating_point() else x
    norms, clip, want = _reference(model, x, y, loss)
    materialise, unfold = ghost_clipping.MATERIALISE_LIMIT, ghost_clipping.UNFOLD_LIMIT
    # (materialise limit, GPU forms, unfold limit): the CPU's forms; a GPU's with the input
    # unfolded and offset by offset; the ghost norm, on the CPU's and on both GPU forms
    ways = [(materialise, False, unfold), (materialise, True, unfold), (materialise, True, 0)]
    ways += [(0, False, unfold), (0, True, unfold), (0, True, 0)]
    for limit, gpu_forms, unfold_limit in ways:
        monkeypatch.setattr(ghost_clipping, "MATERIALISE_LIMIT", limit)
        monkeypatch.setattr(ghost_clipping, "UNFOLD_LIMIT", unfold_limit)
        monkeypatch.setattr(ghost_clipping, "_offsets_on", lambda device, on=gpu_forms: on)
        got_norms = ghost_clipping.per_example_norms(model, x, example_losses(y))
        torch.testing.assert_close(got_norms, norms, rtol=1e-10, atol=1e-12)
        got = ghost_clipping.clipped_sum(model, x, example_losses(y), clip)
        assert list(got) == list(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12, msg=k)
    return got


class Seq(nn.Module):
    """A linear layer over a sequence, mean-pooled to logits."""

    def __init__(self, d_in, d_out, classes=3):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)
        self.head = nn.Linear(d_out, classes)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(x)).mean(1))


@pytest.mark.parametrize(
    "t, d_in, d_out",
    [(1, 5, 4), (3, 16, 16), (12, 3, 4)],  # one position; Gram matrices (limit 0); materialised
)
def test_linear_rows_and_sequences(t, d_in, d_out, monkeypatch):
    torch.manual_seed(0)
    _check(Seq(d_in, d_out), torch.randn(7, t, d_in), torch.randint(0, 3, (7,)), monkeypatch)


def test_linear_with_frozen_weight_and_no_bias(monkeypatch):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 5, bias=False), nn.ReLU(), nn.Linear(5, 3))
    model[2].weight.requires_grad_(False)
    got = _check(model, torch.randn(8, 6), torch.randint(0, 3, (8,)), monkeypatch)
    assert set(got) == {"0.weight", "2.bias"}


class Conv(nn.Module):
    def __init__(self, conv, size):
        super().__init__()
        self.conv = conv
        # a square (or 1-d) input of this size, or this shape
        shape = (
            size
            if isinstance(size, tuple)
            else (size,) * {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}[type(conv)]
        )
        with torch.no_grad():
            n = conv(torch.zeros(1, conv.in_channels, *shape)).numel()
        self.head = nn.Linear(n, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.conv(x)).flatten(1))


@pytest.mark.parametrize(
    "conv, size",
    [
        (nn.Conv2d(2, 3, 3, padding=1), 6),  # few channels, large map: always materialised
        (nn.Conv2d(8, 8, 3, padding=1, bias=False), 2),  # many channels, small map: ghost at 0
        (nn.Conv2d(2, 4, (3, 2), stride=2, dilation=(1, 2), padding=(1, 0)), 7),
        (nn.Conv2d(8, 8, 3, stride=2, dilation=2, padding=(2, 1)), 6),  # strided ghost at 0
        (nn.Conv2d(2, 3, (3, 2), dilation=2, padding=(1, 2)), 7),
        (nn.Conv2d(2, 3, 4, padding="same"), 5),  # asymmetric "same" padding
        (nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect"), 5),
        (nn.Conv2d(4, 6, 3, padding=1, groups=2), 5),  # grouped
        (nn.Conv2d(4, 8, 3, stride=2, padding=1, groups=4, bias=False), 6),  # depthwise, x2
        (nn.Conv1d(2, 3, 3, padding=1), 9),
        (nn.Conv1d(8, 8, 3, stride=2, dilation=2, padding=2), 8),  # strided ghost at 0
        (nn.Conv1d(2, 3, 4, padding="same"), 7),
        (nn.Conv1d(2, 3, 3, padding=2, padding_mode="circular"), 7),
        (nn.Conv1d(6, 6, 5, padding=2, groups=6), 8),  # depthwise
        # 3-d: materialised on every device
        (nn.Conv3d(2, 3, 3, padding=1), 4),
        (nn.Conv3d(2, 4, (3, 2, 2), stride=(2, 1, 2), dilation=(1, 2, 1), padding=(1, 0, 1)), 5),
        (nn.Conv3d(2, 3, 2, padding="same"), 4),
        (nn.Conv3d(2, 3, 3, padding=1, padding_mode="replicate"), 4),
        (nn.Conv3d(4, 4, 3, padding=1, groups=4, bias=False), 4),  # depthwise
    ],
)
def test_convolutions(conv, size, monkeypatch):
    torch.manual_seed(2)
    conv.reset_parameters()  # the same weights whatever the tests collected before drew
    shape = (size,) * {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}[type(conv)]
    _check(
        Conv(conv, size),
        torch.randn(6, conv.in_channels, *shape),
        torch.randint(0, 3, (6,)),
        monkeypatch,
    )


@pytest.mark.parametrize(
    "conv, size",
    [
        (nn.Conv2d(3, 4, 3, padding=1), 6),
        (nn.Conv2d(2, 4, (3, 2), stride=2, dilation=(1, 2), padding=(1, 0)), 7),
        (nn.Conv2d(2, 3, 4, padding="same"), 5),
        (nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect"), 5),
        (nn.Conv2d(2, 3, 1, stride=2), 5),
    ],
)
@pytest.mark.parametrize("channels_last", [False, True])
def test_unfolded_input_is_f_unfold(conv, size, channels_last, monkeypatch):
    """The GPU form's unfolded input (one strided view copied) is ``F.unfold`` of the padded
    input, bit for bit, whatever the input's memory layout."""
    torch.manual_seed(4)
    a = torch.randn(5, conv.in_channels, size, size)
    if channels_last:
        a = a.contiguous(memory_format=torch.channels_last)
    monkeypatch.setattr(ghost_clipping, "_offsets_on", lambda device: True)
    geometry = ghost_clipping._conv_of(conv, a, conv(a))
    got = ghost_clipping._unfolded(*geometry)
    padded, padding = ghost_clipping._padded(geometry[0], a)
    want = F.unfold(padded, conv.kernel_size, conv.dilation, padding, conv.stride)
    assert got is not None and torch.equal(got, want)


def _random_convolution(
    rng: random.Random, volume: bool = False
) -> tuple[nn.Module, tuple[int, ...]] | None:
    """A convolution of random geometry (1-d or 2-d, or with ``volume`` 3-d; kernel, stride,
    dilation, integer, tuple, "same" or "valid" padding, every padding mode, groups, depthwise,
    bias or not) and an input shape it accepts, or None where torch refuses the draw."""
    one_d = not volume and rng.random() < 0.4
    dims = 3 if volume else 1 if one_d else 2
    groups = rng.choice([1, 1, 1, 2, 3])
    c_in, c_out = groups * rng.randint(1, 3), groups * rng.randint(1, 3)
    if rng.random() < 0.2:  # depthwise
        groups = c_out = c_in
    pair = (
        (lambda lo, hi: rng.randint(lo, hi))
        if one_d
        else (lambda lo, hi: tuple(rng.randint(lo, hi) for _ in range(dims)))
    )
    mode = rng.choice(["zeros", "zeros", "reflect", "replicate", "circular"])
    if rng.random() < 0.25:
        padding, stride = rng.choice(["same", "valid"]), pair(1, 1)
        mode = "zeros" if padding == "valid" else mode
    else:
        padding, stride = pair(0, 2), pair(1, 3)
    cls = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
    shape = tuple(rng.randint(3, 9 if dims < 3 else 6) for _ in range(dims))
    try:
        conv = cls(
            c_in,
            c_out,
            pair(1, 4),
            stride,
            padding,
            pair(1, 2),
            groups,
            bias=rng.random() < 0.6,
            padding_mode=mode,
        )
        with torch.no_grad():
            if conv(torch.zeros(1, c_in, *shape)).numel() == 0:
                return None
    except (ValueError, RuntimeError):  # a padding larger than the input, "same" with a stride
        return None
    return conv, shape


@pytest.mark.parametrize("seed, volume", [(0, False), (1, False), (2, False), (3, True)])
def test_convolutions_of_random_geometry(seed, volume, monkeypatch):
    """Twenty convolutions of random geometry per seed (1-d and 2-d, or 3-d), on inputs in either
    memory layout, all six ways of ``_check``: the cases above chosen by hand, and the
    combinations between them."""
    rng = random.Random(seed)
    checked = 0
    while checked < 20:
        drawn = _random_convolution(rng, volume)
        if drawn is None:
            continue
        conv, shape = drawn
        torch.manual_seed(100 * seed + checked)
        b = rng.randint(3, 7)
        # each example's input at its own scale: the norms spread, some clipped and some not
        x = torch.randn(b, conv.in_channels, *shape) * torch.exp2(4 * torch.rand(b) - 2).view(
            b, *[1] * (len(shape) + 1)
        )
        if len(shape) == 2 and rng.random() < 0.3:
            x = x.contiguous(memory_format=torch.channels_last)
        _check(
            Conv(conv, shape),
            x,
            torch.randint(0, 3, (b,)),
            monkeypatch,
        )
        checked += 1


class _Channels(nn.Module):
    """A layer over channels applied to a sequence ``(B, T, d)``: ``(B, d, T)`` in and out."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x.transpose(1, 2)).transpose(1, 2)


def _random_sequence_model(rng: random.Random) -> tuple[nn.Module, torch.Tensor]:
    """Random layers over a sequence ``(B, T, d)`` (tokens through an embedding, with or without a
    padding index, or features): linear maps with and without bias, LayerNorm over the last one
    or two dimensions (with and without its affine parameters and bias), RMSNorm, GroupNorm and
    "same" 1-d convolutions over the channels, activations; then a linear head over the
    flattened sequence; each parameter frozen with probability 0.15; and a batch of 3-7 records
    at scales spread over 2**-2..2**2."""
    vocab, length, d = rng.randint(5, 12), rng.randint(2, 6), rng.choice([3, 4, 6, 8])
    tokens = rng.random() < 0.5
    layers: list[nn.Module] = [nn.Embedding(vocab, d, padding_idx=rng.choice([None, 0]))] * tokens
    width = d
    for _ in range(rng.randint(1, 4)):
        kind = rng.choice(["linear", "ln", "ln2", "rms", "act", "conv", "gn"])
        if kind == "linear":
            out = rng.choice([2, 3, 5, 8])
            layers.append(nn.Linear(width, out, bias=rng.random() < 0.7))
            width = out
        elif kind == "ln":
            affine = rng.random() < 0.8
            layers.append(nn.LayerNorm(width, elementwise_affine=affine, bias=rng.random() < 0.7))
        elif kind == "ln2":
            layers.append(nn.LayerNorm((length, width)))
        elif kind == "rms":
            layers.append(nn.RMSNorm(width, eps=rng.choice([None, 1e-3])))
        elif kind == "act":
            layers.append(rng.choice([nn.Tanh(), nn.GELU(), nn.SiLU()]))
        elif kind == "conv":
            out = rng.choice([2, 4, 6])
            conv = nn.Conv1d(
                width, out, rng.choice([1, 3]), padding="same", bias=rng.random() < 0.5
            )
            layers.append(_Channels(conv))
            width = out
        else:
            groups = rng.choice([g for g in (1, 2, 3) if width % g == 0])
            layers.append(_Channels(nn.GroupNorm(groups, width, affine=rng.random() < 0.8)))
    model = nn.Sequential(*layers, nn.Flatten(), nn.Linear(length * width, 3))
    for m in model.modules():  # affine parameters away from their initial ones and zeros
        if isinstance(m, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)) and m.weight is not None:
            nn.init.normal_(m.weight, 1.0, 0.3)
            if getattr(m, "bias", None) is not None:
                nn.init.normal_(m.bias, 0.0, 0.3)
    params = list(model.parameters())
    for q in params:
        q.requires_grad_(rng.random() >= 0.15)
    params[-1].requires_grad_(True)  # something to train
    b = rng.randint(3, 7)
    if tokens:
        return model, torch.randint(0, vocab, (b, length))
    return model, torch.randn(b, length, d) * torch.exp2(4 * torch.rand(b) - 2).view(b, 1, 1)


@pytest.mark.parametrize("seed", range(3))
def test_sequence_models_of_random_layers(seed, monkeypatch):
    """Fifteen random stacks of sequence layers per seed (:func:`_random_sequence_model`), all
    six ways of ``_check``: the layers' book-kept norms and sums together, in orders and
    combinations the hand-written models do not take."""
    rng = random.Random(seed)
    for i in range(15):
        torch.manual_seed(100 * seed + i)
        model, x = _random_sequence_model(rng)
        _check(model, x, torch.randint(0, 3, (x.shape[0],)), monkeypatch)


def test_group_norm_layer_norm_and_rms_norm(monkeypatch):
    torch.manual_seed(3)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3),
        nn.GroupNorm(2, 4),
        nn.Flatten(),
        nn.LayerNorm(36),
        nn.Linear(36, 4),
        nn.LayerNorm(4, bias=False),
        nn.Linear(4, 6),
        nn.Unflatten(1, (2, 3)),
        nn.RMSNorm(3, eps=1e-3),  # over the last dimension of a sequence
        nn.Flatten(),
        nn.RMSNorm(6),  # eps: the dtype's
        nn.Linear(6, 3),
    )
    for m in model:  # non-trivial affine parameters
        if isinstance(m, (nn.GroupNorm, nn.LayerNorm, nn.RMSNorm)):
            nn.init.normal_(m.weight, 1.0, 0.3)
            if getattr(m, "bias", None) is not None:
                nn.init.normal_(m.bias, 0.0, 0.3)
    got = _check(model, torch.randn(7, 2, 5, 5), torch.randint(0, 3, (7,)), monkeypatch)
    assert {"8.weight", "10.weight"} <= set(got)


def _instance_norms():
    eval_norm = nn.InstanceNorm2d(4, affine=True, track_running_stats=True)
    eval_norm.running_mean.normal_()
    eval_norm.running_var.uniform_(0.5, 2.0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3),
        nn.InstanceNorm2d(4, affine=True),
        nn.Tanh(),
        eval_norm.eval(),
        nn.Flatten(2),
        nn.InstanceNorm1d(4, affine=True),
        nn.Flatten(),
        nn.LazyLinear(3),
    ), torch.randn(7, 2, 6, 6)


def _batch_norm_in_eval():
    norm = nn.BatchNorm2d(4)
    norm.running_mean.normal_()
    norm.running_var.uniform_(0.5, 2.0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3), norm.eval(), nn.Tanh(), nn.Flatten(), nn.LazyLinear(3)
    ), torch.randn(7, 2, 5, 5)


@pytest.mark.parametrize(
    "build", [_instance_norms, _batch_norm_in_eval], ids=["instance", "batch-eval"]
)
def test_batch_norm_in_eval_and_instance_norm(build, monkeypatch):
    """Their affine weight's gradient is ``sum g * x_hat`` per channel, ``x_hat`` by the running
    statistics (BatchNorm in eval mode, an InstanceNorm in eval mode keeping them) or by the
    example's own (an InstanceNorm without them): formed per example directly; the statistics
    are neither changed nor counted."""
    torch.manual_seed(14)
    model, x = build()
    model(x)  # a lazy layer's shape
    for m in model.modules():  # non-trivial affine parameters
        if isinstance(m, (nn.BatchNorm2d, nn.InstanceNorm1d, nn.InstanceNorm2d)):
            nn.init.normal_(m.weight, 1.0, 0.3)
            nn.init.normal_(m.bias, 0.0, 0.3)
    kept = {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "tracked" in k}
    assert not any(layer.vjp for layer in ghost_clipping._layers(model))
    y = torch.randint(0, 3, (7,))
    _check(model, x, y, monkeypatch)
    clipping_off_is_the_plain_sum(model, x.double(), y)
    state = model.state_dict()
    assert kept and all(torch.equal(state[k], v.to(state[k].dtype)) for k, v in kept.items())


class Upsampled(nn.Module):
    """A transposed convolution, called with an ``output_size`` (its output padding then chosen
    per call) where given, or twice, then a linear head."""

    def __init__(self, up: nn.Module, x_shape: tuple[int, ...], output_size=None, twice=False):
        super().__init__()
        self.up, self.output_size, self.twice = up, output_size, twice
        with torch.no_grad():
            n = self(torch.zeros(1, *x_shape), head=False).numel()
        self.head = nn.Linear(n, 3)

    def forward(self, x, head=True):
        h = self.up(x, output_size=self.output_size)
        if self.twice:  # the same layer on its own output (in channels = out channels)
            h = self.up(torch.tanh(h))
        return self.head(torch.tanh(h).flatten(1)) if head else h


@pytest.mark.parametrize(
    "up, x_shape, output_size, twice",
    [
        (
            nn.ConvTranspose1d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2),
            (4, 5),
            None,
            False,
        ),
        (
            nn.ConvTranspose2d(2, 3, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2)),
            (2, 4, 5),
            None,
            False,
        ),
        (nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1), (2, 4, 4), (8, 8), False),
        (nn.ConvTranspose2d(3, 3, 2, padding=1, bias=False), (3, 4, 4), None, True),
        (nn.ConvTranspose3d(2, 4, 2, stride=2, groups=2), (2, 3, 3, 3), None, False),
    ],
    ids=["1d-grouped", "2d-dilated", "2d-output-size", "2d-twice", "3d-grouped"],
)
def test_transposed_convolutions(up, x_shape, output_size, twice, monkeypatch):
    """Per-example weight gradients by one grouped weight gradient (transposed), the output
    padding read from the shapes (an ``output_size`` call's own)."""
    torch.manual_seed(15)
    model = Upsampled(up, x_shape, output_size, twice)
    x, y = torch.randn(6, *x_shape), torch.randint(0, 3, (6,))
    assert not any(layer.vjp for layer in ghost_clipping._layers(model))
    _check(model, x, y, monkeypatch)
    clipping_off_is_the_plain_sum(model, x.double(), y)


class SharedPReLU(nn.Module):
    """One PReLU after each of two linear layers: one layer, two calls."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.act = nn.Linear(5, 6), nn.Linear(6, 6), nn.PReLU(6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.act(self.b(self.act(self.a(x)))))


@pytest.mark.parametrize(
    "build, shape",
    [
        (lambda: nn.Sequential(nn.Linear(5, 6), nn.PReLU(6), nn.Linear(6, 3), nn.PReLU()), (5,)),
        (
            lambda: nn.Sequential(nn.Conv2d(2, 4, 3), nn.PReLU(4), nn.Flatten(), nn.Linear(36, 3)),
            (2, 5, 5),
        ),
        # on a sequence (B, T, d): PReLU's channels are dimension 1, the positions
        (
            lambda: nn.Sequential(nn.Linear(5, 4), nn.PReLU(3), nn.Flatten(), nn.Linear(12, 3)),
            (3, 5),
        ),
        (SharedPReLU, (5,)),
    ],
    ids=["rows", "channels", "sequence", "twice"],
)
def test_prelu_slopes(build, shape, monkeypatch):
    """A PReLU's slope gradient is ``sum g min(0, a)`` per channel (or over every value): formed
    per example directly, with the other layers' small parameters."""
    torch.manual_seed(13)
    model = build()
    for m in model.modules():  # slopes of both signs
        if isinstance(m, nn.PReLU):
            nn.init.normal_(m.weight, 0.2, 0.5)
    x, y = torch.randn(7, *shape), torch.randint(0, 3, (7,))
    assert not any(layer.vjp for layer in ghost_clipping._layers(model))
    _check(model, x, y, monkeypatch)
    clipping_off_is_the_plain_sum(model, x.double(), y)


class Bag(nn.Module):
    def __init__(self, padding_idx=None):
        super().__init__()
        self.emb = nn.Embedding(6, 4, padding_idx=padding_idx)
        self.head = nn.Linear(4, 3)

    def forward(self, idx):
        return self.head(torch.tanh(self.emb(idx)).sum(1))


class Bags(nn.Module):
    """An EmbeddingBag of each example's tokens (with ``twice``, of each half of them: one layer,
    two calls), then a linear head."""

    def __init__(self, mode: str, padding_idx=None, twice=False):
        super().__init__()
        self.bag = nn.EmbeddingBag(20, 6, mode=mode, padding_idx=padding_idx)
        self.head = nn.Linear(6, 3)
        self.twice = twice

    def forward(self, x):
        if self.twice:
            return self.head(self.bag(x[:, :2]) + torch.tanh(self.bag(x[:, 2:])))
        return self.head(self.bag(x))


@pytest.mark.parametrize(
    "mode, padding_idx, twice",
    [("sum", None, False), ("mean", None, False), ("mean", 0, False), ("sum", 1, True)],
    ids=["sum", "mean", "mean-padding", "sum-twice"],
)
def test_embedding_bags_of_tokens(mode, padding_idx, twice, monkeypatch):
    """An EmbeddingBag summing or averaging its tokens as an embedding whose rows receive the
    bag's output gradient (divided by the bag's count of tokens other than the padding index in
    ``mean`` mode); a bag of padding tokens alone included (rows 0-1 of a vocabulary of 4)."""
    torch.manual_seed(16)
    model = Bags(mode, padding_idx, twice)
    x, y = torch.randint(0, 4, (7, 5)), torch.randint(0, 3, (7,))
    x[0] = 0 if padding_idx is None else padding_idx
    assert not any(layer.vjp for layer in ghost_clipping._layers(model))
    _check(model, x, y, monkeypatch)
    clipping_off_is_the_plain_sum(model.double(), x, y)


def test_embedding_bags_by_offsets_are_refused():
    """Bags given by offsets (a second input) are not the batch's rows: refused (per-sample
    weights, a keyword, are refused too: ``test_ghost_layer_vjp``'s keyword case)."""
    bag = nn.EmbeddingBag(10, 3, mode="sum")
    tokens = torch.randint(0, 10, (6, 4))
    with pytest.raises(UnsupportedModelError, match="without its one positional input"):
        ghost_clipping.per_example_norms(
            nn.Sequential(_Offsets(bag)), tokens, _example_losses(torch.zeros(6, dtype=torch.long))
        )


class _Offsets(nn.Module):
    def __init__(self, bag):
        super().__init__()
        self.bag = bag

    def forward(self, x):
        return self.bag(x.flatten(), torch.arange(0, x.numel(), x.shape[1]))


@pytest.mark.parametrize("padding_idx", [None, 0])
def test_embedding_with_repeated_and_padding_tokens(padding_idx, monkeypatch):
    torch.manual_seed(4)
    idx = torch.randint(0, 6, (9, 7))
    idx[0] = 2  # one token repeated throughout
    idx[1, :3] = 0
    _check(Bag(padding_idx), idx, torch.randint(0, 3, (9,)), monkeypatch)


def test_clipping_off_leaves_the_padding_row_without_gradient():
    """``clip = inf`` over an embedding with a padding index: the plain sum, the padding row's
    exactly zero (its tokens' rows are zeroed where they stand, not selected away: a selection's
    count is read back from a device)."""
    torch.manual_seed(4)
    idx = torch.randint(0, 6, (9, 7))
    idx[1, :3] = 0
    y = torch.randint(0, 3, (9,))
    model = Bag(0).double()
    clipping_off_is_the_plain_sum(model, idx, y)
    got = ghost_clipping.clipped_sum(model, idx, _example_losses(y), math.inf)
    assert int(torch.count_nonzero(got["emb.weight"][0])) == 0
    assert int(torch.count_nonzero(got["emb.weight"][1:])) > 0


class Block(nn.Module):
    """GroupNorm residual block (ResNet-18's basic block, GroupNorm for BatchNorm)."""

    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.gn1 = nn.GroupNorm(2, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.gn2 = nn.GroupNorm(2, c_out)
        self.relu = nn.ReLU(inplace=True)
        self.short = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.short = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.GroupNorm(2, c_out)
            )

    def forward(self, x):
        out = self.relu(self.gn1(self.conv1(x)))
        out = self.gn2(self.conv2(out))
        out += self.short(x)
        return self.relu(out)


def small_resnet(width=4, classes=3):
    return nn.Sequential(
        nn.Conv2d(3, width, 3, 1, 1, bias=False),
        nn.GroupNorm(2, width),
        nn.ReLU(inplace=True),
        Block(width, width, 1),
        Block(width, 2 * width, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, classes),
    )


def test_group_norm_resnet_with_inplace_activations(monkeypatch):
    torch.manual_seed(5)
    _check(small_resnet(), torch.randn(6, 3, 8, 8), torch.randint(0, 3, (6,)), monkeypatch)


class TinyTransformer(nn.Module):
    """Token and position embeddings, one pre-norm block (attention by nn.Linear q/k/v/out, MLP)."""

    def __init__(self, vocab=11, d=8, heads=2, length=5, classes=3):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(length, d)
        self.ln1, self.ln2, self.ln3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, classes)
        self.heads = heads

    def forward(self, idx):
        b, t = idx.shape
        h = self.tok(idx) + self.pos(torch.arange(t).expand(b, t))
        z = self.ln1(h)

        def split(u):
            return u.view(b, t, self.heads, -1).transpose(1, 2)

        att = F.scaled_dot_product_attention(split(self.q(z)), split(self.k(z)), split(self.v(z)))
        h = h + self.o(att.transpose(1, 2).reshape(b, t, -1))
        h = h + self.mlp(self.ln2(h))
        return self.head(self.ln3(h).mean(1))


def test_transformer_block(monkeypatch):
    torch.manual_seed(6)
    _check(TinyTransformer(), torch.randint(0, 11, (7, 5)), torch.randint(0, 3, (7,)), monkeypatch)


def test_a_hook_changing_a_layer_output_is_differentiated_through(monkeypatch):
    """A user's forward hook that rescales a layer's output: the layer's output gradient is taken
    before the hook (ours runs first), so the per-example gradients stay right."""
    torch.manual_seed(10)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    model[0].register_forward_hook(lambda _m, _a, out: 3 * out)
    _check(model, torch.randn(7, 4), torch.randint(0, 3, (7,)), monkeypatch)


def clipping_off_is_the_plain_sum(model, x, y, loss=_loss, example_losses=_example_losses):
    """``clipped_sum`` with ``clip = inf`` is the sum of torch.func's per-example gradients, in
    ``named_parameters`` order; returns those gradients."""
    per = dp_sgd_step.per_sample_gradients(model, x, y, loss)
    got = ghost_clipping.clipped_sum(model, x, example_losses(y), math.inf)
    assert list(got) == list(per)
    for k, g in per.items():
        torch.testing.assert_close(got[k], g.sum(0), rtol=1e-10, atol=1e-12, msg=k)
    return per


def test_clipping_off_is_the_plain_sum_and_dp_sgd_takes_this_path(monkeypatch):
    """``clip = inf`` (an audit's clipping-off mutation) sums the raw gradients; a DP-SGD step of a
    model outside privkit's own layers runs here, not through torch.func."""
    torch.manual_seed(7)
    model = small_resnet().double()
    x, y = torch.randn(5, 3, 8, 8, dtype=torch.float64), torch.randint(0, 3, (5,))
    per = clipping_off_is_the_plain_sum(model, x, y)
    monkeypatch.setattr(dp_sgd_step, "per_sample_gradients", None)  # no torch.func fallback
    step = dp_sgd_step.DpSgdStep(0.1, 0.0, 0.5, 10)
    with mutations.mutated(mutations.Mutation(clipping=False)):
        noisy = step.noisy_gradient(model, x, y, _loss, torch.Generator().manual_seed(0))
    for k, g in per.items():
        torch.testing.assert_close(noisy[k], g.sum(0) / 5, rtol=1e-10, atol=1e-12)


class TiedByFunction(nn.Module):
    """An output layer tied to the embedding by a functional call: no shared module parameter."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 3)

    def forward(self, idx):
        return self.emb(idx).mean(1) @ self.emb.weight.T


class ScaledConv(nn.Conv2d):
    """A Conv2d subclass with its own forward: refused (only linear, normalisation and embedding
    subclasses are seen by their functional calls)."""

    def forward(self, x):
        return super().forward(2 * x)


@pytest.mark.parametrize(
    "model, x",
    [
        (
            nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.Flatten()),
            torch.randn(6, 2, 3, 3),
        ),
        (nn.Sequential(nn.Flatten(), nn.Linear(4, 3), nn.BatchNorm1d(3)), torch.randn(6, 4)),
        (TiedByFunction(), torch.randint(0, 5, (6, 4))),
        (nn.Sequential(ScaledConv(2, 3, 1), nn.Flatten()), torch.randn(6, 2, 1, 1)),
    ],
    ids=[
        "batchnorm2d",
        "batchnorm1d",
        "tied-functional",
        "subclass",
    ],
)
def test_unsupported_layers_are_refused(model, x):
    y = torch.randint(0, 3, (6,))
    with pytest.raises(UnsupportedModelError):
        ghost_clipping.clipped_sum(model, x, _example_losses(y), 1.0)


class Paired(nn.Module):
    """A bilinear form of each sequence's first and last step: ``nn.Bilinear`` takes two inputs,
    which no rule of ghost clipping covers."""

    def __init__(self):
        super().__init__()
        self.pair = nn.Bilinear(3, 3, 3)

    def forward(self, x):
        return self.pair(x[:, 0], x[:, -1])


class Projected(nn.Module):
    """A Conv1d and a weight of the model's own passed to ``F.linear``: its per-example stand-in
    fails the forward, so ghost clipping refuses the model and ``torch.func`` clips it."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 3, 2)
        self.weight = nn.Parameter(torch.randn(3, 3))

    def forward(self, x):
        return F.linear(torch.tanh(self.conv(x)).mean(2), self.weight)


def test_layers_outside_fall_back_to_torch_func():
    torch.manual_seed(8)
    y = torch.randint(0, 3, (6,))
    with pytest.raises(UnsupportedModelError, match="Bilinear called without its one positional"):
        ghost_clipping.clipped_sum(Paired(), torch.randn(6, 4, 3), _example_losses(y), 1.0)
    model = Projected().double()
    x = torch.randn(6, 2, 5, dtype=torch.float64)
    # no stand-in gets through F.linear, nor does following the weight to the batch
    why = "weight, followed to where it meets the batch, is used by linear"
    with pytest.raises(UnsupportedModelError, match=why):
        ghost_clipping.clipped_sum(model, x, _example_losses(y), 1.0)
    falls_back(model, x, y, why)


def test_float32_norms_of_large_layers_are_accurate():
    """Squared norms of a million-term per-example gradient keep float32's accuracy (a plain
    ``vector_norm`` reduction loses about 1e-4 there: a clip factor that much off)."""
    torch.manual_seed(9)
    model = nn.Sequential(
        nn.Conv2d(64, 256, 3, padding=1), nn.Unflatten(1, (4, 64)), nn.Flatten(2), Seq(1024, 1024)
    )
    x, y = torch.randn(3, 64, 4, 4), torch.randint(0, 3, (3,))
    got = ghost_clipping.per_example_norms(model, x, _example_losses(y))
    want = ghost_clipping.per_example_norms(model.double(), x.double(), _example_losses(y))
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=0)


class SequenceFirst(nn.Module):
    """A linear layer run on ``(T, B, d)``: whenever ``T`` equals the batch size its shapes look
    batch-first too."""

    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.mix(x.transpose(0, 1))).transpose(0, 1).mean(1))


class SequenceCentred(SequenceFirst):
    """:class:`SequenceFirst` with each position's features less the batch's mean there: it
    mixes its examples, whatever its layout."""

    def forward(self, x):
        h = torch.tanh(self.mix(x.transpose(0, 1)))
        return self.head((h - h.mean(1, keepdim=True)).transpose(0, 1).mean(1))


class BatchCentred(nn.Module):
    """A model mixing its examples by its own code (each example's features less the batch's
    mean)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return self.head(h - h.mean(0, keepdim=True))


def test_rows_that_are_not_examples_are_refused_and_fall_back():
    """The shapes pass; the row check refuses a model mixing its examples, for this step and
    every later one, and DP-SGD's clipping falls back to ``torch.func``."""
    torch.manual_seed(10)
    model = BatchCentred().double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    with pytest.raises(UnsupportedModelError, match="not the batch's examples"):
        ghost_clipping.clipped_sum(model, x, _example_losses(y), 1.0)
    with pytest.raises(UnsupportedModelError, match="not the batch's examples"):
        ghost_clipping.per_example_norms(model, x, _example_losses(y))
    falls_back(model, x, y, "not the batch's examples")


def test_a_sequence_first_layer_is_taken_by_its_shapes(monkeypatch):
    """A linear layer on ``(T, B, d)``: taken sequence-first by its shapes, per-example gradients
    as ``torch.func``'s, whether its first pass could tell (``T`` other than the batch size) or
    not (``T`` equal to it: the guess, batch-first, fails the row check and the pass is taken
    again guessing sequence-first, from the same random state); a later pass of equal sizes takes
    what was learnt, and a call no pass told, on a pass without the check, is refused for that
    pass. A model mixing its examples fails both guesses and is refused from then on."""
    torch.manual_seed(10)
    x, y = torch.randn(5, 5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    for first in (x, x[:, :4]):  # T = B = 5 (guessed), T = 4 (told)
        model = SequenceFirst().double()
        passes: list[int] = []
        real = ghost_clipping._forward_backward
        monkeypatch.setattr(
            ghost_clipping,
            "_forward_backward",
            lambda *a, passes=passes, real=real: passes.append(1) or real(*a),
        )
        norms = ghost_clipping.per_example_norms(model, first, _example_losses(y))
        assert len(passes) == (2 if first is x else 1)
        monkeypatch.undo()
        assert ghost_clipping._ROWS_CHECKED[model] is None
        assert ghost_clipping._LAYOUTS[model.mix] == {0: "sequence"}
        torch.testing.assert_close(norms, _reference(model, first, y)[0], rtol=1e-10, atol=1e-12)
        _check(model, x, y, monkeypatch)  # T = B = 5: as learnt
    other = SequenceFirst().double()
    ghost_clipping._ROWS_CHECKED[other] = None  # a model whose check passed without this call
    with pytest.raises(UnsupportedModelError, match="admits batch and sequence layouts"):
        ghost_clipping.clipped_sum(other, x, _example_losses(y), 1.0)

    centred = SequenceCentred().double()
    with pytest.raises(UnsupportedModelError, match="not the batch's examples"):
        ghost_clipping.clipped_sum(centred, x, _example_losses(y), 1.0)
    assert ghost_clipping._ROWS_CHECKED[centred] is not None
    falls_back(centred, x, y, "not the batch's examples")


def test_rows_are_checked_once_per_model_and_pass_in_float32(monkeypatch):
    """The check runs on a model's first batch of two or more examples only, and float32's
    rounding in deep models does not trip it."""
    calls = []
    check = ghost_clipping._check_rows
    monkeypatch.setattr(ghost_clipping, "_check_rows", lambda *a: calls.append(a[0]) or check(*a))
    torch.manual_seed(11)
    resnet, transformer = small_resnet(width=16), TinyTransformer(d=32, length=16)
    for _ in range(2):
        y = torch.randint(0, 3, (1,))
        ghost_clipping.per_example_norms(resnet, torch.randn(1, 3, 16, 16), _example_losses(y))
        y = torch.randint(0, 3, (32,))
        ghost_clipping.per_example_norms(resnet, torch.randn(32, 3, 16, 16), _example_losses(y))
        idx = torch.randint(0, 11, (32, 16))
        ghost_clipping.per_example_norms(transformer, idx, _example_losses(y))
    assert calls == [resnet, transformer]


def test_rows_in_bfloat16():
    """bfloat16's rounding (about 1% here) passes the row check; a model mixing its examples on
    a sequence-first tensor as long as the batch (either layout guessed) does not."""
    torch.manual_seed(12)
    y = torch.randint(0, 3, (16,))

    def losses(logits, s):
        return F.cross_entropy(logits.float(), y[s], reduction="none")

    resnet = small_resnet(width=16).to(torch.bfloat16)
    ghost_clipping.per_example_norms(resnet, torch.randn(16, 3, 16, 16).bfloat16(), losses)
    assert ghost_clipping._ROWS_CHECKED[resnet] is None
    with pytest.raises(UnsupportedModelError, match="not the batch's examples"):
        ghost_clipping.per_example_norms(
            SequenceCentred().to(torch.bfloat16), torch.randn(16, 16, 4).bfloat16(), losses
        )
