"""torch's recurrent layers under ghost clipping (privkit.mechanisms.ghost_rnn): their forward
written out with their input and hidden maps as linear layers.

The written-out forward equals torch's fused kernel (outputs and final states; LSTM, GRU, RNN;
stacked, bidirectional, sequence-first, without bias, from a given state, an LSTM's projection, on
packed sequences of different lengths; with dropout between layers, torch's single layers with the
same masks); the per-example norms and the clipped sum equal per-example gradients taken one
example at a time by autograd (float64, where ``torch.func`` cannot batch the fused kernel; every
way of the other layers' norms; clipping off is the plain sum); DP-SGD's step takes the path
without fallback, and under autocast and in bfloat16 one record alone contributes the clip norm;
what it cannot write out (a subclass) is refused and clipped by ``torch.func`` whole. torch's cells
in a model's loop are written out likewise.
"""

import functools
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from privkit.mechanisms import dp_sgd_step, ghost_clipping, ghost_rnn
from privkit.mechanisms.stacked import UnsupportedModelError
from tests.privkit.test_ghost_clipping import _check, _example_losses, _loss

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from hf_models import looped as _looped


def _given(model: nn.Module, x: torch.Tensor) -> tuple:
    """With ``model.given``, the recurrent layer's first state computed from the input ``(B, T,
    in)``; else none (its zeros)."""
    if not model.given:
        return ()
    rnn = model.rnn
    h = torch.tanh(x.mean(1)).repeat(1, 2)[:, : rnn.hidden_size]
    h0 = h.unsqueeze(0).repeat(rnn.num_layers * model.directions, 1, 1)
    if not isinstance(rnn, nn.LSTM):
        return (h0,)
    return ((h0[..., : rnn.proj_size or rnn.hidden_size], 0.5 * h0),)  # h projected, c not


def _from_final(model: nn.Module, final) -> torch.Tensor:
    """The head on the last layer's final states (both directions')."""
    h = final[0] if isinstance(model.rnn, nn.LSTM) else final
    return model.head(h[-model.directions :].transpose(0, 1).flatten(1))


class Classifier(nn.Module):
    """A recurrent layer on ``(B, T, 4)`` (transposed for a sequence-first one), its last step's
    output or (``final``) its last layer's final states to a linear head; with ``given`` its
    initial state computed from the input."""

    def __init__(self, rnn: nn.RNNBase, final: bool = False, given: bool = False):
        super().__init__()
        self.rnn, self.final, self.given = rnn, final, given
        self.directions = 2 if rnn.bidirectional else 1
        width = getattr(rnn, "proj_size", 0) or rnn.hidden_size
        self.head = nn.Linear(width * self.directions, 3)

    def forward(self, x):
        seq = x if self.rnn.batch_first else x.transpose(0, 1)
        out, final = self.rnn(seq, *_given(self, x))
        if self.final:
            return _from_final(self, final)
        out = out if self.rnn.batch_first else out.transpose(0, 1)
        return self.head(out[:, -1])


CASES = {
    "lstm": lambda: Classifier(nn.LSTM(4, 5, batch_first=True)),
    "lstm-stacked-bidirectional-sequence-first": lambda: Classifier(
        nn.LSTM(4, 5, num_layers=2, bidirectional=True), final=True, given=True
    ),
    "lstm-projected-stacked-bidirectional": lambda: Classifier(
        nn.LSTM(4, 5, num_layers=2, bidirectional=True, proj_size=3, batch_first=True),
        final=True,
        given=True,
    ),
    "gru-without-bias": lambda: Classifier(nn.GRU(4, 5, batch_first=True, bias=False), given=True),
    "gru-bidirectional": lambda: Classifier(nn.GRU(4, 3, batch_first=True, bidirectional=True)),
    "rnn-relu-stacked": lambda: Classifier(
        nn.RNN(4, 5, num_layers=2, nonlinearity="relu", batch_first=True), final=True
    ),
}


