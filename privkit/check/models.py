"""Findings on a torch model: layers that mix examples, so per-example clipping bounds nothing
(:mod:`privkit.mechanisms.batch_statistics`: BatchNorm on the batch's statistics), and layers
that keep their batches' statistics in the model unnoised (InstanceNorm's running statistics)."""

from __future__ import annotations

from typing import Any

from privkit.check.findings import Finding

__all__ = ["batchnorm_finding", "running_statistics_finding", "unwrap"]


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
    from privkit.mechanisms.batch_statistics import batch_statistics_layers, refusal

    layers = batch_statistics_layers(unwrap(model))
    if not layers:
        return None
    message = refusal(name, layers)
    return Finding("batchnorm", message, True)


def running_statistics_finding(name: str, model: Any) -> Finding | None:
    """A finding for the InstanceNorm layers of ``model`` that keep running statistics in
    training mode (the batches' statistics released with the model, unnoised).

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
    from privkit.mechanisms.batch_statistics import kept_statistics_layers, kept_statistics_refusal

    layers = kept_statistics_layers(unwrap(model))
    if not layers:
        return None
    return Finding("running_statistics", kept_statistics_refusal(name, layers), True)
