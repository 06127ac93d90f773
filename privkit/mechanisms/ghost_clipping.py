"""Flat-clipped per-example gradient sums of any model made of common layers, in one forward and one
backward pass (book-keeping ghost clipping, Bu, Wang, Zha & Karypis, ICML 2023).

DP-SGD needs ``sum_i min(1, C / ||g_i||) g_i``, ``g_i`` the gradient of record ``i``'s loss over
*all* trainable parameters. Per-example gradients (``torch.func``'s ``vmap(grad)``, opacus' hooks)
form every ``g_i``: ``B`` copies of the model's parameters, and for a convolution or a sequence
layer ``B`` weight gradients where plain training forms one. For the layers people use, both the
norms and the clipped sum come from two things plain back-propagation already has: each layer's
input ``a`` and the gradient ``g`` of the summed per-example losses w.r.t. its output (row ``i`` of
``g`` depends on record ``i`` only, the losses being per-example and the model mixing no examples).

One forward pass with hooks stores every parametrised layer's input and the autograd edge of its
output; one backward pass (``torch.autograd.grad`` w.r.t. those edges only) gives the output
gradients and computes no parameter gradient at all. Then, per layer (``T``: positions of a
sequence or of a convolution's output, ``a_t``, ``g_t`` an example's rows):

* **Linear** ``y = a W^T + b`` (any leading shape): ``G_i = sum_t g_t a_t^T`` (a single position:
  ``||G_i||^2 = |a|^2 |g|^2``). Either ``G_i`` is materialised (cost ``T in out`` per example,
  and the clipped sum is then ``sum_i c_i G_i``, almost free), or its squared norm is the ghost
  norm ``sum_{t,s} (a_t . a_s)(g_t . g_s)`` from two ``T x T`` Gram matrices (cost ``T^2 (in +
  out)``, and the clipped sum then costs one weight gradient, ``T in out``, besides). The ghost
  norm wins where ``T`` is small against the layer's width (the deep, wide layers of a CNN) or the
  per-example gradients would not fit (beyond :data:`MATERIALISE_LIMIT` elements: ResNet-18's
  256- and 512-channel convolutions at batch 256); the choice weighs both (``_ghost``). Bias:
  ``sum_t g_t``.
* **Rows that flatten the batch**: a linear layer, LayerNorm or RMSNorm on ``(B k, ...)`` rows
  (OPT's MLP on ``(B T, d)``) is taken on ``(B, k, ...)``; the row check shows the rows to be
  example-major on the first pass.
* **A linear layer of the model's own** (HF transformers' ``Conv1D``, GPT-2's maps, whose weight
  is stored ``(in, out)``; a hand-written layer over ``F.linear``): a module of the model's own code
  with a 2-d ``weight`` and a bias is taken as a linear layer in the layout its first call's
  weight gradient shows (:mod:`privkit.mechanisms.ghost_affine`), else its parameters stand in
  as bare ones (below).
* **Conv2d** is a linear map of the input patches (``in k^2`` values at each of ``T`` output
  positions), so the same two choices apply: materialised, the per-example weight gradients come
  from one grouped convolution's weight gradient with the batch as the groups (the kernel plain
  training's weight gradient runs; ``F.unfold``'s ``im2col`` is several times slower on a CPU);
  the ghost norm sums the patch Gram over the ``k^2`` kernel offsets, one strided slice of the
  input at a time (no ``k^2``-fold unfolded copy). A **Conv1d** is taken as a Conv2d of height 1;
  a **Conv3d**'s per-example gradients are always materialised, by the grouped weight gradient,
  and so are a **transposed convolution**'s (1-d, 2-d, 3-d), by the grouped transposed weight
  gradient, its output padding read from the shapes (as a call with ``output_size`` chose it).
  A grouped convolution (depthwise included) has its per-example gradients materialised: on the
  CPU the batch times its groups as the groups of that one weight gradient, on a GPU one batched
  product of the unfolded input group by group.
* **GroupNorm**, **LayerNorm**, **RMSNorm**: the affine weight's gradient is ``sum`` over every
  non-batch position of ``g * x_hat`` per channel (``x_hat`` the normalised input, recomputed from
  the stored input), the bias' ``sum g``; so for **BatchNorm in eval mode** (``x_hat`` by its
  running statistics) and **InstanceNorm** (by the example's own, or in eval mode by the running
  statistics it keeps); a **PReLU**'s slopes' ``sum g * min(0, a)`` per channel (or over every
  value): small per-example vectors, formed directly, and
  with every layer's bias joined into one block whose squared norms and clipped sums take one
  operation each (:mod:`privkit.mechanisms.ghost_joined`).
* **Embedding**: ``G_i`` adds ``g_t`` into row ``idx_t``; the rows an example touches are summed
  (tokens repeated within an example add up before the norm) by one ``index_add`` over
  ``(example, token)`` keys: exact and linear in the tokens. Positions shared by the batch
  (nanoGPT's ``arange(T)``, GPT-2's ``(1, T)`` ids, whose output the model broadcasts over the
  batch) have the output repeated for each example for the pass (:func:`_per_example`; the
  first pass checks that the model's outputs do not change, as for bare parameters below). Where
  the model's code does not take a repeated output (T5 permutes its ``(T, T, H)`` relative-position
  bias as a 3-d tensor), the output is followed to where it meets the batch
  (:mod:`privkit.mechanisms.ghost_broadcast`), and each example's output gradient comes from
  there.
  Embeddings of one table (T5's and BART's encoder and decoder) are one layer called by each. A
  subclass with a forward of its own (HF's scaled word embeddings, OPT's offset positions) is
  seen by its table's ``F.embedding`` lookups, not by its module's call, as is a linear or
  normalisation layer's subclass by its functional calls (ConvNeXt's LayerNorm on permuted
  channels; :mod:`privkit.mechanisms.ghost_subclasses`). An **EmbeddingBag** summing or
  averaging each example's bag of tokens (a 2-d input, no offsets, no per-sample weights) is an
  embedding of those tokens, each given its bag's output gradient (divided by the bag's count of
  tokens other than the padding index in ``mean`` mode).
* **An output layer tied to the embedding** (``head.weight = emb.weight``, a language model's
  head): the weight's per-example gradient is the embedding's rows ``s_j`` (tokens ``r_j``) plus
  the head's ``sum_t g_t a_t^T``, so its squared norm is the two layers' plus twice
  ``sum_j s_j . sum_t g_t[r_j] a_t`` (:func:`_tied_inner`), and its clipped sum is the two
  layers' added.
* **MultiheadAttention** (and ``nn.TransformerEncoderLayer`` and ``DecoderLayer``, batch-first
  or sequence-first): its forward is replaced for the pass by
  :func:`privkit.mechanisms.ghost_attention.forward`, the same computation with its linear maps in
  the open. Its input projection is a linear map per distinct input over rows of the packed
  weight (self-attention: one map to all ``3E`` rows), each taken as a linear layer above; the
  packed weight's per-example gradient is the maps' stacked, so their squared norms add; its
  ``out_proj`` is called as an ``nn.Linear`` layer.
* **torch's recurrent layers** (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``; stacked, bidirectional,
  either layout, from a given state, on packed sequences, with dropout between layers, an LSTM's
  projection) **and cells** (``nn.LSTMCell``, ``nn.GRUCell``, ``nn.RNNCell``, in a loop of the
  model's own): their forward written out for the pass, each layer and direction's input and
  hidden maps called as linear layers on the recurrent layer's own parameters
  (:mod:`privkit.mechanisms.ghost_rnn`), the maps' calls over the steps taken as one call, as
  below.
* **A parametrized weight** (``torch.nn.utils.parametrize``: weight normalisation, spectral
  normalisation, orthogonal weights, a standardisation of the user's own) of a linear layer or a
  convolution: the per-example gradients ``G_i`` of the weight the pass computed (once:
  ``parametrize.cached``) are materialised, and each example's gradient of the tensors it is
  computed from is ``J^T G_i`` through the recorded graph
  (:mod:`privkit.mechanisms.ghost_parametrized`).
* **A layer run several times** in one forward pass (an RNN's cells over the time steps, opacus'
  ``DPLSTM``, a block shared across depth): ``G_i = sum_calls sum_t g_t a_t^T``. A linear layer's,
  an embedding's, a LayerNorm's or an RMSNorm's calls are taken as one call over all of their
  positions (:func:`_merge_calls`); a convolution's (whose calls may differ in shape) and a
  GroupNorm's (whose statistics are per call) per-example gradients are formed call by call and
  summed (:func:`_summed_over_calls`). An attention's input projections are merged range of rows
  by range of rows, cut where the calls split the packed rows otherwise
  (:func:`_merge_projections`).
* **Other layers of torch's own** without a rule here (an EmbeddingBag in ``max`` mode):
  each example's gradient of the layer's parameters is the vector-Jacobian product of its call on
  that example's stored input against its output gradient, by ``torch.func`` under ``vmap`` on
  the layer alone (:mod:`privkit.mechanisms.ghost_layer_vjp`): only that layer's per-example
  gradients are formed, and the first pass checks that its call on an example alone gives the
  example's row.
* **Bare parameters** of the model's own modules (a vision transformer's class token and position
  embedding, a layer scale): replaced for the pass by per-example stand-ins, ``P`` repeated along
  a batch axis, whose output gradient holds each example's gradient of ``P`` in its row
  (:mod:`privkit.mechanisms.ghost_parameters`; the first pass checks that the stand-ins change no
  output and that each row belongs to one example). Where no form of stand-in gets through the
  forward (Swin's bias table, indexed by positions), ``P`` itself is followed to where it meets
  the batch (:mod:`privkit.mechanisms.ghost_broadcast`).

Squared norms add over layers (flat clipping over every trainable parameter), the clip factors are
``min(1, C / ||g_i||)`` exactly as :func:`privkit.mechanisms.dp_sgd_step.clip_per_sample` (``C =
inf``, an audit's clipping-off mutation, gives 1 and skips the norms), and the clipped sum is
book-kept: each layer's summed gradient with the output gradients weighted by the factors,
``sum_i c_i G_i = (c g)^T a`` (one weight gradient as plain training forms it, or ``sum_i c_i G_i``
where ``G_i`` was materialised anyway); no second backward pass.

Anything else is refused with :class:`~privkit.mechanisms.stacked.UnsupportedModelError` (the
caller falls back to ``torch.func`` per-example gradients) rather than computed wrong: a trainable
parameter of one of torch's own modules with children or hidden states (attention's
``add_bias_kv``), one of torch's own layers called with keyword arguments or more than one input,
returning more than one tensor, or updating buffers in training mode, InstanceNorm keeping running
statistics in training mode (the batch's, kept in the model unnoised), a bare parameter used in a
way neither its stand-in nor following it to the batch covers (passed to a functional layer, read
through another reference), BatchNorm in training mode or without running statistics (it mixes the
batch's examples), a parameter shared by layers other than embeddings of one table and a linear
layer tied to it, a layer's parameter used outside the layer's call (an output tied by
``h @ emb.weight.T`` or a weight read by ``F.linear`` elsewhere: the autograd graph is checked for one
edge into each parameter and call), a subclass of a convolution with its own ``forward``, a layer
applied to a tensor whose first dimension is not the batch's (nor, for a position-wise layer, a
multiple of it or a sequence-first tensor's second dimension), an embedding with ``max_norm`` or
``scale_grad_by_freq``, a layer input modified in place after the layer read it (in-place
operations on a layer's *output*, such as ``ReLU(inplace=True)``, are fine: the output's gradient
edge is taken before them).

**Sequence-first models.** A position-wise layer (linear, LayerNorm, RMSNorm, embedding) on a
sequence-first tensor ``(T, B, ...)`` (``batch_first=False``, torch's default for its transformer
layers) is taken with its input and output gradient transposed to ``(B, T, ...)``. Its shapes
tell where the batch is unless the sequence is as long as the batch (or a multiple of it): each
call's layout is remembered per layer from the passes where they told it (:func:`_layout`). A
call they never told is guessed on the checked first pass, batch-first and, where the rows check
then fails, sequence-first (the pass taken again); on a later pass it is refused for that pass.

The shapes cannot show a wrong guess, nor a model that mixes examples by its own code (a batch
mean in ``forward``): the first pass of each model on two or more examples checks that every
layer's output gradient row belongs to one example (one more backward pass, once:
``_check_rows``), and a model failing it is refused from then on (a failing guess refuses that
pass only, and the next pass is checked again).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import NoReturn, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.nn.utils import parametrize

from privkit.mechanisms import (
    batch_statistics,
    ghost_affine,
    ghost_attention,
    ghost_broadcast,
    ghost_joined,
    ghost_layer_vjp,
    ghost_parameters,
    ghost_parametrized,
    ghost_rnn,
    ghost_subclasses,
)
from privkit.mechanisms.clip_precision import compute_dtype, full_precision, lowered
from privkit.mechanisms.stacked import UnsupportedModelError

__all__ = ["MATERIALISE_LIMIT", "SUPPORTED", "clipped_sum", "per_example_norms"]

#: the layer types whose per-example gradient norms and clipped sums this module forms (and
#: ``nn.MultiheadAttention``'s input projections: :mod:`privkit.mechanisms.ghost_attention`)
SUPPORTED = (
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.GroupNorm,
    nn.LayerNorm,
    nn.RMSNorm,
    nn.Embedding,
    nn.PReLU,
    nn.modules.batchnorm._BatchNorm,  # in eval mode, on its running statistics
    nn.modules.instancenorm._InstanceNorm,
)

_NORMS = (nn.GroupNorm, nn.LayerNorm, nn.RMSNorm)
_FIXED_NORMS = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)
#: layers whose parameters are small per-example vectors formed directly (joined with the others')
_SMALL = (*_NORMS, *_FIXED_NORMS, nn.PReLU)
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
#: an EmbeddingBag summing or averaging its bag is taken as an embedding of its tokens
_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)

#: per-example weight gradients of one layer are materialised up to this many elements (``B in
#: out``: 64 MiB in float32); beyond it the ghost norm is taken wherever its Gram matrices are smaller
MATERIALISE_LIMIT = 1 << 24


def _ghost(conv: bool, b: int, t: int, n_in: int, n_out: int) -> bool:
    """Whether a weight's norms take the ghost norm rather than the materialised per-example
    gradients (``T`` positions, ``n_in`` inputs: a convolution's ``in k^2``).

    Materialising costs ``T in out`` multiply-adds per example plus writing and reading ``in out``
    values, and serves the clipped sum (``sum_i c_i G_i``); the ghost norm costs ``T^2 (in + out)``
    and then the clipped sum costs one batched weight gradient, ``T in out`` at a plain GEMM's
    speed. The weights of the two were fitted on one CPU core (torch 2.13, oneDNN): a grouped
    convolution's weight gradient slows down with many channels per group (an element written
    there costs about 500 multiply-adds' time), small-``K`` Gram products run at about a quarter of
    a GEMM's speed. On a GPU the same weights choose (per-example convolution gradients are formed
    there by batched products, :func:`_offsets_on`); they were not refitted for it. Above
    :data:`MATERIALISE_LIMIT` memory decides.
    """
    weights = n_in * n_out
    if b * weights > MATERIALISE_LIMIT:
        return t * (n_in + n_out) < weights
    if conv:
        return 4 * t * t * (n_in + n_out) + t * weights // 3 < 2 * t * weights + 500 * weights
    return 2 * t * t * (n_in + n_out) + t * weights // 2 < t * weights + 8 * weights


@dataclass(eq=False)  # compared by identity (``layer in expanded``): its fields hold tensors
class _Layer:
    """One parametrised layer's trainable parameters and what the pass stored for it."""

    module: nn.Module
    names: dict[str, str]  # "weight"/"bias" -> the model's parameter name (trainable only)
    inputs: list[torch.Tensor] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    edges: list = field(default_factory=list)
    grad: torch.Tensor | None = None
    per_example: dict[str, torch.Tensor] = field(default_factory=dict)  # formed for the norms
    # the small ones (a normalisation's affine weight and bias, a bias), (B, ...): their norms
    # and clipped sums are taken with every layer's at once (ghost_joined)
    small: dict[str, torch.Tensor] = field(default_factory=dict)
    rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # an embedding's
    # an attention's input projections (ghost_attention.Projection), their output gradients
    plan: list = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    # per call: run on a sequence-first tensor ``(T, B, ...)``, stored batch-first
    sequence_first: list[bool] = field(default_factory=list)
    # called by a forward privkit writes out (an attention's out_proj, a recurrent layer's maps),
    # always on batch-first tensors
    written: bool = False
    # a bare parameter of its module (``names``' one entry), clipped by a per-example stand-in
    bare: bool = False
    # a linear layer's: the embedding layer whose weight its weight is (an output layer tied to
    # the input embedding), whose per-example gradients add to its own
    tied: _Layer | None = None
    # a linear layer of the model's own (HF's Conv1D): privkit.mechanisms.ghost_affine
    affine: bool = False
    # an embedding's: the other embeddings of its table, whose calls are its calls
    also: list[nn.Module] = field(default_factory=list)
    # followed to where it meets the batch (ghost_broadcast): an embedding's output on positions
    # shared by the batch, one source per call; a bare parameter itself, one source
    sources: list = field(default_factory=list)
    # one of torch's own layers without a rule here: its per-example gradients by torch.func on
    # the layer alone (privkit.mechanisms.ghost_layer_vjp); its outputs kept on a checked pass
    vjp: bool = False
    outputs: list[torch.Tensor] = field(default_factory=list)
    # a map of torch's recurrent layer (privkit.mechanisms.ghost_rnn), called by that layer's
    # forward written out for the pass
    rnn: ghost_rnn.Recurrent | None = None
    # an attention's calls in the pass (each splits its packed weight once)
    calls: int = 0
    # a layer whose weight a parametrization computes (privkit.mechanisms.ghost_parametrized):
    # ``names`` holds the tensors it is computed from; ``derived`` the weight the pass used
    parametrized: bool = False
    derived: torch.Tensor | None = None


