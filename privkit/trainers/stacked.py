"""M models of one privkit architecture as stacked tensors: forward pass and per-example clipping.

Parameters of M models with the same architecture are stacked on a leading model axis (as
``torch.func.stack_module_state`` does) and the M forward passes run as one: linear layers as one
batched matrix product (``baddbmm``), convolutions as one grouped convolution (``groups=M``).

DP-SGD needs, for every model m and example i of its batch, the L2 norm of the example's whole
gradient, and the sum of the gradients scaled by ``min(1, clip / norm)``. Materialising the M x B
per-example gradients (``vmap(vmap(grad))``) costs M x B x (parameters) memory traffic per step and
makes the vectorised run slower than a loop. Instead, per layer, from the layer's input ``a`` and
the gradient ``g`` of the loss with respect to its output (one backward pass):

* linear layer: the example's weight gradient is the outer product ``g_i a_i^T``, whose norm is
  ``||g_i|| ||a_i||`` (Goodfellow 2015; "ghost norm", Li et al. 2022); the clipped sum is one
  batched product ``(c * g)^T a``. No per-example weight gradient is formed.
* convolution: per-example weight gradients are formed from the unfolded input (they are small:
  out x in x k x k per example), then reduced.

The result equals the per-example gradients of ``vmap(grad)`` up to float rounding (tested against
:func:`privkit.trainers.dp_sgd_step.per_sample_gradients`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from privkit.models import FeatureClassifier, UnitNormalize

_PARAMETRISED = (nn.Linear, nn.Conv2d)
_SUPPORTED = _PARAMETRISED + (nn.ReLU, nn.MaxPool2d, nn.Flatten, UnitNormalize)


def layer_sequence(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Leaf layers of a privkit :class:`~privkit.models.FeatureClassifier` in execution order, with
    the prefixes of their parameter names; any other model or layer is a ``ValueError``."""
    if not isinstance(model, FeatureClassifier) or not isinstance(model.features, nn.Sequential):
        raise ValueError(f"model must be a privkit FeatureClassifier with sequential features; found "
                         f"{type(model).__name__}")
    seq = [(f"features.{n}", m) for n, m in model.features.named_children()] + [("head", model.head)]
    for name, m in seq:
        if not isinstance(m, _SUPPORTED):
            raise ValueError(f"layer {name} ({type(m).__name__}) is not supported by stacked training; "
                             f"supported: {', '.join(t.__name__ for t in _SUPPORTED)}")
        if isinstance(m, nn.Conv2d) and (m.groups != 1 or m.padding_mode != "zeros" or m.bias is None
                                         or m.stride != (1, 1) or m.dilation != (1, 1)):
            raise ValueError(f"layer {name}: stacked training needs Conv2d with groups=1, stride 1, no "
                             f"dilation, zero padding and a bias; found groups={m.groups}, stride="
                             f"{m.stride}, dilation={m.dilation}, padding_mode={m.padding_mode!r}")
        if isinstance(m, nn.Linear) and m.bias is None:
            raise ValueError(f"layer {name}: stacked training needs Linear layers with a bias")
    return seq


@dataclass
class _Record:
    """A parametrised layer's input and output during one forward pass (for per-example norms)."""

    name: str
    module: nn.Module
    inp: torch.Tensor
    out: torch.Tensor


