"""A model's own linear layers under ghost clipping (privkit.mechanisms.ghost_affine) against
torch.func.

HF transformers' ``Conv1D`` (weight stored ``(in, out)``, read by ``addmm``; written out here as its
code has it) and a hand-written linear layer over ``F.linear`` (stored ``(out, in)``, identity
initialised, so its outputs cannot show its layout) are taken as linear layers in the layout their
first call's weight gradient shows: norms and clipped sums equal ``torch.func``'s per-example
gradients clipped (float64; materialised, by the ghost norm, and book-kept by input or by output
gradient), with a frozen weight (BitFit), run once per time step, and with dropout. Modules of the
same shapes whose weight enters otherwise (scaled, added) are found so on their first call and
clipped by per-example stand-ins, with the pass taken again from the same random state.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from privkit.mechanisms import dp_sgd_step, ghost_affine, ghost_clipping
from tests.privkit.test_ghost_clipping import (
    _check,
    _example_losses,
    _loss,
    clipping_off_is_the_plain_sum,
    falls_back,
)
from tests.privkit.test_ghost_parameters import takes_ghost_clipping

D, T = 8, 5


class Conv1D(nn.Module):
    """HF transformers' ``Conv1D`` (``transformers.pytorch_utils``), as its code writes it."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.3)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class OwnLinear(nn.Module):
    """A square linear layer of a model's own over ``F.linear``, identity-initialised."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.eye(d))
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class Mlp(nn.Module):
    """GPT-2's MLP of Conv1D maps over a sequence, a square linear layer of the model's own,
    dropout, mean pooling, a torch linear head."""

    def __init__(self, dropout=0.0):
        super().__init__()
        self.c_fc = Conv1D(2 * D, D)
        self.c_proj = Conv1D(D, 2 * D)
        self.square = OwnLinear(D)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        h = self.c_proj(F.gelu(self.c_fc(x)))
        return self.head(self.drop(self.square(h + x)).mean(1))


def _batch(b=7):
    return torch.randn(b, T, D), torch.randint(0, 3, (b,))


def test_conv1d_and_a_linear_layer_of_its_own_are_linear_layers(monkeypatch):
    """Every form of a linear layer's norms and sums, in the layout each module's gradient shows:
    Conv1D's ``(in, out)``, and ``(out, in)`` for the identity-initialised square weight, whose
    outputs are the same either way round."""
    torch.manual_seed(40)
    model = Mlp()
    x, y = _batch()
    _check(model, x, y, monkeypatch)
    assert ghost_affine.verified(model.c_fc) is True
    assert ghost_affine.verified(model.c_proj) is True
    assert ghost_affine.verified(model.square) is False
    clipping_off_is_the_plain_sum(model, x.double(), y)
    takes_ghost_clipping(model, x.double(), y, monkeypatch)


def test_a_frozen_weight_with_a_trainable_bias(monkeypatch):
    """BitFit: only the biases train; the Conv1D layers' per-example bias gradients."""
    torch.manual_seed(41)
    model = Mlp()
    for m in (model.c_fc, model.c_proj, model.square):
        m.weight.requires_grad_(False)
    got = _check(model, *_batch(), monkeypatch)
    assert "c_fc.bias" in got and "c_fc.weight" not in got


class Recurrent(nn.Module):
    """An Elman cell of Conv1D maps run once per time step (their calls merged)."""

    def __init__(self):
        super().__init__()
        self.inp = Conv1D(D, D)
        self.rec = Conv1D(D, D)
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        h = torch.zeros(x.shape[0], D, dtype=x.dtype)
        for t in range(x.shape[1]):
            h = torch.tanh(self.inp(x[:, t]) + self.rec(h))
        return self.head(h)


def test_a_conv1d_run_once_per_time_step(monkeypatch):
    torch.manual_seed(42)
    model = Recurrent()
    _check(model, *_batch(), monkeypatch)
    assert ghost_affine.verified(model.rec) is True


class Scaled(nn.Module):
    """A 2-d weight whose output is twice a linear map's: not a linear layer of its weight,
    though shaped as one."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(D, D) * 0.3)

    def forward(self, x):
        return 2 * (x @ self.weight)


class Positions(nn.Module):
    """A learned position table ``(T, D)`` added to the tokens, here square (``T = D``): an input
    and an output as wide as a square linear layer's."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(D, D) * 0.3)

    def forward(self, x):
        return x + self.weight