def _linear(layer: _Layer) -> bool:
    """Whether the layer is a linear map ``a W + b``: an ``nn.Linear`` or one of the model's own."""
    return layer.affine or isinstance(layer.module, nn.Linear)


def _parameter(layer: _Layer, k: str) -> torch.Tensor:
    """The layer's trainable tensor ``k`` (a parametrization's by its path in the module)."""
    return layer.module.get_parameter(k) if "." in k else getattr(layer.module, k)


def _thetas(layer: _Layer) -> list[str]:
    """A parametrized layer's trainable tensors its weight is computed from (their keys)."""
    return [k for k in layer.names if k.startswith("parametrizations.")]


def _weight_shape(layer: _Layer) -> torch.Size:
    """The shape of the weight the layer's calls used (a parametrized one's as the pass computed
    it, not computed again)."""
    weight = layer.derived if layer.parametrized else layer.module.weight
    return cast(torch.Tensor, weight).shape


def _weight_trained(layer: _Layer) -> bool:
    """Whether the layer's weight, or what a parametrization computes it from, is trained."""
    return "weight" in layer.names or bool(_thetas(layer))


def _as_stored(layer: _Layer, w: torch.Tensor) -> torch.Tensor:
    """A linear layer's weight gradient(s) ``(..., out, in)`` in the layout its weight is
    stored in (``(in, out)`` for HF's Conv1D)."""
    return w.mT if layer.affine and ghost_affine.verified(layer.module) else w


def _layers(model: nn.Module) -> list[_Layer]:
    """The model's parametrised layers with trainable parameters; UnsupportedModelError for any
    trainable parameter this module cannot clip or a layer that mixes examples."""
    owners: dict[int, str] = {}  # each trainable parameter's name (its first, where shared)
    shared: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.requires_grad and owners.setdefault(id(p), name) != name:
            shared[id(p)] = name
    layers = []
    inside: list[str] = []  # the parametrizations of layers taken: part of their owner's layer
    for prefix, module in model.named_modules():
        if any(prefix == p or prefix.startswith(p + ".") for p in inside):
            continue
        if batch_statistics.uses_batch_statistics(module):
            raise UnsupportedModelError(
                f"{prefix}: {type(module).__name__} "
                f"{'in training mode' if module.training else 'without running statistics'} "
                "mixes the examples"
            )
        if batch_statistics.keeps_batch_statistics(module):
            raise UnsupportedModelError(
                f"{prefix}: {type(module).__name__} in training mode with running statistics "
                "(the batch's, kept in the model unnoised)"
            )
        own = {k: p for k, p in module.named_parameters(recurse=False) if p.requires_grad}
        full = {k: owners[id(p)] for k, p in own.items()}
        if ghost_parametrized.covers(module):
            why = ghost_parametrized.refusal(module)
            if why is not None:
                raise UnsupportedModelError(f"{prefix or 'the model'}: {why}")
            inside.append(f"{prefix}.parametrizations" if prefix else "parametrizations")
            thetas = ghost_parametrized.originals(module)
            full |= {k: owners[id(p)] for k, p in thetas.items()}
            if full:
                layers.append(_Layer(module, full, parametrized=True))
            continue
        if isinstance(module, nn.MultiheadAttention):
            if any(p.requires_grad for p in module.parameters()):  # its own or its out_proj's
                layers.append(_attention_layer(prefix, module, full))
            continue
        if not own:
            continue
        if isinstance(module, (nn.RNNBase, nn.RNNCellBase)):
            why = ghost_rnn.refusal(module)
            if why is not None:
                raise UnsupportedModelError(f"{prefix}: {why}")
            layers.extend(_recurrent_layers(module, own, full))
            continue
        if isinstance(module, nn.EmbeddingBag) and _bag_of_tokens(module):
            layers.append(_Layer(module, full))
            continue
        if not isinstance(module, SUPPORTED) and ghost_affine.may_be_affine(module):
            layers.append(_Layer(module, full, affine=True))  # verified on its first call
            continue
        if not isinstance(module, SUPPORTED) and ghost_parameters.may_stand_in(module):
            # a model's own module reading its parameters in its forward (a class token)
            layers.extend(_Layer(module, {k: full[k]}, bare=True) for k in own)
            continue
        if not isinstance(module, SUPPORTED) and ghost_layer_vjp.covers(module):
            why = ghost_layer_vjp.refusal(module)
            if why is not None:
                raise UnsupportedModelError(f"{prefix}: {why}")
            layers.append(_Layer(module, full, vjp=True))
            continue
        if not isinstance(module, SUPPORTED) or set(own) - {"weight", "bias"}:
            raise UnsupportedModelError(
                f"{prefix or 'the model'}: trainable parameters of {type(module).__name__} "
                "are not covered by ghost clipping"
            )
        base = next(t for t in SUPPORTED if isinstance(module, t))
        if (
            type(module).forward is not base.forward
            and not ghost_subclasses.overrides_forward(module)
        ) or (
            isinstance(module, _CONVS)
            and type(module)._conv_forward
            is not next(c for c in _CONVS if isinstance(module, c))._conv_forward
        ):
            raise UnsupportedModelError(
                f"{prefix}: {type(module).__name__} overrides {base.__name__}'s forward"
            )
        if isinstance(module, nn.Embedding) and (
            module.max_norm is not None or module.scale_grad_by_freq
        ):
            raise UnsupportedModelError(
                f"{prefix}: an embedding with max_norm or scale_grad_by_freq"
            )
        layers.append(_Layer(module, full))
    if not layers:
        raise UnsupportedModelError("the model has no trainable parameters")
    out_projs = {id(m.out_proj) for m in model.modules() if isinstance(m, nn.MultiheadAttention)}
    for layer in layers:
        layer.written = layer.rnn is not None or id(layer.module) in out_projs
    for pid, name in shared.items():
        holders = [layer for layer in layers if pid in _parameter_ids(layer)]
        if any(not layer.bare for layer in holders):
            # a layer's parameter also registered on a module of the model's own (opacus' DPLSTM
            # names its cells' weights as nn.LSTM does): read through the layer, no stand-in (a
            # read through the other name is found in the autograd graph)
            layers = [layer for layer in layers if not (layer.bare and layer in holders)]
            holders = [layer for layer in holders if not layer.bare]
        if len(holders) > 1:
            layers = _tie(layers, holders, pid, f"parameter {name} is shared with {owners[pid]}")
    return layers


def _recurrent_layers(
    module: ghost_rnn.Recurrent, own: dict[str, nn.Parameter], full: dict[str, str]
) -> list[_Layer]:
    """A recurrent layer's (or cell's) maps with trainable parameters, each a linear layer
    (:mod:`privkit.mechanisms.ghost_rnn`)."""
    layers = []
    for name, m in ghost_rnn.maps(module).items():
        names = {k: full[f"{k}_{name}"] for k in ("weight", "bias") if f"{k}_{name}" in own}
        if names:
            layers.append(_Layer(m, names, rnn=module))
    return layers


def _bag_of_tokens(module: nn.EmbeddingBag) -> bool:
    """Whether an EmbeddingBag is an embedding of its tokens whose output is their sum or mean:
    torch's own forward, no ``max_norm`` nor ``scale_grad_by_freq`` (its ``max`` mode, and those,
    are taken by :mod:`privkit.mechanisms.ghost_layer_vjp`)."""
    return (
        module.mode in ("sum", "mean")
        and module.max_norm is None
        and not module.scale_grad_by_freq
        and type(module).forward is nn.EmbeddingBag.forward
    )


def _by_calls(layer: _Layer) -> bool:
    """Whether a layer is seen by the functional calls on its weight
    (:mod:`privkit.mechanisms.ghost_subclasses`) rather than by its modules' calls: where one of
    its modules is a subclass with a forward of its own (HF's scaled word embeddings, ConvNeXt's
    LayerNorm)."""
    return any(ghost_subclasses.overrides_forward(m) for m in (layer.module, *layer.also))


def _parameter_ids(layer: _Layer) -> set[int]:
    """The ids of the layer's trainable parameters."""
    return {id(_parameter(layer, k)) for k in layer.names}


def _tie(layers: list[_Layer], holders: list[_Layer], pid: int, why: str) -> list[_Layer]:
    """``layers`` with a weight shared by the ``holders`` as one parameter: embeddings of one
    table (T5's encoder and decoder token embeddings) are one embedding layer called by each
    (``also``: its per-example gradient sums their lookups, as a layer run several times), and an
    output linear layer's weight tied to it (``head.weight = emb.weight``, GPT-2's and BERT's
    language-model heads) is linked (``tied``; its per-example gradient is the two layers'
    summed). Any other sharing is refused (``why``)."""
    keys = [(layer, k) for layer in holders for k in layer.names if id(_parameter(layer, k)) == pid]
    weights = [layer for layer, k in keys if k == "weight"]
    embedding = [layer for layer in weights if isinstance(layer.module, nn.Embedding)]
    linear = [layer for layer in weights if isinstance(layer.module, nn.Linear)]
    if len(keys) != len(embedding) + len(linear) or not embedding or len(linear) > 1:
        raise UnsupportedModelError(why)
    first, *rest = embedding
    padding = cast(nn.Embedding, first.module).padding_idx
    if any(cast(nn.Embedding, e.module).padding_idx != padding for e in rest):
        raise UnsupportedModelError(f"{why}, by embeddings of different padding rows")
    first.also.extend(e.module for e in rest)
    if linear:
        linear[0].tied = first
    return [layer for layer in layers if layer not in rest]


