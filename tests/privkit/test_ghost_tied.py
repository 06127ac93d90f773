"""An output layer tied to the input embedding under ghost clipping (``head.weight = emb.weight``,
GPT-2's and BERT's language-model heads) against torch.func.

The tied weight's per-example gradient is the embedding's rows plus the head's ``sum_t g_t a_t^T``:
its squared norm adds the two parts and twice their inner product, and its clipped sum adds the
two layers' clipped sums. Norms and clipped sums equal ``torch.func``'s per-example gradients
clipped (float64; the head's part materialised and by the ghost norm), for a causal language model
with the head on every position, a head on one pooled position, a padding token and repeated
tokens, and with the head declared first. Other sharing stays refused.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from privkit.mechanisms import ghost_clipping
from privkit.mechanisms.stacked import UnsupportedModelError
from tests.privkit.test_ghost_clipping import _check, _example_losses, _reference

V, D, T = 11, 8, 6


class LanguageModel(nn.Module):
    """Token and position embeddings, a causal ``nn.TransformerEncoderLayer``, a head on every
    position tied to the token embedding (declared first where ``head_first``)."""

    def __init__(self, padding_idx=None, head_first=False):
        super().__init__()
        if head_first:
            self.head = nn.Linear(D, V, bias=False)
        self.tok = nn.Embedding(V, D, padding_idx=padding_idx)
        self.pos = nn.Embedding(T, D)
        self.enc = nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0, batch_first=True)
        self.norm = nn.LayerNorm(D)
        if head_first:
            self.tok.weight = self.head.weight
        else:
            self.head = nn.Linear(D, V)
            self.head.weight = self.tok.weight

    def forward(self, idx):
        b, t = idx.shape
        h = self.tok(idx) + self.pos(torch.arange(t, device=idx.device).repeat(b, 1))
        mask = nn.Transformer.generate_square_subsequent_mask(t, h.device, h.dtype)
        return self.head(self.norm(self.enc(h, src_mask=mask, is_causal=True)))


def _next_token_loss(logits, y, _aux):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _next_token_losses(y):
    return lambda logits, s: F.cross_entropy(logits.transpose(1, 2), y[s], reduction="none").mean(1)


def _tokens(b=6, padding_idx=None):
    x = torch.randint(0, V, (b, T))
    x[0, :3] = 4  # a token repeated within an example
    if padding_idx is not None:
        x[1, -2:] = padding_idx
    return x, torch.randint(0, V, (b, T))


@pytest.mark.parametrize(
    "padding_idx, head_first",
    [(None, False), (0, False), (None, True)],
    ids=["tied", "padding-token", "head-declared-first"],
)
def test_a_language_models_tied_head(padding_idx, head_first, monkeypatch):
    torch.manual_seed(30)
    model = LanguageModel(padding_idx, head_first)
    x, y = _tokens(padding_idx=padding_idx)
    got = _check(model, x, y, monkeypatch, _next_token_loss, _next_token_losses)
    assert ("head.weight" if head_first else "tok.weight") in got
    assert ("tok.weight" if head_first else "head.weight") not in got


class Pooled(nn.Module):
    """Embeddings mean-pooled, then an output layer tied to them: the head on one position."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.out = nn.Linear(3, 5, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx):
        return self.out(torch.tanh(self.emb(idx).mean(1)))


def test_a_tied_head_on_one_position(monkeypatch):
    torch.manual_seed(31)
    x = torch.randint(0, 5, (6, 4))
    x[2] = 1  # one token four times
    _check(Pooled(), x, torch.randint(0, 5, (6,)), monkeypatch)


def test_the_inner_product_is_what_ties_the_norms():
    """Without the inner product term the norms are those of two separate weights: off."""
    torch.manual_seed(32)
    model = Pooled().double()
    x, y = torch.randint(0, 5, (6, 4)), torch.randint(0, 5, (6,))
    norms, _, _ = _reference(model, x, y)
    got = ghost_clipping.per_example_norms(model, x, _example_losses(y))
    torch.testing.assert_close(got, norms, rtol=1e-10, atol=1e-12)
    layers = ghost_clipping._layers(model)
    assert layers[1].tied is layers[0]


def test_clipping_off_adds_the_two_layers_sums():
    from tests.privkit.test_ghost_clipping import clipping_off_is_the_plain_sum

    torch.manual_seed(33)
    x, y = _tokens()
    model = LanguageModel().double()
    clipping_off_is_the_plain_sum(model, x, y, _next_token_loss, _next_token_losses)


def test_a_language_models_dp_sgd_step_takes_ghost_clipping(monkeypatch):
    from tests.privkit.test_ghost_parameters import takes_ghost_clipping

    torch.manual_seed(34)
    x, y = _tokens(8)
    takes_ghost_clipping(LanguageModel().double(), x, y, monkeypatch, _next_token_loss)


class TwoLinears(nn.Module):
    """Two linear layers sharing one weight: not an embedding's tie."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class TiedAndReused(Pooled):
    """A tied head whose weight is also read by a functional call."""

    def forward(self, idx):
        h = torch.tanh(self.emb(idx).mean(1))
        return self.out(h) + h @ self.emb.weight.T


@pytest.mark.parametrize(
    "model, x, why",
    [
        (TwoLinears(), torch.randn(6, 3), "is shared with"),
        (TiedAndReused(), torch.randint(0, 5, (6, 4)), "other than through its layer"),
    ],
    ids=["two-linears", "tied-and-reused"],
)
def test_other_sharing_is_refused(model, x, why):
    y = torch.randint(0, 3, (6,))
    with pytest.raises(UnsupportedModelError, match=why):
        ghost_clipping.clipped_sum(model, x, _example_losses(y), 1.0)


class NextToken(LanguageModel):
    """The language model predicting each sequence's next token from its last position."""

    def forward(self, idx):
        return super().forward(idx)[:, -1]


def test_a_language_models_dp_sgd_audit_sees_its_bugs(monkeypatch):
    """A language model's DP-SGD, its tied weight clipped as one parameter, audited white-box
    with canaries on every parameter (the tied weight's included): as claimed it is not a
    violation, and half the noise or clipping switched off are caught, at each of three seeds."""
    from tests.privkit.test_ghost_attention import audit_sees_its_bugs

    def build():
        data = torch.randint(0, V, (400, T)), torch.randint(0, V, (400,))
        return NextToken(), data

    audit_sees_its_bugs(monkeypatch, build)