@pytest.mark.parametrize("module", [Scaled, Positions], ids=["scaled", "positions"])
def test_a_module_shaped_as_a_linear_layer_but_not_one_takes_stand_ins(module, monkeypatch):
    """Found on its first call (its weight gradient is no layout's), remembered, and clipped by
    per-example stand-ins with no fallback; dropout before it is drawn as a plain pass draws it
    (the pass taken again from the random state it began with)."""
    torch.manual_seed(43)
    model = nn.Sequential(nn.Linear(D, D), module(), nn.Flatten(), nn.Linear(D * D, 3))
    x, y = torch.randn(6, D, D, dtype=torch.float64), torch.randint(0, 3, (6,))
    takes_ghost_clipping(model.double(), x, y, monkeypatch)
    assert ghost_affine.verified(model[1]) is None and not ghost_affine.may_be_affine(model[1])

    dropped = nn.Sequential(nn.Dropout(0.5), module(), nn.Flatten(), nn.Linear(D * D, 3)).double()
    torch.manual_seed(44)
    got = ghost_clipping.clipped_sum(dropped, x, _example_losses(y), math.inf)
    after = torch.rand(1)
    torch.manual_seed(44)
    F.cross_entropy(dropped(x), y, reduction="sum").backward()
    assert torch.equal(torch.rand(1), after)  # one pass' draws, no more
    for k, p in dropped.named_parameters():
        torch.testing.assert_close(got[k], p.grad, rtol=1e-10, atol=1e-12, msg=k)


def test_dropout_after_a_conv1d_is_drawn_as_a_plain_pass_draws_it():
    """The first call's check draws from a generator of its own: a model with dropout clipped
    with clipping off has the plain pass's gradient for the same seed."""
    torch.manual_seed(45)
    model = Mlp(dropout=0.5).double()
    x, y = _batch()
    x = x.double()
    torch.manual_seed(46)
    got = ghost_clipping.clipped_sum(model, x, _example_losses(y), math.inf)
    torch.manual_seed(46)
    F.cross_entropy(model(x), y, reduction="sum").backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(got[k], p.grad, rtol=1e-10, atol=1e-12, msg=k)


def test_a_dp_sgd_step_of_conv1d_layers_is_the_torch_func_step():
    """``DpSgdStep`` through ghost clipping: the noiseless step of a model of Conv1D layers is
    torch.func's clipped mean."""
    torch.manual_seed(47)
    model = Mlp().double()
    x, y = _batch(6)
    x = x.double()
    per = dp_sgd_step.per_sample_gradients(model, x, y, _loss)
    clipped, _ = dp_sgd_step.clip_per_sample(per, 0.5)
    step = dp_sgd_step.DpSgdStep(0.5, 0.0, 0.5, 12)
    got = step.noisy_gradient(model, x, y, _loss, torch.Generator().manual_seed(0))
    for k, g in clipped.items():
        torch.testing.assert_close(got[k], g.sum(0) / 6, rtol=1e-10, atol=1e-12, msg=k)


class SquaredBias(nn.Module):
    """A linear map plus its bias squared: linear in its weight, not in its bias."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(D, D) * 0.3)
        self.bias = nn.Parameter(torch.randn(D))

    def forward(self, x):
        return x @ self.weight + self.bias**2


def test_a_bias_entering_otherwise_is_not_a_linear_layers():
    """Found on its first call; on rows ``(B, D)`` its weight's stand-in broadcasts to other
    outputs (the output check finds it), so the model falls back to torch.func's clipped sum."""
    torch.manual_seed(48)
    model = nn.Sequential(nn.Linear(D, D), SquaredBias(), nn.Tanh(), nn.Linear(D, 3)).double()
    x, y = torch.randn(6, D, dtype=torch.float64), torch.randint(0, 3, (6,))
    falls_back(model, x, y, "other outputs than the model.s own")
    assert not ghost_affine.may_be_affine(model[1])


class FlatRows(nn.Module):
    """Conv1D maps on ``(B T, d)`` rows (the sequence flattened into the batch, as OPT's MLP)."""

    def __init__(self):
        super().__init__()
        self.c_fc = Conv1D(2 * D, D)
        self.head = nn.Linear(2 * D, 3)

    def forward(self, x):
        b = x.shape[0]
        h = torch.tanh(self.c_fc(x.reshape(-1, D)))
        return self.head(h.reshape(b, T, 2 * D).mean(1))


def test_a_conv1d_on_rows_that_flatten_the_batch(monkeypatch):
    torch.manual_seed(49)
    model = FlatRows()
    _check(model, *_batch(), monkeypatch)
    assert ghost_affine.verified(model.c_fc) is True


def test_no_rows_show_no_layout():
    """A call on no rows fits either layout: the check claims none (and ghost clipping does not
    ask it on an empty call, leaving the layout to a later one)."""
    layer = OwnLinear(D)
    a = torch.randn(0, D)
    with pytest.raises(ghost_affine.NotAffine):
        ghost_affine.layout(layer, a, layer(a), 1e-3)