def _attention_layer(prefix: str, module: nn.MultiheadAttention, names: dict[str, str]) -> _Layer:
    """An attention module's layer: its input projections' trainable weights and bias (its
    ``out_proj`` is an ``nn.Linear`` layer of its own, called by
    :func:`privkit.mechanisms.ghost_attention.forward`)."""
    why = ghost_attention.refusal(module)
    if why is not None:
        raise UnsupportedModelError(f"{prefix}: {why}")
    return _Layer(module, names)


def _forward_backward(
    model: nn.Module,
    x: torch.Tensor,
    example_losses: Callable[[torch.Tensor, slice], torch.Tensor],
    layers: list[_Layer],
) -> None:
    """One forward pass storing each layer's input and output edge, one backward pass to those
    edges: ``layer.grad`` = gradient of the summed per-example losses w.r.t. the layer's output."""

    expanded: list[_Layer] = []  # embeddings of positions shared by the batch, made per example
    # calls whose layout the shapes left open on a checked pass, guessed (_layout)
    guessed: list[tuple[nn.Module, int]] = []
    sequence_first = model in _SEQUENCE_FIRST  # guessed sequence-first before the other layouts
    traced: list[_Layer] = []  # such embeddings whose output is followed to the batch instead

    def hook(layer: _Layer):
        def store(_module, args, out):
            if len(args) != 1:  # an input passed by keyword
                raise UnsupportedModelError(
                    f"{type(_module).__name__} called without its one positional input"
                )
            a = args[0]
            version = a._version
            b = x.shape[0]
            if (
                isinstance(_module, nn.Embedding)
                and (_module in _SHARED_POSITIONS or (a.dim() and a.shape[0] != b))
                and not _sequence_first(layer, a, out, b)
            ):
                _SHARED_POSITIONS.add(_module)
                if trace is not None and _module in _TRACED_POSITIONS:
                    return _traced_call(layer, a, out, version)
                expanded.append(layer)
                a, out = _per_example(a, out, b)
            layout = _layout(layer, a, out, b, len(layer.inputs), check, guessed, sequence_first)
            # (an empty call shows no layout, and its sums are zeros either way)
            if layer.affine and ghost_affine.verified(_module) is None and a.numel():
                _verify_affine(_module, a, out, cast(ghost_parameters.RandomState, before))
            if layout == "flattened":  # (B k, ...) rows: (B, k, ...)
                a = a.reshape(b, -1, *a.shape[1:])
            elif layout == "sequence":  # (T, B, ...): (B, T, ...), its gradient likewise
                a = a.transpose(0, 1)
            layer.sequence_first.append(layout == "sequence")
            if layer.parametrized and layer.derived is None:  # cached: the weight the call used
                layer.derived = cast(torch.Tensor, _module.weight)
            layer.inputs.append(a.detach())
            layer.versions.append(version)
            layer.edges.append(get_gradient_edge(out))
            return out if layer in expanded else None

        return store

    def strict_hook(layer: _Layer):
        """A hook for a layer whose call is known by its one positional input only: one taken by
        ghost_layer_vjp (its call recomputed later from that input) or an EmbeddingBag (whose
        offsets or per-sample weights would change its tokens' gradients): a call with keyword
        arguments, or returning other than one tensor, is refused."""
        store = hook(layer)

        def stored(_module, args, kwargs, out):
            name = type(_module).__name__
            if kwargs:
                raise UnsupportedModelError(
                    f"{name} called with keyword arguments {sorted(kwargs)}"
                )
            if not isinstance(out, torch.Tensor):
                raise UnsupportedModelError(f"{name} returns {type(out).__name__}, not one tensor")
            if check and layer.vjp:  # before any in-place operation on it
                layer.outputs.append(out.detach().clone())
            return store(_module, args, out)

        return stored

    def _traced_call(layer: _Layer, a: torch.Tensor, out: torch.Tensor, version: int) -> None:
        """An embedding call whose output the model keeps as it is, followed to the batch."""
        if layer not in traced:
            traced.append(layer)
        layer.inputs.append(a.expand(x.shape[0], *a.shape).detach())  # each example's positions
        layer.versions.append(version)
        name = f"the output of {layer.names.get('weight', type(layer.module).__name__)}"
        layer.sources.append(cast(ghost_broadcast.BroadcastTrace, trace).source(out, name))
        return None

    def called(layer: _Layer) -> ghost_subclasses.Report:
        store = hook(layer)

        def report(ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
            return store(layer.module, (ids,), out)

        return report

    def projected(layer: _Layer):
        def record(projection, a: torch.Tensor, out: torch.Tensor) -> None:
            if a.shape[:1] != x.shape[:1]:
                raise UnsupportedModelError(
                    "MultiheadAttention runs on a tensor whose first dimension is not the batch's"
                )
            if layer.names:  # only out_proj trainable: nothing of the projections is needed
                layer.plan.append(projection)
                layer.inputs.append(a.detach())
                layer.versions.append(a._version)
                layer.edges.append(get_gradient_edge(out))

        def attention(*args, **kwargs):
            layer.calls += 1
            return ghost_attention.forward(
                cast(nn.MultiheadAttention, layer.module), record, *args, **kwargs
            )

        return attention

    # first among the module's forward hooks: the edge of the layer's own output, whatever a
    # user's hook makes of it afterwards; an attention's forward with its linear maps in the open
    attention = [layer for layer in layers if isinstance(layer.module, nn.MultiheadAttention)]
    bare = [layer for layer in layers if layer.bare]
    # bare parameters no form of stand-ins got through the forward: followed to the batch
    followed = [layer for layer in bare if _followed(layer)]
    bare = [layer for layer in bare if layer not in followed]
    trace = (
        ghost_broadcast.BroadcastTrace(x.shape[0])
        if followed
        or any(m in _TRACED_POSITIONS for layer in layers for m in (layer.module, *layer.also))
        else None
    )
    # a layer subclass with a forward of its own: its functional calls, as they happen
    by_calls = [layer for layer in layers if _by_calls(layer)]
    handles = [
        module.register_forward_hook(hook(layer), prepend=True)
        for layer in layers
        if not layer.bare
        and not _strict(layer)
        and layer not in attention
        and layer not in by_calls
        for module in (layer.module, *layer.also)
    ]
    handles += [
        layer.module.register_forward_hook(strict_hook(layer), prepend=True, with_kwargs=True)
        for layer in layers
        if _strict(layer)
    ]
    seen = {
        id(cast(torch.Tensor, layer.module.weight)): (layer.module, called(layer))
        for layer in by_calls
    }
    check = model not in _ROWS_CHECKED and x.shape[0] > 1
    # the random state, to replay the pass, only where something may stand in for it (or a
    # linear layer of the model's own found otherwise on its first call takes the pass again)
    may_stand_in = (
        bare
        or followed
        or any(
            isinstance(layer.module, nn.Embedding)
            or (layer.affine and ghost_affine.verified(layer.module) is None)
            for layer in layers
        )
    )
    before = ghost_parameters.RandomState(x.device) if may_stand_in else None
    # a checked pass may be taken again with other layouts guessed (_layout): from the same draws
    start = before if before is not None or not check else ghost_parameters.RandomState(x.device)
    owners = [(layer.module, next(iter(layer.names))) for layer in bare]
    form = _FORMS.get(model, 0)
    try:
        try:
            with (
                _in_the_open(attention, projected),
                _written_out(layers),
                ghost_parameters.standing_in(owners, x.shape[0], form) as stand_ins,
                parametrize.cached(),  # a parametrized weight computed once, as the calls used it
            ):
                for layer, s in zip(bare, stand_ins, strict=True):
                    layer.edges.append(get_gradient_edge(s))
                for layer in followed:  # the parameter itself
                    ((k, name),) = layer.names.items()
                    source = cast(ghost_broadcast.BroadcastTrace, trace).source(
                        getattr(layer.module, k), name
                    )
                    layer.sources = [source]
                calls = ghost_subclasses.FunctionalCalls(seen, UnsupportedModelError)
                with calls if seen else nullcontext(), trace if trace else nullcontext():
                    if trace is not None:  # the input and the stand-ins hold examples
                        for held in (x, *stand_ins):
                            trace.batch(held)
                    logits = model(x)
                if trace is not None:
                    trace.escaped(logits)
        finally:
            for h in handles:
                h.remove()
    except ghost_broadcast.Untraceable as e:
        _ROWS_CHECKED[model] = str(e)  # refused from then on
        raise
    except UnsupportedModelError:
        raise
    except (RuntimeError, ValueError, IndexError, TypeError) as e:
        if before is None or not (bare or expanded or traced or followed):
            raise
        _refuse_stand_ins(model, x, layers, (bare, expanded, traced + followed), before, e, form)
    for layer in traced + followed:  # the edges of where its source met the batch
        layer.edges = [edge for source in layer.sources for edge in source.edges]
    if check and before is not None and (bare or expanded or traced or followed):
        _check_outputs(model, x, layers, logits, before, bare, form)
    ran = [layer for layer in layers if layer.edges]
    losses = example_losses(logits, slice(None))
    if losses.shape != (x.shape[0],):
        raise UnsupportedModelError(
            f"example_losses gave shape {tuple(losses.shape)}, not one loss per example"
        )
    total = losses.sum()
    _check_parameter_uses(total, layers)
    if not ran:
        return
    edges = [edge for layer in ran for edge in layer.edges]
    # on the first pass, also each followed source's whole gradient, to check that it reaches
    # the loss only where it met the batch (_check_followed)
    sources = [s for layer in traced + followed for s in layer.sources] if check else []
    found = torch.autograd.grad(
        total, [*edges, *(s.tensor for s in sources)], allow_unused=True, retain_graph=check
    )
    found, whole = found[: len(edges)], found[len(edges) :]
    whole_of: dict[int, torch.Tensor | None] = dict(zip(map(id, sources), whole, strict=True))
    if check:
        sequence = [first for layer in ran for first in _orders(layer)]
        try:
            _check_rows(model, losses, edges, found, sequence)
        except UnsupportedModelError:  # a stand-in broadcast against the wrong dimension?
            for module, call in guessed:  # or a layout guessed wrong: guessed again next pass
                _LAYOUTS.get(module, {}).pop(call, None)
            if before is not None:  # the stand-ins' next form first, layouts guessed as before
                _next_form(model, bare, form, before)
            if guessed:
                _guessed_wrong(model, cast(ghost_parameters.RandomState, start))
            raise
    grads = iter(found)
    for layer in ran:
        if any(a._version != v for a, v in zip(layer.inputs, layer.versions, strict=True)):
            raise UnsupportedModelError(
                f"the input of {type(layer.module).__name__} was modified in place after it ran"
            )
        if layer.sources:  # per call, each example's gradient of the output it followed
            per_call = [
                ghost_broadcast.per_example_grads(
                    source, [next(grads) for _ in source.meetings], x.shape[0]
                )
                for source in layer.sources
            ]
            layer.grads = cast(list[torch.Tensor], per_call)  # None: a call unused, as below
            if check:
                _check_followed(model, layer, per_call, [whole_of[id(s)] for s in layer.sources])
            layer.edges = layer.sources  # one per call, as for a layer's own calls
        else:
            layer.grads = [
                _by_example(next(grads), x.shape[0], sequence) for sequence in _orders(layer)
            ]
        if isinstance(layer.module, nn.EmbeddingBag) and not layer.vjp:
            _as_tokens(layer)
        layer.grad = next((g for g in layer.grads if g is not None), None)  # None: unused
        if layer.plan and any(g is None for g in layer.grads) and layer.grad is not None:
            raise UnsupportedModelError(
                "an input projection of MultiheadAttention does not reach the loss"
            )
        if layer.calls > 1 and layer.plan:
            _merge_projections(layer)
        if (
            len(layer.edges) > 1
            and not layer.plan
            and not layer.vjp
            and (layer.affine or isinstance(layer.module, _MERGED))
        ):
            _merge_calls(layer)
    for layer in traced + followed:  # met the batch nowhere: it must not reach the loss either
        if check and layer not in ran:
            unmet = [whole_of[id(s)] for s in layer.sources]
            _check_followed(model, layer, [None] * len(unmet), unmet)
    if check:
        _check_vjp_outputs(model, ran)


def _strict(layer: _Layer) -> bool:
    """Whether the layer's calls are hooked by ``strict_hook`` (:func:`_forward_backward`)."""
    return layer.vjp or isinstance(layer.module, nn.EmbeddingBag)


def _as_tokens(layer: _Layer) -> None:
    """An EmbeddingBag's calls as an embedding's: each call's input ``(B, L)`` tokens, and its
    output gradient ``(B, d)`` given to each of its tokens (divided by the bag's count of tokens
    other than the padding index in ``mean`` mode, as its backward pass divides it; the padding
    index's tokens are no example's rows: :func:`_embedding_rows`)."""
    m = cast(nn.EmbeddingBag, layer.module)
    grads: list[torch.Tensor | None] = []
    for idx, g in zip(layer.inputs, layer.grads, strict=True):
        if idx.dim() != 2:
            raise UnsupportedModelError(
                f"EmbeddingBag on a {idx.dim()}-d input: bags by offsets are not the batch's rows"
            )
        if g is None:
            grads.append(None)
            continue
        tokens = g[:, None, :].expand(-1, idx.shape[1], -1)
        if m.mode == "mean":
            kept = idx != m.padding_idx if m.padding_idx is not None else torch.ones_like(idx)
            tokens = tokens / kept.sum(1).clamp(min=1).to(g.dtype)[:, None, None]
        grads.append(tokens)
    layer.grads = cast(list[torch.Tensor], grads)


def _check_vjp_outputs(model: nn.Module, ran: list[_Layer]) -> None:
    """Once per model (with the rows check): each layer taken by ghost_layer_vjp gives, called on
    each example alone, that example's row of its output; else UnsupportedModelError, remembered
    for the model (``torch.func`` then clips every step)."""
    for layer in ran:
        if layer.vjp:
            why = ghost_layer_vjp.check_outputs(
                layer.module, layer.inputs, layer.outputs, ROWS_RTOL
            )
            layer.outputs = []
            if why is not None:
                _ROWS_CHECKED[model] = why
                raise UnsupportedModelError(why)


#: layers run several times in one forward pass (a layer shared across depth, an RNN cell's maps
#: over the time steps) whose calls are merged: each call's positions are more positions of one
#: call. A convolution's calls may differ in shape and a GroupNorm's statistics are per call:
#: their per-example gradients are formed call by call and summed (:func:`_summed_over_calls`)
_MERGED = (nn.Linear, nn.LayerNorm, nn.RMSNorm, *_EMBEDDINGS)


def _flattened(layer: _Layer, a: torch.Tensor, out: torch.Tensor, b: int) -> bool:
    """Whether a position-wise layer (linear, LayerNorm, RMSNorm) runs on rows that flatten the
    batch with more positions, ``(B k, ...)`` (OPT's MLP on ``(B T, d)``; a windowed attention's
    maps on ``(B windows, ...)``): taken as ``(B, k, ...)``, example-major (the row check shows
    it on the first pass)."""
    position_wise = _linear(layer) or isinstance(layer.module, (nn.LayerNorm, nn.RMSNorm))
    n = a.shape[0] if a.dim() > 1 else 0
    return position_wise and b > 0 and n > b and n % b == 0 and out.shape[:1] == a.shape[:1]


def _sequence_first(layer: _Layer, a: torch.Tensor, out: torch.Tensor, b: int) -> bool:
    """Whether a position-wise layer (linear, LayerNorm, RMSNorm, embedding) may run on a
    sequence-first tensor ``(T, B, ...)``: a sequence-first model's (``nn.TransformerEncoderLayer``
    with ``batch_first=False``, as torch's tutorials build them). An embedding's ``(1, T)``
    positions are positions shared by the batch, not one position of ``T`` examples; a layer
    called by a forward privkit writes out is batch-first."""
    module = layer.module
    if layer.written:
        return False
    embedding = isinstance(module, nn.Embedding) and module not in _SHARED_POSITIONS
    position_wise = _linear(layer) or isinstance(module, (nn.LayerNorm, nn.RMSNorm))
    if not (embedding and a.dim() >= 2 and a.shape[0] > 1) and not (position_wise and a.dim() >= 3):
        return False
    return b > 0 and a.shape[1] == b and out.dim() >= 2 and out.shape[1] == b


#: models whose checked pass guessed its layouts batch-first and failed the rows check: their
#: layouts guessed sequence-first from then on (:func:`_layout`)
_SEQUENCE_FIRST: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _guessed_wrong(model: nn.Module, start: ghost_parameters.RandomState) -> None:
    """A checked pass whose guessed layouts failed the rows check: guessed batch-first, the pass
    is taken again (from the same random state) guessing sequence-first (:class:`_NextForm`);
    guessed both ways, the model is refused as any failing the check is."""
    if model in _SEQUENCE_FIRST:
        _SEQUENCE_FIRST.discard(model)
        return  # _check_rows remembered the refusal
    _ROWS_CHECKED.pop(model, None)
    _SEQUENCE_FIRST.add(model)
    start.restore()
    raise _NextForm


#: each layer's calls' layouts, by call (``"batch"``, ``"sequence"``, ``"flattened"``): where a
#: later pass's shapes admit two (a sequence as long as the batch), the one its shapes chose
_LAYOUTS: weakref.WeakKeyDictionary[nn.Module, dict[int, str]] = weakref.WeakKeyDictionary()


def _layout(
    layer: _Layer,
    a: torch.Tensor,
    out: torch.Tensor,
    b: int,
    call: int,
    check: bool,
    guessed: list[tuple[nn.Module, int]],
    sequence_first: bool = False,
) -> str:
    """Where a layer's call has the batch: ``"batch"`` (its first dimension), ``"flattened"``
    (rows ``(B k, ...)``: :func:`_flattened`) or ``"sequence"`` (its second:
    :func:`_sequence_first`). Where the shapes admit more than one, the one this call had before;
    on a checked pass without one, the first of that order (``sequence_first``: sequence-first
    before it), the guess noted in ``guessed`` (the rows check shows a wrong one:
    :func:`_guessed_wrong`); on another, UnsupportedModelError. With one example every layout
    gives it every row."""
    admitted = [
        name
        for name, fits in (
            ("batch", a.shape[:1] == (b,) and out.shape[:1] == (b,)),
            ("flattened", _flattened(layer, a, out, b)),
            ("sequence", _sequence_first(layer, a, out, b)),
        )
        if fits
    ]
    if sequence_first and "sequence" in admitted:
        admitted.remove("sequence")
        admitted.insert(0, "sequence")
    name = type(layer.module).__name__
    if not admitted:
        raise UnsupportedModelError(
            f"{name} runs on a tensor whose first dimension is not the batch's"
        )
    if b == 1:  # one example: every row is its own, whatever the layout (none learnt)
        return admitted[0]
    known = _LAYOUTS.setdefault(layer.module, {})
    if known.get(call) in admitted:
        return known[call]
    if len(admitted) > 1:
        if not check:
            raise UnsupportedModelError(
                f"{name}'s call {call} admits {' and '.join(admitted)} layouts and has not run "
                "on shapes that tell them apart"
            )
        guessed.append((layer.module, call))
    known[call] = admitted[0]
    return admitted[0]


def _orders(layer: _Layer) -> list[bool]:
    """Per output edge of the layer, whether its call ran sequence-first (an attention's
    projections and a followed source's meetings are batch-first)."""
    if len(layer.sequence_first) == len(layer.edges):
        return layer.sequence_first
    return [False] * len(layer.edges)


def _by_example(g: torch.Tensor, b: int, sequence: bool = False) -> torch.Tensor:
    """A layer's output gradient on rows ``(B k, ...)`` as ``(B, k, ...)`` (:func:`_flattened`),
    on a sequence-first tensor ``(T, B, ...)`` (``sequence``) as ``(B, T, ...)``; ``None``, an
    unused call's, as it is."""
    if g is None:
        return g
    if sequence:
        return g.transpose(0, 1)
    if g.shape[0] == b:
        return g
    return g.reshape(b, -1, *g.shape[1:])


def _several_calls(layer: _Layer) -> bool:
    """Whether the layer ran several times and its calls were not merged."""
    return (
        len(layer.edges) > 1
        and not layer.plan
        and not layer.affine
        and not isinstance(layer.module, _MERGED)
    )


def _summed_over_calls(layer: _Layer, b: int) -> None:
    """A convolution or GroupNorm run several times: ``layer.per_example``, its per-example
    gradients formed call by call (a convolution's materialised whatever their size: no more
    than ``torch.func`` would hold for the layer) and summed over the calls whose output reached
    the loss."""
    m, names = layer.module, layer.names
    total: dict[str, torch.Tensor] = {}
    for a, g in zip(layer.inputs, layer.grads, strict=True):
        if g is None:
            continue
        if isinstance(m, (nn.GroupNorm, nn.PReLU, *_FIXED_NORMS)):
            part = _small_of(m, a, g, names)
        else:
            part = {}
            if "weight" in names and isinstance(m, _TRANSPOSED):
                part["weight"] = _transposed_weight_grad(m, a, g, per_example=True)
            elif _weight_trained(layer):
                conv, a2, g2 = _conv_of(m, a, g)
                part["weight"] = _conv_per_example(conv, a2, g2).reshape(b, *_weight_shape(layer))
            if "bias" in names:
                part["bias"] = g.reshape(b, g.shape[1], -1).sum(2)
        for k, v in part.items():
            total[k] = total[k] + v if k in total else v
    layer.per_example = total
    if layer.parametrized:
        _to_thetas(layer)


def _to_thetas(layer: _Layer) -> None:
    """A parametrized layer's per-example weight gradients ``G_i`` (``layer.per_example``'s
    ``weight``) as the per-example gradients of the tensors the weight is computed from, ``J^T
    G_i`` (:func:`privkit.mechanisms.ghost_parametrized.per_example`)."""
    per_weight = layer.per_example.pop("weight", None)
    keys = _thetas(layer)
    if per_weight is None or not keys:
        return
    found = ghost_parametrized.per_example(
        cast(torch.Tensor, layer.derived), [_parameter(layer, k) for k in keys], per_weight
    )
    # a half-precision model's in float32: each example's norm and contribution from them
    layer.per_example |= {k: v.to(compute_dtype(v.dtype)) for k, v in zip(keys, found, strict=True)}


def _merge_calls(layer: _Layer) -> None:
    """A layer run several times in one pass as one call over all of their positions: per
    example, its inputs (and output gradients) of every call whose output reached the loss,
    concatenated along one position axis. ``G_i = sum_calls sum_t g_t a_t^T`` is then one sum
    over positions (a linear layer; an embedding's rows; a LayerNorm's or RMSNorm's affine
    gradients, whose statistics are per position)."""
    module = layer.module
    trailing = (
        len(cast(nn.LayerNorm, module).normalized_shape)
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm))
        else 0
        if isinstance(module, _EMBEDDINGS)
        else 1
    )
    calls = [(a, g) for a, g in zip(layer.inputs, layer.grads, strict=True) if g is not None]
    if not calls:
        return

    def joined(parts: list[torch.Tensor], keep: int) -> torch.Tensor:
        b = parts[0].shape[0]
        tail = parts[0].shape[parts[0].dim() - keep :]
        return torch.cat([p.reshape(b, -1, *tail) for p in parts], dim=1)

    layer.inputs = [joined([a for a, _ in calls], trailing)]
    # an embedding's output gradient keeps its width: one row per token
    layer.grad = joined([g for _, g in calls], trailing or 1)
    layer.grads = [layer.grad]


