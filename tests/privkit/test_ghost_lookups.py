"""Embedding tables read by subclasses, shared by several embeddings, and layers on rows that
flatten the batch, under ghost clipping, against torch.func.

- An ``nn.Embedding`` subclass with a forward of its own (HF's scaled word embeddings,
  ``super().forward(ids) * scale``; OPT's and BART's learned positions, ``super().forward(positions +
  offset)``) is seen by its table's lookups (``privkit.mechanisms.ghost_lookups``); one that reads
  its weight otherwise, or looks up with another padding row or a ``max_norm``, is refused.
- Embeddings of one table (T5's and BART's encoder and decoder token embeddings, an output layer
  tied to it) are one embedding layer called by each.
- Linear and normalisation layers on ``(B T, d)`` rows (OPT's MLP) are taken per example; rows
  flattened position-major are found by the row check and refused.

Norms and clipped sums equal ``torch.func``'s per-example gradients clipped (float64).
"""

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
        (OtherPadding, "padding_idx 0, not None"),
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
