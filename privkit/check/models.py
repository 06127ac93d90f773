"""Findings on a torch model: layers that mix examples, so per-example clipping bounds nothing.

DP-SGD's sensitivity argument needs each example's gradient to depend on that example alone.
``BatchNorm`` in training mode (or without running statistics) normalises each example by its
batch's mean and variance: one record moves every other example's gradient, so clipping each
example's gradient does not bound the record's influence, and the running statistics it keeps are
released with the model unnoised (jax_privacy's "cross-example operations"; opacus refuses such
modules in ``make_private``).
"""

from __future__ import annotations

from typing import Any

from privkit.check.findings import Finding

__all__ = ["batchnorm_finding", "unwrap"]


def unwrap(model: Any) -> Any:
    """The user's module inside opacus' ``GradSampleModule`` (or the model itself).

    Parameters
    ----------
    model : torch.nn.Module
        A module, possibly wrapped by opacus.

    Returns
    -------
    torch.nn.Module
    """
    inner = model
    while type(inner).__module__.startswith("opacus") and hasattr(inner, "_module"):
        inner = inner._module
    return inner


def batchnorm_finding(name: str, model: Any) -> Finding | None:
    """A finding for the BatchNorm layers of ``model`` that use batch statistics.

    Parameters
    ----------
    name : str
        The model's name in the message.
    model : torch.nn.Module
        The model that will be trained.

    Returns
    -------
    Finding or None
    """
    from torch.nn.modules.batchnorm import _BatchNorm

    layers = [
        f"{path} ({type(m).__name__})" if path else type(m).__name__
        for path, m in unwrap(model).named_modules()
        if isinstance(m, _BatchNorm) and (m.training or not m.track_running_stats)
    ]
    if not layers:
        return None
    shown = ", ".join(layers[:3]) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")
    message = (
        f"{name}: {len(layers)} BatchNorm layer(s) using batch statistics ({shown}): a cross-example "
        "operation, so per-example clipping does not bound one record's influence and no epsilon "
        "holds (use GroupNorm or LayerNorm, or freeze the layers in eval mode)"
    )
    return Finding("batchnorm", message, True)