def _merge_projections(layer: _Layer) -> None:
    """An attention run several times in one pass (a block shared across depth): each range of
    rows of its weights as one call over all of the positions of the calls that mapped it, as a
    linear layer's (:func:`_merge_calls`). Calls that split the rows otherwise (self-attention's
    one map to all ``3E`` rows in one call, cross-attention's query and key maps in another) are
    cut at every call's boundaries first: a map's gradient restricted to some of its rows is the
    map of those rows."""
    cuts: dict[str, set[int]] = {}
    for p in layer.plan:  # a separate weight's map takes all of its rows (``slice(None)``)
        cuts.setdefault(p.weight, set()).update((p.rows.start, p.rows.stop))
    merged: dict[tuple, tuple[ghost_attention.Projection, list, list]] = {}
    for p, a, g in zip(layer.plan, layer.inputs, layer.grads, strict=True):
        a, g = a.reshape(a.shape[0], -1, a.shape[-1]), g.reshape(g.shape[0], -1, g.shape[-1])
        if p.rows.start is None:
            _, inputs, grads = merged.setdefault((p.weight, None, None), (p, [], []))
            inputs.append(a)
            grads.append(g)
            continue
        bounds = sorted(c for c in cuts[p.weight] if p.rows.start <= c <= p.rows.stop)
        for lo, hi in itertools.pairwise(bounds):
            shift = p.bias_rows.start - p.rows.start
            piece = dataclasses.replace(
                p, rows=slice(lo, hi), bias_rows=slice(lo + shift, hi + shift)
            )
            _, inputs, grads = merged.setdefault((p.weight, lo, hi), (piece, [], []))
            inputs.append(a)
            grads.append(g[..., lo - p.rows.start : hi - p.rows.start])
    # in the packed rows' order, as the clipped sum stacks them (the bias across the weights)
    pieces = sorted(merged.values(), key=lambda piece: piece[0].bias_rows.start)
    layer.plan = [p for p, _, _ in pieces]
    layer.inputs = [torch.cat(inputs, 1) for _, inputs, _ in pieces]
    layer.grads = [torch.cat(grads, 1) for _, _, grads in pieces]
    layer.grad = layer.grads[0]


@contextmanager
def _in_the_open(attention: list[_Layer], forward_of: Callable) -> Iterator[None]:
    """Within the block, each attention layer's forward replaced by ``forward_of(layer)`` (an
    instance attribute, taken away again however the block ends)."""
    try:
        for layer in attention:
            layer.module.forward = forward_of(layer)
        yield
    finally:
        for layer in attention:
            layer.module.__dict__.pop("forward", None)


@contextmanager
def _written_out(layers: list[_Layer]) -> Iterator[None]:
    """Within the block, each recurrent layer's forward written out with its maps
    (:func:`privkit.mechanisms.ghost_rnn.forward`; an instance attribute, taken away again
    however the block ends)."""
    rnns = {id(layer.rnn): layer.rnn for layer in layers if layer.rnn is not None}
    try:
        for rnn in rnns.values():
            rnn.forward = functools.partial(ghost_rnn.forward, rnn)
        yield
    finally:
        for rnn in rnns.values():
            rnn.__dict__.pop("forward", None)


