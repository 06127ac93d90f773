"""Layer subclasses with a forward of their own, embedding tables shared by several embeddings,
and layers on rows that flatten the batch, under ghost clipping, against torch.func.

- A subclass of an embedding, linear or normalisation layer with a forward of its own (HF's
  scaled word embeddings, ``super().forward(ids) * scale``; OPT's and BART's learned positions,
  ``super().forward(positions + offset)``; ConvNeXt's LayerNorm on permuted channels) is seen by
  its functional calls on its weight (``privkit.mechanisms.ghost_subclasses``); one that reads
  its weight otherwise, or calls with another padding row, ``max_norm``, bias or epsilon than its
  own, is refused. ConvNeXt's channels-last layer scale takes the third form of stand-ins.
- Embeddings of one table (T5's and BART's encoder and decoder token embeddings, an output layer
  tied to it) are one embedding layer called by each.
- Linear and normalisation layers on ``(B T, d)`` rows (OPT's MLP) are taken per example; rows
  flattened position-major are found by the row check and refused.

Norms and clipped sums equal ``torch.func``'s per-example gradients clipped (float64).
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from privkit.mechanisms import ghost_clipping
from privkit.mechanisms.stacked import UnsupportedModelError
from tests.privkit.test_ghost_clipping import _check, _example_losses, falls_back

V, D, T = 13, 8, 6


class ScaledEmbedding(nn.Embedding):
    """HF's scaled word embedding: the lookup times a constant."""

    def forward(self, ids):
        return super().forward(ids) * D**0.5


class OffsetPositions(nn.Embedding):
    """OPT's and BART's learned positions: ``arange(T)`` shifted by 2, shared by the batch."""

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)[None]
        return super().forward(positions + 2)


class Encoder(nn.Module):
    """Scaled token embeddings plus offset positions, a block whose MLP runs on ``(B T, d)``
    rows (as OPT's), mean pooling, a head."""

    def __init__(self, flatten=True):
        super().__init__()
        self.tok = ScaledEmbedding(V, D, padding_idx=1)
        self.pos = OffsetPositions(T + 2, D)
        self.norm = nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.head = nn.Linear(D, 3)
        self.flatten = flatten

    def forward(self, ids):
        h = self.tok(ids) + self.pos(ids)
        shape = h.shape
        if self.flatten:
            h = h.reshape(-1, D)
        h = (h + self.fc2(F.gelu(self.fc1(self.norm(h))))).reshape(shape)
        return self.head(h.mean(1))


def _tokens(b=7):
    ids = torch.randint(0, V, (b, T))
    ids[0, -2:] = 1  # padding
    return ids, torch.randint(0, 3, (b,))


@pytest.mark.parametrize("flatten", [True, False], ids=["rows-b-t", "rows-b"])
def test_subclassed_embeddings_and_flattened_rows(flatten, monkeypatch):
    torch.manual_seed(60)
    model = Encoder(flatten)
    _check(model, *_tokens(), monkeypatch)


class Seq2Seq(nn.Module):
    """T5's and BART's sharing: a table, an encoder's and a decoder's token embeddings of it
    (scaled where ``scaled``), and an output layer tied to it."""

    def __init__(self, scaled=False, padding=(None, None)):
        super().__init__()
        kind = ScaledEmbedding if scaled else nn.Embedding
        self.shared = kind(V, D, padding_idx=padding[0])
        self.enc_tok = kind(V, D, padding_idx=padding[0])
        self.dec_tok = kind(V, D, padding_idx=padding[1])
        self.enc_tok.weight = self.dec_tok.weight = self.shared.weight
        self.mix = nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.shared.weight

    def forward(self, ids):
        memory = torch.tanh(self.mix(self.enc_tok(ids))).mean(1, keepdim=True)
        return self.head(self.dec_tok(ids.flip(1)) + memory)


def _next_token_loss(logits, y, _aux):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _next_token_losses(y):
    return lambda logits, s: F.cross_entropy(logits.transpose(1, 2), y[s], reduction="none").mean(1)


@pytest.mark.parametrize("scaled", [False, True], ids=["embeddings", "scaled-embeddings"])
def test_one_table_for_an_encoder_a_decoder_and_the_head(scaled, monkeypatch):
    torch.manual_seed(61)
    model = Seq2Seq(scaled)
    ids, y = torch.randint(0, V, (6, T)), torch.randint(0, V, (6, T))
    got = _check(model, ids, y, monkeypatch, _next_token_loss, _next_token_losses)
    assert "shared.weight" in got and "head.weight" not in got


def test_one_table_with_two_padding_rows_is_refused():
    model = Seq2Seq(padding=(0, 1))
    ids, y = torch.randint(0, V, (4, T)), torch.randint(0, V, (4, T))
    with pytest.raises(UnsupportedModelError, match="different padding rows"):
        ghost_clipping.clipped_sum(model, ids, _next_token_losses(y), 1.0)


class Indexed(nn.Embedding):
    """A subclass reading its table by indexing: no lookup."""

    def forward(self, ids):
        return self.weight[ids]


class OtherPadding(nn.Embedding):
    """A subclass looking up with another padding row than its own."""

    def forward(self, ids):
        return F.embedding(ids, self.weight, padding_idx=0)


class MaxNorm(nn.Embedding):
    """A subclass looking up with a max_norm (renormalising the rows it reads)."""

    def forward(self, ids):
        return F.embedding(ids, self.weight, max_norm=1.0)


