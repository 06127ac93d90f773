"""Embeddings of positions shared by the batch under ghost clipping, against torch.func.

nanoGPT embeds ``arange(T)`` and GPT-2 ``(1, T)`` position ids, and the model's code broadcasts
the ``(T, d)`` or ``(1, T, d)`` output over the batch: the embedding's output gradient is then
summed over the examples. For the pass, its output is repeated for each example (what the
broadcast gives), so its gradient holds each example's rows. Norms and clipped sums equal
``torch.func``'s (float64, every form of ghost clipping's layers), for both forms of positions;
the embedding is taken so at every later pass, also where the sequence is as long as the batch
(whose shapes could not tell). A model whose forward fails with the repeated output, or that uses
it other than broadcast over the batch, is refused and clipped by ``torch.func``. nanoGPT's model as its code writes it (tied head,
shared positions, causal attention) takes ghost clipping, no fallback.
"""

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from privkit.mechanisms import ghost_clipping
from privkit.mechanisms.stacked import UnsupportedModelError
from tests.privkit.test_ghost_clipping import _check, _example_losses, falls_back

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from dpsgd_step import CausalBlock


class Positions(nn.Module):
    """Token and position embeddings, the positions ``arange(T)`` (nanoGPT) or ``(1, T)`` (GPT-2)
    shared by the batch, mean-pooled to logits."""

    def __init__(self, leading_one=False):
        super().__init__()
        self.tok, self.pos = nn.Embedding(5, 3), nn.Embedding(6, 3)
        self.lin = nn.Linear(3, 3)
        self.leading_one = leading_one

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        pos = pos[None] if self.leading_one else pos
        return self.lin(torch.tanh(self.tok(idx) + self.pos(pos)).mean(1))


@pytest.mark.parametrize("leading_one", [False, True], ids=["arange", "leading-one"])
def test_positions_shared_by_the_batch(leading_one, monkeypatch):
    torch.manual_seed(50)
    model = Positions(leading_one)
    y = torch.randint(0, 3, (6,))
    _check(model, torch.randint(0, 5, (6, 4)), y, monkeypatch)
    # later, a sequence as long as the batch: the positions are still taken as shared
    _check(model, torch.randint(0, 5, (6, 6)), y, monkeypatch)


class Unpooled(Positions):
    """The position embedding's output used as one vector per position, then summed over the
    positions into every example: with the output repeated, the sum runs over the examples too
    (other outputs: refused)."""

    def forward(self, idx):
        p = self.pos(torch.arange(idx.shape[1], device=idx.device)).sum()
        return self.lin(torch.tanh(self.tok(idx)).mean(1)) + p


class Stacked(Positions):
    """The position embedding's output given a batch dimension by the model's code
    (``unsqueeze(0).expand(B, -1, -1)``) and stacked under the tokens: a repeated output no longer
    fits it, and following it to the batch stops at the concatenation."""

    def forward(self, idx):
        p = self.pos(torch.arange(2, device=idx.device)).unsqueeze(0)
        h = torch.cat([self.tok(idx), p.expand(idx.shape[0], -1, -1)], 1)
        return self.lin(torch.tanh(h))[:, 0]


class Multiplied(Positions):
    """The position embedding's output in a matrix product with the tokens' features: neither a
    repeated output nor following it to the batch gets through."""

    def forward(self, idx):
        p = self.pos(torch.arange(idx.shape[1], device=idx.device))  # (T, d)
        return self.lin(torch.tanh(self.tok(idx) @ p.T @ p).mean(1))


@pytest.mark.parametrize(
    "build, why",
    [
        (Unpooled, "other outputs than the model's own"),
        (Stacked, "the output of pos.weight, followed to where it meets the batch, is used by"),
        (Multiplied, "the output of pos.weight, followed to where it meets the batch, is used by"),
    ],
    ids=["summed-over-the-batch", "expanded-by-the-model", "in-a-matrix-product"],
)
def test_other_uses_of_shared_positions_are_refused_and_fall_back(build, why):
    torch.manual_seed(51)
    model = build().double()
    x, y = torch.randint(0, 5, (6, 4)), torch.randint(0, 3, (6,))
    with pytest.raises(UnsupportedModelError, match=why):
        ghost_clipping.clipped_sum(model, x, _example_losses(y), 1.0)
    falls_back(model, x, y, why)


class NanoGPT(nn.Module):
    """nanoGPT's model as its code writes it: ``wte.weight = lm_head.weight`` (the head declared
    first), positions ``arange(T)`` broadcast over the batch."""

    def __init__(self, vocab=13, d=8, length=8):
        super().__init__()
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(length, d)
        self.wte.weight = self.lm_head.weight
        self.h = nn.ModuleList([CausalBlock(d, 2), CausalBlock(d, 2)])
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def test_nanogpt_takes_ghost_clipping(monkeypatch):
    """nanoGPT's model through ``DpSgdStep``'s clipping, no fallback: its tied head and its shared
    positions, at three batch shapes (the second with a sequence as long as the batch)."""
    from tests.privkit.test_ghost_parameters import takes_ghost_clipping
    from tests.privkit.test_ghost_tied import _next_token_loss

    torch.manual_seed(52)
    model = NanoGPT().double()
    for b, t in ((5, 7), (6, 6), (3, 8)):
        x, y = torch.randint(0, 13, (b, t)), torch.randint(0, 13, (b, t))
        with monkeypatch.context() as patched:  # torch.func back for the next reference
            takes_ghost_clipping(model, x, y, patched, _next_token_loss)