def _own_forward(model: nn.Module, x: torch.Tensor, layers: list[_Layer]) -> torch.Tensor:
    """``model(x)`` with its own parameters and no gradient, its attention layers' and recurrent
    layers' forward in the open as in the pass (whose dropout draws differ from torch's fused
    kernels'), nothing recorded."""
    attention = [layer for layer in layers if isinstance(layer.module, nn.MultiheadAttention)]

    def plain(layer: _Layer):
        module = cast(nn.MultiheadAttention, layer.module)
        return functools.partial(ghost_attention.forward, module, lambda *_: None)

    with _in_the_open(attention, plain), _written_out(layers), torch.no_grad():
        return model(x)


def _refuse_stand_ins(
    model: nn.Module,
    x: torch.Tensor,
    layers: list[_Layer],
    stood_in: tuple[list[_Layer], list[_Layer], list[_Layer]],
    before: ghost_parameters.RandomState,
    error: Exception,
    form: int,
) -> NoReturn:
    """The forward failed with stand-ins (``stood_in``: for the bare parameters in ``form``, for
    the outputs of embeddings of positions shared by the batch, and such outputs followed to the
    batch): the model's own error where its own forward fails too; else the next form where one
    gives a parameter another shape (:class:`_NextForm`); else UnsupportedModelError, remembered
    for the model (a use no stand-in follows; ``torch.func`` clips it). Where outputs of shared
    positions were repeated per example, the pass is first taken again with those outputs as the
    model makes them, followed to where they meet the batch
    (:mod:`~privkit.mechanisms.ghost_broadcast`: T5's relative-position bias, which its code
    permutes as a ``(T, T, H)`` tensor; following is right wherever repeating was). The random
    state is put back to where the pass began."""
    bare, expanded, traced = stood_in
    before.restore()
    _own_forward(model, x, layers)
    if expanded:  # followed instead: right wherever the repeated outputs were
        _TRACED_POSITIONS.update(m for layer in expanded for m in (layer.module, *layer.also))
        before.restore()
        raise _NextForm
    _next_form(model, bare, form, before)
    if bare:  # no form got through: the parameters followed to the batch, from the first form
        for layer in bare:
            _FOLLOWED.setdefault(layer.module, set()).update(layer.names)
        _FORMS.pop(model, None)
        before.restore()
        raise _NextForm
    before.restore()
    names = ", ".join(
        [name for layer in bare for name in layer.names.values()]
        + [
            name if layer.bare else f"the positions of {name}"
            for layer in expanded + traced
            for name in layer.names.values()
        ]
    )
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    why = f"the forward fails with per-example stand-ins of {names} ({first})"
    _ROWS_CHECKED[model] = why
    raise UnsupportedModelError(why) from error


def _check_outputs(
    model: nn.Module,
    x: torch.Tensor,
    layers: list[_Layer],
    logits: torch.Tensor,
    before: ghost_parameters.RandomState,
    bare: list[_Layer],
    form: int,
) -> None:
    """Once per model with bare parameters: the forward with their stand-ins in ``form`` gave the
    model's own outputs (else the next form, or UnsupportedModelError, remembered for the
    model)."""
    own = functools.partial(_own_forward, model, x, layers)
    if not ghost_parameters.same_outputs(own, logits, before, ROWS_RTOL):
        _next_form(model, bare, form, before)
        why = (
            "the forward with per-example stand-ins of its bare parameters or shared positions "
            "gives other outputs than the model's own"
        )
        _ROWS_CHECKED[model] = why
        raise UnsupportedModelError(why)


#: embeddings seen on positions shared by the batch (``arange(T)``, ``(1, T)``): taken so at every
#: pass after, also where ``T`` equals the batch size and the shapes could not tell
_SHARED_POSITIONS: weakref.WeakSet[nn.Module] = weakref.WeakSet()

#: those of them whose output repeated per example failed the model's forward: their output is
#: followed to where it meets the batch (:mod:`privkit.mechanisms.ghost_broadcast`) at every pass
_TRACED_POSITIONS: weakref.WeakSet[nn.Module] = weakref.WeakSet()

#: bare parameters (by module, the names of its own) whose stand-ins no form got through the
#: model's forward (Swin's bias table, indexed by positions): followed to the batch at every pass
_FOLLOWED: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()


def _followed(layer: _Layer) -> bool:
    """Whether the bare parameter of ``layer`` is followed to the batch (:data:`_FOLLOWED`)."""
    return bool(set(layer.names) & _FOLLOWED.get(layer.module, set()))


def _per_example(idx: torch.Tensor, out: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An embedding's positions shared by the batch and its output, repeated for each of the
    ``b`` examples (stride-0 views): a leading dimension of 1 taken as the batch's, else one put
    in front. The model's code broadcast the output over the batch; the repeated output is what
    that broadcast gives, and its gradient holds each example's rows."""
    if idx.dim() > 1 and idx.shape[0] == 1:
        return idx.expand(b, *idx.shape[1:]), out.expand(b, *out.shape[1:])
    return idx.expand(b, *idx.shape), out.expand(b, *out.shape)


class _NextForm(UnsupportedModelError):
    """The pass is to be taken again with the model's next form of stand-ins."""


def _next_form(
    model: nn.Module, bare: list[_Layer], form: int, before: ghost_parameters.RandomState
) -> None:
    """Where a next form of stand-ins gives some bare parameter another shape: remember it for the
    model, put the random state back to where the pass began, and raise :class:`_NextForm`."""
    changes = any(
        ghost_parameters.changes_with_form(getattr(layer.module, k))
        for layer in bare
        for k in layer.names
    )
    if form + 1 < ghost_parameters.FORMS and changes:
        _FORMS[model] = form + 1
        _ROWS_CHECKED.pop(model, None)
        before.restore()
        raise _NextForm


#: the form of stand-ins (:data:`privkit.mechanisms.ghost_parameters.FORMS`) a model's forward
#: takes, where not the first
_FORMS: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()

#: models whose layer outputs were checked row by row (:func:`_check_rows`): ``None`` where every
#: row belongs to one example, else why not (the model is then refused at once; also a model whose
#: bare parameters' stand-ins fail its forward or change its outputs)
_ROWS_CHECKED: weakref.WeakKeyDictionary[nn.Module, str | None] = weakref.WeakKeyDictionary()

#: the largest difference :func:`_check_rows` puts down to float rounding, relative to the layer
#: output gradient's largest value, or 8 units of the dtype's precision where that is more (bfloat16
#: models: 0.0625). Measured: float32 models up to 1.4e-6 (ResNet-18 included), bfloat16 ones 0.011;
#: a linear layer on a sequence-first tensor taken batch-first is off by 0.44 (in either dtype)
ROWS_RTOL = 1e-3


def _check_followed(
    model: nn.Module,
    layer: _Layer,
    per_example: list[torch.Tensor | None],
    whole: list[torch.Tensor | None],
) -> None:
    """Once per model: each followed source's per-example gradients (from where it met the batch)
    add up to its whole gradient, as they do when every path from it to the loss runs through a
    meeting; a path the trace did not see (an operation outside torch's function overrides) adds
    to the whole only: UnsupportedModelError, remembered for the model."""
    for got, want in zip(per_example, whole, strict=True):
        if got is None and want is None:
            continue
        summed = got.sum(0) if got is not None else torch.zeros_like(cast(torch.Tensor, want))
        want = torch.zeros_like(summed) if want is None else want
        scale = max(float(want.abs().max()), float(summed.abs().max()))
        tol = max(ROWS_RTOL, 8 * torch.finfo(want.dtype).eps) * scale
        if float((summed - want).abs().max()) > tol:
            why = (
                f"{layer.sources[0].name} reaches the loss other than where it meets the batch "
                "(its examples' gradients do not add up to its gradient)"
            )
            _ROWS_CHECKED[model] = why
            raise UnsupportedModelError(why)


def _check_rows(
    model: nn.Module,
    losses: torch.Tensor,
    edges: list,
    grads: tuple[torch.Tensor | None, ...],
    sequence: list[bool],
) -> None:
    """Once per model (on a batch of two or more examples): each layer's output gradient for the
    weighted loss ``sum_i w_i L_i`` (distinct weights ``w_i``) is its gradient for ``sum_i L_i``
    with row ``i`` times ``w_i``, as it is when row ``i`` of every layer's output belongs to example
    ``i`` alone (``sequence``: per edge, its call's rows transposed from ``(T, B, ...)``). A
    layout guessed wrong (:func:`_layout`), or a model that mixes examples in its own code (a
    batch mean), breaks it: UnsupportedModelError, remembered for the model (``torch.func`` then
    clips every step) unless the pass guessed a layout (:func:`_guessed_wrong`)."""
    b = losses.shape[0]
    w = 1 + torch.arange(b, dtype=losses.dtype, device=losses.device) / b
    weighted = torch.autograd.grad((losses * w).sum(), edges, allow_unused=True)
    for g, gw, first in zip(grads, weighted, sequence, strict=True):
        if g is None or gw is None:
            continue
        if first:  # (T, B, ...): _sequence_first
            g, gw = g.transpose(0, 1), gw.transpose(0, 1)
        g, gw = g.reshape(b, -1), gw.reshape(b, -1)  # rows (B k, ...) example-major: _flattened
        want = g * w[:, None]
        rtol = max(ROWS_RTOL, 8 * torch.finfo(g.dtype).eps)
        if float((gw - want).abs().max()) > rtol * float(want.abs().max()):
            why = (
                "a layer's output rows are not the batch's examples (examples mixed by the "
                "model's code, or a layout the shapes could not tell)"
            )
            _ROWS_CHECKED[model] = why
            raise UnsupportedModelError(why)
    _ROWS_CHECKED[model] = None


def _verify_affine(
    module: nn.Module, a: torch.Tensor, out: torch.Tensor, before: ghost_parameters.RandomState
) -> None:
    """The first call of a linear layer of the model's own: its layout
    (:func:`privkit.mechanisms.ghost_affine.layout`); where it shows none, the random state is put
    back to where the pass began and the pass is taken again (:class:`_NextForm`), the module's
    parameters then standing in as bare ones."""
    try:
        ghost_affine.layout(module, a, out, max(ROWS_RTOL, 8 * torch.finfo(out.dtype).eps))
    except ghost_affine.NotAffine:
        before.restore()
        raise _NextForm from None


def _leaf_edges(tensor: torch.Tensor) -> dict[int, int]:
    """The edges into each leaf tensor (by id) of the autograd graph that computed ``tensor``:
    for a loss, how many times the model's operations read each parameter; for a parametrized
    weight, how many times its parametrization reads each of its tensors."""
    edges: dict[int, int] = {}
    if tensor.grad_fn is None:
        return edges
    seen, stack = {tensor.grad_fn}, [tensor.grad_fn]
    while stack:
        for node, _ in stack.pop().next_functions:
            if node is None:
                continue
            leaf = getattr(node, "variable", None)
            if leaf is not None:
                edges[id(leaf)] = edges.get(id(leaf), 0) + 1
            if node not in seen:
                seen.add(node)
                stack.append(node)
    return edges


def _check_parameter_uses(total: torch.Tensor, layers: list[_Layer]) -> None:
    """UnsupportedModelError unless every trainable parameter reaches the loss only through its
    own layer's one call: the autograd graph has one edge into each parameter of a layer that ran
    and none into a layer's that did not (a weight used by a functional call elsewhere, or an
    output layer tied by ``h @ emb.weight.T``, would add its gradient where the hooks do not see
    it). A parametrization's tensors reach it through the weight they compute, once per pass
    (``parametrize.cached``), by as many edges as the parametrization reads them."""
    edges = _leaf_edges(total)
    allowed: dict[int, int] = {}  # one edge per call of a layer holding it (two where tied)
    for layer in layers:
        # a bare parameter reaches the loss through its stand-in only; an attention's packed
        # weight through one split however many projections read it
        # (a followed one through each operation the trace saw read it)
        calls = len(layer.sources) or len(layer.edges)
        if layer.bare:
            calls = sum(source.uses for source in layer.sources)
        if isinstance(layer.module, nn.MultiheadAttention):
            calls = layer.calls
        reads = _leaf_edges(layer.derived) if layer.derived is not None else {}
        for k in layer.names:
            pid = id(_parameter(layer, k))
            uses = reads.get(pid, 0) if k.startswith("parametrizations.") else calls
            allowed[pid] = allowed.get(pid, 0) + uses
    for layer in layers:
        for k, name in layer.names.items():
            pid = id(_parameter(layer, k))
            if edges.get(pid, 0) > allowed[pid]:
                raise UnsupportedModelError(
                    f"parameter {name} reaches the loss other than through its layer's one call"
                )


@dataclass(frozen=True)
class _Conv:
    """A convolution's geometry in two dimensions: a Conv2d's own, a Conv1d's as one row of
    height 1 (its input ``(B, C, L)`` seen as ``(B, C, 1, L)``), so both take the same forms; a
    Conv3d's in its three (:attr:`volume`: materialised per-example gradients only)."""

    kernel_size: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...] | str
    dilation: tuple[int, ...]
    padding_mode: str
    reversed_padding: tuple[int, ...]  # F.pad's order, for padding modes other than zeros
    in_channels: int
    groups: int
    weight_shape: tuple[int, ...]  # (out, in / groups, kh, kw) or (out, in / groups, kd, kh, kw)

    @property
    def volume(self) -> bool:
        """A 3-d convolution: its per-example gradients are materialised by one grouped
        convolution's weight gradient on every device (the Gram matrices and the offset-by-offset
        products are formed in two dimensions only)."""
        return len(self.kernel_size) == 3