@pytest.mark.parametrize(
    "kind, why",
    [
        (Indexed, "other than through its layer"),
        (OtherPadding, "padding_idx 0, not its own None"),
        (MaxNorm, "max_norm"),
    ],
    ids=["indexed", "other-padding", "max-norm"],
)
def test_a_subclass_reading_its_table_otherwise_is_refused(kind, why):
    torch.manual_seed(62)
    model = nn.Sequential(kind(V, D), nn.Flatten(), nn.Linear(T * D, 3)).double()
    ids, y = _tokens(5)
    with pytest.raises(UnsupportedModelError, match=why):
        ghost_clipping.clipped_sum(model, ids, _example_losses(y), 1.0)
    if kind is not MaxNorm:  # torch.func cannot take max_norm's in-place renormalisation
        falls_back(model, ids, y, why)


class PositionMajor(nn.Module):
    """A linear layer on ``(T B, d)`` rows (the sequence transposed before flattening): its rows
    are not example-major."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        b = x.shape[0]
        h = self.lin(x.transpose(0, 1).reshape(-1, D)).reshape(T, b, D)
        return self.head(torch.tanh(h).mean(0))


def test_rows_flattened_position_major_are_refused_by_the_row_check():
    torch.manual_seed(63)
    model = PositionMajor().double()
    x, y = torch.randn(4, T, D, dtype=torch.float64), torch.randint(0, 3, (4,))
    falls_back(model, x, y, "output rows are not the batch's examples")


class NegativePadding(nn.Embedding):
    """A subclass looking up with its padding row counted from the end, as F.embedding allows."""

    def forward(self, ids):
        return 2 * F.embedding(ids, self.weight, padding_idx=-1)


def test_a_padding_row_counted_from_the_end_is_the_layers(monkeypatch):
    torch.manual_seed(64)
    model = nn.Sequential(
        NegativePadding(V, D, padding_idx=V - 1), nn.Flatten(), nn.Linear(T * D, 3)
    )
    ids, y = _tokens()
    ids[1, :2] = V - 1
    _check(model, ids, y, monkeypatch)


class InputScaled(nn.Linear):
    """A linear subclass scaling its input before its own map."""

    def forward(self, x):
        return super().forward(2 * x)


class ChannelsFirstNorm(nn.LayerNorm):
    """ConvNeXt's LayerNorm over the channels of ``(B, C, H, W)`` maps, permuted around it."""

    def forward(self, x):
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class Halved(nn.GroupNorm):
    """A GroupNorm subclass halving its output."""

    def forward(self, x):
        return super().forward(x) / 2


class ConvNextBlock(nn.Module):
    """ConvNeXt's block: depthwise convolution, the channels-first LayerNorm, channels-last
    point-wise maps, a layer scale ``(C,)`` on channels-last maps (the third form of stand-ins),
    then a GroupNorm subclass and a linear subclass on the pooled features."""

    def __init__(self, c=4):
        super().__init__()
        self.dw = nn.Conv2d(c, c, 3, padding=1, groups=c)
        self.norm = ChannelsFirstNorm(c, eps=1e-6)
        self.pw1, self.pw2 = nn.Linear(c, 2 * c), nn.Linear(2 * c, c)
        self.gamma = nn.Parameter(torch.rand(c) + 0.5)
        self.gn = Halved(2, c)
        self.head = InputScaled(c, 3)

    def forward(self, x):
        h = self.norm(self.dw(x)).permute(0, 2, 3, 1)
        h = (self.gamma * self.pw2(F.gelu(self.pw1(h)))).permute(0, 3, 1, 2)
        return self.head(self.gn(x + h).mean((2, 3)))


def test_a_convnext_block_of_subclasses_and_a_channels_last_layer_scale(monkeypatch):
    torch.manual_seed(65)
    model = ConvNextBlock()
    x, y = torch.randn(6, 4, 5, 5), torch.randint(0, 3, (6,))
    _check(model, x, y, monkeypatch)
    assert ghost_clipping._FORMS[model.double()] == 2


class OtherEps(nn.LayerNorm):
    """A LayerNorm subclass normalising with another epsilon than its own."""

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, 1e-3)


class NoBias(nn.Linear):
    """A linear subclass leaving its own bias out of its map (and adding it otherwise)."""

    def forward(self, x):
        return F.linear(x, self.weight) + self.bias


@pytest.mark.parametrize(
    "layer, why",
    [(OtherEps(T * D), "eps 0.001, not its own 1e-05"), (NoBias(T * D, T * D), "bias")],
    ids=["other-eps", "bias-otherwise"],
)
def test_a_subclass_calling_with_other_arguments_is_refused(layer, why):
    torch.manual_seed(66)
    model = nn.Sequential(nn.Flatten(), layer, nn.Linear(T * D, 3)).double()
    x, y = torch.randn(5, T, D, dtype=torch.float64), torch.randint(0, 3, (5,))
    with pytest.raises(UnsupportedModelError, match=why):
        ghost_clipping.clipped_sum(model, x, _example_losses(y), 1.0)
    falls_back(model, x, y, why)


class SparseLookup(nn.Embedding):
    """A subclass looking up with a sparse gradient (its values are the dense one's)."""

    def forward(self, ids):
        return 2 * F.embedding(ids, self.weight, sparse=True)


def test_a_sparse_lookup_is_the_layers():
    """Clipping off, the sum is plain autograd's (its sparse gradient made dense)."""
    torch.manual_seed(67)
    model = nn.Sequential(SparseLookup(V, D), nn.Flatten(), nn.Linear(T * D, 3)).double()
    ids, y = _tokens()
    got = ghost_clipping.clipped_sum(model, ids, _example_losses(y), math.inf)
    F.cross_entropy(model(ids), y, reduction="sum").backward()
    for k, p in model.named_parameters():
        want = p.grad.to_dense() if p.grad.is_sparse else p.grad
        torch.testing.assert_close(got[k], want, rtol=1e-10, atol=1e-12, msg=k)
