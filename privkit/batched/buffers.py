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
    buffer is reused while it is large enough, so sizes that change from round to round (records,
    batch widths) do not make fresh tensors; it grows to at least half again its size. Rounds of
    clients sampled at random ask for sizes a few tenths apart: grown to the size asked for, a
    FedAvg audit's record buffer (28 MB) was made anew in 4 of its 10 rounds, at 30 ms of fresh
    pages each, and is made in 2."""
    size = math.prod(shape)
    buf = scratch.get(key)
    same_kind = buf is not None and (buf.dtype, buf.device) == (like.dtype, like.device)
    if buf is None or not same_kind or buf.numel() < size:
        grown = max(size, buf.numel() * 3 // 2) if same_kind and buf is not None else size
        buf = scratch[key] = torch.empty(grown, dtype=like.dtype, device=like.device)
    return buf[:size].view(shape)


__all__ = ["kept"]
