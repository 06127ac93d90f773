"""Layers whose weight is a function of their parameters (``torch.nn.utils.parametrize``: weight
normalisation, spectral normalisation, orthogonal weights, a weight standardised by a
parametrization of the user's own) under ghost clipping.

A parametrized linear layer or convolution computes its weight ``W = f(theta)`` from its
parametrization's tensors ``theta`` (``original``, or ``original0``, ``original1``, ... and any
trainable tensor of the parametrization itself) and then runs as the plain layer. Example ``i``'s
gradient of ``theta`` is ``J_f(theta)^T G_i``, ``G_i`` its gradient of ``W`` (``sum_t g_t a_t^T``
for a linear map): one vector-Jacobian product of ``f`` per example, all of them through the
autograd graph the forward pass recorded from ``theta`` to ``W`` (``is_grads_batched``). So the
layer's per-example weight gradients ``G_i`` are materialised (no Gram-matrix norm: the norm of
``J^T G_i`` is not ``G_i``'s), and the clipped sum is ``J^T (sum_i c_i G_i)``, one more product.

The pass runs under ``parametrize.cached()``: ``W`` is computed once and is the tensor the layer's
calls used (a spectral normalisation's power iteration runs once, as in a plain training step).

Refused (:func:`refusal`; the model then takes ``torch.func``): a parametrized tensor other than
``weight`` (a bias), a layer other than ``nn.Linear`` and ``nn.Conv1d``/``2d``/``3d``, or one
whose class has a forward of its own; ``torch.nn.utils.weight_norm`` of old (a forward
pre-hook, not a parametrization) is not recognised and falls back likewise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.utils import parametrize

__all__ = ["BASES", "covers", "originals", "per_example", "refusal", "summed"]

#: the layers whose parametrized weight this module takes
BASES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def covers(module: nn.Module) -> bool:
    """Whether ``module`` has a tensor computed by a parametrization."""
    return parametrize.is_parametrized(module)


def refusal(module: nn.Module) -> str | None:
    """Why the parametrized ``module`` is not taken, or ``None``."""
    name = type(module).__name__
    tensors = set(module.parametrizations)  # type: ignore[arg-type]
    if tensors != {"weight"}:
        return f"{name} with parametrized {', '.join(sorted(tensors))} (only a weight is taken)"
    base = next((b for b in BASES if isinstance(module, b)), None)
    if base is None:
        return f"{name}: a parametrized layer other than a linear layer or a convolution"
    own = ("forward", "_conv_forward") if base is not nn.Linear else ("forward",)
    if any(getattr(type(module), f) is not getattr(base, f) for f in own):
        return f"{name} overrides {base.__name__}'s forward"
    return None


def originals(module: nn.Module) -> dict[str, nn.Parameter]:
    """The trainable tensors ``theta`` the weight is computed from, by their path in ``module``
    (``parametrizations.weight.original``, ...)."""
    found = module.parametrizations.weight.named_parameters()  # type: ignore[union-attr]
    return {f"parametrizations.weight.{k}": p for k, p in found if p.requires_grad}


def _filled(grads: Sequence[torch.Tensor | None], like: Sequence[torch.Tensor], b: int | None):
    """``None`` (a tensor ``f`` does not read) as zeros, per example where ``b`` is given."""
    shape = (lambda t: (b, *t.shape)) if b is not None else (lambda t: t.shape)
    return [
        g if g is not None else torch.zeros(shape(t), dtype=t.dtype, device=t.device)
        for g, t in zip(grads, like, strict=True)
    ]


def per_example(
    weight: torch.Tensor, thetas: Sequence[torch.Tensor], per_weight: torch.Tensor
) -> list[torch.Tensor]:
    """Each example's gradient of each of ``thetas``, ``(B, *theta.shape)``, from its gradient of
    the ``weight`` they computed, ``per_weight`` ``(B, *weight.shape)``: ``J^T G_i`` through the
    recorded graph, batched over the examples (one at a time where the graph's operations have no
    batching rule)."""
    try:
        grads = torch.autograd.grad(
            weight,
            thetas,
            per_weight.to(weight.dtype),
            retain_graph=True,
            allow_unused=True,
            is_grads_batched=True,
        )
    except RuntimeError:  # an operation of f without a batching rule: example by example
        rows = [
            _filled(
                torch.autograd.grad(weight, thetas, g, retain_graph=True, allow_unused=True),
                thetas,
                None,
            )
            for g in per_weight.to(weight.dtype)
        ]
        return [torch.stack(parts) for parts in zip(*rows, strict=True)]
    return _filled(grads, thetas, per_weight.shape[0])


def summed(
    weight: torch.Tensor, thetas: Sequence[torch.Tensor], weight_sum: torch.Tensor
) -> list[torch.Tensor]:
    """``J^T S``: the gradient of each of ``thetas`` for the gradient ``S`` of the ``weight`` (the
    clipped sum of the examples' ``G_i``, or their plain sum)."""
    grads = torch.autograd.grad(
        weight, thetas, weight_sum.to(weight.dtype), retain_graph=True, allow_unused=True
    )
    return _filled(grads, thetas, None)