class StackedModels:
    """M models of ``template``'s architecture; parameters and buffers as ``{name: (M, ...)}``.

    Activations travel in one of two layouts: model-major ``(M, B, features)`` for dense layers, or
    batch-major with the models merged into the channels, ``(B, M * C, H, W)``, for convolutions
    and pooling (what a grouped convolution reads and writes).
    """

    def __init__(self, template: nn.Module, n_models: int):
        layers = layer_sequence(template)
        # relu(maxpool(h)) == maxpool(relu(h)) (relu is monotone): pooling first makes the relu
        # and its backward pass 4x smaller
        for i in range(len(layers) - 1):
            if isinstance(layers[i][1], nn.ReLU) and isinstance(layers[i + 1][1], nn.MaxPool2d):
                layers[i], layers[i + 1] = layers[i + 1], layers[i]
        self.layers = layers
        self.m = n_models
        self.parametrised = [name for name, layer in layers if isinstance(layer, _PARAMETRISED)]

    # -- layout changes ---------------------------------------------------------------------
    def _grid(self, h: torch.Tensor, kind: str) -> torch.Tensor:
        if kind == "grid":
            return h
        m, b = h.shape[:2]  # (M, B, C, H, W) -> (B, M * C, H, W), channels last
        h = h.transpose(0, 1).reshape(b, m * h.shape[2], *h.shape[3:])
        return h.contiguous(memory_format=torch.channels_last)

    def _dense(self, h: torch.Tensor, kind: str) -> torch.Tensor:
        if kind == "dense":
            return h.reshape(h.shape[0], h.shape[1], -1)
        return h.reshape(h.shape[0], self.m, -1).transpose(0, 1)  # (B, M*C, H, W) -> (M, B, C*H*W)

    # -- forward ----------------------------------------------------------------------------
    def forward(self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], x: torch.Tensor,
                record: Collection[str] = ()) -> tuple[torch.Tensor, list[_Record]]:
        """Logits ``(M, B, classes)`` of model m on ``x[m]`` (``x``: ``(M, B, C, H, W)``), and the
        inputs and outputs of the parametrised layers named in ``record``."""
        h, kind, recs = x, "dense", []
        for name, layer in self.layers:
            if isinstance(layer, nn.Linear):
                h = self._dense(h, kind)
                inp = h
                h = torch.baddbmm(params[f"{name}.bias"].unsqueeze(1), h,
                                  params[f"{name}.weight"].transpose(1, 2))
                kind = "dense"
            elif isinstance(layer, nn.Conv2d):
                h = self._grid(h, kind)
                inp = h
                w = params[f"{name}.weight"]
                h = F.conv2d(h, w.reshape(-1, *w.shape[2:]), params[f"{name}.bias"].reshape(-1),
                             layer.stride, layer.padding, layer.dilation, groups=self.m)
                kind = "grid"
            elif isinstance(layer, nn.ReLU):
                h = F.relu(h)
            elif isinstance(layer, nn.MaxPool2d):
                h = F.max_pool2d(self._grid(h, kind), layer.kernel_size, layer.stride, layer.padding,
                                 layer.dilation, ceil_mode=layer.ceil_mode)
                kind = "grid"
            elif isinstance(layer, nn.Flatten):
                h, kind = self._dense(h, kind), "dense"
            else:  # UnitNormalize, per model its own centre
                h = self._dense(h, kind) - buffers[f"{name}.center"].unsqueeze(1)
                norm = h.norm(dim=2, keepdim=True)
                h, kind = torch.where(norm > 0, h / norm.clamp_min(1e-30), torch.zeros_like(h)), "dense"
            if name in record:
                recs.append(_Record(name, layer, inp, h))
        return self._dense(h, kind), recs

    # -- per-example clipping -----------------------------------------------------------------
    def clipped_gradient_sum(self, recs: list[_Record], out_grads: list[torch.Tensor],
                             clip: float) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """``sum_i min(1, clip / ||grad_i||) grad_i`` per model, and the norms ``(M, B)``.

        ``out_grads[l]`` is the gradient of the summed per-example losses with respect to layer l's
        output, i.e. each example's own output gradient (examples do not interact).
        """
        sq = None
        parts = []
        for rec, g in zip(recs, out_grads):
            if isinstance(rec.module, nn.Linear):
                # ||g_i a_i^T||^2 = ||g_i||^2 ||a_i||^2 ; bias gradient is g_i
                g2 = g.pow(2).sum(-1)
                layer_sq, per = g2 * (rec.inp.pow(2).sum(-1) + 1.0), None
            else:
                per = self._conv_per_example(rec, g)
                layer_sq = (per[0].pow(2).sum((0, 3, 4)) + per[1].pow(2).sum(2)).transpose(0, 1)
            sq = layer_sq if sq is None else sq + layer_sq
            parts.append(per)
        norms = sq.sqrt()
        factor = (clip / norms.clamp_min(1e-12)).clamp(max=1.0)  # (M, B), as clip_per_sample
        out = {}
        for rec, g, per in zip(recs, out_grads, parts):
            if isinstance(rec.module, nn.Linear):
                gc = g * factor.unsqueeze(-1)
                out[f"{rec.name}.weight"] = torch.bmm(gc.transpose(1, 2), rec.inp)
                out[f"{rec.name}.bias"] = gc.sum(1)
            else:
                ft = factor.transpose(0, 1)  # (B, M)
                w = rec.module.weight
                out[f"{rec.name}.weight"] = torch.einsum("bm,cbmok->mock", ft, per[0]).reshape(self.m, *w.shape)
                out[f"{rec.name}.bias"] = torch.einsum("bm,bmo->mo", ft, per[1])
        return out, norms

    def _conv_per_example(self, rec: _Record, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-example weight gradients ``(in, B, M, out, k*k)`` and bias gradients ``(B, M, out)``.

        The weight gradient of example i is the cross-correlation of its input channels with its
        output gradient: one convolution with the B*M output gradients as depthwise filters
        (stride 1, no dilation).
        """
        conv: nn.Conv2d = rec.module
        b, c = rec.inp.shape[0], conv.in_channels
        inp = rec.inp.reshape(b * self.m, c, *rec.inp.shape[2:]).transpose(0, 1)  # (in, B*M, H, W)
        filt = g.reshape(b * self.m * conv.out_channels, 1, *g.shape[2:])
        per = F.conv2d(inp, filt, padding=conv.padding, groups=b * self.m)       # (in, B*M*out, k, k)
        per = per.reshape(c, b, self.m, conv.out_channels, -1)
        return per, g.reshape(b, self.m, conv.out_channels, -1).sum(-1)


def clipped_sum_one(model: nn.Module, x: torch.Tensor, example_losses: Callable[[torch.Tensor], torch.Tensor],
                    clip: float) -> dict[str, torch.Tensor]:
    """One model's ``sum_i min(1, clip / ||g_i||) g_i`` over its trainable parameters, ``g_i`` the
    gradient of ``example_losses(logits)[i]`` (``logits``: ``(B, classes)``, one loss per example).

    Frozen layers (``requires_grad`` off) take no part in the norms, as with ``torch.func``
    per-example gradients of the trainable parameters. A model :class:`StackedModels` does not
    support, or a layer with only some parameters trainable, is a ``ValueError``.
    """
    stacked = StackedModels(model, 1)
    named = dict(model.named_parameters())
    trainable = []
    for name in stacked.parametrised:
        flags = {named[f"{name}.weight"].requires_grad, named[f"{name}.bias"].requires_grad}
        if len(flags) > 1:
            raise ValueError(f"layer {name}: weight and bias must be both trainable or both frozen")
        if flags.pop():
            trainable.append(name)
    if not trainable:
        raise ValueError("the model has no trainable parameters")
    params = {k: p.detach().unsqueeze(0).requires_grad_(p.requires_grad) for k, p in named.items()}
    buffers = {k: b.unsqueeze(0) for k, b in model.named_buffers()}
    logits, recs = stacked.forward(params, buffers, x.unsqueeze(0), record=trainable)
    outs = torch.autograd.grad(example_losses(logits[0]).sum(), [r.out for r in recs])
    sums, _ = stacked.clipped_gradient_sum(recs, list(outs), clip)
    return {k: v[0] for k, v in sums.items()}
