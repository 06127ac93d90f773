"""FLiP's client updates for MLPs: every client of a round at once, the unroll in rank-one form.

**Why.**  FLiP's unroll (:func:`privkit.trainers.flip.unroll`) takes K single-sample SGD steps and
differentiates through them. Written with ``autograd.grad(create_graph=True)`` on one client at a
time, each step forms a new copy of every weight matrix (784 x 32 for the first layer of an MNIST
MLP) and the outer backward differentiates twice through each copy: a quick FLiP run spent 90% of
its time in autograd on tiny tensors, and its audit (17 runs one after the other) was the demo's
longest stage.

**The form.**  One SGD step on one sample changes a linear layer by a rank-one matrix. With
``a_{l-1}`` the layer's input and ``delta_l`` the error back-propagated to its output,
``W_l <- W_l - eta * delta_l a_{l-1}^T`` and ``b_l <- b_l - eta * delta_l``. After ``j`` steps::

    W_l^(j) v   = W_l^(0) v   - D_l^T (A_{l-1} v + 1)        (bias included)
    W_l^(j)^T u = W_l^(0)^T u - A_{l-1}^T (D_l u)

with ``A_{l-1}`` (j x in) the inputs the layer saw and ``D_l`` (j x out) the scaled errors
``eta_i * delta_{l,i}``. The unroll keeps ``A`` and ``D`` (K rows per layer) and never forms an
updated weight matrix. The errors are written out (softmax cross-entropy's ``softmax(z) * sum(q) -
q``, ReLU's indicator), so the gradient of the raw-data loss with respect to the samples, label
logits and rates is one first-order backward through explicit tensor operations; autograd's double
backward in the generic unroll computes the same derivatives.

**Clients together.**  Every tensor carries a leading client axis: the clients of a round start
from the same distilled data and update it independently, so they step in lockstep, each on its own
raw batch (padded and masked to the longest), each with its own Adam state (Adam is elementwise).
Clients with a different number of batches per epoch form separate lockstep groups. The starting
weights are one model's (the clients of one run), or one per model with the clients of each model
consecutive and as many per model (an audit's reference runs): the products with the weights are
then taken per model, ``m`` clients' rows at once, rather than per client.

**Shapes that suit the CPU.**  The raw rows are held feature-major, ``(C, features, rows)``: the
softmax over 10 classes then runs along the rows (a row-major ``(rows, 10)`` softmax took 16x
longer), and no product's gradient comes back transposed. Each client's raw rows are narrowed to
the inputs some row of it uses (MNIST: about two thirds of the pixels): the samples meet the rows
only there, so the other columns add nothing to the product or its gradient. The unroll's
one-row products are broadcast multiplications and sums, not matrix products of one row, whose
backward passes are matrix products of inner size 1 (slow in the BLAS).

The result equals the per-client generic path up to floating-point rounding (checked in float64 by
``tests/privkit/test_flip.py``: weights, gradients and client updates). It applies to privkit's
``mlp`` architecture (Flatten, then Linear and ReLU layers, then the Linear head); other models
keep the generic path. This module holds the unroll's algebra; the lockstep client updates that use
it are :func:`privkit.trainers.flip.round_updates`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

History = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer ``(A, D)``: the inputs ``(C, K, in)`` and scaled errors ``(C, K, out)`` of the steps."""

Layers = Sequence[tuple[torch.Tensor, torch.Tensor]]
"""Per linear layer ``(W, b)``: ``(out, in)`` and ``(out,)`` shared by the clients, or ``(R, out,
in)`` and ``(R, out)``, one per model, the ``C`` clients grouped ``C / R`` per model in order."""


