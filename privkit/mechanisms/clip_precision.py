"""The precision DP-SGD's norms and clipped sums are computed in, whatever the caller's.

A record's clipped gradient must not exceed the clip norm that calibrates the noise, and it does
not, up to float32 rounding, only where the record's norm and its contribution to the sum are
formed from the same values in the same arithmetic. Three settings of the caller's would break
that:

* ``torch.autocast`` (mixed precision): products cast down to half precision, the norms' among
  them (a record exceeded the clip norm by up to 0.4% in bfloat16);
* a model held in bfloat16 or float16: the same in the parameters' own dtype (0.7%);
* ``torch.set_float32_matmul_precision("high")`` or ``"medium"``, or torch's per-backend flags
  (``torch.backends.cuda.matmul.fp32_precision = "tf32"``): float32 products in TF32 (10 bits)
  or bfloat16 on a GPU, rounded one way in the norms' Gram matrices and another in the sum.

So the norms and the clipped sum are computed in :func:`compute_dtype` (float32, or the
parameters' dtype where wider) inside :func:`full_precision`: autocast off and float32 products
at float32's precision while inside, the caller's settings put back after. The forward and
backward passes, which only define each record's gradient, run as the caller set them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch

__all__ = ["compute_dtype", "full_precision", "lowered"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a parameter of ``dtype`` has its norms and clipped sums formed in: its own, or
    float32 where it is narrower (bfloat16, float16)."""
    return torch.promote_types(dtype, torch.float32)


def autocast_on(device: torch.device) -> bool:
    """Whether autocast is on for ``device``'s type."""
    try:
        return torch.is_autocast_enabled(device.type)
    except RuntimeError:  # a device type autocast does not know
        return False


def lowered(device: torch.device) -> bool:
    """Whether the caller computes below float32 for ``device``: autocast on, or float32 matrix
    products lowered (``torch.set_float32_matmul_precision``, or torch's per-backend flags)."""
    if autocast_on(device):
        return True
    try:
        return torch.get_float32_matmul_precision() != "highest"
    except RuntimeError:  # torch's per-backend flags in use: read through them
        return any(_effective(flag) not in ("none", "ieee") for flag in _product_flags())


def _product_flags() -> tuple:
    """The per-backend flags of float32 matrix products: cuBLAS's and oneDNN's."""
    # (set on the modules at import: attributes the type stubs do not list)
    return (torch.backends.cuda.matmul, getattr(torch.backends.mkldnn, "matmul"))  # noqa: B009


def _effective(flag) -> str:
    """A per-backend flag's precision, its parent's where it is ``"none"`` (inherited)."""
    own = flag.fp32_precision
    return own if own != "none" else getattr(torch.backends, "fp32_precision")  # noqa: B009


@contextmanager
def _products_at_float32() -> Iterator[None]:
    """float32 matrix products at float32's precision while inside, where the caller lowered
    them, and the caller's setting put back after: through ``torch.set_float32_matmul_precision``
    where the caller set that, else through torch's per-backend flags (once those are written,
    torch refuses to read the legacy setting beside them), each put back to the precision it
    read (torch reads a flag that inherits its parent's as the parent's)."""
    try:
        precision = torch.get_float32_matmul_precision()
    except RuntimeError:
        flags = _product_flags()
        kept = [flag.fp32_precision for flag in flags]
        try:
            for flag in flags:
                flag.fp32_precision = "ieee"
            yield
        finally:
            for flag, value in zip(flags, kept, strict=True):
                flag.fp32_precision = value
        return
    if precision == "highest":
        yield
        return
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(precision)


@contextmanager
def full_precision(device: torch.device) -> Iterator[None]:
    """Autocast off for ``device`` (where it is on) and float32 products at float32's precision
    while inside (module docstring)."""
    with ExitStack() as stack:
        if autocast_on(device):
            stack.enter_context(torch.autocast(device.type, enabled=False))
        stack.enter_context(_products_at_float32())
        yield
