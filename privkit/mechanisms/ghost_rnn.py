"""torch's recurrent layers (``nn.RNN``, ``nn.LSTM``, ``nn.GRU``) and cells (``nn.RNNCell``,
``nn.LSTMCell``, ``nn.GRUCell``) under ghost clipping: their linear maps in the open.

torch runs a recurrent layer as one fused kernel, whose per-example gradients no hook sees. Each
layer and direction of it is two linear maps, the input map ``x_t W_ih^T + b_ih`` and the hidden
map ``h_{t-1} W_hh^T + b_hh``, feeding the cell's gates. For the pass of
:mod:`privkit.mechanisms.ghost_clipping` its forward is replaced by the same recurrence written out
(:func:`forward`): the input map over every step at once, the hidden map at each step, each called
as an ``nn.Linear`` whose weight and bias are the recurrent layer's own parameters (:class:`Map`).
Ghost clipping takes them as linear layers: the input map's ``G_i = sum_t g_t x_t^T`` over the
``T`` steps, the hidden map's ``T`` calls merged into one call over ``T`` positions (a layer run
several times), as it takes opacus' ``DPLSTM``, whose cells are ``nn.Linear`` layers. The gates
are torch's: LSTM ``i, f, g, o`` (``c' = f c + i g``, ``h' = o tanh(c')``), GRU ``r, z, n``
(``n = tanh(x_n + r (h_n))``, ``h' = (1 - z) n + z h``), RNN ``tanh`` or ``relu`` of the sum.

A cell is one step of the same: its forward written out (:func:`cell_forward`) calls its input map
and its hidden map once each, on its own ``weight_ih``, ``weight_hh`` and biases. A user's loop
over the time steps calls the cell, so each map, once per step: ghost clipping takes those calls
as one call over the steps (a layer run several times), and the zero state a cell makes when it
is called on its input alone is made outside any map.

Dropout between stacked layers in training mode is drawn by the written-out forward
(``F.dropout`` on each layer's output but the last, from torch's generator): the fused kernel's
law, not its draws, as any two steps draw differently. A ``PackedSequence`` (sequences of
different lengths) runs padded, each example's steps past its length leaving its state as it was.
An LSTM with ``proj_size`` projects each step's hidden state by a third map, ``h = W_hr (o
tanh(c))``, taken as a linear layer without bias. Refused (:func:`refusal`; the model then takes
``torch.func``): a subclass (its forward may be its own), and at the call an unbatched input.
"""

from __future__ import annotations

import weakref
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from privkit.mechanisms.stacked import UnsupportedModelError

__all__ = ["Map", "Recurrent", "cell_forward", "forward", "maps", "refusal"]


#: a recurrent layer or cell of torch's, whose maps this module writes out
Recurrent = nn.RNNBase | nn.RNNCellBase

#: torch's own cells (a subclass's forward may be its own)
_CELLS = (nn.RNNCell, nn.LSTMCell, nn.GRUCell)