def _conv_of(
    m: nn.Module, a: torch.Tensor, g: torch.Tensor
) -> tuple[_Conv, torch.Tensor, torch.Tensor]:
    """A convolution's geometry, input ``a`` and output gradient ``g``, in two dimensions."""
    if isinstance(m, nn.Conv1d):
        geometry = _Conv(
            (1, m.kernel_size[0]),
            (1, m.stride[0]),
            m.padding if isinstance(m.padding, str) else (0, m.padding[0]),
            (1, m.dilation[0]),
            m.padding_mode,
            (*m._reversed_padding_repeated_twice, 0, 0),
            m.in_channels,
            m.groups,
            (m.out_channels, m.in_channels // m.groups, 1, m.kernel_size[0]),
        )
        return geometry, a.unsqueeze(2), g.unsqueeze(2)
    conv = cast(nn.Conv2d | nn.Conv3d, m)
    geometry = _Conv(
        tuple(conv.kernel_size),
        tuple(conv.stride),
        conv.padding if isinstance(conv.padding, str) else tuple(conv.padding),
        tuple(conv.dilation),
        conv.padding_mode,
        tuple(conv._reversed_padding_repeated_twice),
        conv.in_channels,
        conv.groups,
        (conv.out_channels, conv.in_channels // conv.groups, *conv.kernel_size),
    )
    return geometry, a, g


def _padded(m: _Conv, a: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """A convolution's input and the zero padding left to apply, as the convolution pads it."""
    if m.padding_mode != "zeros":
        return F.pad(a, list(m.reversed_padding), mode=m.padding_mode), (0,) * len(m.stride)
    if isinstance(m.padding, str):  # "same" (extra padding on the right and bottom) or "valid"
        pads = []
        for k, d in zip(reversed(m.kernel_size), reversed(m.dilation), strict=True):
            total = 0 if m.padding == "valid" else d * (k - 1)
            pads += [total // 2, total - total // 2]
        return F.pad(a, pads), (0,) * len(m.stride)
    return a, tuple(m.padding)


def _patches(m: _Conv, a: torch.Tensor, g: torch.Tensor) -> Iterator[torch.Tensor]:
    """A convolution's input at each kernel offset ``(kh, kw)`` in turn (row-major) as ``(B, in,
    T)``: the values each output position multiplies by ``weight[:, :, kh, kw]``. One offset at
    a time (a strided slice, copied): ``F.unfold``'s ``k^2``-fold copy of the input is never held,
    and on the CPU its slow ``im2col`` is avoided."""
    a, padding = _padded(m, a)
    if any(padding):
        a = F.pad(a, [p for p in reversed(padding) for _ in range(2)])
    (sh, sw), (dh, dw), (ho, wo) = m.stride, m.dilation, g.shape[2:]
    for kh in range(m.kernel_size[0]):
        for kw in range(m.kernel_size[1]):
            view = a[:, :, kh * dh : kh * dh + sh * (ho - 1) + 1 : sh, kw * dw :: sw][..., :wo]
            yield view.reshape(a.shape[0], a.shape[1], ho * wo)


def _linear_weight_sq(
    a: torch.Tensor, g: torch.Tensor, per_example: dict[str, torch.Tensor], key: str
) -> torch.Tensor:
    """Squared norms of a linear map's per-example weight gradients ``sum_t g_t a_t^T`` (input
    ``a``, output gradient ``g``, any leading shape after the batch), by the Gram matrices or by
    the gradients themselves (then kept in ``per_example[key]`` for the clipped sum)."""
    b = a.shape[0]
    a, g = a.reshape(b, -1, a.shape[-1]), g.reshape(b, -1, g.shape[-1])
    t, n_in, n_out = a.shape[1], a.shape[2], g.shape[2]
    if t == 1:
        return a[:, 0].pow(2).sum(1) * g[:, 0].pow(2).sum(1)
    if _ghost(False, b, t, n_in, n_out):
        gram = torch.bmm(a, a.transpose(1, 2))
        return (gram * torch.bmm(g, g.transpose(1, 2))).sum((1, 2))
    w = torch.bmm(g.transpose(1, 2), a)  # (B, out, in)
    per_example[key] = w
    return w.pow(2).sum((1, 2))  # cascade sums: vector_norm loses 1e-4 at 1e6 terms


def _linear_weight_sum(a: torch.Tensor, cg: torch.Tensor) -> torch.Tensor:
    """A linear map's weight gradient ``(out, in)`` for the output gradients ``cg``, as plain
    training forms it."""
    return cg.reshape(-1, cg.shape[-1]).T @ a.reshape(-1, a.shape[-1])


def _weight_sq(layer: _Layer) -> torch.Tensor:
    """Squared norms of the per-example weight gradients ``sum_t g_t a_t^T`` (``T`` positions of a
    sequence or of a convolution's output), by the ``T x T`` Gram matrices or by materialising the
    gradients (kept for the clipped sum), whichever costs less for the shapes."""
    m, a, g = layer.module, layer.inputs[0], cast(torch.Tensor, layer.grad)
    b = a.shape[0]
    if _linear(layer):  # materialised ``(B, out, in)``, whatever the layout the weight is stored in
        return _linear_weight_sq(a, g, layer.per_example, "weight")
    if isinstance(m, _TRANSPOSED):
        w = layer.per_example["weight"] = _transposed_weight_grad(m, a, g, per_example=True)
        return w.pow(2).sum(tuple(range(1, w.dim())))
    conv, a, g = _conv_of(m, a, g)
    t, n_out = math.prod(g.shape[2:]), g.shape[1]
    n_in = math.prod(conv.weight_shape[1:])
    # a grouped convolution's gradients are materialised (its Gram matrices would be per group;
    # its per-example gradients are the groups-fold smaller); so are a 3-d one's, whatever their
    # size (no more than torch.func would hold for the layer)
    if conv.groups == 1 and not conv.volume and _ghost(True, b, t, n_in, n_out):
        u = _unfolded(conv, a, g)
        if u is not None:  # a GPU: one product, not one per kernel offset
            gram = torch.bmm(u.transpose(1, 2), u)
        else:
            patches = _patches(conv, a, g)
            gram = cast(torch.Tensor, sum(torch.bmm(p.transpose(1, 2), p) for p in patches))
        g = g.reshape(b, n_out, t)
        return (gram * torch.bmm(g.transpose(1, 2), g)).sum((1, 2))
    w = _conv_per_example(conv, a, g)
    layer.per_example["weight"] = w.reshape(b, *cast(torch.Tensor, m.weight).shape)
    return w.pow(2).sum(tuple(range(1, w.dim())))


def _offsets_on(device: torch.device) -> bool:
    """Whether per-example convolution weight gradients are formed offset by offset (batched
    matrix products) rather than by one grouped convolution. On a GPU the grouped weight gradient
    with the batch as its groups ran as one kernel per group (cudnn on an H200: 5.5 ms of a 41 ms
    ResNet-18 step for one layer), where k^2 batched products are one GEMM each; on the CPU the
    grouped convolution is the faster (oneDNN)."""
    return device.type != "cpu"


#: a convolution's unfolded input ``(B, in k^2, T)`` is formed (on a GPU) up to this many elements
#: (512 MiB in float32); beyond it the kernel offsets are taken one at a time
UNFOLD_LIMIT = 1 << 27


def _unfolded(m: _Conv, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor | None:
    """A convolution's input unfolded, ``(B, in k^2, T)`` in ``F.unfold``'s order (channel, then
    kernel row, then column), where :func:`_offsets_on` and :data:`UNFOLD_LIMIT` allow; else
    ``None``. One strided view of the padded input copied once: one kernel where the
    offset-by-offset form launches a copy and a product per offset. Not ``F.unfold``: on a GPU
    its ``im2col`` runs one kernel per example (an H200's ResNet-18 step at batch 256: 4,096
    launches and 15 ms of its 61), and on the CPU it is slow."""
    k = math.prod(m.kernel_size)
    if (
        m.volume
        or not _offsets_on(g.device)
        or a.shape[0] * m.in_channels * k * g[0, 0].numel() > UNFOLD_LIMIT
    ):
        return None
    a, padding = _padded(m, a)
    if any(padding):
        a = F.pad(a, [p for p in reversed(padding) for _ in range(2)])
    (sh, sw), (dh, dw), (ho, wo) = m.stride, m.dilation, g.shape[2:]
    b, c = a.shape[:2]
    s_b, s_c, s_h, s_w = a.stride()
    window = a.as_strided(
        (b, c, m.kernel_size[0], m.kernel_size[1], ho, wo),
        (s_b, s_c, s_h * dh, s_w * dw, s_h * sh, s_w * sw),
        a.storage_offset(),
    )
    return window.reshape(b, c * k, ho * wo)


def _conv_per_example(m: _Conv, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """A convolution's per-example weight gradients, ``(B, out, in / groups, kh, kw)`` (a view)."""
    b, n_out = g.shape[:2]
    u = _unfolded(m, a, g)
    if u is not None:  # every offset at once: (B, out, T) x (B, T, in k^2), in the weight's order
        if m.groups == 1:
            return torch.bmm(g.reshape(b, n_out, -1), u.transpose(1, 2)).view(b, *m.weight_shape)
        # group by group in one product (B, groups, out / groups, T) x (B, groups, T, in / groups
        # k^2): the unfolded rows are channel-major, so each group's are contiguous. A grouped
        # convolution with the batch times the groups as its groups ran one kernel per group on a
        # GPU (a depthwise layer: batch x channels launches)
        rows = g.reshape(b, m.groups, n_out // m.groups, -1)
        cols = u.view(b, m.groups, -1, u.shape[-1])
        return torch.matmul(rows, cols.transpose(-1, -2)).view(b, *m.weight_shape)
    if m.groups == 1 and not m.volume and _offsets_on(g.device):
        kh, kw = m.kernel_size
        rows = g.reshape(b, n_out, -1)
        w = g.new_empty(kh * kw, b, n_out, m.in_channels)
        for j, patch in enumerate(_patches(m, a, g)):  # sum_t g_t a_t^T at each kernel offset
            torch.bmm(rows, patch.transpose(1, 2), out=w[j])
        return w.permute(1, 2, 3, 0).unflatten(3, (kh, kw))
    # the batch times the groups as the groups of one grouped convolution's weight gradient (the
    # kernel plain training's weight gradient runs): example i's group j is group i * groups + j
    a, padding = _padded(m, a)
    return torch.ops.aten.convolution_backward(
        g.reshape(1, b * n_out, *g.shape[2:]),
        a.reshape(1, b * m.in_channels, *a.shape[2:]),
        a.new_empty(1).expand(b * n_out, *m.weight_shape[1:]),
        None,
        m.stride,
        padding,
        m.dilation,
        False,
        [0] * len(m.stride),
        b * m.groups,
        [False, True, False],
    )[1].reshape(b, *m.weight_shape)


def _norm_affine(
    m: nn.GroupNorm | nn.LayerNorm | nn.RMSNorm, a: torch.Tensor, g: torch.Tensor, names
) -> dict[str, torch.Tensor]:
    """Per-example gradients of a GroupNorm's, LayerNorm's or RMSNorm's affine weight and bias,
    ``(B, C...)``."""
    out: dict[str, torch.Tensor] = {}
    b = a.shape[0]
    if isinstance(m, nn.GroupNorm):
        dims = tuple(range(2, a.dim()))
        if "weight" in names:
            x_hat = F.group_norm(a, m.num_groups, None, None, m.eps)
            out["weight"] = (g * x_hat).sum(dims) if dims else g * x_hat
        if "bias" in names:
            out["bias"] = g.sum(dims) if dims else g
        return out
    shape = tuple(m.normalized_shape)
    if "weight" in names:
        if isinstance(m, nn.RMSNorm):
            x_hat = F.rms_norm(a, shape, None, m.eps)
        else:
            x_hat = F.layer_norm(a, shape, None, None, m.eps)
        out["weight"] = (g * x_hat).reshape(b, -1, *shape).sum(1)
    if "bias" in names:
        out["bias"] = g.reshape(b, -1, *shape).sum(1)
    return out


def _transposed_weight_grad(
    m: nn.ConvTranspose1d | nn.ConvTranspose2d | nn.ConvTranspose3d,
    a: torch.Tensor,
    g: torch.Tensor,
    per_example: bool,
) -> torch.Tensor:
    """A transposed convolution's weight gradient ``(in, out / groups, k...)`` for input ``a`` and
    output gradient ``g``, or each example's, ``(B, in, out / groups, k...)``: the batch times the
    groups as the groups of one weight gradient, as for a convolution on the CPU (on every device
    here). The output padding is read from the shapes, as the call chose it (its ``output_size``
    included)."""
    weight = cast(torch.Tensor, m.weight)
    spans = zip(
        a.shape[2:], g.shape[2:], m.stride, m.padding, m.dilation, m.kernel_size, strict=True
    )
    output_padding = [o - ((i - 1) * s - 2 * p + d * (k - 1) + 1) for i, o, s, p, d, k in spans]
    b = a.shape[0]
    if per_example:  # example i's channels are the i-th block of groups of one call
        g, a = g.reshape(1, -1, *g.shape[2:]), a.reshape(1, -1, *a.shape[2:])
        like = weight.new_empty(1).expand(b * weight.shape[0], *weight.shape[1:])
        groups = b * m.groups
    else:
        like, groups = weight.detach().to(g.dtype), m.groups
    w = torch.ops.aten.convolution_backward(
        g,
        a,
        like,
        None,
        m.stride,
        cast(tuple[int, ...], m.padding),
        m.dilation,
        True,
        output_padding,
        groups,
        [False, True, False],
    )[1]
    return w.reshape(b, *weight.shape) if per_example else w


def _small_of(m: nn.Module, a: torch.Tensor, g: torch.Tensor, names) -> dict[str, torch.Tensor]:
    """Per-example gradients of a normalisation's affine weight and bias, or of a PReLU's slopes,
    ``(B, ...)``."""
    if isinstance(m, _FIXED_NORMS):
        return _channel_affine(m, a, g, names)
    if not isinstance(m, nn.PReLU):
        return _norm_affine(cast(nn.GroupNorm | nn.LayerNorm | nn.RMSNorm, m), a, g, names)
    # y = max(0, a) + w min(0, a): the slope of channel j (dimension 1), or of every value
    negative = g * a.clamp(max=0)
    b = a.shape[0]
    if m.num_parameters == 1:
        return {"weight": negative.reshape(b, -1).sum(1, keepdim=True)}
    return {"weight": negative.reshape(b, m.num_parameters, -1).sum(2)}


def _channel_affine(
    m: nn.Module, a: torch.Tensor, g: torch.Tensor, names
) -> dict[str, torch.Tensor]:
    """Per-example gradients of a BatchNorm's (eval mode, running statistics) or an InstanceNorm's
    affine weight and bias, ``(B, C)``: ``sum g * x_hat`` and ``sum g`` over each channel's
    positions (dimension 1), ``x_hat`` normalised as the layer's call normalised it (by the running
    statistics, or by the example's own for an InstanceNorm without them or in training mode)."""
    b, c = a.shape[:2]
    out: dict[str, torch.Tensor] = {}
    if "weight" in names:
        mean, var = (
            cast(torch.Tensor | None, m.running_mean),
            cast(torch.Tensor | None, m.running_var),
        )
        eps = cast(float, m.eps)
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            x_hat = F.batch_norm(a, mean, var, None, None, False, 0.0, eps)
        else:  # no statistics passed where the example's own are used: none are updated
            own = m.training or not m.track_running_stats
            x_hat = F.instance_norm(
                a, None if own else mean, None if own else var, None, None, own, 0.0, eps
            )
        out["weight"] = (g * x_hat).reshape(b, c, -1).sum(2)
    if "bias" in names:
        out["bias"] = g.reshape(b, c, -1).sum(2)
    return out


def _embedding_rows(layer: _Layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An embedding's per-example gradient rows: ``(example of each row, token of each row, the
    row: the sum of that example's output gradients at that token)``, one row per token of the
    batch: the distinct ``(example, token)`` pairs first, in their sorted order, then zero rows of
    example ``B`` (no example; token 0), as are the padding index's tokens.

    A size fixed by the batch's shape, where :func:`torch.unique` gave one row per distinct pair:
    on a GPU its count is read back, a wait for every kernel queued before it in the middle of
    the step. The pairs are grouped by sorting their keys instead (each row's group is the count
    of distinct keys before it), and each group's rows added in the batch's order, as
    ``index_add`` over ``unique``'s inverse added them: the same sums, bit for bit on the CPU."""
    m, idx = cast(nn.Embedding | nn.EmbeddingBag, layer.module), layer.inputs[0]
    g = cast(torch.Tensor, layer.grad)
    b, n = idx.shape[0], m.num_embeddings
    idx = idx.reshape(b, -1)
    keys = (torch.arange(b, device=idx.device)[:, None] * n + idx).flatten()
    rows = g.reshape(keys.shape[0], -1)
    if m.padding_idx is not None:  # the padding row receives no gradient: no example's row
        keep = idx.flatten() != m.padding_idx
        keys = torch.where(keep, keys, b * n)
        rows = torch.where(keep[:, None], rows, 0.0)
    ordered, order = torch.sort(keys)
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    group = first.cumsum(0) - 1  # each sorted key's group: the distinct keys before it
    summed = torch.zeros_like(rows).index_add_(
        0, torch.empty_like(group).scatter_(0, order, group), rows
    )
    # each group's key; the rows past the last group: example B's (no example)
    key = torch.full_like(ordered, b * n).scatter_(0, group, ordered)
    return key // n, key % n, summed


def _per_example_of_rows(example: torch.Tensor, values: torch.Tensor, b: int) -> torch.Tensor:
    """``values`` (one per embedding row) added up by example, the rows of no example (example
    ``B``: :func:`_embedding_rows`) left out."""
    out = torch.zeros(b + 1, dtype=values.dtype, device=values.device)
    return out.index_add_(0, example, values)[:b]


def _row_factors(c: torch.Tensor, example: torch.Tensor) -> torch.Tensor:
    """Each embedding row's clip factor (0 for the rows of no example)."""
    return torch.cat([c, c.new_zeros(1)])[example]


def _sq_norms(layer: _Layer, b: int) -> torch.Tensor | int:
    """Squared norm of each example's gradient of this layer's trainable parameters (what is
    formed on the way is kept in ``layer`` for the clipped sum), less its small parameters' (kept
    in ``layer.small``, whose norms are taken with every layer's: :mod:`ghost_joined`)."""
    m, names, g = layer.module, layer.names, cast(torch.Tensor, layer.grad)
    if isinstance(m, nn.MultiheadAttention):
        return _attention_sq(layer, b)
    if layer.bare:  # the stand-in's gradient rows are the per-example gradients
        return g.reshape(b, -1).pow(2).sum(1)
    if layer.vjp:
        layer.per_example = ghost_layer_vjp.per_example(m, list(names), layer.inputs, layer.grads)
        return _added([v.reshape(b, -1).pow(2).sum(1) for v in layer.per_example.values()])
    if _several_calls(layer):
        _summed_over_calls(layer, b)
        return cast(
            torch.Tensor, sum(v.reshape(b, -1).pow(2).sum(1) for v in layer.per_example.values())
        )
    if isinstance(m, _EMBEDDINGS):
        layer.rows = _embedding_rows(layer)
        example, _, summed = layer.rows
        return _per_example_of_rows(example, summed.pow(2).sum(1), b)
    if isinstance(m, _SMALL):  # joined with the other layers' small ones
        layer.small = _small_of(m, layer.inputs[0], g, names)
        return 0
    if "bias" in names:  # joined with the other layers' small ones
        if _linear(layer):
            layer.small["bias"] = g.reshape(b, -1, g.shape[-1]).sum(1)
        else:
            layer.small["bias"] = g.reshape(b, g.shape[1], -1).sum(2)
    if layer.parametrized:
        return _parametrized_sq(layer, b)
    return _weight_sq(layer) if "weight" in names else 0


def _parametrized_sq(layer: _Layer, b: int) -> torch.Tensor | int:
    """A parametrized layer's per-example gradients of the tensors its weight is computed from:
    its per-example weight gradients materialised, then ``J^T G_i`` (:func:`_to_thetas`)."""
    if not _thetas(layer):
        return 0
    a, g = layer.inputs[0], cast(torch.Tensor, layer.grad)
    if _linear(layer):
        layer.per_example["weight"] = torch.bmm(
            g.reshape(b, -1, g.shape[-1]).transpose(1, 2), a.reshape(b, -1, a.shape[-1])
        )
    else:
        conv, a2, g2 = _conv_of(layer.module, a, g)
        layer.per_example["weight"] = _conv_per_example(conv, a2, g2).reshape(
            b, *_weight_shape(layer)
        )
    _to_thetas(layer)
    return _added([v.reshape(b, -1).pow(2).sum(1) for k, v in layer.per_example.items()])


def _attention_sq(layer: _Layer, b: int) -> torch.Tensor:
    """An attention's input projections: each a linear map over rows of the packed weight (or of
    its own weight) and of the bias, whose squared norms add (the packed weight's per-example
    gradient is its projections' stacked)."""
    sq = torch.zeros(b, dtype=layer.grads[0].dtype, device=layer.grads[0].device)
    for j, (p, a, g) in enumerate(zip(layer.plan, layer.inputs, layer.grads, strict=True)):
        if p.weight in layer.names:
            sq = sq + _linear_weight_sq(a, g, layer.per_example, f"{j}.weight")
        if "in_proj_bias" in layer.names:
            sq = sq + g.reshape(b, -1, g.shape[-1]).sum(1).pow(2).sum(1)
    return sq


def _attention_clipped(layer: _Layer, c: torch.Tensor) -> dict[str, torch.Tensor]:
    """``sum_i c_i G_i`` of an attention's input projections' trainable weights and bias, each
    projection's rows from its materialised per-example gradients or book-kept, then stacked in
    the rows' order."""
    blocks: dict[str, list[torch.Tensor]] = {k: [] for k in layer.names}
    c = c.to(layer.grads[0].dtype)
    for j, (p, a, g) in enumerate(zip(layer.plan, layer.inputs, layer.grads, strict=True)):
        w = layer.per_example.get(f"{j}.weight")
        if p.weight in layer.names and w is not None:  # materialised for the norms
            blocks[p.weight].append(torch.tensordot(c, w, dims=1))
        if (p.weight in layer.names and w is None) or "in_proj_bias" in layer.names:
            cg = g * c.view(-1, 1, 1)  # (B, T, rows) weighted by the clip factors
            if p.weight in layer.names and w is None:
                blocks[p.weight].append(_linear_weight_sum(a, cg))
            if "in_proj_bias" in layer.names:
                blocks["in_proj_bias"].append(cg.reshape(-1, cg.shape[-1]).sum(0))
    return {k: v[0] if len(v) == 1 else torch.cat(v) for k, v in blocks.items()}


def _clipped(
    layer: _Layer, c: torch.Tensor, small: dict[tuple[int, str], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``sum_i c_i G_i`` of the layer's trainable parameters: its small ones' from ``small`` (every
    layer's, by ``(id(layer), key)``: :meth:`ghost_joined.JoinedRows.clipped`), the others' from
    the per-example gradients the norms formed where they did, else book-kept from the stored
    input and the factor-weighted output gradients (one weight gradient as plain training forms
    it)."""
    m, names = layer.module, layer.names
    if layer.grad is None:  # an unused layer: zero gradients
        return {
            k: torch.zeros_like(w := _parameter(layer, k), dtype=compute_dtype(w.dtype))
            for k in names
        }
    if isinstance(m, nn.MultiheadAttention):
        return _attention_clipped(layer, c)
    g = layer.grad
    c = c.to(g.dtype)
    if layer.bare:
        (k,) = names
        shape = getattr(m, k).shape
        return {k: torch.tensordot(c, g.reshape(g.shape[0], -1), dims=1).reshape(shape)}
    if layer.vjp and not layer.per_example:  # clipping off: no norms were formed
        return ghost_layer_vjp.summed(m, list(names), layer.inputs, layer.grads, c)
    if _several_calls(layer) and not layer.per_example:  # clipping off: no norms were formed
        _summed_over_calls(layer, g.shape[0])
    out = {k: small[(id(layer), k)] for k in layer.small}
    for k, v in layer.per_example.items():
        out[k] = torch.tensordot(c, v, dims=1)
    if layer.affine and "weight" in out:  # summed first: the transpose of one weight, not B
        out["weight"] = _as_stored(layer, out["weight"])
    if isinstance(m, _EMBEDDINGS) and layer.rows is not None:
        example, token, summed = layer.rows
        weighted = summed * _row_factors(c, example)[:, None]
        out["weight"] = torch.zeros_like(m.weight, dtype=weighted.dtype).index_add_(
            0, token, weighted
        )
        return out
    missing = [k for k in names if k not in out]
    if layer.parametrized and set(_thetas(layer)) & set(missing):  # clipping off
        out |= _parametrized_sum(layer, c)
        missing = [k for k in missing if k not in out]
    if not missing:
        return out
    if _linear(layer) and layer.inputs[0].numel() < g.numel():
        by_input = _linear_clipped_by_input(layer.inputs[0], g, c, missing)
        if "weight" in by_input:
            by_input["weight"] = _as_stored(layer, by_input["weight"])
        return out | by_input
    cg = g * c.view(-1, *([1] * (g.dim() - 1)))
    if isinstance(m, _EMBEDDINGS):  # clipping off: no norms were formed
        flat = layer.inputs[0].flatten()
        rows = cg.reshape(flat.shape[0], -1)
        if m.padding_idx is not None:
            keep = flat != m.padding_idx
            rows = torch.where(keep[:, None], rows, 0.0)  # (a mask's count: a device wait)
        out["weight"] = torch.zeros_like(m.weight, dtype=rows.dtype).index_add_(0, flat, rows)
        return out
    if isinstance(m, _SMALL):
        per = _small_of(m, layer.inputs[0], cg, missing)
        return out | {k: v.sum(0) for k, v in per.items()}
    if "weight" in missing:
        if _linear(layer):
            w = _as_stored(layer, _linear_weight_sum(layer.inputs[0], cg))
        else:
            w = _conv_weight_grad(layer, cg)
        out["weight"] = w.reshape(cast(torch.Tensor, m.weight).shape)
    if "bias" in missing:
        out["bias"] = (
            cg.reshape(cg.shape[0], cg.shape[1], -1).sum((0, 2))
            if isinstance(m, (*_CONVS, *_TRANSPOSED))
            else cg.reshape(-1, cg.shape[-1]).sum(0)
        )
    return out


def _parametrized_sum(layer: _Layer, c: torch.Tensor) -> dict[str, torch.Tensor]:
    """``J^T sum_i c_i G_i`` for the tensors a parametrized layer's weight is computed from: the
    weight's gradient for the factor-weighted output gradients, as plain training forms it, then
    one vector-Jacobian product of the parametrization."""
    g = cast(torch.Tensor, layer.grad)
    cg = g * c.view(-1, *([1] * (g.dim() - 1)))
    if _linear(layer):
        weight_sum = _linear_weight_sum(layer.inputs[0], cg)
    else:
        weight_sum = _conv_weight_grad(layer, cg)
    keys = _thetas(layer)
    weight = cast(torch.Tensor, layer.derived)
    found = ghost_parametrized.summed(
        weight, [_parameter(layer, k) for k in keys], weight_sum.reshape(weight.shape)
    )
    return {k: v.to(compute_dtype(v.dtype)) for k, v in zip(keys, found, strict=True)}


def _linear_clipped_by_input(
    a: torch.Tensor, g: torch.Tensor, c: torch.Tensor, missing: list[str]
) -> dict[str, torch.Tensor]:
    """A linear layer's ``sum_i c_i G_i`` with the factors on its input, ``g^T (c a)``, where the
    input is the smaller of the two (a language model's output layer: ``d`` against the
    vocabulary), rather than on its output gradient; its bias' ``c . sum_t g_t``."""
    out: dict[str, torch.Tensor] = {}
    if "weight" in missing:
        out["weight"] = _linear_weight_sum(a * c.view(-1, *([1] * (a.dim() - 1))), g)
    if "bias" in missing:
        out["bias"] = torch.tensordot(c, g.reshape(g.shape[0], -1, g.shape[-1]).sum(1), dims=1)
    return out


def _conv_weight_grad(layer: _Layer, cg: torch.Tensor) -> torch.Tensor:
    """A convolution's weight gradient for output gradients ``cg`` (in two dimensions: a Conv1d's
    with a unit height): on the CPU as plain training forms it (oneDNN's weight gradient); in a
    GPU's forms (:func:`_offsets_on`, ungrouped) by matrix products of the unfolded input (or of
    each kernel offset's patch), the values and the library the norms' Gram matrices took. cuDNN's
    weight gradient runs in TF32 by default on a GPU (``torch.backends.cudnn.conv.fp32_precision``),
    cuBLAS's products in float32: a clipped sum in TF32 against norms in float32 could carry an
    example past the clip norm by TF32's rounding (10 bits)."""
    if isinstance(layer.module, _TRANSPOSED):
        return _transposed_weight_grad(layer.module, layer.inputs[0], cg, per_example=False)
    m, a, g = _conv_of(layer.module, layer.inputs[0], cg)
    if m.groups == 1 and not m.volume and _offsets_on(cg.device):
        rows = g.reshape(g.shape[0], g.shape[1], -1)  # (B, out, T)
        u = _unfolded(m, a, g)
        if u is not None:  # (out, in k^2), in the weight's order
            return torch.tensordot(rows, u, dims=([0, 2], [0, 2]))
        kh, kw = m.kernel_size
        per_offset = [torch.tensordot(rows, p, dims=([0, 2], [0, 2])) for p in _patches(m, a, g)]
        return torch.stack(per_offset, -1).unflatten(-1, (kh, kw))  # (out, in, kh, kw)
    a, padding = _padded(m, a)
    return torch.ops.aten.convolution_backward(
        cg.unsqueeze(2) if cg.dim() == 3 else cg,
        a,
        cast(torch.Tensor, layer.derived if layer.parametrized else layer.module.weight)
        .detach()
        .view(m.weight_shape)
        .to(cg.dtype),
        None,
        m.stride,
        padding,
        m.dilation,
        False,
        [0] * len(m.stride),
        m.groups,
        [False, True, False],
    )[1]


def _run(
    model: nn.Module,
    x: torch.Tensor,
    example_losses: Callable[[torch.Tensor, slice], torch.Tensor],
    norms: bool,
) -> tuple[list[_Layer], torch.Tensor | None, ghost_joined.JoinedRows | None]:
    """The pass, each example's gradient norm where ``norms`` (unused layers add zero), and the
    small parameters' per-example gradients joined (for the clipped sum)."""
    why = _ROWS_CHECKED.get(model)
    if why is not None:
        raise UnsupportedModelError(why)
    if model not in _ROWS_CHECKED and x.shape[0] > 1 and lowered(x.device):
        _checked_in_full_precision(model, x, example_losses)
    while True:
        layers = _layers(model)
        try:
            _forward_backward(model, x, example_losses, layers)
            break
        except _NextForm:  # a pass with fresh layers and the next form of stand-ins
            continue
    ran = [layer for layer in layers if layer.grad is not None]
    for layer in ran:
        _in_parameter_dtype(layer)
    if not norms:
        return layers, None, None
    with full_precision(x.device), _remembered(model):
        return layers, *_norms(ran, x)


@contextmanager
def _remembered(model: nn.Module) -> Iterator[None]:
    """A layer found not to take torch.func's transforms on one example refuses the model from
    then on (``torch.func`` then clips every step), as the rows check does."""
    try:
        yield
    except ghost_layer_vjp.NotPerExample as e:
        _ROWS_CHECKED[model] = str(e)
        raise


def _norms(
    ran: list[_Layer], x: torch.Tensor
) -> tuple[torch.Tensor, ghost_joined.JoinedRows | None]:
    """Each example's gradient norm over the layers that ran, and their small parameters'
    per-example gradients joined."""
    b = x.shape[0]
    if not ran:
        return torch.zeros(b, device=x.device), None
    parts = [sq for sq in (_sq_norms(layer, b) for layer in ran) if isinstance(sq, torch.Tensor)]
    joined = ghost_joined.JoinedRows(
        [
            (layer, k, v, _parameter(layer, k).shape)
            for layer in ran
            for k, v in layer.small.items()
        ],
        b,
    )
    parts += joined.squared_norms()
    for layer in ran:  # a tied weight's norm: the two layers' parts and twice their inner product
        if layer.tied is not None and layer.tied.grad is not None:
            parts.append(2 * _tied_inner(layer.tied, layer, b))
    return _added(parts).sqrt(), joined


def _in_parameter_dtype(layer: _Layer) -> None:
    """The layer's stored inputs and output gradients in its parameters' compute dtype
    (:mod:`privkit.mechanisms.clip_precision`) where they are of another floating type: under
    autocast a layer's output, and so its output gradient, is half precision while its parameters
    are float32; a model held in bfloat16 has all three in it. Each example's norm and its
    contribution to the sum are then formed from the same float32 (or wider) values. The sums
    come in that dtype: the noise is added to them there, and the noisy gradient takes the
    parameter's dtype after (post-processing)."""
    dtype = compute_dtype(next(_parameter(layer, k).dtype for k in layer.names))

    def up(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    layer.inputs = [up(a) for a in layer.inputs]
    layer.grads = [g if g is None else up(g) for g in layer.grads]
    layer.grad = next((g for g in layer.grads if g is not None), None)


def _checked_in_full_precision(
    model: nn.Module, x: torch.Tensor, example_losses: Callable[[torch.Tensor, slice], torch.Tensor]
) -> None:
    """Where the caller computes below float32 (autocast, lowered float32 products), a model's
    first-pass checks (its output rows, its stand-ins' outputs, its followed outputs) taken on a
    pass of their own at full precision; the random state put back after it, so that the step's
    pass draws what it would have drawn. The checks compare values to a relative tolerance: an
    output gradient that went through half-precision operations differs from its rows' weighted
    sum by 0.5-0.9% (bfloat16, the transformer block of ``benchmarks/dpsgd_step.py``), past the
    checks' 0.1%, and half precision's own tolerance (8 units: 6% for bfloat16) would let a model
    that mixes its examples a little pass."""
    before = ghost_parameters.RandomState(x.device)
    try:
        with full_precision(x.device):
            _run(model, x, example_losses, norms=False)
    finally:
        before.restore()


def _added(parts: list[torch.Tensor]) -> torch.Tensor:
    """The layers' squared norms added up (some layer ran: one part at least): one stack and one
    sum where they share a dtype and a device (on a GPU two launches, where an addition per layer
    took one each), else one by one."""
    if len({(p.dtype, p.device) for p in parts}) == 1:
        return torch.stack(parts).sum(0)
    return cast(torch.Tensor, sum(parts))


def _tied_inner(embedding: _Layer, linear: _Layer, b: int) -> torch.Tensor:
    """Each example's inner product of its gradients of a tied weight through the embedding
    (rows ``s_j`` at tokens ``r_j``, :func:`_embedding_rows`, formed by its norms) and through the
    linear layer (``sum_t g_t a_t^T``): ``sum_j s_j . sum_t g_t[r_j] a_t``, from the linear
    layer's materialised gradients where the norms formed them, else from its input and output
    gradient, ``(a_t . s_j) g_t[r_j]`` summed over the positions (``B x T x U`` values, ``U`` an
    example's token count, which bounds its distinct tokens: no larger than the ghost norm's Gram
    matrices)."""
    example, token, rows = cast(tuple[torch.Tensor, ...], embedding.rows)
    if not len(example):
        return torch.zeros(b, dtype=rows.dtype, device=rows.device)
    w = linear.per_example.get("weight")
    if w is not None:  # (B, V, d); the rows of no example (example B) are zero rows
        inner = (w[example.clamp(max=b - 1), token] * rows).sum(1)
        return _per_example_of_rows(example, inner, b)
    a, g = linear.inputs[0], cast(torch.Tensor, linear.grad)
    a, g = a.reshape(b, -1, a.shape[-1]), g.reshape(b, -1, g.shape[-1])
    # an example's rows in slots 0, 1, ... (the entries come sorted by example), at most its
    # tokens' count: a bound known on the host, where their largest count was read back
    u = len(example) // b
    ones = torch.ones_like(example)
    counts = torch.zeros(b + 1, dtype=example.dtype, device=example.device).index_add_(
        0, example, ones
    )
    slot = torch.arange(len(example), device=example.device) - (counts.cumsum(0) - counts)[example]
    slot = torch.where(example < b, slot, 0)  # the rows of no example: zero rows, one slot
    s = torch.zeros(b + 1, u, rows.shape[1], dtype=rows.dtype, device=rows.device)
    s[example, slot] = rows
    r = torch.zeros(b + 1, u, dtype=torch.long, device=rows.device)
    r[example, slot] = token  # padding slots: token 0 against a zero row, adding nothing
    s, r = s[:b], r[:b]
    picked = torch.gather(g, 2, r[:, None, :].expand(-1, g.shape[1], -1))  # g_t[r_j]: (B, T, U)
    return (torch.bmm(a, s.transpose(1, 2)) * picked).sum((1, 2))


def per_example_norms(
    model: nn.Module,
    x: torch.Tensor,
    example_losses: Callable[[torch.Tensor, slice], torch.Tensor],
) -> torch.Tensor:
    """``||g_i||`` over the trainable parameters for each example of ``x`` (``g_i``: the gradient
    of ``example_losses(model(x), slice(None))[i]``), without forming the ``g_i``.

    Parameters
    ----------
    model : torch.nn.Module
        A model of the :data:`SUPPORTED` layers (see the module docstring for what is refused).
    x : torch.Tensor
        The batch's inputs, the batch on the first dimension.
    example_losses : callable
        ``example_losses(logits, s)``: the losses of the records ``s`` (a slice of the batch,
        here ``slice(None)``) from their logits, one per record, shape ``(B,)``.

    Returns
    -------
    torch.Tensor
        The ``B`` gradient norms.
    """
    return cast(torch.Tensor, _run(model, x, example_losses, norms=True)[1])


def clipped_sum(
    model: nn.Module,
    x: torch.Tensor,
    example_losses: Callable[[torch.Tensor, slice], torch.Tensor],
    clip: float,
) -> dict[str, torch.Tensor]:
    """``sum_i min(1, clip / ||g_i||) g_i`` over the trainable parameters, by name (``clip = inf``:
    the plain sum). :class:`~privkit.mechanisms.stacked.UnsupportedModelError` for a model this
    module does not cover (see the module's docstring).

    Parameters
    ----------
    model : torch.nn.Module
        A model of the :data:`SUPPORTED` layers (see the module docstring for what is refused).
    x : torch.Tensor
        The batch's inputs, the batch on the first dimension.
    example_losses : callable
        ``example_losses(logits, s)``: the losses of the records ``s`` (a slice of the batch,
        here ``slice(None)``) from their logits, one per record, shape ``(B,)``.
    clip : float
        The L2 clipping norm ``C`` (``> 0``; ``inf``: no clipping, no norms computed).

    Returns
    -------
    dict of str to torch.Tensor
        The clipped sum of each trainable parameter, by its name in ``model.named_parameters()``
        and in that order.
    """
    if not clip > 0:
        raise ValueError(f"clip must be > 0; found {clip}")
    layers, norms, joined = _run(model, x, example_losses, norms=not math.isinf(clip))
    if norms is None:
        factor = torch.ones(x.shape[0], device=x.device)
    else:
        factor = torch.clamp(clip / torch.clamp(norms, min=1e-12), max=1.0)
    sums: dict[str, torch.Tensor] = {}
    with full_precision(x.device), _remembered(model):
        small = joined.clipped(factor) if joined is not None else {}
        for layer in layers:
            for k, v in _clipped(layer, factor, small).items():
                name = layer.names[k]  # a tied weight's two layers add
                sums[name] = sums[name] + v if name in sums else v
    order = [k for k, p in model.named_parameters() if p.requires_grad]
    return {k: sums[k] for k in order}
