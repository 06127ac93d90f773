"""Values added to a list of tensors at flat coordinates, touching those coordinates only.

The tensors are read as one vector, flattened one after another (the order of a model's
trainable parameters); a coordinate set is spread over the tensors it falls in and each share is
added on its tensor's own device. White-box canaries (:mod:`attacks.whitebox`) and canary records
(:mod:`attacks.canary_records`) add their gradients this way: no dense vector as large as the
release is formed per step.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np
import torch

__all__ = ["add_at", "add_in_place"]


def _shares(
    tensors: Sequence[torch.Tensor], coords: torch.Tensor, values: torch.Tensor
) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """``(tensor index, offsets in it, values)`` for each tensor the flat ``coords`` (CPU) fall
    in, the offsets and values on that tensor's device (one transfer for all) and in its dtype."""
    if not coords.numel():
        return []
    sizes = np.fromiter((t.numel() for t in tensors), dtype=np.int64, count=len(tensors))
    ends = np.cumsum(sizes)
    at = np.asarray(coords, dtype=np.int64)
    which = np.searchsorted(ends, at, side="right")
    order = np.argsort(which, kind="stable")
    which = which[order]
    bounds = [0, *(np.flatnonzero(np.diff(which)) + 1).tolist(), int(which.size)]
    dev = tensors[int(which[0])].device
    local = torch.from_numpy(at[order] - (ends - sizes)[which]).to(dev)
    vals = values[torch.from_numpy(order)].to(dev)
    out = []
    for lo, hi in itertools.pairwise(bounds):
        t = tensors[int(which[lo])]
        out.append(
            (
                int(which[lo]),
                local[lo:hi].to(t.device),
                vals[lo:hi].to(device=t.device, dtype=t.dtype),
            )
        )
    return out


def add_at(
    tensors: Sequence[torch.Tensor], coords: torch.Tensor, values: torch.Tensor
) -> list[torch.Tensor]:
    """``tensors`` (flattened one after another) plus ``values`` at the distinct flat
    ``coords``, each tensor's share added on its own device (``index_add_``): a tensor no
    coordinate falls in comes back as itself, a touched one as a new tensor (the given ones are
    never modified)."""
    out = list(tensors)
    for j, local, v in _shares(out, coords, values):
        t = out[j]
        flat = (t.clone() if t.is_contiguous() else t.contiguous()).view(-1)
        out[j] = flat.index_add_(0, local, v).view(t.shape)
    return out


def add_in_place(
    tensors: Sequence[torch.Tensor], coords: torch.Tensor, values: torch.Tensor
) -> Callable[[], None]:
    """Add ``values`` at the distinct flat ``coords`` to ``tensors`` in place, touching those
    coordinates only (as :func:`add_at` adds them); returns a function that puts back, bit for
    bit, what the tensors held there (for a loop whose clean sum is needed after its release,
    e.g. opacus' ``summed_grad`` or a step's clipped sum)."""
    saved = []
    for j, local, v in _shares(tensors, coords, values):
        t = tensors[j].detach()
        where: tuple[torch.Tensor, ...]
        if t.is_contiguous():
            t, where = t.view(-1), (local,)
        else:
            where = torch.unravel_index(local, t.shape)
        saved.append((t, where, t[where]))  # advanced indexing: a copy
        t.index_put_(where, v, accumulate=True)

    def restore() -> None:
        for t, where, old in saved:
            t.index_put_(where, old)

    return restore
