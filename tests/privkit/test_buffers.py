"""Buffers kept across the steps or rounds of a batched computation (privkit.batched.buffers)."""

from __future__ import annotations

import torch

from privkit.batched.buffers import kept


def test_kept_buffers_are_reused_while_large_enough_and_grow_by_half_again():
    """A size the buffer holds reuses its storage; a larger one grows it to at least half again
    its size (rounds of randomly sampled clients ask for sizes a few tenths apart), or to the size
    asked for where that is larger; another dtype makes a new buffer of the size asked for."""
    scratch: dict = {}
    like = torch.zeros(1)
    first = kept(scratch, "x", (10, 10), like)
    assert first.shape == (10, 10) and scratch["x"].numel() == 100
    grown = kept(scratch, "x", (12, 10), like)
    assert grown.shape == (12, 10) and scratch["x"].numel() == 150
    again = kept(scratch, "x", (7, 20), like)  # 140 <= 150: the same storage
    assert again.shape == (7, 20) and again.data_ptr() == grown.data_ptr()
    assert kept(scratch, "x", (30, 10), like).shape == (30, 10) and scratch["x"].numel() == 300
    other = kept(scratch, "x", (5,), torch.zeros(1, dtype=torch.float64))
    assert other.dtype == torch.float64 and scratch["x"].numel() == 5
    assert kept(scratch, "y", (3, 4), like).shape == (3, 4)  # one buffer per key