def mlp_linear_names(model: nn.Module) -> list[tuple[str, str]] | None:
    """``[(weight name, bias name), ...]`` of the linear layers in order when ``model`` is privkit's
    MLP (``features`` = Flatten, then Linear/ReLU pairs; ``head`` = Linear), else ``None``."""
    features, head = getattr(model, "features", None), getattr(model, "head", None)
    if not isinstance(features, nn.Sequential) or type(head) is not nn.Linear:
        return None
    layers = list(features)
    if not layers or type(layers[0]) is not nn.Flatten or len(layers) % 2 != 1:
        return None
    names = []
    for i in range(1, len(layers), 2):
        if type(layers[i]) is not nn.Linear or type(layers[i + 1]) is not nn.ReLU:
            return None
        names.append((f"features.{i}.weight", f"features.{i}.bias"))
    if any(layer.bias is None for layer in (*layers[1::2], head)):
        return None
    return [*names, ("head.weight", "head.bias")]


# ----------------------------------------------------------------------------- products per model
def _linear(W: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``a W^T + b`` for rows ``a`` (C, n, in), each client's by its model's weights."""
    if W.dim() == 2:
        return F.linear(a, W, b)
    C, n, _ = a.shape
    R = W.shape[0]
    z = torch.baddbmm(b.unsqueeze(1), a.reshape(R, -1, a.shape[-1]), W.transpose(1, 2))
    return z.view(C, n, -1)


def _linear_transposed(W: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``u W`` for errors ``u`` (C, out), each client's by its model's weights: (C, in)."""
    if W.dim() == 2:
        return u @ W
    return torch.bmm(u.reshape(W.shape[0], -1, u.shape[-1]), W).view(len(u), -1)


def _linear_columns(W: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``W a + b`` for feature-major rows ``a`` (C, in, n), each client's by its model's weights."""
    C, _, n = a.shape
    if W.dim() == 2:
        return torch.matmul(W, a) + b.unsqueeze(-1)
    R = W.shape[0]
    z = torch.matmul(W.unsqueeze(1), a.view(R, C // R, -1, n)) + b[:, None, :, None]
    return z.view(C, -1, n)


def _combine(coef: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``coef @ rows`` per client for one row of coefficients ``coef`` (C, j) and ``rows`` (C, j, f):
    a broadcast product and a sum, whose backward is two more (a matrix product of one row has
    products of inner size 1 in its backward, twice as slow here at an audit's shapes)."""
    return (coef.unsqueeze(-1) * rows).sum(1)


class _SampleProducts(torch.autograd.Function):
    """The samples' products an unroll and its raw loss read, with one gradient buffer.

    ``S`` (C, K, d) against the first layer (``W S^T + b``: (C, K, out), per model), against
    themselves (the Gram matrix ``S S^T``: (C, K, K)) and against each client's raw rows at its
    used columns (``S_u X_u^T``: (C, K, n); ``xt`` (C, u, n) for the forward product and ``x``
    (C, n, u) for the backward one, both contiguous: the product of a transposed view is slower;
    ``xt`` ``None``: no rows, an empty product). The gradient ``g_first W + (G + G^T) S +
    scatter(g_q X_u)`` is summed in place in one buffer: autograd's three gradients, each as
    large as the samples, their zero-filled scatter target and their two sums took about a
    fifth of a step of an audit's reference runs."""

    @staticmethod
    def forward(ctx, S, W, b, cols, xt, x):
        ctx.save_for_backward(S, W, cols, x)
        first = _linear(W, b, S)
        gram = torch.bmm(S, S.transpose(1, 2))
        if xt is None:
            return first, gram, S.new_empty((*S.shape[:2], 0))
        return first, gram, torch.bmm(_at_columns(S, cols), xt)

    @staticmethod
    def backward(ctx, g_first, g_gram, g_rows):
        S, W, cols, x = ctx.saved_tensors
        grad = torch.bmm(g_gram + g_gram.transpose(1, 2), S)
        if W.dim() == 2:
            grad.view(-1, S.shape[-1]).addmm_(g_first.reshape(-1, W.shape[0]), W)
        else:
            R = W.shape[0]
            grad.view(R, -1, S.shape[-1]).baddbmm_(g_first.reshape(R, -1, W.shape[1]), W)
        if x is not None and g_rows.numel():
            on_rows = torch.bmm(g_rows, x)
            if cols is None:
                grad += on_rows
            else:
                grad.scatter_add_(2, _column_index(cols, S.shape[1]), on_rows)
        return grad, None, None, None, None, None


def _at_columns(S: torch.Tensor, cols: torch.Tensor | None) -> torch.Tensor:
    """``S`` (C, K, d) at each client's columns ``cols`` (C, u): (C, K, u)."""
    if cols is None:
        return S
    return S.gather(2, _column_index(cols, S.shape[1]))


def _column_index(cols: torch.Tensor, k: int) -> torch.Tensor:
    """``cols`` (C, u) for each of ``k`` rows: the index of a gather or scatter along (C, k, d)."""
    return cols.unsqueeze(1).expand(-1, k, -1)


# ----------------------------------------------------------------------------- the raw rows
class RawRows(NamedTuple):
    """A lockstep step's raw batches, padded to the longest and feature-major.

    ``x`` (C, n, u) and ``xt`` (C, u, n): each client's rows at the input columns ``cols`` (C, u)
    that some row of it uses (``cols`` ``None``: every column), the padding rows and columns zero;
    ``first`` (C, out, n): the first layer's ``W x + b`` at the starting weights; ``y`` (C, n)
    the labels and ``mask`` (C, n) 1 on real rows, 0 on padding."""

    x: torch.Tensor
    xt: torch.Tensor
    cols: torch.Tensor | None
    first: torch.Tensor
    y: torch.Tensor
    mask: torch.Tensor


def used_columns(flat: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Per client the input columns some of its rows ``flat[c]`` (n_c, d) use, padded to the
    widest with a column it does not use (so its rows read 0 there): (C, u); ``None`` where
    narrowing would keep more than nine tenths of the columns."""
    masks = [torch.count_nonzero(x, 0) > 0 for x in flat]  # 5x faster than ne(0).any(0) here
    width = max(1, *(int(m.sum()) for m in masks))
    if width > 0.9 * flat[0].shape[1]:
        return None
    cols = []
    for m in masks:
        used = torch.nonzero(m).squeeze(1)
        spare = torch.nonzero(~m)[0]  # exists: this client uses at most nine tenths
        cols.append(torch.cat([used, spare.expand(width - len(used))]))
    return torch.stack(cols)


def narrowed(flat: Sequence[torch.Tensor], cols: torch.Tensor | None) -> list[torch.Tensor]:
    """Each client's rows at its columns ``cols[c]`` (``cols`` ``None``: the rows as they are)."""
    if cols is None:
        return list(flat)
    return [torch.index_select(x, 1, col) for x, col in zip(flat, cols)]  # 6x x[:, col]


@torch.no_grad()
def first_layer(layers: Layers, flat: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each client's ``W x + b`` of the first layer on its rows ``flat[c]`` (n_c, d) at the
    starting weights: the same at every step of a round, so taken once."""
    W, b = layers[0]
    if W.dim() == 2:
        return [F.linear(x, W, b) for x in flat]
    per_model = len(flat) // W.shape[0]
    return [F.linear(x, W[c // per_model], b[c // per_model]) for c, x in enumerate(flat)]


def row_mask(lengths: torch.Tensor, n: int) -> torch.Tensor:
    """``(C, n)``: row ``i`` of client ``c`` is one of its ``lengths[c]`` rows, not padding."""
    return torch.arange(n, device=lengths.device)[None, :] < lengths[:, None]


def raw_rows(
    x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, first: torch.Tensor, cols
) -> RawRows:
    """:class:`RawRows` from row-major padded batches ``x`` (C, n, u), ``first`` (C, n, out)."""
    return RawRows(
        x, x.transpose(1, 2).contiguous(), cols, first.transpose(1, 2).contiguous(), y, mask
    )


def padded_rows(
    xs: Sequence[torch.Tensor],
    ys: Sequence[torch.Tensor],
    firsts: Sequence[torch.Tensor],
    cols: torch.Tensor | None,
) -> RawRows:
    """:class:`RawRows` of every client's whole rows ``xs[c]`` (n_c, u), labels ``ys[c]`` and
    first-layer outputs ``firsts[c]`` (n_c, out), padded to the longest. The feature-major
    tensors are filled client by client (one transposed copy of the whole padded batch took
    twice as long: its strides leave the cache)."""
    C, n = len(xs), max(len(x) for x in xs)
    x = torch.nn.utils.rnn.pad_sequence(list(xs), batch_first=True)
    xt = xs[0].new_zeros((C, xs[0].shape[1], n))
    first = firsts[0].new_zeros((C, firsts[0].shape[1], n))
    for c in range(C):
        xt[c, :, : len(xs[c])] = xs[c].T
        first[c, :, : len(firsts[c])] = firsts[c].T
    lengths = torch.tensor([len(t) for t in xs], device=x.device)
    mask = row_mask(lengths, n).to(x.dtype)
    return RawRows(
        x, xt, cols, first, torch.nn.utils.rnn.pad_sequence(list(ys), batch_first=True), mask
    )


# ----------------------------------------------------------------------------- the unroll
def unroll(
    layers: Layers, samples: torch.Tensor, targets: torch.Tensor, rates: torch.Tensor
) -> History:
    """K single-sample SGD steps from ``layers`` (see :data:`Layers`) through ``samples``
    (C, K, d) with soft labels ``targets`` (C, K, classes, summing to 1) and rates (C, K);
    differentiable in all three."""
    return _unrolled(layers, samples, targets, rates, None)[0]


def losses(
    layers: Layers,
    samples: torch.Tensor,
    targets: torch.Tensor,
    rates: torch.Tensor,
    rows: RawRows,
) -> torch.Tensor:
    """Each client's mean cross-entropy on its real raw rows ``rows`` after the unroll
    (:func:`unroll`'s arguments): (C,), differentiable in the samples, targets and rates."""
    hist, q = _unrolled(layers, samples, targets, rates, rows)
    nll = F.cross_entropy(raw_logits(layers, hist, rows, q), rows.y, reduction="none")
    return (nll * rows.mask).sum(1) / rows.mask.sum(1)


def _unrolled(layers, samples, targets, rates, rows: RawRows | None):
    """:func:`unroll`'s history, and the samples against the raw ``rows`` (C, K, n), taken
    with the unroll's own products of the samples (:class:`_SampleProducts`).

    The first layer's inputs are the samples themselves, known before the unroll: its history
    ``A`` after ``j`` steps is ``samples[:, :j]``, so the first layer's products are taken once
    for all steps (``W s_j + b`` for every ``j``, and the samples' Gram matrix for ``s_j A^T``)
    and each step reads its row. Growing that history step by step copied ``K^2 / 2`` rows of
    ``d`` numbers and, in the backward pass, filled and added a gradient of the samples' size
    for every step (about a third of an audit's FLiP reference runs)."""
    count = len(layers)
    (W0, b0), k = layers[0], samples.shape[1]
    raw = (None, None, None) if rows is None else (rows.cols, rows.xt, rows.x)
    first, gram, on_rows = _SampleProducts.apply(samples, W0, b0, *raw)
    first, gram = first.unbind(1), gram.unbind(1)  # (C, out) and (C, K) per step
    hist: list[tuple[torch.Tensor | None, torch.Tensor | None]] = [(None, None)] * count
    for j in range(k):  # the forward pass at theta_(j-1)
        D0 = hist[0][1]
        z = first[j] if D0 is None else first[j] - _combine(gram[j][:, :j] + 1.0, D0)
        inputs: list[Any] = [None]  # the first layer's input, s_j: its history is the samples
        pre = [z]
        a = torch.relu(z) if count > 1 else z
        for idx in range(1, count):
            (W, b), (A, D) = layers[idx], hist[idx]
            inputs.append(a)
            z = _linear(W, b, a.unsqueeze(1)).squeeze(1)
            if A is not None and D is not None:
                z = z - _combine((A * a.unsqueeze(1)).sum(-1) + 1.0, D)
            pre.append(z)
            a = torch.relu(z) if idx < count - 1 else z
        q = targets[:, j]
        # d/dz of -sum_c q_c log softmax(z)_c, as autograd's log_softmax backward computes it
        delta = torch.softmax(pre[-1], -1) * q.sum(-1, keepdim=True) - q
        eta = rates[:, j : j + 1]
        steps: list[Any] = [None] * count  # tensors, filled from the last layer
        for idx in range(count - 1, -1, -1):  # the backward pass, also at theta_(j-1)
            steps[idx] = eta * delta
            if idx:
                (W, _), (A, D) = layers[idx], hist[idx]
                back = _linear_transposed(W, delta)
                if A is not None and D is not None:
                    back = back - _combine((D * delta.unsqueeze(1)).sum(-1), A)
                delta = back * (pre[idx - 1] > 0)
        hist = [
            (
                None if i == 0 else _grown(A, inputs[i]),
                _grown(D, steps[i]),
            )
            for i, (A, D) in enumerate(hist)
        ]
    hist[0] = (samples if k else None, hist[0][1])
    return hist, on_rows


def _grown(history: torch.Tensor | None, row: torch.Tensor) -> torch.Tensor:
    """``history`` (C, j, f) with ``row`` (C, f) appended."""
    return row.unsqueeze(1) if history is None else torch.cat([history, row.unsqueeze(1)], 1)


def raw_logits(
    layers: Layers, hist: History, rows: RawRows, q: torch.Tensor | None = None
) -> torch.Tensor:
    """The unrolled models' logits on their raw rows, feature-major: (C, classes, n).

    Layer by layer ``W^(K) a + b^(K) = W a + b - D^T (A a) - D^T 1``, the first layer's ``W a +
    b`` given (``rows.first``) and its ``A a`` the samples against the rows (``q`` where the caller holds it)."""
    S, D = hist[0]
    if q is None:  # the samples against the rows, by autograd
        q = torch.bmm(_at_columns(S, rows.cols), rows.xt)
    z = rows.first - torch.bmm(D.transpose(1, 2), q) - D.sum(1).unsqueeze(-1)
    for (W, b), (A, D) in zip(layers[1:], hist[1:]):
        a = torch.relu(z)
        z = _linear_columns(W, b, a) - torch.bmm(D.transpose(1, 2), torch.bmm(A, a))
        z = z - D.sum(1).unsqueeze(-1)
    return z


def logits(layers: Layers, hist: History, x: torch.Tensor) -> torch.Tensor:
    """The unrolled models' logits on ``x`` (C, N, d), client c's model on its own rows: (C, N,
    classes) (for tests and inspection; the lockstep updates use :func:`losses`)."""
    flat = list(x)
    cols = used_columns(flat)
    labels = [torch.zeros(len(t), dtype=torch.long, device=x.device) for t in flat]
    rows = padded_rows(narrowed(flat, cols), labels, first_layer(layers, flat), cols)
    return raw_logits(layers, hist, rows).transpose(1, 2)


def weights(layers: Layers, hist: History) -> list:
    """The unrolled models' ``(W, b)`` per layer, with a client axis (for tests and inspection)."""
    out = []
    for (W, b), (A, D) in zip(layers, hist, strict=True):
        if W.dim() == 3:  # one per model: repeated for its clients
            W, b = (t.repeat_interleave(len(A) // len(W), 0) for t in (W, b))
        out.append((W - D.transpose(1, 2) @ A, b - D.sum(1)))
    return out


__all__ = [
    "History",
    "Layers",
    "RawRows",
    "first_layer",
    "logits",
    "losses",
    "mlp_linear_names",
    "narrowed",
    "padded_rows",
    "raw_logits",
    "raw_rows",
    "row_mask",
    "unroll",
    "used_columns",
    "weights",
]
