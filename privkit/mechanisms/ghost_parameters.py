"""Bare trainable parameters under book-keeping ghost clipping, by per-example stand-ins.

A bare parameter is an ``nn.Parameter`` of a model's own module read by that module's forward
outside any layer: a vision transformer's class token and position embedding
(``cls.expand(B, -1, -1)``, ``x + pos``), a ConvNeXt block's layer scale (``gamma * x``). No hook
sees where it enters, so :mod:`privkit.mechanisms.ghost_clipping` gives it a stand-in for the
pass: the module's entry for ``P`` is replaced by ``S``, ``P``'s values repeated along a new batch
axis, a leaf tensor of its own (a stride-0 view: no memory). Its shape is ``(B, *P.shape[1:])``
where ``P``'s first dimension is 1 (the convention of parameters broadcast over the batch, as
torchvision's and timm's class tokens and position embeddings are), else ``(B, *P.shape)``
(a layer scale ``(C, 1, 1)`` against ``(B, C, H, W)`` activations); where that form fails, the
second form gives such a parameter ``(B, 1, *P.shape)`` (timm's and DINOv2's layer scale
``(d,)`` against ``(B, N, d)`` tokens) and the third ``(B, 1, 1, *P.shape)`` (ConvNeXt's against
channels-last ``(B, H, W, C)`` maps), and the form that passes is kept for the model.

Where the forward uses ``S`` as it used ``P``, broadcast over the batch, example ``i``'s losses
read row ``i`` of ``S`` alone, so the gradient of the summed per-example losses w.r.t. ``S`` (one
more output gradient of the one backward pass) holds example ``i``'s gradient of ``P`` in its row
``i``: the norms and the clipped sum come from it directly, as for a normalisation layer's
per-example affine gradients.

The shapes cannot show that use, so nothing rests on them. A forward that fails with the
stand-ins of every form (``P`` indexed, reshaped, or passed to torch's functional layers with a
shape they refuse) refuses the model. The first pass of a model with stand-ins on two or more examples checks
that the forward with stand-ins gives the model's own outputs (:func:`same_outputs`, one more
forward pass, with the random state of dropout replayed), and ghost clipping's row check then
checks that row ``i`` of each stand-in's gradient belongs to example ``i`` (``P[0]`` or a batch
mean over ``S`` break it; so does a first-form ``(B, d)`` layer scale against ``B`` tokens of
``B`` examples, which then takes the second form). A model failing either in its last form is
refused from then on. Torch's own modules
read their parameters their own ways (an LSTM's flat weights, ``F.prelu``): those not covered by
ghost clipping are refused rather than given stand-ins, and any use of ``P`` itself during the
pass is found in the autograd graph.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = [
    "FORMS",
    "RandomState",
    "changes_with_form",
    "may_stand_in",
    "same_outputs",
    "stand_in_shape",
    "standing_in",
]


def may_stand_in(module: nn.Module) -> bool:
    """Whether ``module``'s own trainable parameters may take stand-ins: not a module of torch's
    own (those read their parameters in their own ways; the ones ghost clipping does not cover are
    refused)."""
    return not type(module).__module__.startswith("torch.")


#: the stand-in shapes tried for a model, in turn: a parameter without a leading 1 gets a batch
#: dimension in front (``(C, 1, 1)`` against ``(B, C, H, W)``), then a batch dimension and a unit
#: one (a timm or DINOv2 layer scale ``(d,)`` against ``(B, N, d)`` tokens), then two unit ones
#: (ConvNeXt's layer scale ``(C,)`` against channels-last ``(B, H, W, C)`` maps)
FORMS = 3


def stand_in_shape(p: torch.Tensor, b: int, form: int = 0) -> tuple[int, ...]:
    """The stand-in's shape for ``b`` examples: ``P``'s leading dimension of 1 taken as the batch's,
    else a batch dimension in front and ``form`` unit dimensions after it."""
    if p.dim() and p.shape[0] == 1:
        return (b, *p.shape[1:])
    return (b, *[1] * form, *p.shape)


def changes_with_form(p: torch.Tensor) -> bool:
    """Whether the forms give ``P`` different stand-in shapes (no leading 1)."""
    return not (p.dim() and p.shape[0] == 1)


@contextmanager
def standing_in(
    owners: list[tuple[nn.Module, str]], b: int, form: int = 0
) -> Iterator[list[torch.Tensor]]:
    """Within the block, each ``(module, name)`` parameter replaced in its module by its stand-in
    for ``b`` examples in ``form`` (yielded in order); the parameters are put back however the
    block ends.

    The stand-in goes into the module's parameter table directly (``Module.__setattr__`` takes
    ``nn.Parameter`` only there), so the module's ``self.name`` reads it."""
    stand_ins, put = [], []
    try:
        for module, name in owners:
            p = module._parameters[name]
            assert p is not None  # a trainable parameter (ghost_clipping's _layers)
            s = p.detach().expand(stand_in_shape(p, b, form)).requires_grad_()
            module._parameters[name] = s  # type: ignore[assignment]  # the pass's stand-in
            put.append((module, name, p))
            stand_ins.append(s)
        yield stand_ins
    finally:
        for module, name, p in reversed(put):
            module._parameters[name] = p


class RandomState:
    """The random state a forward pass draws dropout from (the CPU's generator and, for a CUDA
    batch, the device's), to replay that pass: :func:`same_outputs`."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


def same_outputs(
    own: Callable[[], torch.Tensor], outputs: torch.Tensor, before: RandomState, rtol: float
) -> bool:
    """Whether ``own()`` (the model's forward with its own parameters) gives ``outputs`` (the pass
    with stand-ins, begun in random state ``before``) within ``rtol`` of their largest value (or
    8 units of their dtype's precision): the same random draws replayed, the random state after
    that pass kept."""
    after = RandomState(outputs.device)
    before.restore()
    try:
        got = own()
    finally:
        after.restore()
    if not isinstance(got, torch.Tensor) or got.shape != outputs.shape:
        return False
    tol = max(rtol, 8 * torch.finfo(got.dtype).eps) * float(got.abs().max())
    return float((outputs.detach() - got).abs().max()) <= tol