def _built(case: str):
    torch.manual_seed(sorted(CASES).index(case))
    model = CASES[case]()
    return model, torch.randn(7, 6, 4), torch.randint(0, 3, (7,))


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_written_out_forward_is_torchs(case):
    model, x, _ = _built(case)
    seq = x if model.rnn.batch_first else x.transpose(0, 1)
    with torch.no_grad():
        want, got = model.rnn(seq), ghost_rnn.forward(model.rnn, seq)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    if isinstance(model.rnn, nn.LSTM):
        for g, w in zip(got[1], want[1], strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", sorted(CASES))
def test_recurrent_layers_against_per_example_gradients(case, monkeypatch):
    model, x, y = _built(case)
    _against_autograd(model, "rnn", x, y, monkeypatch)


def _against_autograd(model: nn.Module, name: str, x, y, monkeypatch) -> None:
    """The recurrent layer or cell ``name``'s maps taken as linear layers on its own parameters;
    norms and clipped sums as autograd's one example at a time, every way of the other layers'
    norms; clipping off, the plain sum."""
    monkeypatch.setattr(dp_sgd_step, "per_sample_gradients", _looped)
    recurrent = getattr(model, name)
    maps = [layer for layer in ghost_clipping._layers(model) if layer.rnn is not None]
    assert maps and all(isinstance(layer.module, ghost_rnn.Map) for layer in maps)
    assert all(layer.rnn is recurrent for layer in maps)
    got = _check(model, x, y, monkeypatch)
    assert {k for k in got if k.startswith(f"{name}.")} == {
        f"{name}.{k}" for k, _ in recurrent.named_parameters()
    }
    per = _looped(model.double(), x.double(), y, _loss)
    plain = ghost_clipping.clipped_sum(model, x.double(), _example_losses(y), float("inf"))
    for k, g in per.items():
        torch.testing.assert_close(plain[k], g.sum(0), rtol=1e-10, atol=1e-12, msg=k)


def test_dp_sgd_takes_the_path_and_leaves_the_layer_as_it_was():
    """No fallback, no torch.func; the recurrent layer's own forward is back after the step."""
    model, x, y = _built("lstm")
    with warnings.catch_warnings():
        warnings.simplefilter("error", dp_sgd_step.ClippingFallbackWarning)
        dp_sgd_step.clipped_gradient_sum(model, x, y, _loss, 1.0)
    assert "forward" not in model.rnn.__dict__
    assert not any(isinstance(m, ghost_rnn.Map) for m in model.modules())


class OwnLSTM(nn.LSTM):
    """A subclass of torch's LSTM (its forward could be anything)."""


@pytest.mark.parametrize(
    "rnn, why",
    [
        (OwnLSTM(4, 5, batch_first=True), "a subclass of torch's recurrent layers"),
    ],
    ids=["subclass"],
)
def test_what_it_cannot_write_out_is_refused(rnn, why):
    torch.manual_seed(3)
    model = Classifier(rnn)
    x, y = torch.randn(7, 6, 4), torch.randint(0, 3, (7,))
    with pytest.raises(UnsupportedModelError, match=why):
        ghost_clipping.clipped_sum(model, x, _example_losses(y), 1.0)


def _value_dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """Dropout whose mask comes from each value itself: the same masks for an example alone as in
    its batch, so that autograd one example at a time sees what the batch's pass saw."""
    keep = (x.detach() * 997).frac().abs() >= p
    return x * keep / (1 - p) if training else x


@pytest.mark.parametrize("bidirectional", [False, True], ids=["one-way", "bidirectional"])
def test_dropout_between_layers_in_training(bidirectional, monkeypatch):
    """A stacked LSTM with dropout in training mode: the written-out forward drops each layer's
    output but the last, as torch's kernel (its single layers run one by one with the same
    masks), and its norms and sums are autograd's one example at a time through it."""
    torch.manual_seed(6)
    monkeypatch.setattr(ghost_rnn.F, "dropout", _value_dropout)
    rnn = nn.LSTM(4, 5, num_layers=3, dropout=0.4, batch_first=True, bidirectional=bidirectional)
    model = Classifier(rnn, final=True).double()
    x, y = torch.randn(7, 6, 4, dtype=torch.float64), torch.randint(0, 3, (7,))
    d = 2 if bidirectional else 1
    layers = [
        nn.LSTM(4 if k == 0 else 5 * d, 5, batch_first=True, bidirectional=bidirectional)
        for k in range(3)
    ]
    h, finals = x, []
    with torch.no_grad():
        for k, layer in enumerate(layers):
            for name, p in layer.double().named_parameters():  # weight_ih_l0(_reverse) ...
                p.copy_(getattr(rnn, name.replace("_l0", f"_l{k}")))
            h, (h_n, _) = layer(h)
            finals.append(h_n)
            h = _value_dropout(h, 0.4) if k < 2 else h
        out, (h_n, _) = ghost_rnn.forward(rnn, x)
    torch.testing.assert_close(out, h, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(h_n, torch.cat(finals), rtol=1e-10, atol=1e-12)

    def written_looped(m, xs, ys, loss, aux=None):  # autograd through the written-out forward
        m.rnn.forward = functools.partial(ghost_rnn.forward, m.rnn)
        try:
            return _looped(m, xs, ys, loss, aux)
        finally:
            m.rnn.__dict__.pop("forward", None)

    monkeypatch.setattr(dp_sgd_step, "per_sample_gradients", written_looped)
    _check(model, x, y, monkeypatch)


def _lengths(x: torch.Tensor) -> torch.Tensor:
    """Each example's length, from its own first value."""
    return 1 + (x[:, 0, 0].detach().abs() * 10).long() % x.shape[1]


class Packed(nn.Module):
    """A recurrent layer on sequences of different lengths, packed (each example's length from its
    own values, so that an example alone packs as in its batch; with ``sort`` packed as given,
    ``enforce_sorted``): its final states (``final``) or its outputs unpacked and averaged over
    each example's steps, to a linear head. A packed sequence has no layout: the recurrent layer
    takes it batch-first or not."""

    def __init__(self, rnn: nn.RNNBase, final: bool = False, given: bool = False, sort=False):
        super().__init__()
        self.rnn, self.final, self.given, self.sort = rnn, final, given, sort
        self.directions = 2 if rnn.bidirectional else 1
        width = getattr(rnn, "proj_size", 0) or rnn.hidden_size
        self.head = nn.Linear(width * self.directions, 3)

    def forward(self, x):
        packed = nn.utils.rnn.pack_padded_sequence(
            x, _lengths(x), batch_first=True, enforce_sorted=self.sort
        )
        out, final = self.rnn(packed, *_given(self, x))
        if self.final:
            return _from_final(self, final)
        padded, lengths = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
        return self.head(padded.sum(1) / lengths[:, None].to(padded.dtype))


PACKED = {
    "lstm-packed": lambda: Packed(nn.LSTM(4, 5, batch_first=True)),
    "lstm-packed-stacked-bidirectional-final": lambda: Packed(
        nn.LSTM(4, 5, num_layers=2, bidirectional=True), final=True, given=True
    ),
    "lstm-packed-projected": lambda: Packed(nn.LSTM(4, 5, batch_first=True, proj_size=2)),
    "gru-packed-bidirectional": lambda: Packed(nn.GRU(4, 3, bidirectional=True)),
    "rnn-packed-sorted-final": lambda: Packed(nn.RNN(4, 5), final=True, sort=True),
}


def _packed_built(case: str):
    torch.manual_seed(20 + sorted(PACKED).index(case))
    model, x = PACKED[case](), torch.randn(7, 6, 4)
    if model.sort:  # lengths 6, 5, ..., 1, 1: the batch longest first
        x[:, 0, 0] = torch.tensor([5, 4, 3, 2, 1, 0, 0]) / 10 + 0.05
    return model, x, torch.randint(0, 3, (7,))


@pytest.mark.parametrize("case", sorted(PACKED))
def test_the_written_out_forward_of_a_packed_sequence_is_torchs(case):
    """Outputs packed as torch packs them (its batch sizes and orders), final states per example
    in the batch's order."""
    model, x, _ = _packed_built(case)
    packed = nn.utils.rnn.pack_padded_sequence(
        x, _lengths(x), batch_first=True, enforce_sorted=model.sort
    )
    with torch.no_grad():
        want, got = model.rnn(packed), ghost_rnn.forward(model.rnn, packed)
    torch.testing.assert_close(got[0].data, want[0].data, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[0].batch_sizes, want[0].batch_sizes)
    for g_order, w_order in zip(got[0][2:], want[0][2:], strict=True):
        assert (g_order is None and w_order is None) or torch.equal(g_order, w_order)
    finals = (
        zip(got[1], want[1], strict=True) if isinstance(want[1], tuple) else [(got[1], want[1])]
    )
    for g, w in finals:
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", sorted(PACKED))
def test_packed_sequences_against_per_example_gradients(case, monkeypatch):
    model, x, y = _packed_built(case)
    _against_autograd(model, "rnn", x, y, monkeypatch)


def test_an_lstm_trains_by_dp_sgd_with_per_example_norms_as_autograd_s():
    """Three DP-SGD steps of the LSTM classifier in float32 (seeded noise): finite, and each step's
    norms as autograd's one example at a time (to float32 rounding)."""
    from privkit.mechanisms.dp_random import DpRandom

    model, x, y = _built("lstm")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = dp_sgd_step.DpSgdStep(1.0, 1.0, 7 / 100, 100)
    source = DpRandom(torch.Generator().manual_seed(0))
    for _ in range(3):
        norms = ghost_clipping.per_example_norms(model, x, _example_losses(y))
        per = _looped(model, x, y, _loss)
        want = sum(g.reshape(7, -1).pow(2).sum(1) for g in per.values()).sqrt()
        torch.testing.assert_close(norms, want, rtol=1e-4, atol=1e-6)
        step.apply(model, opt, x, y, lambda lo, t, a: F.cross_entropy(lo, t), source)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("precision", ["autocast", "bfloat16"])
def test_an_example_alone_contributes_the_clip_norm_in_half_precision(precision):
    """A stacked GRU under bfloat16 autocast and held in bfloat16: one record alone clipped to
    the clip norm."""
    from tests.privkit.test_ghost_layer_vjp import each_record_alone_is_clipped_to_the_norm

    torch.manual_seed(5)
    model = Classifier(nn.GRU(4, 5, num_layers=2, batch_first=True))
    x, y = torch.randn(4, 6, 4), torch.randint(0, 3, (4,))
    each_record_alone_is_clipped_to_the_norm(model, x, y, precision)


def test_parameters_replaced_are_the_ones_clipped(monkeypatch):
    """The maps follow the recurrent layer's parameters when they are replaced (a state dict
    loaded with ``assign``): norms of the new weights, not of the first ones."""
    model, x, y = _built("gru-without-bias")
    ghost_clipping.per_example_norms(model, x, _example_losses(y))
    torch.manual_seed(11)
    fresh = nn.GRU(4, 5, batch_first=True, bias=False)
    model.rnn.load_state_dict(fresh.state_dict(), assign=True)
    norms = ghost_clipping.per_example_norms(model, x, _example_losses(y))
    per = _looped(model, x, y, _loss)
    want = sum(g.reshape(7, -1).pow(2).sum(1) for g in per.values()).sqrt()
    torch.testing.assert_close(norms, want, rtol=1e-4, atol=1e-6)


class CellLoop(nn.Module):
    """A cell run over the steps of ``(B, T, 4)`` by the model's own loop, its last state to a
    linear head; with ``given`` its first state computed from the input, else the cell's zeros
    (the cell called on its input alone)."""

    def __init__(self, cell: nn.RNNCellBase, given: bool = False):
        super().__init__()
        self.cell, self.given = cell, given
        self.head = nn.Linear(cell.hidden_size, 3)

    def forward(self, x):
        lstm = isinstance(self.cell, nn.LSTMCell)
        state = None
        if self.given:
            h = torch.tanh(x.mean(1)).repeat(1, 2)[:, : self.cell.hidden_size]
            state = (h, 0.5 * h) if lstm else h
        for t in range(x.shape[1]):
            state = self.cell(x[:, t]) if state is None else self.cell(x[:, t], state)
        return self.head(state[0] if lstm else state)


CELLS = {
    "lstm-cell": lambda: CellLoop(nn.LSTMCell(4, 5)),
    "lstm-cell-given": lambda: CellLoop(nn.LSTMCell(4, 5), given=True),
    "gru-cell-without-bias": lambda: CellLoop(nn.GRUCell(4, 5, bias=False), given=True),
    "gru-cell": lambda: CellLoop(nn.GRUCell(4, 3)),
    "rnn-cell-relu": lambda: CellLoop(nn.RNNCell(4, 5, nonlinearity="relu")),
    "rnn-cell-tanh-given": lambda: CellLoop(nn.RNNCell(4, 5), given=True),
}


def _cell_built(case: str):
    torch.manual_seed(10 + sorted(CELLS).index(case))
    return CELLS[case](), torch.randn(7, 6, 4), torch.randint(0, 3, (7,))


@pytest.mark.parametrize("case", sorted(CELLS))
def test_the_written_out_cell_is_torchs(case):
    model, x, _ = _cell_built(case)
    h = torch.randn(7, model.cell.hidden_size)
    state = (h, torch.randn_like(h)) if isinstance(model.cell, nn.LSTMCell) else h
    with torch.no_grad():
        for args in ((x[:, 0],), (x[:, 0], state)):
            want, got = model.cell(*args), ghost_rnn.forward(model.cell, *args)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        with ghost_clipping._written_out(ghost_clipping._layers(model)):
            torch.testing.assert_close(model(x), _own(model, x), rtol=1e-5, atol=1e-6)


def _own(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's output by torch's fused cell (the written-out forward taken away)."""
    forward = model.cell.__dict__.pop("forward")
    try:
        return model(x)
    finally:
        model.cell.forward = forward


@pytest.mark.parametrize("case", sorted(CELLS))
def test_cells_in_a_loop_against_per_example_gradients(case, monkeypatch):
    """Each map called once per step (six calls, merged)."""
    model, x, y = _cell_built(case)
    _against_autograd(model, "cell", x, y, monkeypatch)


def test_dp_sgd_takes_the_path_for_a_cell_and_leaves_it_as_it_was():
    """No fallback, no torch.func; the cell's own forward is back after the step, a cell and a
    recurrent layer in one model are both written out, and an LSTM on packed sequences is too."""

    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.loop = nn.GRU(4, 4, batch_first=True), CellLoop(nn.LSTMCell(4, 5))

        def forward(self, x):
            return self.loop(self.rnn(x)[0])

    torch.manual_seed(12)
    x, y = torch.randn(7, 6, 4), torch.randint(0, 3, (7,))
    for model in (_cell_built("lstm-cell")[0], Both(), _packed_built("lstm-packed")[0]):
        with warnings.catch_warnings():
            warnings.simplefilter("error", dp_sgd_step.ClippingFallbackWarning)
            got = dp_sgd_step.clipped_gradient_sum(model, x, y, _loss, 0.5)
        assert set(got) == {k for k, _ in model.named_parameters()}
        assert not any("forward" in m.__dict__ for m in model.modules())
        norms = ghost_clipping.per_example_norms(model, x, _example_losses(y))
        per = _looped(model, x, y, _loss)
        want = sum(g.reshape(7, -1).pow(2).sum(1) for g in per.values()).sqrt()
        torch.testing.assert_close(norms, want, rtol=1e-4, atol=1e-6)


class OwnGRUCell(nn.GRUCell):
    """A subclass of torch's GRU cell (its forward could be anything)."""


def test_what_a_cell_cannot_write_out_is_refused():
    """A subclass of a cell, and a cell on an unbatched input: refused, clipped by torch.func."""
    torch.manual_seed(13)
    x, y = torch.randn(7, 6, 4), torch.randint(0, 3, (7,))
    with pytest.raises(UnsupportedModelError, match="a subclass of torch's recurrent cells"):
        ghost_clipping.clipped_sum(CellLoop(OwnGRUCell(4, 5)), x, _example_losses(y), 1.0)

    class Unbatched(CellLoop):
        def forward(self, x):
            states = [torch.tanh(row[0]).repeat(2)[: self.cell.hidden_size] for row in x]
            return self.head(torch.stack([self.cell(r[0], h) for r, h in zip(x, states)]))

    with pytest.raises(UnsupportedModelError, match="GRUCell on an unbatched input"):
        ghost_clipping.clipped_sum(Unbatched(nn.GRUCell(4, 5)), x, _example_losses(y), 1.0)
    with pytest.warns(dp_sgd_step.ClippingFallbackWarning, match="unbatched input"):
        dp_sgd_step.clipped_gradient_sum(Unbatched(nn.GRUCell(4, 5)), x, y, _loss, 1.0)


def test_a_cell_alone_contributes_the_clip_norm_in_half_precision():
    """An LSTM cell's loop under bfloat16 autocast: one record alone clipped to the clip norm."""
    from tests.privkit.test_ghost_layer_vjp import each_record_alone_is_clipped_to_the_norm

    torch.manual_seed(14)
    model = CellLoop(nn.LSTMCell(4, 5))
    x, y = torch.randn(4, 6, 4), torch.randint(0, 3, (4,))
    each_record_alone_is_clipped_to_the_norm(model, x, y, "autocast")
