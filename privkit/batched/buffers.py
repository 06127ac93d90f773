"""Buffers kept across the steps or rounds of a batched computation.

A fresh tensor of tens of megabytes is fresh pages from the system: on this project's CPUs,
writing one costs three to four times what writing a reused one does (page faults; measured in
docs/performance.md). The batched engines therefore keep their large per-step and per-round
tensors in a ``scratch`` dict that lives as long as the computation and write into them.
"""

from __future__ import annotations

import math

import torch


def kept(scratch: dict, key, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of ``shape`` and ``like``'s dtype and device in the buffer
    ``scratch[key]`` (one per call site: its contents are the caller's until its next use). The
    buffer grows to the largest size asked for and is otherwise reused, so sizes that change from
    round to round (records, batch widths) do not make fresh tensors."""
    size = math.prod(shape)
    buf = scratch.get(key)
    if buf is None or buf.numel() < size or (buf.dtype, buf.device) != (like.dtype, like.device):
        buf = scratch[key] = torch.empty(size, dtype=like.dtype, device=like.device)
    return buf[:size].view(shape)


__all__ = ["kept"]
