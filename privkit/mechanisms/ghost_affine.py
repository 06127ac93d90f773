"""A model's own linear layers under book-keeping ghost clipping: modules that are not
``nn.Linear`` but compute ``y = a W + b`` with their own ``weight`` and ``bias``.

HF transformers' GPT-2 (and OpenAI GPT, DistilGPT2, DialoGPT) builds every attention and MLP map
from ``Conv1D``, a linear layer whose weight is stored ``(in, out)`` and read by
``torch.addmm(bias, x, weight)``; models written by hand carry their own ``Linear`` classes over
``F.linear``. Such a module's per-example weight gradient is ``sum_t a_t g_t^T`` (stored
``(in, out)``) or its transpose (stored ``(out, in)``, as ``nn.Linear``'s), exactly as a linear
layer's, so :mod:`privkit.mechanisms.ghost_clipping` takes it as one, in the layout its first call
shows.

What decides is the one thing the ghost norms and the book-kept sum rest on: the gradient of the
layer's output w.r.t. its weight. On the module's first call, the output's vector-Jacobian product
with a random cotangent ``v`` (one weight gradient, by autograd through the module's own code)
is compared with ``a^T v`` and with its transpose (:func:`layout`); the bias', where trainable, with
``v`` summed over the rows. A linear map equal to another at a random vector is equal to it with
probability one, so a module whose weight enters its output in any other way (scaled, squared,
added, reshaped) fails the check, whatever its shapes, and so does a square weight read the other
way round (an identity-initialised weight cannot show its layout by its outputs, only by its
gradient). A module failing it keeps the path of bare parameters (per-example stand-ins,
:mod:`privkit.mechanisms.ghost_parameters`). The check runs once per module; ghost clipping's row
check and its count of autograd edges into each parameter hold for these layers as for torch's.

Privacy does not rest on this check: ghost clipping clips what it adds, each example's computed
gradient scaled to norm at most ``C``, and the row check shows each row of the layer's input and
output gradient to be one example's. The check makes the clipped sum the model's true gradient.
"""

from __future__ import annotations

import weakref
from typing import cast

import torch
from torch import nn

__all__ = ["NotAffine", "layout", "may_be_affine", "verified"]

#: modules whose first call showed a linear layer: whether the weight is stored ``(in, out)``
_LAYOUT: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()

#: modules whose first call did not (their parameters take per-example stand-ins)
_NOT_AFFINE: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def may_be_affine(module: nn.Module) -> bool:
    """Whether ``module`` may be a linear layer of the model's own: a module of its own code (not
    torch's), without children, whose only parameters are a 2-d ``weight`` and a 1-d ``bias`` (or
    none), not yet found to be anything else."""
    params = dict(module.named_parameters(recurse=False))
    weight, bias = params.get("weight"), params.get("bias")
    return (
        not type(module).__module__.startswith("torch.")
        and module not in _NOT_AFFINE
        and next(module.children(), None) is None
        and set(params) <= {"weight", "bias"}
        and weight is not None
        and weight.dim() == 2
        and (bias is None or (bias.dim() == 1 and bias.shape[0] in weight.shape))
    )


def verified(module: nn.Module) -> bool | None:
    """The layout :func:`layout` found on ``module``'s first call (``True``: the weight is stored
    ``(in, out)``), or ``None`` before it."""
    return _LAYOUT.get(module)


class NotAffine(Exception):
    """A module's first call showed that it is not a linear layer (remembered for the module)."""


def layout(module: nn.Module, a: torch.Tensor, out: torch.Tensor, rtol: float) -> bool:
    """The layout of a linear layer of the model's own, from one call (input ``a``, output
    ``out`` still in the autograd graph), remembered for the module: ``True`` where the weight is
    stored ``(in, out)``, ``False`` where ``(out, in)``. :class:`NotAffine` (remembered too) where
    the gradient of ``out`` w.r.t. the trainable weight and bias is neither layout's (``rtol``:
    the largest difference put down to float rounding, relative to the largest value)."""
    found = _layout_of(module, a, out, rtol)
    if found is None:
        _NOT_AFFINE.add(module)
        raise NotAffine(f"{type(module).__name__} is not a linear layer of its weight")
    _LAYOUT[module] = found
    return found


def _layout_of(module: nn.Module, a: torch.Tensor, out: torch.Tensor, rtol: float) -> bool | None:
    """:func:`layout`'s answer, ``None`` for neither layout: the vector-Jacobian product of the
    output with a random cotangent ``v`` against ``a^T v`` (and its transpose) for the weight and
    ``sum v`` for the bias."""
    weight = cast(torch.Tensor, module.weight)
    bias = getattr(module, "bias", None)
    bias = bias if isinstance(bias, torch.Tensor) else None
    if a.dim() == 0 or out.dim() == 0 or out.grad_fn is None:
        return None
    n_in, n_out = a.shape[-1], out.shape[-1]
    if a.shape[:-1].numel() != out.shape[:-1].numel() or not a.numel():  # a row out per row in
        return None  # (no rows: any layout fits)
    if tuple(weight.shape) not in ((n_in, n_out), (n_out, n_in)):
        return None
    if bias is not None and bias.requires_grad and bias.shape[0] != n_out:
        return None
    wanted = [p for p in (weight, bias) if p is not None and p.requires_grad]
    if not wanted:
        return None
    # a generator of its own: the model's random state (its dropout) is left as it was
    generator = torch.Generator(device=out.device).manual_seed(0x5EED)
    v = torch.randn(out.shape, generator=generator, dtype=out.dtype, device=out.device)
    got = torch.autograd.grad(out, wanted, v, retain_graph=True, allow_unused=True)
    if any(g is None for g in got):
        return None
    a2, v2 = a.detach().reshape(-1, n_in), v.reshape(-1, n_out)
    if bias is not None and bias.requires_grad and not _close(got[-1], v2.sum(0), rtol):
        return None
    if not weight.requires_grad:  # a frozen weight's layout serves no sum
        return tuple(weight.shape) == (n_in, n_out)
    product = a2.T @ v2  # (in, out)
    for stored_in_out in (True, False):
        want = product if stored_in_out else product.T
        if got[0].shape == want.shape and _close(got[0], want, rtol):
            return stored_in_out
    return None


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> bool:
    """Whether ``got`` is ``want`` up to ``rtol`` of ``want``'s largest value."""
    return float((got - want).abs().max()) <= rtol * float(want.abs().max())