class Map(nn.Linear):
    """A recurrent layer's input or hidden map as a linear layer: its ``weight`` and ``bias`` are
    the recurrent layer's own parameters (the same tensors, not copies)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None):
        nn.Module.__init__(self)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = weight
        self.register_parameter("bias", bias)


#: its maps' kinds: the input map, the hidden map, and an LSTM's projection of its hidden state
#: (``proj_size``; a weight without bias)
_KINDS = ("ih", "hh", "hr")

#: each recurrent layer's maps, by name (``ih_l0``, ``hh_l0_reverse``, ...), made once: the same
#: modules from step to step (not registered on the layer: its parameters would appear twice)
_MAPS: weakref.WeakKeyDictionary[Recurrent, dict[str, Map]] = weakref.WeakKeyDictionary()


def _suffixes(module: Recurrent) -> list[str]:
    """The suffixes of its parameters' names, layer by layer, each layer's directions in turn (a
    cell's: none)."""
    if isinstance(module, nn.RNNCellBase):
        return [""]
    directions = ["", "_reverse"] if module.bidirectional else [""]
    return [f"_l{k}{d}" for k in range(module.num_layers) for d in directions]


def maps(module: Recurrent) -> dict[str, Map]:
    """The recurrent layer's (or cell's) maps by name: ``ih``, ``hh`` (and an LSTM's projection
    ``hr``) and the suffix of its parameters'."""
    made = _MAPS.get(module)
    if made is None or any(
        m.weight is not getattr(module, f"weight_{name}")
        or m.bias is not getattr(module, f"bias_{name}", None)
        for name, m in made.items()
    ):  # its parameters replaced since (a load_state_dict with assign, a model moved by hand)
        made = {
            f"{kind}{s}": Map(
                getattr(module, f"weight_{kind}{s}"), getattr(module, f"bias_{kind}{s}", None)
            )
            for s in _suffixes(module)
            for kind in _KINDS[: 3 if getattr(module, "proj_size", 0) else 2]
        }
        _MAPS[module] = made
    return made


def refusal(module: Recurrent) -> str | None:
    """Why the recurrent layer (or cell) cannot be written out as its fused kernel runs it, or
    ``None``."""
    name = type(module).__name__
    if isinstance(module, nn.RNNCellBase):
        return None if type(module) in _CELLS else f"{name}, a subclass of torch's recurrent cells"
    if type(module) not in (nn.RNN, nn.LSTM, nn.GRU):  # its forward may differ from torch's
        return f"{name}, a subclass of torch's recurrent layers"
    return None


def _cell(
    module: Recurrent, gx: torch.Tensor, gh: torch.Tensor, h: torch.Tensor, c: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One step of the cell from the input map's and the hidden map's outputs."""
    if isinstance(module, (nn.LSTM, nn.LSTMCell)):
        i, f, g, o = (gx + gh).chunk(4, 1)
        c = torch.sigmoid(f) * cast(torch.Tensor, c) + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c
    if isinstance(module, (nn.GRU, nn.GRUCell)):
        xr, xz, xn = gx.chunk(3, 1)
        hr, hz, hn = gh.chunk(3, 1)
        r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
        n = torch.tanh(xn + r * hn)
        return (1 - z) * n + z * h, None
    total = gx + gh
    nonlinearity = cast(str, module.nonlinearity)
    return (torch.tanh(total) if nonlinearity == "tanh" else torch.relu(total)), None


def cell_forward(module: nn.RNNCellBase, input: torch.Tensor, hx=None):
    """``module(input, hx)`` of a cell written out with its two maps (:func:`maps`): the same
    output as torch's fused cell, up to float rounding (an LSTM cell's ``(h, c)``)."""
    if input.dim() != 2:
        raise UnsupportedModelError(f"{type(module).__name__} on an unbatched input")
    lstm = isinstance(module, nn.LSTMCell)
    if hx is None:  # the zero state, made here rather than inside a map's call
        zeros = input.new_zeros(input.shape[0], module.hidden_size)
        hx = (zeros, zeros) if lstm else zeros
    h, c = hx if lstm else (hx, None)
    found = maps(module)
    h, c = _cell(module, found["ih"](input), found["hh"](h), h, c)
    return (h, c) if lstm else h


def forward(module: Recurrent, input, hx=None):
    """``module(input, hx)`` written out with its maps (:func:`maps`) called at each step: the same
    outputs as torch's fused kernel, up to float rounding. A ``PackedSequence`` runs padded, in
    the batch's own order: each example's state is kept past its last step (and, in the reverse
    direction, left as it was until its last step), so the steps beyond its length, whose outputs
    are not packed, reach nothing."""
    if isinstance(module, nn.RNNCellBase):
        return cell_forward(module, input, hx)
    packed = isinstance(input, nn.utils.rnn.PackedSequence)
    if packed:
        x, lengths = nn.utils.rnn.pad_packed_sequence(input, batch_first=True)
        active = (torch.arange(x.shape[1])[None, :] < lengths[:, None]).to(x.device)
    elif input.dim() != 3:
        raise UnsupportedModelError(f"{type(module).__name__} on an unbatched input")
    else:
        x, active = (input if module.batch_first else input.transpose(0, 1)), None  # (B, T, in)
    b = x.shape[0]
    lstm = isinstance(module, nn.LSTM)
    d = 2 if module.bidirectional else 1
    if hx is None:  # an LSTM's h of its projection's size
        size = getattr(module, "proj_size", 0) or module.hidden_size
        zeros = x.new_zeros(module.num_layers * d, b, module.hidden_size)
        hx = (zeros[..., :size], zeros) if lstm else zeros
    h0, c0 = hx if lstm else (hx, None)
    h_n, c_n = [], []
    for layer in range(module.num_layers):
        outs = []
        for direction in range(d):
            k = layer * d + direction
            suffix = f"_l{layer}" + ("_reverse" if direction else "")
            out, h, c = _direction(module, suffix, x, h0[k], c0[k] if c0 is not None else None,
                                   bool(direction), active)  # fmt: skip
            outs.append(out)
            h_n.append(h)
            c_n.append(c)
        x = torch.cat(outs, 2) if d == 2 else outs[0]
        if module.training and module.dropout > 0 and layer < module.num_layers - 1:
            x = F.dropout(x, module.dropout, training=True)  # between layers, as torch's kernel
    if not packed:
        x = x if module.batch_first else x.transpose(0, 1)
    out = _packed_like(x, input) if packed else x
    if lstm:
        return out, (torch.stack(h_n), torch.stack(cast(list[torch.Tensor], c_n)))
    return out, torch.stack(h_n)


def _direction(
    module: nn.RNNBase,
    suffix: str,
    x: torch.Tensor,
    h: torch.Tensor,
    c: torch.Tensor | None,
    reverse: bool,
    active: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One layer and direction over ``x`` ``(B, T, in)`` from the state ``(h, c)``: its outputs
    ``(B, T, hidden)`` and final state. ``active`` ``(B, T)``: the steps within each example's
    length (a packed sequence's), the others leaving the state as it was."""
    found = maps(module)
    gx = found[f"ih{suffix}"](x)  # every step at once: (B, T, gates)
    hh, hr = found[f"hh{suffix}"], found.get(f"hr{suffix}")
    steps = x.shape[1]
    seq: list[torch.Tensor] = [x] * steps  # each replaced below
    for s in range(steps - 1, -1, -1) if reverse else range(steps):
        h_s, c_s = _cell(module, gx[:, s], hh(h), h, c)
        if hr is not None:  # h = W_hr (o tanh(c)): an LSTM with proj_size
            h_s = hr(h_s)
        if active is not None:
            on = active[:, s, None]
            h_s = torch.where(on, h_s, h)
            c_s = None if c is None else torch.where(on, cast(torch.Tensor, c_s), c)
        h, c = h_s, c_s
        seq[s] = h
    out = torch.stack(seq, 1) if steps else x.new_zeros(x.shape[0], 0, h.shape[-1])
    return out, h, c


def _packed_like(x: torch.Tensor, packed: nn.utils.rnn.PackedSequence):
    """The padded outputs ``x`` ``(B, T, ...)`` (the batch's own order) packed as ``packed`` is:
    step by step, each step's examples in ``packed``'s sorted order."""
    sizes = packed.batch_sizes
    step = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
    rank = torch.cat([torch.arange(int(n)) for n in sizes])
    order = packed.sorted_indices
    example = rank if order is None else order.cpu()[rank]
    data = x[example.to(x.device), step.to(x.device)]
    return nn.utils.rnn.PackedSequence(data, sizes, packed.sorted_indices, packed.unsorted_indices)
