"""Tensors of no example broadcast over the batch, followed to where they meet it
(``privkit.mechanisms.ghost_broadcast``), against ``torch.func``'s per-example gradients (float64).

Taken by ghost clipping, with sums equal to per-example gradients': a T5-style relative-position
bias (an embedding looked up on ``(T, T)`` buckets, permuted as a 3-d tensor, added to the scores
or passed to ``scaled_dot_product_attention`` as its mask, after a causal mask of no example,
shared by two layers), a Swin-style bias table (a bare parameter indexed by positions, added to
every window's scores: ``B * windows`` rows), a batch of one, a bias added first to a table as
long as a multiple of the batch (the meeting told by where tensors come from, not by shapes), a
bias meeting the batch through a bare parameter's stand-in. The switch is remembered. Refused (and
clipped by ``torch.func`` to the same sum where checked): a followed tensor in a matrix product,
added to in place, indexed by the batch's tokens, returned as the model's output, in attention
among tensors of no example, broadcast against a sequence-first tensor (rows of positions: the
row check; rows not a multiple of the batch), read through a view made before the pass (the
count of the autograd graph's edges), or through an ``autograd.Function`` whose backward is not its
forward's (the examples' gradients do not add up to the whole).
"""

import math
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from privkit.mechanisms import dp_sgd_step, ghost_broadcast, ghost_clipping
from privkit.mechanisms.stacked import UnsupportedModelError
from tests.privkit.test_ghost_clipping import _check, _example_losses, falls_back
from tests.privkit.test_ghost_parameters import takes_ghost_clipping

V, D, H, T = 20, 16, 4, 6


def _loss(logits, y, _aux):
    return F.cross_entropy(logits, y)


