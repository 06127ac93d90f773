"""Per-example gradients of one of torch's own layers that book-keeping ghost clipping has no rule
for (an EmbeddingBag in ``max`` mode, a layer torch adds), formed for that layer alone.

:mod:`privkit.mechanisms.ghost_clipping` stores each layer's input ``a`` and the gradient ``g`` of
the summed per-example losses w.r.t. its output. For a layer without a closed form, example ``i``'s
gradient of the layer's parameters is the vector-Jacobian product of the layer's call on ``a_i``
alone against ``g_i``: ``torch.func.vjp`` of the call, under ``vmap`` over the examples. Only this
layer's per-example gradients are held (its parameters times the batch); the model's other layers
keep their ghost norms and book-kept sums, where the whole model's ``torch.func`` fallback formed
every parameter's per-example gradient. The layer's call is computed a second time for it (its
forward and backward on the batch, once).

This is example ``i``'s gradient only where the layer's output row ``i`` depends on ``a_i`` alone
(the layer mixes no examples): BatchNorm on the batch's statistics does not, and is refused
before. The first pass of each model checks it (:func:`check_outputs`: the call on each example
alone gives that example's row of the batch's output), with the rows check of the model's other
layers. A layer is refused (the model then takes ``torch.func`` whole) where the recomputed call
could differ from the one the forward pass made: it updates buffers in training mode (statistics
the second call would update again), it is called with keyword arguments or more than one input
(the hook sees one positional input), it returns more than one tensor (an LSTM's hidden states,
batch second); and where its call does not take ``vmap`` on one example (one writing a batched
value into a tensor it makes inside its call: :class:`NotPerExample`, the model remembered as
refused). torch's recurrent cells, which return a pair or take a state, have their own rule
(:mod:`privkit.mechanisms.ghost_rnn`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap

from privkit.mechanisms.stacked import UnsupportedModelError

__all__ = ["NotPerExample", "check_outputs", "covers", "per_example", "refusal", "summed"]


class NotPerExample(UnsupportedModelError):
    """The layer's call does not take ``torch.func``'s transforms on one example (one writing a
    batched value into a tensor it makes inside its call, which ``vmap`` cannot batch): the model
    is clipped by ``torch.func`` whole, or refused."""


def covers(module: nn.Module) -> bool:
    """Whether ``module`` is one of torch's own layers (no children) that this module may take."""
    return (
        type(module).__module__.startswith("torch.nn.")
        and next(module.children(), None) is None
        and not isinstance(module, (nn.RNNBase, nn.RNNCellBase, nn.MultiheadAttention))
    )


def refusal(module: nn.Module) -> str | None:
    """Why ``module``'s call cannot be recomputed as the forward pass made it, or ``None``."""
    if module.training and next(module.buffers(recurse=False), None) is not None:
        return (
            f"{type(module).__name__} in training mode with buffers (statistics its call "
            "updates, which a second call would update again)"
        )
    return None


def _state(module: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The layer's parameters and buffers, detached, the floating ones in ``dtype`` (the dtype its
    stored inputs and output gradients were taken to: ghost clipping's ``_in_parameter_dtype``)."""
    tensors = dict(module.named_parameters(recurse=False)) | dict(
        module.named_buffers(recurse=False)
    )
    return {
        k: v.detach().to(dtype) if v.is_floating_point() else v.detach() for k, v in tensors.items()
    }


def _dtype(grads: Sequence[torch.Tensor | None]) -> torch.dtype:
    return next(g for g in grads if g is not None).dtype


def _over_calls(
    module: nn.Module,
    keys: list[str],
    inputs: list[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    of_call: Callable[..., dict[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """``of_call(call, trainable, a, g)`` (``call(p, a)``: the layer's call with its trainable
    parameters ``p``) summed over the layer's calls whose output reached the loss (``grads[j]``
    ``None`` where it did not)."""
    state = _state(module, _dtype(grads))
    trainable = {k: state.pop(k) for k in keys}

    def call(p: dict[str, torch.Tensor], a: torch.Tensor) -> torch.Tensor:
        return functional_call(module, state | p, (a,))

    total: dict[str, torch.Tensor] = {}
    for a, g in zip(inputs, grads, strict=True):
        if g is None:
            continue
        try:
            part = of_call(call, trainable, a, g)
        except RuntimeError as e:  # an operation vmap cannot batch (a write into a new tensor)
            raise NotPerExample(
                f"{type(module).__name__} does not take torch.func's vjp ({e})"
            ) from None
        total = {k: total[k] + v for k, v in part.items()} if total else part
    return total


def per_example(
    module: nn.Module,
    keys: list[str],
    inputs: list[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
) -> dict[str, torch.Tensor]:
    """Each example's gradient of the layer's trainable parameters ``keys``, ``(B, ...)``, summed
    over its calls whose output reached the loss (``grads[j]`` ``None`` where it did not)."""

    def of_call(call, trainable, a, g) -> dict[str, torch.Tensor]:
        def one(ai: torch.Tensor, gi: torch.Tensor) -> dict[str, torch.Tensor]:
            pull = vjp(lambda p: call(p, ai.unsqueeze(0)), trainable)[1]
            return pull(gi.unsqueeze(0))[0]

        return cast(dict[str, torch.Tensor], vmap(one)(a, g))

    return _over_calls(module, keys, inputs, grads, of_call)


def summed(
    module: nn.Module,
    keys: list[str],
    inputs: list[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    c: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """``sum_i c_i G_i`` of the layer's trainable parameters without forming the ``G_i`` (where no
    norms were taken: clipping off): the call's vector-Jacobian product on the whole batch against
    the output gradients weighted by the factors ``c``."""

    def of_call(call, trainable, a, g) -> dict[str, torch.Tensor]:
        pull = vjp(lambda p: call(p, a), trainable)[1]
        return pull(g * c.to(g.dtype).view(-1, *[1] * (g.dim() - 1)))[0]

    return _over_calls(module, keys, inputs, grads, of_call)


def check_outputs(
    module: nn.Module, inputs: list[torch.Tensor], outputs: list[torch.Tensor], rtol: float
) -> str | None:
    """``None`` where the layer's call on each example alone gives that example's row of each
    call's batch output (to ``rtol`` of the output's largest value, or 8 units of its dtype), else
    why not."""
    name = type(module).__name__
    for a, out in zip(inputs, outputs, strict=True):
        state = _state(module, out.dtype) if out.is_floating_point() else _state(module, a.dtype)

        def alone(ai: torch.Tensor, state: dict[str, torch.Tensor] = state) -> torch.Tensor:
            return functional_call(module, state, (ai.unsqueeze(0),)).squeeze(0)

        try:
            rows = vmap(alone)(a)
        except RuntimeError as e:  # an operation vmap has no rule for and cannot loop over
            return f"{name} does not take torch.func's vmap on one example ({e})"
        if rows.shape != out.shape:
            alike = False
        elif not out.is_floating_point() or not out.numel():
            alike = torch.equal(rows, out)
        else:
            tol = max(rtol, 8 * torch.finfo(out.dtype).eps) * float(out.abs().max())
            alike = float((rows - out).abs().max()) <= tol
        if not alike:
            return (
                f"{name}'s output on an example alone is not that example's row of the "
                "batch's output (the layer mixes examples)"
            )
    return None
