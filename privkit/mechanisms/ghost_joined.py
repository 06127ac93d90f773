"""The per-example gradients of a model's small parameters, joined into one block for every layer
at once, under book-keeping ghost clipping (:mod:`privkit.mechanisms.ghost_clipping`).

A normalisation layer's affine weight and bias and a layer's bias have per-example gradients of
a few hundred values, ``(B, C)``, formed directly. Taken one tensor at a time, each costs its
squared norms (a square, a sum), their addition to the layer's, and its clipped sum (a product
with the clip factors): about four operations for a few hundred values, 160 of ResNet-18's
operations a step, and on a GPU, where a small step is bound by launching kernels, each a
launch. Joined into one ``(B, n)`` block (one copy), every such parameter's squared norms are one
square and one sum, and their clipped sums one product with the factors, each parameter's a view
of it. Blocks are per dtype and device (a copy into one would convert the others).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["JoinedRows"]


@dataclass
class _Block:
    rows: torch.Tensor  # (B, n): the joined per-example gradients
    # where each parameter's columns are: (its owner's key, the parameter's key, start, shape)
    places: list[tuple[object, str, int, torch.Size]]


class JoinedRows:
    """The small per-example gradients of several layers, ``(B, ...)`` each, by owner (a layer)
    and parameter key, joined into a block per dtype and device."""

    def __init__(self, entries: list[tuple[object, str, torch.Tensor, torch.Size]], b: int):
        """``entries``: ``(owner, key, per-example gradients (B, ...), the parameter's shape)``."""
        groups: dict[tuple, list] = {}
        for owner, key, rows, shape in entries:
            groups.setdefault((rows.dtype, rows.device), []).append((owner, key, rows, shape))
        self.blocks: list[_Block] = []
        for members in groups.values():
            places, at = [], 0
            for owner, key, rows, shape in members:
                places.append((owner, key, at, shape))
                at += rows.shape[1:].numel()
            joined = torch.cat([rows.reshape(b, -1) for _, _, rows, _ in members], 1)
            self.blocks.append(_Block(joined, places))

    def squared_norms(self) -> list[torch.Tensor]:
        """Each example's squared norm over the joined parameters, one ``(B,)`` part per block."""
        return [block.rows.pow(2).sum(1) for block in self.blocks]

    def clipped(self, c: torch.Tensor) -> dict[tuple[int, str], torch.Tensor]:
        """``sum_i c_i G_i`` of every joined parameter, by ``(id(owner), key)``: one product of the
        factors with each block, each parameter's sum a view of it in its shape."""
        out: dict[tuple[int, str], torch.Tensor] = {}
        for block in self.blocks:
            summed = c.to(block.rows.dtype) @ block.rows  # (n,)
            for owner, key, start, shape in block.places:
                out[(id(owner), key)] = summed[start : start + shape.numel()].view(shape)
        return out
