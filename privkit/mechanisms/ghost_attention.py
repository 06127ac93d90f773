"""``nn.MultiheadAttention`` as book-keeping ghost clipping sees it: its forward computed as torch
computes it, with its linear maps exposed.

torch's attention runs its input projection (the packed ``in_proj_weight``, or ``q_proj_weight``,
``k_proj_weight`` and ``v_proj_weight`` where the key and value widths differ) and its output
projection (``out_proj``, an ``nn.Linear``) inside ``F.multi_head_attention_forward`` by
``F.linear``: no module hook sees their inputs or outputs, which is what per-example norms without
per-example gradients need (:mod:`privkit.mechanisms.ghost_clipping`). :func:`forward` is the
module's forward written with its linear maps in the open (a sequence-first module's on its
inputs' batch-first views): each input projection's input and output go to a callback, and
``out_proj`` is *called* (its forward hooks fire, so the module is an ``nn.Linear`` layer like
any other). Everything between the maps (the heads' split, the masks, the scaled dot products,
softmax, dropout, the returned attention weights) follows ``F.multi_head_attention_forward`` step
by step, in batch-first order: the same values up to float rounding
(``tests/privkit/test_ghost_attention.py`` against the module itself, with every mask kind,
``need_weights``, ``add_zero_attn``, separate key and value widths, either layout).

An input projection is one linear map per distinct input, over rows of the weight: self-attention
(``query is key is value``) is one map to all ``3E`` rows, as torch computes it; with ``key is
value`` the query's map to the first ``E`` rows and the key's to the other ``2E``; otherwise three
maps. A packed weight is split once (one autograd node into the parameter, the graph check of
:mod:`~privkit.mechanisms.ghost_clipping`).

Not covered (ghost clipping refuses the module, and DP-SGD falls back to ``torch.func``):
``add_bias_kv`` (``bias_k``, ``bias_v``), a subclass with its own ``forward``, unbatched (2-d)
inputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from privkit.mechanisms.stacked import UnsupportedModelError

__all__ = ["Projection", "forward", "projections", "refusal"]


@dataclass(frozen=True)
class Projection:
    """One input projection: the input it maps (``"query"``, ``"key"``, ``"value"``), the weight
    it uses (``in_proj_weight`` or a separate ``*_proj_weight``) and its rows of that weight and of
    ``in_proj_bias``."""

    source: str
    weight: str
    rows: slice
    bias_rows: slice


def refusal(m: nn.MultiheadAttention) -> str | None:
    """Why :func:`forward` cannot stand for ``m``'s forward, or ``None`` where it can."""
    if type(m).forward is not nn.MultiheadAttention.forward:
        return f"{type(m).__name__} overrides MultiheadAttention's forward"
    if "forward" in m.__dict__:
        return "a MultiheadAttention whose forward was replaced on the instance"
    if m.bias_k is not None or m.bias_v is not None:
        return "MultiheadAttention with add_bias_kv"
    return None


