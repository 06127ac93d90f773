"""Findings on a torch model: layers that mix examples, so per-example clipping bounds nothing
(:mod:`privkit.mechanisms.batch_statistics`: BatchNorm on the batch's statistics), and layers
that keep their batches' statistics in the model unnoised (InstanceNorm's running statistics)."""

from __future__ import annotations

from typing import Any

from privkit.check.findings import Finding

__all__ = ["statistics_findings", "unwrap"]


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


def statistics_findings(name: str, model: Any) -> list[Finding]:
    """The findings for the layers of ``model`` that use their batch's statistics (``batchnorm``:
    BatchNorm in training mode) or keep them unnoised (``running_statistics``: InstanceNorm with
    running statistics in training mode).

    Parameters
    ----------
    name : str
        The model's name in the messages.
    model : torch.nn.Module
        The model that will be trained.

    Returns
    -------
    list of Finding
        One per kind found (empty where there is none).
    """
    from privkit.mechanisms.batch_statistics import batch_statistics_layers, refusal

    findings = []
    for kind, kept in (("batchnorm", False), ("running_statistics", True)):
        layers = batch_statistics_layers(unwrap(model), kept=kept)
        if layers:
            findings.append(Finding(kind, refusal(name, layers, kept=kept), True))
    return findings
