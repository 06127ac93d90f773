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
Clients with a different number of batches per epoch form separate lockstep groups.

The result equals the per-client generic path up to floating-point rounding (checked in float64 by
``tests/privkit/test_flip.py``: weights, gradients and client updates). It applies to privkit's
``mlp`` architecture (Flatten, then Linear and ReLU layers, then the Linear head); other models
keep the generic path. This module holds the unroll's algebra; the lockstep client updates that use
it are :func:`privkit.trainers.flip.round_updates`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

History = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer ``(A, D)``: the inputs ``(C, K, in)`` and scaled errors ``(C, K, out)`` of the steps."""


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


def _apply(W, b, A, D, a, base=None):
    """``W^(j) a + b^(j)`` for inputs ``a`` (C, N, in), histories ``A`` (C, j, in), ``D`` (C, j, out).
    ``W`` (out, in) and ``b`` (out,) are shared by the clients, or one per client: (C, out, in)
    and (C, out). ``base``: ``W a + b`` where the caller already holds it."""
    if base is not None:
        z = base
    elif W.dim() == 2:
        z = a @ W.T + b
    else:
        z = torch.baddbmm(b.unsqueeze(1), a, W.transpose(1, 2))
    if A is None:
        return z
    # a A^T taken as (A a^T)^T: the backward pass's gradient of A is then the product
    # (grad)^T a, whose output is as wide as the inputs (1.5x faster on the CPU for a raw batch
    # of MNIST rows against K samples) rather than a^T grad, as narrow as K
    return z - (torch.bmm(A, a.transpose(1, 2)).transpose(1, 2) + 1.0) @ D


def _apply_transposed(W, A, D, u):
    """``W^(j)^T u`` for errors ``u`` (C, out); ``W`` shared (out, in) or per client (C, out, in)."""
    back = u @ W if W.dim() == 2 else torch.bmm(u.unsqueeze(1), W).squeeze(1)
    if A is None:
        return back
    return back - ((D @ u.unsqueeze(-1)).transpose(1, 2) @ A).squeeze(1)


class _Gram(torch.autograd.Function):
    """``S S^T`` (C, K, K) of the samples ``S`` (C, K, d), with its gradient ``(G + G^T) S`` in
    one product: autograd's backward of ``bmm(S, S^T)`` takes one per operand, each as large as
    the samples, and adds them."""

    @staticmethod
    def forward(ctx, S: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(S)
        return torch.bmm(S, S.transpose(1, 2))

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        (S,) = ctx.saved_tensors
        return torch.bmm(g + g.transpose(1, 2), S)


def unroll(
    layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
    samples: torch.Tensor,
    targets: torch.Tensor,
    rates: torch.Tensor,
) -> History:
    """K single-sample SGD steps from ``layers`` (``(W, b)`` of each linear layer, shared by the
    clients, or one per client with a leading client axis: clients of several runs) through
    ``samples`` (C, K, d) with soft labels ``targets`` (C, K, classes, summing to 1) and rates
    (C, K); differentiable in all three.

    The first layer's inputs are the samples themselves, known before the unroll: its history
    ``A`` after ``j`` steps is ``samples[:, :j]``, so the first layer's products are taken once
    for all steps (``W s_j + b`` for every ``j``, and the samples' Gram matrix for ``s_j A^T``)
    and each step reads its row. Growing that history step by step copied ``K^2 / 2`` rows of
    ``d`` numbers and, in the backward pass, filled and added a gradient of the samples' size
    for every step (about a third of an audit's FLiP reference runs)."""
    count = len(layers)
    (W0, b0), k = layers[0], samples.shape[1]
    first = _apply(W0, b0, None, None, samples).split(1, dim=1)  # (C, 1, out) per step
    gram = _Gram.apply(samples).split(1, dim=1)  # (C, 1, K) per step
    hist: list[tuple[torch.Tensor | None, torch.Tensor | None]] = [(None, None)] * count
    for j in range(k):  # the forward pass at theta_(j-1)
        D0 = hist[0][1]
        z = first[j] if D0 is None else first[j] - (gram[j][..., :j] + 1.0) @ D0
        inputs: list[Any] = [None]  # the first layer's input, s_j: its history is the samples
        pre = [z]
        a = torch.relu(z) if count > 1 else z
        for idx in range(1, count):
            W, b = layers[idx]
            inputs.append(a)
            z = _apply(W, b, *hist[idx], a)
            pre.append(z)
            a = torch.relu(z) if idx < count - 1 else z
        q = targets[:, j]
        # d/dz of -sum_c q_c log softmax(z)_c, as autograd's log_softmax backward computes it
        delta = torch.softmax(pre[-1][:, 0], -1) * q.sum(-1, keepdim=True) - q
        eta = rates[:, j : j + 1]
        steps: list[Any] = [None] * count  # tensors, filled from the last layer
        for idx in range(count - 1, -1, -1):  # the backward pass, also at theta_(j-1)
            steps[idx] = eta * delta
            if idx:
                W = layers[idx][0]
                delta = _apply_transposed(W, *hist[idx], delta) * (pre[idx - 1][:, 0] > 0)
        hist = [
            (
                None if i == 0 else inputs[i] if A is None else torch.cat([A, inputs[i]], 1),
                steps[i].unsqueeze(1) if D is None else torch.cat([D, steps[i].unsqueeze(1)], 1),
            )
            for i, (A, D) in enumerate(hist)
        ]
    hist[0] = (samples if k else None, hist[0][1])
    return hist  # type: ignore[return-value]


def logits(
    layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
    hist: History,
    x: torch.Tensor,
    first: torch.Tensor | None = None,
) -> torch.Tensor:
    """The unrolled models' logits on ``x`` (C, N, d): client c's model on its own rows.

    ``first`` (C, N, out), where given: the first layer's ``W x + b`` of these rows at the
    layers' (starting) weights. A client's raw rows meet the same starting weights at every step
    of a round, so its caller takes that product once per round rather than once per step (the
    largest product of a step: the raw rows are ``d`` wide)."""
    a = x
    for idx, ((W, b), (A, D)) in enumerate(zip(layers, hist)):
        a = _apply(W, b, A, D, a, first if idx == 0 else None)
        if idx < len(layers) - 1:
            a = torch.relu(a)
    return a


def weights(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], hist: History) -> list:
    """The unrolled models' ``(W, b)`` per layer, with a client axis (for tests and inspection)."""
    return [
        (W - D.transpose(1, 2) @ A, b - D.sum(1))
        for (W, b), (A, D) in zip(layers, hist, strict=True)
    ]


__all__ = ["History", "logits", "mlp_linear_names", "unroll", "weights"]