def projections(
    m: nn.MultiheadAttention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> list[Projection]:
    """The input projections :func:`forward` runs for these inputs, in the weight's row order."""
    e = m.embed_dim
    q, k, v = slice(0, e), slice(e, 2 * e), slice(2 * e, 3 * e)
    if not m._qkv_same_embed_dim:
        return [
            Projection("query", "q_proj_weight", slice(None), q),
            Projection("key", "k_proj_weight", slice(None), k),
            Projection("value", "v_proj_weight", slice(None), v),
        ]
    if key is value:
        if query is key:
            return [Projection("query", "in_proj_weight", slice(0, 3 * e), slice(0, 3 * e))]
        kv = slice(e, 3 * e)
        return [
            Projection("query", "in_proj_weight", q, q),
            Projection("key", "in_proj_weight", kv, kv),
        ]
    return [
        Projection("query", "in_proj_weight", q, q),
        Projection("key", "in_proj_weight", k, k),
        Projection("value", "in_proj_weight", v, v),
    ]


def _split(tensor: torch.Tensor | None, parts: list[slice]) -> list[torch.Tensor | None]:
    """``tensor``'s rows ``parts`` (contiguous, in order, covering it) by one split: one autograd
    node into a parameter however many maps use it."""
    if tensor is None:
        return [None] * len(parts)
    if len(parts) == 1:
        return [tensor]
    return list(tensor.split([s.stop - s.start for s in parts]))


def _in_projection(
    m: nn.MultiheadAttention,
    inputs: dict[str, torch.Tensor],
    record: Callable[[Projection, torch.Tensor, torch.Tensor], None],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q, k, v`` (batch-first), each map's input and output handed to ``record``."""
    plan = projections(m, inputs["query"], inputs["key"], inputs["value"])
    biases = _split(m.in_proj_bias, [p.bias_rows for p in plan])
    if m._qkv_same_embed_dim:
        weights = cast(list[torch.Tensor], _split(m.in_proj_weight, [p.rows for p in plan]))
    else:
        weights = [getattr(m, p.weight) for p in plan]
    outputs = []
    for p, w, b in zip(plan, weights, biases, strict=True):
        out = F.linear(inputs[p.source], w, b)
        record(p, inputs[p.source], out)
        outputs.append(out)
    q, k, v = (piece for out in outputs for piece in out.split(m.embed_dim, -1))
    return q, k, v


def _masks(
    m: nn.MultiheadAttention,
    query: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    need_weights: bool,
    is_causal: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, bool]:
    """The masks as float additions (torch's canonical form) and the causal hint, as
    ``nn.MultiheadAttention.forward`` and ``F.multi_head_attention_forward`` settle them."""
    key_padding_mask = F._canonical_mask(
        mask=key_padding_mask,
        mask_name="key_padding_mask",
        other_type=F._none_or_dtype(attn_mask),
        other_name="attn_mask",
        target_type=query.dtype,
    )
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint.")
    if is_causal and key_padding_mask is None and not need_weights:
        return None, None, True  # scaled_dot_product_attention's own causal mask
    attn_mask = F._canonical_mask(
        mask=attn_mask,
        mask_name="attn_mask",
        other_type=None,
        other_name="",
        target_type=query.dtype,
        check_other=False,
    )
    return key_padding_mask, attn_mask, False  # a padding mask ends the causal hint


def forward(
    m: nn.MultiheadAttention,
    record: Callable[[Projection, torch.Tensor, torch.Tensor], None],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    need_weights: bool = True,
    attn_mask: torch.Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``m(query, key, value, ...)`` for an ``m`` :func:`refusal` takes and batched inputs, with
    each input projection, its input and its output handed to ``record(projection, input,
    output)`` (:func:`projections`' order) and ``m.out_proj`` called as a module. A
    sequence-first ``m`` (``batch_first=False``) computes on its inputs' batch-first views, as
    torch's batch-first module computes on its inputs' sequence-first ones: its maps see
    batch-first tensors, and its output is transposed back."""
    if query.dim() != 3:
        raise UnsupportedModelError(
            f"MultiheadAttention on an unbatched ({query.dim()}-d) query: its first dimension is "
            "not the batch's"
        )
    options = (key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal)
    if m.batch_first:
        return _forward(m, record, query, key, value, *options)
    # one view per distinct input: self-attention stays one input, as torch's identity checks see it
    q = query.transpose(0, 1)
    k = q if key is query else key.transpose(0, 1)
    v = q if value is query else k if value is key else value.transpose(0, 1)
    out, weights = _forward(m, record, q, k, v, *options)
    return out.transpose(0, 1), weights


def _forward(
    m: nn.MultiheadAttention,
    record: Callable[[Projection, torch.Tensor, torch.Tensor], None],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    need_weights: bool,
    attn_mask: torch.Tensor | None,
    average_attn_weights: bool,
    is_causal: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`forward` on batch-first inputs."""
    kpm, mask, causal = _masks(m, query, key_padding_mask, attn_mask, need_weights, is_causal)
    q, k, v = _in_projection(m, {"query": query, "key": key, "value": value}, record)
    b, length, e = q.shape
    h = m.num_heads
    d = e // h
    # (B, H, T, d) views; masks as (B or 1, H or 1, L, S) additions (torch's (B * H, L, S) rows
    # are example-major, head-minor)
    q, k, v = (t.unflatten(-1, (h, d)).transpose(1, 2) for t in (q, k, v))
    if mask is not None:
        many = mask.dim() == 3 and mask.size(0) != 1
        mask = mask.view(b, h, *mask.shape[-2:]) if many else mask.view(1, 1, *mask.shape[-2:])
    if m.add_zero_attn:
        k = torch.cat([k, k.new_zeros(b, h, 1, d)], dim=2)
        v = torch.cat([v, v.new_zeros(b, h, 1, d)], dim=2)
        mask = None if mask is None else F.pad(mask, (0, 1))
        kpm = None if kpm is None else F.pad(kpm, (0, 1))
    if kpm is not None:
        kpm = kpm.view(b, 1, 1, k.shape[2])
        mask = kpm if mask is None else mask + kpm
    dropout = m.dropout if m.training else 0.0
    weights: torch.Tensor | None = None
    if need_weights:
        weights = (q * math.sqrt(1.0 / float(d))) @ k.transpose(-2, -1)
        if mask is not None:
            weights = weights + mask
        weights = F.softmax(weights, dim=-1)
        if dropout > 0.0:
            weights = F.dropout(weights, p=dropout)
        out = weights @ v
        if average_attn_weights:
            weights = weights.mean(dim=1)
    else:
        out = F.scaled_dot_product_attention(q, k, v, mask, dropout, causal)
    return m.out_proj(out.transpose(1, 2).reshape(b, length, e)), weights
