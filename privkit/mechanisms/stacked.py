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
* convolution: per-example weight gradients are formed (they are small, out x in x k x k per
  example, and cheaper than the ghost norm's T^2 terms for T = H x W output positions: 784^2 for a
  28x28 layer) by one weight-gradient convolution with B x M groups, one per (example, model) pair,
  then reduced with the clipping factors. It costs what the weight gradient of plain training costs.

The pass runs in chunks of examples (a few MB of activations, so that they stay in cache), each
with a forward pass without autograd and a hand-written backward pass (autograd only for the
loss): the backward pass runs in the layout where the per-example convolution needs no copies.
A convolution's clipped sum is reduced within its chunk; a linear layer's waits for the whole
batch, one product over all its examples rather than one per chunk over a few.

The result equals the per-example gradients of ``vmap(grad)`` up to float rounding (tested against
:func:`privkit.mechanisms.dp_sgd_step.per_sample_gradients`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from privkit.models import FeatureClassifier, UnitNormalize

_PARAMETRISED = (nn.Linear, nn.Conv2d)
_SUPPORTED = _PARAMETRISED + (nn.ReLU, nn.MaxPool2d, nn.Flatten, UnitNormalize)


class UnsupportedModelError(ValueError):
    """A model or layer the stacked forward/backward does not cover (callers fall back to
    ``torch.func``); any other ``ValueError`` from this module is a bug and propagates."""


def layer_sequence(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Leaf layers of a privkit :class:`~privkit.models.FeatureClassifier` in execution order, with
    the prefixes of their parameter names; any other model or layer is a ``ValueError``."""
    if not isinstance(model, FeatureClassifier) or not isinstance(model.features, nn.Sequential):
        raise UnsupportedModelError(
            f"model must be a privkit FeatureClassifier with sequential features; found "
            f"{type(model).__name__}"
        )
    seq = [(f"features.{n}", m) for n, m in model.features.named_children()] + [
        ("head", model.head)
    ]
    for name, m in seq:
        if not isinstance(m, _SUPPORTED):
            raise UnsupportedModelError(
                f"layer {name} ({type(m).__name__}) is not supported by stacked training; "
                f"supported: {', '.join(t.__name__ for t in _SUPPORTED)}"
            )
        if isinstance(m, nn.Conv2d) and (
            m.groups != 1
            or m.padding_mode != "zeros"
            or m.bias is None
            or m.stride != (1, 1)
            or m.dilation != (1, 1)
        ):
            raise UnsupportedModelError(
                f"layer {name}: stacked training needs Conv2d with groups=1, stride 1, no "
                f"dilation, zero padding and a bias; found groups={m.groups}, stride="
                f"{m.stride}, dilation={m.dilation}, padding_mode={m.padding_mode!r}"
            )
        if isinstance(m, nn.Linear) and m.bias is None:
            raise UnsupportedModelError(
                f"layer {name}: stacked training needs Linear layers with a bias"
            )
    return seq


@dataclass
class _Record:
    """A parametrised layer's input and output during one forward pass (for per-example norms)."""

    name: str
    module: nn.Module
    inp: torch.Tensor
    out: torch.Tensor


@dataclass
class _Saved:
    """What the hand-written backward pass through one layer needs from the forward pass."""

    name: str
    module: nn.Module
    tensor: (
        Any  # a tensor (linear, conv: input; relu, unit-normalise: output; pool: indices) or None
    )
    shape: torch.Size  # the layer's output shape (grid layers: the layout to go back to)
    extra: Any = (  # a torch.Size, a tensor or None
        None  # pool: its input's shape; unit-normalise: the norms;
    )
    #                                                 the first conv: its input, contiguous


def _pair(v) -> list[int]:
    return list(v) if isinstance(v, tuple | list) else [v, v]


class LinearSums:
    """The linear layers' (clipped) gradient sums of a batch taken in several chunks
    (:meth:`StackedModels.clipped_sums`; plain gradients in centralized training's reference
    steps, :mod:`privkit.batched.many_central`): each chunk's inputs and (clipped) output gradients
    go to ``(M, width, ...)`` tensors at its examples' places (0 elsewhere: pads and the models a
    chunk leaves out add nothing), and each weight's sum is one batched product over the whole
    batch, where a chunk's product over its few examples runs at a fraction of the kernel's
    rate."""

    def __init__(self, m: int, width: int):
        self.m, self.width = m, width
        self.kinds: dict[str, str] = {}
        self.inputs: dict[str, torch.Tensor] = {}
        self.grads: dict[str, torch.Tensor] = {}

    def put(
        self,
        per: dict[str, tuple],
        factor: torch.Tensor | None,
        models: torch.Tensor | None,
        sl: slice,
    ) -> dict[str, tuple]:
        """Keep the linear layers' pieces ``(kind, input, output gradient)`` of the chunk of
        examples ``sl`` (of ``models``; None: all of them), each example's output gradient
        scaled by its clipping ``factor`` ``(M, b)`` (None: as it is); the others (convolutions)
        come back for the chunk's own sums."""
        rest = {}
        for name, (kind, a, g) in per.items():
            if kind == "conv":
                rest[name] = (kind, a, g)
                continue
            if name not in self.kinds:
                self.kinds[name] = kind
                self.inputs[name] = a.new_zeros(self.m, self.width, a.shape[-1])
                # held transposed, (M, out, width): the product's left factor as its kernel reads
                # it fastest (17 x (128 x 64) @ (64 x 1568): 5.9 ms, 7.2 ms from a transposed view)
                self.grads[name] = g.new_zeros(self.m, g.shape[-1], self.width)
            gc = (g if factor is None else g * factor.unsqueeze(-1)).mT
            if models is None:
                self.inputs[name][:, sl] = a
                self.grads[name][:, :, sl] = gc
            else:
                self.inputs[name][models, sl] = a
                self.grads[name][models, :, sl] = gc
        return rest

    def sums(self) -> dict[str, torch.Tensor]:
        """Each kept layer's weight sum (and bias sum, where it has one) over the whole batch."""
        out = {}
        for name, kind in self.kinds.items():
            g = self.grads[name]
            out[f"{name}.weight"] = torch.bmm(g, self.inputs[name])
            if kind == "linear":
                out[f"{name}.bias"] = g.sum(2)
        return out


# model-examples per chunk of the clipped-sum pass on the CPU, in bytes of the largest convolutional
# activation: a few MB keep a chunk's activations in cache (measured best at 4-8 MB for the quickstart
# cnn, 16 models); tens of MB make every step pay for memory traffic and fresh page mappings, which
# cost more than the arithmetic of small convolutions (batch 128 x 16 models at once: 1.6x slower).
# With the linear layers' clipped sums taken over the whole batch (LinearSums), 8 MB beat 6 MB for
# 17 CNNs of either size at batch 64 and 128 (4-9% a step) and 16 quickstart CNNs' plain gradients;
# 12 MB was slower for three of the four (docs/performance.md)
CHUNK_BYTES = 8 << 20


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
        #: clipping factor ``min(1, clip / (norm + norm_offset))``; 0 guards 0 norms only, as
        #: privkit's clip_per_sample; opacus adds 1e-6 (its DPOptimizer.clip_and_accumulate)
        self.norm_offset = 0.0

    # -- layout changes ---------------------------------------------------------------------
    @staticmethod
    def _grid(h: torch.Tensor, kind: str, memory_format=torch.channels_last) -> torch.Tensor:
        if kind == "grid":
            return h
        m, b = h.shape[:2]  # (M, B, C, H, W) -> (B, M * C, H, W), channels last
        h = h.transpose(0, 1).reshape(b, m * h.shape[2], *h.shape[3:])
        return h.contiguous(memory_format=memory_format)

    @staticmethod
    def _dense(h: torch.Tensor, kind: str, m: int) -> torch.Tensor:
        if kind == "dense":
            return h.reshape(h.shape[0], h.shape[1], -1)
        return h.reshape(h.shape[0], m, -1).transpose(0, 1)  # (B, M*C, H, W) -> (M, B, C*H*W)

    # -- forward ----------------------------------------------------------------------------
    def forward(
        self,
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        x: torch.Tensor,
        record: Collection[str] = (),
    ) -> tuple[torch.Tensor, list[_Record]]:
        """Logits ``(M, B, classes)`` of model m on ``x[m]`` (``x``: ``(M, B, C, H, W)``), and the
        inputs and outputs of the parametrised layers named in ``record``."""
        recs: list[_Record] = []
        h = self._run(
            params,
            buffers,
            x,
            None,
            lambda name, layer, inp, out: (
                recs.append(_Record(name, layer, inp, out)) if name in record else None
            ),
        )
        return h, recs

    def _run(self, params, buffers, x, tape: list[_Saved] | None, seen=None) -> torch.Tensor:
        """Logits ``(M, B, classes)``; with a ``tape``, save what :meth:`_backward` needs. ``M`` is
        ``x``'s first dimension (all models, or some of them with their parameters)."""
        h, kind, m = x, "dense", x.shape[0]
        saved: Any
        extra: Any
        for name, layer in self.layers:
            saved, extra = None, None
            if isinstance(layer, nn.Linear):
                h = saved = self._dense(h, kind, m)
                inp = h
                h = torch.baddbmm(
                    params[f"{name}.bias"].unsqueeze(1), h, params[f"{name}.weight"].transpose(1, 2)
                )
                kind = "dense"
            elif isinstance(layer, nn.Conv2d):
                if (
                    kind == "dense"
                ):  # the input, (B, M*C, H, W); its contiguous copy kept for the backward
                    extra = self._grid(h, kind, torch.contiguous_format)
                    h = extra.contiguous(memory_format=torch.channels_last)
                saved = inp = h
                w = params[f"{name}.weight"]
                h = F.conv2d(
                    h,
                    w.reshape(-1, *w.shape[2:]),
                    params[f"{name}.bias"].reshape(-1),
                    layer.stride,
                    layer.padding,
                    layer.dilation,
                    groups=m,
                )
                kind = "grid"
            elif isinstance(layer, nn.ReLU):
                inp = h
                h = saved = F.relu(h)
            elif isinstance(layer, nn.MaxPool2d):
                h = inp = self._grid(h, kind)
                extra = h.shape
                h, saved = F.max_pool2d(
                    h,
                    layer.kernel_size,
                    layer.stride,
                    layer.padding,
                    layer.dilation,
                    ceil_mode=layer.ceil_mode,
                    return_indices=True,
                )
                kind = "grid"
            elif isinstance(layer, nn.Flatten):
                inp = h
                h, kind = self._dense(h, kind, m), "dense"
            else:  # UnitNormalize, per model its own centre
                inp = h = self._dense(h, kind, m)
                h = h - buffers[f"{name}.center"].unsqueeze(1)
                extra = h.norm(dim=2, keepdim=True)
                h = saved = torch.where(extra > 0, h / extra.clamp_min(1e-30), torch.zeros_like(h))
                kind = "dense"
            if tape is not None:
                tape.append(_Saved(name, layer, saved, h.shape, extra))
            if seen is not None:
                seen(name, layer, inp, h)
        return self._dense(h, kind, m)

    # -- per-example clipping -----------------------------------------------------------------
    def clipped_sums(
        self,
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        x: torch.Tensor,
        example_losses: Callable[[torch.Tensor, torch.Tensor, slice], torch.Tensor],
        clip: float,
        record: Collection[str] | None = None,
        counts: list[int] | None = None,
        input_norms: torch.Tensor | None = None,
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """``sum_i min(1, clip / ||grad_i||) grad_i`` per model over the layers in ``record`` (all
        parametrised layers by default), and the norms ``(M, B)``.

        ``grad_i`` is the gradient of ``example_losses(logits, models, s)[j, i]``: ``logits`` are
        ``(len(models), b, classes)`` for the examples ``x[models, s]`` and the losses one per
        example (each depending on its own logits only). Model m's examples are its first
        ``counts[m]`` (default: all); the rest are pads: they add nothing and have norm 0, whatever
        their losses.

        The examples are processed in chunks (``s``), each with its own forward and backward pass:
        every example's norm is formed within its chunk, so the chunks only add up, and a chunk's
        activations stay in cache. A chunk leaves out the models whose examples have run out.

        ``input_norms`` ``(M, B)``: each example's squared input norm, where the caller keeps its
        records' (a model whose first layer is linear on the input, :attr:`linear_on_input`):
        that layer's norms read them, where every step would square and sum its batch again.
        """
        m, width = x.shape[:2]
        if input_norms is not None and not self.linear_on_input:
            raise ValueError("input_norms needs a first layer linear on the input; found another")
        record = (
            self.parametrised if record is None else [n for n in self.parametrised if n in record]
        )
        counts = [width] * m if counts is None else counts
        if len(counts) != m or min(counts) < 0 or max(counts) > width:
            raise ValueError(f"counts must be {m} numbers in [0, {width}]; found {counts}")
        from attacks.transfers import to_device  # queued: a plain copy waits for the device

        size = to_device(torch.tensor(counts), x.device)
        sums: dict[str, torch.Tensor] = {}
        norms = x.new_zeros(m, width)
        step = self.chunk_size(x)
        # Over several chunks, the linear layers' clipped sums wait for the whole batch: one
        # product over all its examples, where a chunk's product over its few examples ran at a
        # fraction of the kernel's rate (17 CNNs, chunks of 7 examples: the 1568 x 128 layer's
        # products took 48 ms of a 268 ms step). A convolution's per-example gradients are
        # reduced in their chunk, while they are in cache.
        dense = LinearSums(m, width) if max(counts, default=0) > step else None
        for start in range(0, max(counts), step):
            sl = slice(start, min(start + step, width))
            rows = [j for j in range(m) if counts[j] > start]
            if len(rows) == m:
                models, sub, p, bf = torch.arange(m, device=x.device), x[:, sl], params, buffers
            else:
                models = to_device(torch.tensor(rows), x.device)
                sub = x[models, sl]
                p = {k: v[models] for k, v in params.items()}
                bf = {k: v[models] for k, v in buffers.items()}
            # pads among the chunk's examples (of a model whose examples run out within it)
            keep = (
                torch.arange(sl.start, sl.stop, device=x.device) < size[models, None]
                if min(counts[j] for j in rows) < sl.stop
                else None
            )
            per = self._chunk_pieces(
                p, bf, sub, lambda lo, mo=models, s=sl: example_losses(lo, mo, s), record
            )
            n, factor = self._clip_factors(
                per,
                clip,
                keep,
                None
                if input_norms is None
                else input_norms[:, sl]
                if len(rows) == m
                else input_norms[models, sl],
            )
            if dense is not None:  # the linear layers' pieces, for the batch's products
                per = dense.put(per, factor, None if len(rows) == m else models, sl)
            part = self._clipped_products(per, factor, p)
            for k, v in part.items():
                if len(rows) == m:
                    sums[k] = sums[k].add_(v) if k in sums else v
                else:  # models whose examples ran out add nothing
                    sums[k] = sums[k] if k in sums else torch.zeros_like(params[k])
                    sums[k].index_add_(0, models, v)
            norms[models, sl] = n
        if dense is not None:
            sums.update(dense.sums())
        keys = [k for n in record for k in (f"{n}.weight", f"{n}.bias") if k in params]
        return {k: sums[k] if k in sums else torch.zeros_like(params[k]) for k in keys}, norms

    def chunk_size(self, x: torch.Tensor) -> int:
        """Examples per model and chunk: on the CPU about :data:`CHUNK_BYTES` of the largest
        convolutional activation; the whole batch for an mlp, and on a GPU (no cache to fit; fewer,
        larger kernels)."""
        if x.device.type != "cpu":
            return max(1, x.shape[1])
        h = torch.empty(1, *x.shape[2:], device="meta")
        largest = 0
        for _, layer in self.layers:
            if isinstance(layer, nn.Conv2d):
                h = F.conv2d(
                    h,
                    torch.empty(layer.weight.shape, device="meta"),
                    None,
                    layer.stride,
                    layer.padding,
                    layer.dilation,
                )
                largest = max(largest, h.numel())
            elif isinstance(layer, nn.MaxPool2d):
                h = F.max_pool2d(
                    h,
                    layer.kernel_size,
                    layer.stride,
                    layer.padding,
                    layer.dilation,
                    ceil_mode=layer.ceil_mode,
                )
        if not largest:
            return max(1, x.shape[1])
        return max(1, CHUNK_BYTES // (largest * x.element_size() * x.shape[0]))

    @property
    def linear_on_input(self) -> bool:
        """Whether the first parametrised layer is linear on the input itself (flattened): its
        per-example input norms are the records' own (:meth:`clipped_sums`' ``input_norms``)."""
        for _, layer in self.layers:
            if not isinstance(layer, nn.Flatten):
                return isinstance(layer, nn.Linear)
        return False

    def _chunk_pieces(self, params, buffers, x, losses_of, record) -> dict[str, tuple]:
        """One chunk's per-layer pieces (:meth:`_backward`) for :meth:`clipped_sums`: forward
        without autograd, the loss's gradient by autograd, the rest of the backward pass by
        hand."""
        tape: list[_Saved] = []
        with torch.no_grad():
            logits = self._run(params, buffers, x, tape)
        logits.requires_grad_(True)
        with torch.enable_grad():
            (dlogits,) = torch.autograd.grad(losses_of(logits).sum(), [logits])
        return self._backward(tape, dlogits, params, record)

    def _clip_factors(
        self,
        per: dict[str, tuple],
        clip: float,
        keep: torch.Tensor | None,
        input_norms: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every example's norm over all the layers of ``per`` and its clipping factor, both
        ``(M, b)`` and 0 at pads (``keep`` False)."""
        first = next(iter(per.values()))
        shape = first[1].shape[:2] if first[0] != "conv" else first[1].shape[:2][::-1]
        sq = torch.zeros(shape, dtype=first[1].dtype, device=first[1].device)
        known = {self.parametrised[0]: input_norms} if input_norms is not None else {}
        for name, (kind, a, g) in per.items():
            if kind == "linear":  # ||g_i a_i^T||^2 = ||g_i||^2 ||a_i||^2 ; the bias gradient is g_i
                a_sq = known[name] if name in known else a.pow(2).sum(-1)
                sq += g.pow(2).sum(-1) * (a_sq + 1.0)
            elif kind == "linear_nobias":
                sq += g.pow(2).sum(-1) * a.pow(2).sum(-1)
            else:
                sq += (a.pow(2).sum(-1) + g.pow(2).sum(-1)).transpose(0, 1)
        norms = sq.sqrt()
        factor = (
            clip / (norms + self.norm_offset if self.norm_offset else norms.clamp_min(1e-12))
        ).clamp(max=1.0)
        if keep is not None:
            norms, factor = torch.where(keep, norms, 0.0), torch.where(keep, factor, 0.0)
        return norms, factor

    @staticmethod
    def _clipped_products(
        per: dict[str, tuple], factor: torch.Tensor, params: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The sums of the pieces ``per`` scaled by each example's clipping ``factor``."""
        ft = factor.transpose(0, 1)  # (b, M)
        out = {}
        for name, (kind, a, g) in per.items():
            if kind != "conv":
                gc = g * factor.unsqueeze(-1)
                out[f"{name}.weight"] = torch.bmm(gc.transpose(1, 2), a)
                if kind == "linear":
                    out[f"{name}.bias"] = gc.sum(1)
            else:
                out[f"{name}.weight"] = torch.einsum("bm,bmx->mx", ft, a).reshape(
                    params[f"{name}.weight"].shape
                )
                out[f"{name}.bias"] = torch.einsum("bm,bmo->mo", ft, g)
        return out

    def _backward(
        self,
        tape: list[_Saved],
        g: torch.Tensor,
        params,
        record: list[str],
        inject: dict[str, torch.Tensor] | None = None,
    ) -> dict[str, tuple]:
        """From the logits' gradient ``g`` (``(M, B, classes)``), per recorded layer: for a linear
        layer ``("linear", input (M, B, in), output gradient (M, B, out))``, whose per-example
        weight gradients are never formed; for a convolution ``("conv", weight gradients
        (B, M, out * in * k * k), bias gradients (B, M, out))`` per example.

        Grid layers run backward in the contiguous layout ``(B, M * C, H, W)``, which is also
        ``(1, B * M * C, H, W)``: one image whose channel groups are the (example, model) pairs, so
        that one grouped weight-gradient convolution with ``B * M`` groups gives every example's own
        weight gradient without copies. (The forward pass runs channels last, where pooling and the
        forward convolutions are faster.) ``inject`` adds, per linear layer name, a gradient with
        respect to that layer's input after the pass through it: a loss that also reads a hidden
        layer (the head's input, ``(M, B, in)``).
        """
        aten = torch.ops.aten
        m = g.shape[0]
        contiguous: dict[
            int, torch.Tensor
        ] = {}  # a saved tensor in the contiguous layout, made once

        def plain(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in contiguous:
                contiguous[id(t)] = t.contiguous()
            return contiguous[id(t)]

        first = min(i for i, s in enumerate(tape) if s.name in record)
        out: dict[str, tuple] = {}
        for i in range(len(tape) - 1, first - 1, -1):
            s, layer = tape[i], tape[i].module
            if (
                len(s.shape) == 4 and g.dim() == 3
            ):  # leaving the dense part: (M, B, F) -> (B, M*C, H, W)
                g = g.transpose(0, 1).reshape(s.shape)
            if isinstance(layer, nn.Linear):
                if s.name in record:
                    out[s.name] = ("linear", s.tensor, g)
                if i > first:
                    g = torch.bmm(g, params[f"{s.name}.weight"])
                    if inject and s.name in inject:  # the loss reads this layer's input too
                        g = g + inject[s.name]
            elif isinstance(layer, nn.ReLU):
                g = aten.threshold_backward(g, plain(s.tensor), 0)
            elif isinstance(layer, nn.MaxPool2d):
                g = aten.max_pool2d_with_indices_backward(
                    g,
                    g.new_empty(s.extra),
                    _pair(layer.kernel_size),
                    _pair(layer.stride),
                    _pair(layer.padding),
                    _pair(layer.dilation),
                    layer.ceil_mode,
                    plain(s.tensor),
                )
            elif isinstance(layer, nn.Conv2d):
                inp, b = (plain(s.tensor) if s.extra is None else s.extra), s.shape[0]
                o, c = layer.out_channels, layer.in_channels
                if s.name in record:  # weight gradients of B * M one-example convolutions
                    per = aten.convolution_backward(
                        g.view(1, b * m * o, *g.shape[2:]),
                        inp.view(1, b * m * c, *inp.shape[2:]),
                        inp.new_empty(b * m * o, c, *layer.kernel_size),
                        None,
                        layer.stride,
                        layer.padding,
                        layer.dilation,
                        False,
                        [0, 0],
                        b * m,
                        [False, True, False],
                    )[1]
                    out[s.name] = ("conv", per.view(b, m, -1), g.sum((2, 3)).view(b, m, o))
                if i > first:
                    g = aten.convolution_backward(
                        g,
                        inp,
                        params[f"{s.name}.weight"].reshape(m * o, c, *layer.kernel_size),
                        None,
                        layer.stride,
                        layer.padding,
                        layer.dilation,
                        False,
                        [0, 0],
                        m,
                        [True, False, False],
                    )[0]
            elif isinstance(
                layer, UnitNormalize
            ):  # y = u / |u|: du = (g - y (y . g)) / |u|, 0 where u = 0
                y, norm = s.tensor, s.extra
                g = torch.where(
                    norm > 0,
                    (g - y * (y * g).sum(-1, keepdim=True)) / norm.clamp_min(1e-30),
                    torch.zeros_like(g),
                )
            # Flatten: the gradient stays (M, B, F) until a grid layer reshapes it
        return out


def clipped_sum_one(
    model: nn.Module,
    x: torch.Tensor,
    example_losses: Callable[[torch.Tensor, slice], torch.Tensor],
    clip: float,
) -> dict[str, torch.Tensor]:
    """One model's ``sum_i min(1, clip / ||g_i||) g_i`` over its trainable parameters, ``g_i`` the
    gradient of ``example_losses(logits, s)[i]`` (``logits``: ``(b, classes)`` for the examples
    ``x[s]``, one loss per example).

    Frozen layers (``requires_grad`` off) take no part in the norms, as with ``torch.func``
    per-example gradients of the trainable parameters. A model with a ``stacked_form(n_models)``
    method (FedKD's mentor-mentee pair) is computed by the stacked form it returns. A model
    :class:`StackedModels` does not support, or a layer with only some parameters trainable, is a
    ``ValueError``.
    """
    form = getattr(model, "stacked_form", None)  # a composite model's own stacked form
    stacked = form(1) if callable(form) else StackedModels(model, 1)
    named = dict(model.named_parameters())
    trainable = []
    for name in stacked.parametrised:
        flags = {
            named[f"{name}.{p}"].requires_grad for p in ("weight", "bias") if f"{name}.{p}" in named
        }
        if len(flags) > 1:
            raise UnsupportedModelError(
                f"layer {name}: weight and bias must be both trainable or both frozen"
            )
        if flags.pop():
            trainable.append(name)
    if not trainable:
        raise UnsupportedModelError("the model has no trainable parameters")
    params = {k: p.detach().unsqueeze(0).requires_grad_(p.requires_grad) for k, p in named.items()}
    buffers = {k: b.unsqueeze(0) for k, b in model.named_buffers()}
    sums, _ = stacked.clipped_sums(
        params,
        buffers,
        x.unsqueeze(0),
        lambda lo, _models, s: example_losses(lo[0], s)[None],
        clip,
        trainable,
    )
    return {k: v[0] for k, v in sums.items()}
