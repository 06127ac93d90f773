"""Log-softmax and cross-entropy over the class axis of stacked models' logits, fast on the CPU.

torch's CPU log-softmax (and the cross-entropy built on it) vectorises along the axis it
reduces: over a classifier's 10 classes most of a vector register stays empty. On one thread of
this project's CPU a ``(80, 45, 10)`` tensor (a FedKADP audit's step: 80 clients' padded
batches) took 540 us through ``torch.log_softmax(x, -1)`` and 132 us as ``x - logsumexp(x)``;
the per-example cross-entropy with its backward pass 924 us through ``F.cross_entropy`` and
300 us as ``logsumexp(x) - x[label]`` (docs/performance.md). The forms here are the same
functions, equal up to float rounding (4.8e-7 measured on those logits), differentiated by
autograd. On other devices, and for a tensor of a few rows, where the fused kernel is as fast or
faster (one model's batch of 64: 74 us against 114 us), torch's own kernel runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: below this many logits torch's fused kernel is faster than the two-kernel form
SMALL = 4096


def _fused(z: torch.Tensor) -> bool:
    return z.device.type != "cpu" or z.numel() < SMALL


def log_softmax(z: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``log_softmax(z, dim)``. The two-kernel form serves a class axis that is the last one;
    along an earlier axis torch's kernel vectorises along the contiguous axes after it, and is
    the faster (a ``(16, 10, 32)`` tensor over axis 1: 5 us, against 19 us in two kernels)."""
    if _fused(z) or dim % z.dim() != z.dim() - 1:
        return F.log_softmax(z, dim=dim)
    return z - torch.logsumexp(z, -1, keepdim=True)


def cross_entropy(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-example cross-entropy of logits ``z`` (``(..., classes)``) at labels ``y`` (``z``'s
    leading shape): ``F.cross_entropy(..., reduction="none")`` in ``y``'s shape."""
    if _fused(z):
        return F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1), reduction="none").view(
            y.shape
        )
    return torch.logsumexp(z, -1) - z.gather(-1, y[..., None])[..., 0]


__all__ = ["SMALL", "cross_entropy", "log_softmax"]
