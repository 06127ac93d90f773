"""Layers run several times in one forward pass under ghost clipping, against torch.func.

A linear layer, an embedding, a LayerNorm or an RMSNorm called again (an RNN's cells over the
time steps, a block shared across depth as ALBERT's) has the per-example gradient
``sum_calls sum_t g_t a_t^T``: its calls are one call over all of their positions. Norms and
clipped sums equal ``torch.func``'s per-example gradients clipped (float64, every form of ghost
clipping's layers) for an Elman RNN of ``nn.Linear`` cells, a shared block applied three times,
opacus' ``DPLSTM`` (two bidirectional layers: its cells' ``nn.Linear`` maps over the steps, its
weights registered under ``nn.LSTM``'s names too), and a call whose output is not used. A
convolution (2-d, 1-d, grouped) or a GroupNorm run several times has its per-example gradients
formed call by call and summed (their calls may differ in shape; GroupNorm's statistics are per
call).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from privkit.mechanisms import ghost_clipping
from privkit.mechanisms.stacked import UnsupportedModelError
from tests.privkit.test_ghost_clipping import _check, _example_losses


class Elman(nn.Module):
    """An RNN of ``nn.Linear`` cells: each step embeds its token, adds the recurrent map of the
    state, and normalises (every layer run once per step)."""

    def __init__(self, norm=nn.LayerNorm):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.wx, self.wh = nn.Linear(4, 5), nn.Linear(5, 5, bias=False)
        self.norm, self.head = norm(5), nn.Linear(5, 3)

    def forward(self, idx):
        h = torch.zeros(idx.shape[0], 5, dtype=self.wx.weight.dtype)
        for t in range(idx.shape[1]):
            h = self.norm(torch.tanh(self.wx(self.emb(idx[:, t])) + self.wh(h)))
        return self.head(h)


class Shared(nn.Module):
    """One pre-norm MLP block applied three times (weights shared across depth, as ALBERT's),
    on sequences."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 6)
        self.norm, self.up, self.down = nn.LayerNorm(6), nn.Linear(6, 12), nn.Linear(12, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = self.inp(x)
        for _ in range(3):
            h = h + self.down(torch.tanh(self.up(self.norm(h))))
        return self.head(h.mean(1))


class Recurrent(nn.Module):
    """opacus' ``DPLSTM`` (its cells' ``nn.Linear`` maps, run once per step and direction)."""

    def __init__(self):
        from opacus.layers import DPLSTM

        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.lstm = DPLSTM(4, 5, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(10, 3)

    def forward(self, idx):
        return self.head(self.lstm(self.emb(idx))[0][:, -1])


class Unused(nn.Module):
    """A linear layer and a convolution called twice, their first outputs not used."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(1, 2, 2)
        self.lin = nn.Linear(6, 3)

    def forward(self, x):
        self.lin(2 * self.conv(2 * x[:, None]).flatten(1))
        return self.lin(self.conv(x[:, None]).flatten(1))


class SharedConvolutions(nn.Module):
    """A convolution and a GroupNorm applied at two depths (the second call on a smaller map), a
    1-d convolution twice: their per-example gradients are formed call by call and summed."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.conv, self.norm = nn.Conv2d(4, 4, 3, padding=1), nn.GroupNorm(2, 4)
        self.conv1d = nn.Conv1d(4, 4, 2, groups=2)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = self.stem(x)
        h = h + torch.tanh(self.norm(self.conv(h)))
        h = F.avg_pool2d(h, 2)
        h = h + torch.tanh(self.norm(self.conv(h)))
        s = h.flatten(2)
        s = torch.tanh(self.conv1d(torch.tanh(self.conv1d(s))))
        return self.head(s.mean(2))


@pytest.mark.parametrize(
    "build, x",
    [
        (Elman, lambda: torch.randint(0, 7, (6, 4))),
        (lambda: Elman(nn.RMSNorm), lambda: torch.randint(0, 7, (6, 4))),
        (Shared, lambda: torch.randn(6, 5, 3)),
        (Recurrent, lambda: torch.randint(0, 7, (6, 4))),
        (Unused, lambda: torch.randn(6, 4)),
        (SharedConvolutions, lambda: torch.randn(6, 3, 8, 8)),
    ],
    ids=["rnn", "rnn-rmsnorm", "shared-block", "opacus-dplstm", "unused-call", "convolutions"],
)
def test_layers_run_several_times(build, x, monkeypatch):
    torch.manual_seed(40)
    model, x = build(), x()
    got = _check(model, x, torch.randint(0, 3, (6,)), monkeypatch)
    assert list(got) == [k for k, p in model.named_parameters() if p.requires_grad]


class Aliased(nn.Module):
    """A linear layer's bias registered on the model under a second name and read through it
    too: no stand-in for the alias (its reads would be clipped apart from the layer's)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_parameter("scale", self.lin.bias)

    def forward(self, x):
        return self.lin(x) * self.scale


def test_an_alias_read_in_the_forward_is_refused():
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    with pytest.raises(UnsupportedModelError, match="other than through its layer"):
        ghost_clipping.clipped_sum(Aliased(), x, _example_losses(y), 1.0)


def test_clipping_off_sums_every_call():
    """With clipping off (no norms formed) the calls' gradients still all add."""
    from tests.privkit.test_ghost_clipping import clipping_off_is_the_plain_sum

    torch.manual_seed(41)
    x, y = torch.randn(6, 3, 8, 8, dtype=torch.float64), torch.randint(0, 3, (6,))
    clipping_off_is_the_plain_sum(SharedConvolutions().double(), x, y)
