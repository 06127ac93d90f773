"""What a computation's kernels cost on their own: record its aten calls, replay each one and time it.

:class:`KernelRecorder` (a torch dispatch mode) counts the calls of the aten ops a predicate keeps,
each with its arguments described by layout only: a tensor by its shape, strides and dtype, a list
of tensors element by element, anything else (sizes, flags, step sizes, generators) as it was.
:func:`replayed` then runs each distinct call on fresh tensors of the same layouts (floating-point
tensors filled with values in [0.5, 1), so square roots and divisions stay finite; integer and
boolean tensors with 0), warm once, and times it: the best of ``repeats`` timings of a loop long
enough to last about ``window`` seconds, in process CPU seconds. The sum over the calls, each
count times its time, is what those kernels cost with their inputs hot in cache and nothing else
running: a lower bound for the computation's time in them, up to the machine's variation.

Used by ``audit_roofline.py`` for the audit's batched reference runs: their matrix products,
convolutions, optimiser passes and normal draws at the speed torch's kernels reach on those very
shapes on this core.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass(frozen=True)
class TensorLayout:
    """A tensor argument as far as a kernel's time depends on it."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def describe(value: Any) -> Any:
    """``value`` with every tensor replaced by its :class:`TensorLayout` and lists by tuples (a
    hashable key; :func:`materialise` undoes it)."""
    if isinstance(value, torch.Tensor):
        return TensorLayout(tuple(value.shape), tuple(value.stride()), value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(describe(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, describe(v)) for k, v in value.items()))
    return value


def materialise(value: Any) -> Any:
    """Fresh arguments for a described call: each :class:`TensorLayout` a new tensor of that
    layout (floating point in [0.5, 1), others 0), each tuple a list."""
    if isinstance(value, TensorLayout):
        # the storage the layout spans, filled, then viewed with the layout's strides: an
        # expanded tensor (stride 0) cannot be written through itself
        extent = (
            0
            if 0 in value.shape
            else 1 + sum((n - 1) * st for n, st in zip(value.shape, value.stride))
        )
        flat = torch.empty(extent, dtype=value.dtype)
        flat = flat.uniform_(0.5, 1.0) if flat.is_floating_point() else flat.zero_()
        return flat.as_strided(value.shape, value.stride)
    if isinstance(value, tuple):
        return [materialise(v) for v in value]
    return value


class KernelRecorder(TorchDispatchMode):
    """Counts the calls of the aten ops whose name (``aten.mm``, ...) ``keep`` accepts, by
    (op, described positional arguments, described keyword arguments)."""

    def __init__(self, keep: Callable[[str], bool]) -> None:
        super().__init__()
        self.keep = keep
        self.calls: Counter[tuple] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.keep(str(func.overloadpacket)):
            self.calls[(func, describe(args), describe(kwargs))] += 1
        return func(*args, **kwargs)


def call_seconds(
    func, args: tuple, kwargs: tuple, repeats: int = 3, window: float = 0.005
) -> float:
    """Process CPU seconds of one call of ``func`` on fresh tensors of the described layouts: the
    best of ``repeats`` timings of a loop of about ``window`` seconds, after one untimed call."""
    a, kw = materialise(args), {k: materialise(v) for k, v in kwargs}
    start = time.process_time()
    func(*a, **kw)
    first = time.process_time() - start
    n = max(1, int(window / max(first, 1e-6)))
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(n):
            func(*a, **kw)
        best = min(best, (time.process_time() - start) / n)
    return best


def replayed(calls: Counter, repeats: int = 3, window: float = 0.005) -> dict[str, Any]:
    """The recorded ``calls`` replayed: ``seconds`` (each distinct call's time times its count,
    summed), ``by_op`` (seconds per aten op, largest first), ``calls`` and ``signatures``."""
    by_op: Counter[str] = Counter()
    for (func, args, kwargs), count in calls.items():
        by_op[str(func.overloadpacket)] += count * call_seconds(func, args, kwargs, repeats, window)
    return {
        "seconds": sum(by_op.values()),
        "by_op": {op: round(s, 4) for op, s in by_op.most_common()},
        "calls": sum(calls.values()),
        "signatures": len(calls),
    }