def _tokens(b: int = 5, seed: int = 0):
    """``b`` token sequences of length ``T`` and their classes (``b`` other than ``T``: the
    first pass tells shared positions by their shape)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (b, T), generator=g), torch.randint(0, 3, (b,), generator=g)


class RelativeBias(nn.Module):
    """T5's relative attention bias: an embedding of ``(T, T)`` distance buckets, permuted to
    ``(1, H, T, T)``, as T5Attention.compute_bias writes it."""

    def __init__(self, buckets: int = 2 * T):
        super().__init__()
        self.table = nn.Embedding(buckets, H)

    def forward(self, length: int, device) -> torch.Tensor:
        pos = torch.arange(length, device=device)
        bucket = (pos[None, :] - pos[:, None]) + length - 1  # (T, T)
        values = self.table(bucket)  # (T, T, H)
        return values.permute([2, 0, 1]).unsqueeze(0)


class BiasedAttention(nn.Module):
    """Self-attention whose scores get a bias of no example: added (``how="add"``), as
    ``scaled_dot_product_attention``'s mask (``"sdpa"``), after a causal mask of no example
    (``"causal"``), or in a way ghost clipping does not follow (``"matmul"``, ``"in_place"``)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)

    def forward(self, h: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        q, k, v = (z.view(b, t, H, D // H).transpose(1, 2) for z in self.qkv(h).chunk(3, -1))
        if self.how == "sdpa":
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        else:
            scores = q @ k.transpose(2, 3) / (D // H) ** 0.5
            if self.how == "causal":
                causal = torch.full((t, t), -1e9, dtype=h.dtype).triu(1)
                scores = scores + (bias + causal[None, None])
            elif self.how == "matmul":
                scores = scores @ bias
            elif self.how == "in_place":
                bias += 1.0
                scores = scores + bias
            else:
                scores = scores + bias
            a = scores.softmax(-1) @ v
        return self.out(a.transpose(1, 2).reshape(b, t, D))


class TinyT5(nn.Module):
    """Token embedding, one relative bias shared by two attention layers (T5 computes it in its
    first layer and passes it on), a classifier on the mean token."""

    def __init__(self, how: str = "add"):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.bias = RelativeBias()
        self.layers = nn.ModuleList([BiasedAttention(how), BiasedAttention(how)])
        self.head = nn.Linear(D, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        bias = self.bias(ids.shape[1], ids.device)
        for layer in self.layers:
            h = h + layer(h, bias)
        return self.head(h.mean(1))


class WindowBias(nn.Module):
    """Swin's relative position bias: a bare table indexed by a buffer of positions, reshaped and
    permuted, added to every window's scores (windows flattened into the batch's rows)."""

    def __init__(self, window: int = 2):
        super().__init__()
        n = window * window
        self.table = nn.Parameter(torch.randn((2 * window - 1) ** 2, H) * 0.1)
        coords = torch.stack(
            torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")
        )
        flat = coords.flatten(1)
        rel = (flat[:, :, None] - flat[:, None, :]).permute(1, 2, 0) + window - 1
        self.register_buffer("index", rel[..., 0] * (2 * window - 1) + rel[..., 1])
        self.n = n
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, windows: torch.Tensor) -> torch.Tensor:  # (B * W, n, D)
        bw = windows.shape[0]
        q, k, v = (
            z.view(bw, self.n, H, D // H).transpose(1, 2) for z in self.qkv(windows).chunk(3, -1)
        )
        bias = self.table[self.index.view(-1)].view(self.n, self.n, -1)
        bias = bias.permute(2, 0, 1).contiguous()
        scores = q @ k.transpose(2, 3) + bias.unsqueeze(0)
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(bw, self.n, D)


class TinySwin(nn.Module):
    """4x4 feature maps cut into four 2x2 windows, window attention with a bias table."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Linear(3, D)
        self.attention = WindowBias()
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 4, 4, 3)
        b = x.shape[0]
        h = self.patch(x)  # (B, 4, 4, D)
        windows = h.view(b, 2, 2, 2, 2, D).permute(0, 1, 3, 2, 4, 5).reshape(b * 4, 4, D)
        out = self.attention(windows).reshape(b, 4 * 4, D)
        return self.head(out.mean(1))


def _images(b: int = 6, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 4, 4, 3, generator=g).double(), torch.randint(0, 3, (b,), generator=g)


@pytest.mark.parametrize("how", ["add", "sdpa", "causal"])
def test_a_relative_position_bias_is_followed_to_the_batch(how, monkeypatch):
    torch.manual_seed(1)
    model = TinyT5(how).double()
    x, y = _tokens()
    _check(model, x, y, monkeypatch)  # every form of the layers' norms
    assert model.bias.table in ghost_clipping._TRACED_POSITIONS
    takes_ghost_clipping(model, x, y, monkeypatch, _loss)  # DP-SGD's step, no fallback


def test_a_bias_table_indexed_by_positions_is_followed_to_the_windows(monkeypatch):
    torch.manual_seed(2)
    model = TinySwin().double()
    x, y = _images()
    _check(model, x, y, monkeypatch)
    takes_ghost_clipping(model, x, y, monkeypatch, _loss)
    assert ghost_clipping._FOLLOWED[model.attention] == {"table"}


def test_one_example_and_later_batches_take_the_followed_path_at_once(monkeypatch):
    """A batch of one (every row the one example's) and, once the switch is made, later passes
    with no failing pass before them (the model's forward runs twice on a first pass, for the
    output check, once after)."""
    torch.manual_seed(3)
    model = TinyT5().double()
    x, y = _tokens(1, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", dp_sgd_step.ClippingFallbackWarning)
        got = dp_sgd_step.clipped_gradient_sum(model, x, y, _loss, 0.1)
    per = dp_sgd_step.per_sample_gradients(model, x, y, _loss)
    want = {k: g.sum(0) for k, g in dp_sgd_step.clip_per_sample(per, 0.1)[0].items()}
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12)
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    x, y = _tokens(5, seed=4)
    takes_ghost_clipping(model, x, y, monkeypatch, _loss)
    assert len(calls) <= 2 + 1  # torch.func's reference runs the model once too


@pytest.mark.parametrize(
    ("how", "why"),
    [("matmul", "is used by"), ("in_place", "added to in place")],
)
def test_uses_that_are_not_followed_fall_back_to_the_same_sum(how, why):
    torch.manual_seed(4)
    model = TinyT5(how).double()
    x, y = _tokens()
    _refused(model, x, y, why)
    calls = []
    hook = model.register_forward_pre_hook(lambda *_: calls.append(1))
    with pytest.raises(UnsupportedModelError, match=why):  # remembered: no pass taken again
        ghost_clipping.per_example_norms(model, x, _example_losses(y))
    assert not calls
    hook.remove()
    falls_back(model, x, y, why)


class SequenceFirst(nn.Module):
    """A bias of no example, ``(1, D)``, added to a sequence-first ``(T, B, D)`` tensor whose
    length is a multiple of the batch: its rows are positions, not examples."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.positions = nn.Embedding(T, D)
        self.head = nn.Linear(D, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids).transpose(0, 1)  # (T, B, D)
        p = self.positions(torch.arange(1, device=ids.device))  # (1, D): one position
        h = (h + p.permute(0, 1)).tanh()
        return self.head(h.mean(0))


def test_rows_that_are_not_examples_are_refused_by_the_row_check():
    torch.manual_seed(5)
    model = SequenceFirst().double()
    x, y = _tokens(3, seed=5)  # T = 6 = 2 x 3 rows: a multiple of the batch
    with pytest.raises(UnsupportedModelError, match="not the batch's examples"):
        ghost_clipping.per_example_norms(model, x, _example_losses(y))
    falls_back(model, x, y, "not the batch's examples")


class BatchIndexed(nn.Module):
    """A bare table read at the batch's own tokens (an embedding written by hand): no stand-in
    gets through the indexing, and following it stops there (the rows would be examples')."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(V, D) * 0.1)
        self.head = nn.Linear(D, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.table[ids].mean(1))


class LongTable(nn.Module):
    """A bias of no example added first to a table of no example as long as a multiple of the
    batch (rows of positions, not of examples), then to the tokens: the meeting is where the
    tokens come in, whatever the shapes say."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.shift = nn.Parameter(torch.randn(1, D) * 0.1)
        self.register_buffer("table", torch.randn(T, D))
        self.head = nn.Linear(D, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = self.table + self.shift.reshape(1, -1).view(1, D)  # (T, D), T = 2 B below
        return self.head(torch.tanh(self.embed(ids) + positions).mean(1))


def test_a_table_read_at_the_batchs_tokens_is_refused():
    torch.manual_seed(6)
    model = BatchIndexed().double()
    x, y = _tokens()
    with pytest.raises(UnsupportedModelError, match="with the batch's values"):
        ghost_clipping.per_example_norms(
            model, x, lambda z, s: F.cross_entropy(z, y[s], reduction="none")
        )


def test_the_meeting_is_told_by_where_tensors_come_from_not_by_their_shapes(monkeypatch):
    """The shift's ``reshape`` gets no stand-in through (its first form is ``(B, D)``); followed,
    its addition to the ``(T, D)`` table (``T`` a multiple of the batch) is no meeting, its
    addition to the tokens is: the sums are per-example gradients', at batches of 3 and 6."""
    torch.manual_seed(7)
    model = LongTable().double()
    for b in (3, 6):
        x, y = _tokens(b, seed=b)
        with monkeypatch.context() as patched:
            takes_ghost_clipping(model, x, y, patched, _loss)
    assert ghost_clipping._FOLLOWED[model] == {"shift"}


def test_a_trace_with_nothing_to_follow_changes_nothing():
    """Under a trace that follows nothing (every operation still passes through it), the model's
    output and gradients are the plain pass's, bit for bit."""
    torch.manual_seed(3)
    model = TinySwin().double()
    x, _ = _images(4)
    plain = model(x)
    grads = torch.autograd.grad(plain.sum(), list(model.parameters()))
    trace = ghost_broadcast.BroadcastTrace(4)
    with trace:
        trace.batch(x)
        traced = model(x)
    assert torch.equal(traced, plain)
    again = torch.autograd.grad(traced.sum(), list(model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(again, grads, strict=True))


def test_what_holds_examples_follows_the_data_not_a_reused_id():
    """A tensor computed from the batch holds examples, one of no example does not, and an id
    whose entry is another tensor's (one that is gone, or one alive elsewhere: ids are reused
    once a tensor is freed) does not make the tensor now holding it the batch's, nor what is
    computed from it."""
    trace = ghost_broadcast.BroadcastTrace(4)
    x, table = torch.randn(4, 3), torch.randn(3)
    with trace:
        trace.batch(x)
        from_batch, alone = x * 2.0 + 1.0, table.exp()
        held = trace._holds_examples(from_batch), trace._holds_examples(alone)
        gone, other = x * 3.0, x * 4.0  # both hold examples
        dead = weakref.ref(gone)
        del gone  # its entry's reference now gives nothing back
        first, second = torch.zeros(3), torch.zeros(3)
        trace._batch[id(first)] = dead  # as if ``first`` had the freed tensor's id
        trace._batch[id(second)] = weakref.ref(other)  # an entry for another, live tensor
        computed = [first + 1.0, second + 1.0]
    assert held == (True, False) and dead() is None
    assert not any(trace._holds_examples(t) for t in [first, second, *computed])


class ViewedBefore(TinySwin):
    """The bias table also read through a view made when the model was built: a path to the
    loss the trace does not see (the autograd graph's edges into the table count it)."""

    def __init__(self):
        super().__init__()
        self.first_rows = self.attention.table[:3]  # a view, made outside any pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.first_rows.sum()


def test_a_path_the_trace_does_not_see_is_refused():
    torch.manual_seed(8)
    model = ViewedBefore().double()
    model.first_rows = model.attention.table[:3]  # the view of the table in float64
    x, y = _images()
    with pytest.raises(UnsupportedModelError, match="reaches the loss other than through"):
        ghost_clipping.per_example_norms(
            model, x, lambda z, s: F.cross_entropy(z, y[s], reduction="none")
        )


def test_a_followed_tensor_returned_as_the_output_is_refused():
    trace = ghost_broadcast.BroadcastTrace(4)
    table = torch.randn(3, 2, requires_grad=True)
    trace.source(table, "table")
    with trace:
        moved = table.permute(1, 0)
    trace.escaped(torch.randn(4, 2))  # an output of the batch's: fine
    with pytest.raises(
        ghost_broadcast.Untraceable, match=r"table, followed .* is the model's output"
    ):
        trace.escaped((torch.randn(4, 2), moved))


class PriorOut(nn.Module):
    """Returns a class prior of no example beside the logits; the loss adds them (outside the
    model, where the trace does not see the addition)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.head = nn.Linear(D, 3)
        self.prior = nn.Parameter(torch.zeros(3))

    def forward(self, ids):
        return self.head(self.embed(ids).mean(1)), self.prior.view(1, 3)[:, [2, 0, 1]]


class FixedLatents(nn.Module):
    """Attention among fixed latents (a buffer: no example) under a relative bias, added to the
    batch's features afterwards: the bias meets no example in the attention."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.bias = RelativeBias()
        self.register_buffer("latents", torch.randn(1, H, T, D // H))
        self.head = nn.Linear(D, 3)

    def forward(self, ids):
        bias = self.bias(ids.shape[1], ids.device)
        z = F.scaled_dot_product_attention(self.latents, self.latents, self.latents, bias)
        return self.head((self.embed(ids) + z.transpose(1, 2).reshape(1, T, D)).mean(1))


def _refused(model, x, y, why):
    """Refused by ghost clipping with ``why``; the fallback's sum is ``torch.func``'s."""
    with pytest.raises(UnsupportedModelError, match=why):
        ghost_clipping.per_example_norms(model, x, lambda z, s: _prior_loss(z, y[s]))


def _prior_loss(out, y):
    logits, prior = out if isinstance(out, tuple) else (out, 0)
    return F.cross_entropy(logits + prior, y, reduction="none")


def test_a_followed_tensor_the_model_returns_is_refused():
    """Every form of stand-ins fails the prior's view; followed, it is the model's output."""
    torch.manual_seed(9)
    _refused(PriorOut().double(), *_tokens(), "is the model's output")


def test_attention_among_tensors_of_no_example_is_refused():
    torch.manual_seed(10)
    _refused(FixedLatents().double(), *_tokens(), "other than as the additive mask")


def test_a_sequence_first_meeting_on_rows_not_a_multiple_of_the_batch_falls_back():
    """``(1, D)`` positions added to a ``(T, B, D)`` tensor, ``T`` not a multiple of ``B``: no
    meeting (its rows are not the batch's), and the fallback's sum."""
    torch.manual_seed(11)
    model = SequenceFirst().double()
    x, y = _tokens(4, seed=11)  # T = 6 rows, not a multiple of 4
    _refused(model, x, y, "not broadcast over the batch's rows")
    falls_back(model, x, y, "not broadcast over the batch's rows")


class LearnedLatents(FixedLatents):
    """The latents a trainable bare parameter: its per-example stand-in holds the examples, so
    the relative bias meets the batch in the attention over it."""

    def __init__(self):
        super().__init__()
        del self.latents
        self.latents = nn.Parameter(torch.randn(1, H, T, D // H))

    def forward(self, ids):
        bias = self.bias(ids.shape[1], ids.device)
        z = F.scaled_dot_product_attention(self.latents, self.latents, self.latents, bias)
        return self.head((self.embed(ids) + z.transpose(1, 2).reshape(-1, T, D)).mean(1))


def test_a_bias_meets_the_batch_through_a_stand_in(monkeypatch):
    torch.manual_seed(12)
    takes_ghost_clipping(LearnedLatents().double(), *_tokens(), monkeypatch, _loss)


@pytest.mark.parametrize("build", [TinyT5, TinySwin], ids=["relative-bias", "bias-table"])
def test_with_clipping_off_the_sum_is_the_plain_gradient(build):
    """No norms formed (an audit's clipping-off mutation): the followed parameters' sums are the
    plain backward pass' gradients."""
    torch.manual_seed(13)
    model = build().double()
    x, y = _tokens() if build is TinyT5 else _images()
    got = ghost_clipping.clipped_sum(model, x, _example_losses(y), math.inf)
    model.zero_grad()
    F.cross_entropy(model(x), y, reduction="sum").backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(got[k], p.grad, rtol=1e-10, atol=1e-12)


class _Tripled(torch.autograd.Function):
    """Doubles in the forward and triples the gradient in the backward (a straight-through-style
    estimator): ``Function.apply`` runs outside torch's function overrides, so the trace sees the
    forward's operations only."""

    @staticmethod
    def forward(v):
        return v * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g * 3

    @staticmethod
    def vmap(info, in_dims, v):  # torch.func's reference batches it
        return v * 2, in_dims[0]


class CustomBackward(TinyT5):
    """The relative bias through :class:`_Tripled` before the attention layers."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        bias = _Tripled.apply(self.bias(ids.shape[1], ids.device))
        for layer in self.layers:
            h = h + layer(h, bias)
        return self.head(h.mean(1))


def test_a_path_with_its_own_backward_is_refused_by_the_sum_of_the_examples():
    """The trace takes the forward's doubling for the map, autograd triples: the examples'
    gradients of the bias do not add up to its whole gradient (checked on the first pass)."""
    torch.manual_seed(14)
    model = CustomBackward().double()
    x, y = _tokens()
    why = "reaches the loss other than where it meets the batch"
    with pytest.raises(UnsupportedModelError, match=why):
        ghost_clipping.per_example_norms(model, x, _example_losses(y))
    falls_back(model, x, y, why)


class _AddInside(torch.autograd.Function):
    """``scores + bias`` computed inside a custom function: the meeting happens where autograd
    records nothing."""

    @staticmethod
    def forward(ctx, scores, bias):
        return scores + bias

    @staticmethod
    def backward(ctx, g):
        return g, g.sum(0, keepdim=True)


class _Unseen(torch.autograd.Function):
    """The bias read through numpy inside a custom function: it reaches the loss by the
    function's backward only, meeting the batch nowhere the trace sees."""

    @staticmethod
    def forward(ctx, h, bias):
        return h + torch.from_numpy(bias.detach().numpy()).mean()

    @staticmethod
    def backward(ctx, g):
        return g, torch.full((1, H, T, T), float(g.sum()) / (H * T * T), dtype=g.dtype)


class BiasInside(TinyT5):
    """The relative bias handed to a custom autograd function with the batch's features."""

    def __init__(self, function):
        super().__init__()
        self.function = function

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        bias = self.bias(ids.shape[1], ids.device)
        h = self.embed(ids)
        if self.function is _AddInside:
            pooled = _AddInside.apply(h[:, None, :, :H].transpose(1, 3).expand(-1, H, T, T), bias)
            return self.head(pooled.mean((2, 3))[:, :1].expand(-1, D))
        return self.head(_Unseen.apply(h, bias).mean(1))


@pytest.mark.parametrize(
    ("function", "why"),
    [
        (_AddInside, "where autograd records no gradient"),
        (_Unseen, "reaches the loss other than where it meets the batch"),
    ],
    ids=["meeting-inside-a-function", "no-meeting-seen"],
)
def test_paths_autograd_hides_from_the_trace_are_refused(function, why):
    torch.manual_seed(15)
    _refused(BiasInside(function).double(), *_tokens(), why)
