"""Layers that normalise each example by its batch's statistics, so that no example's gradient is
its own, and layers that keep their batches' statistics in the model unnoised.

DP-SGD's sensitivity argument needs each example's gradient to depend on that example alone.
``BatchNorm`` in training mode (or without running statistics) normalises each example by its
batch's mean and variance: one record moves every other example's gradient, so clipping each
example's gradient does not bound the record's influence, and the running statistics it keeps are
released with the model unnoised (jax_privacy's "cross-example operations"; opacus refuses such
modules in ``make_private``). DP-SGD's step refuses them
(:func:`privkit.mechanisms.dp_sgd_step.clipped_gradient_sum`), and ``privkit check`` reports them
in a user's training.

``InstanceNorm`` with running statistics in training mode normalises each example by its own
statistics (its gradient is its own) but averages the batch's into running statistics kept in the
model: released with it, without noise, they are a function of every record of every batch (opacus'
validator refuses it for that reason). The step refuses it too and ``privkit check`` reports it.
"""

from __future__ import annotations

from torch import nn

__all__ = [
    "batch_statistics_layers",
    "keeps_batch_statistics",
    "refusal",
    "uses_batch_statistics",
]


def uses_batch_statistics(module: nn.Module) -> bool:
    """Whether ``module`` is a BatchNorm normalising by its batch's statistics (training mode, or
    no running statistics kept).

    Parameters
    ----------
    module : torch.nn.Module

    Returns
    -------
    bool
    """
    return isinstance(module, nn.modules.batchnorm._BatchNorm) and (
        module.training or not module.track_running_stats
    )


def keeps_batch_statistics(module: nn.Module) -> bool:
    """Whether the torch module ``module`` is an InstanceNorm in training mode keeping running
    statistics: the batch's statistics averaged into buffers released with the model, unnoised."""
    return (
        isinstance(module, nn.modules.instancenorm._InstanceNorm)
        and module.training
        and module.track_running_stats
    )


def batch_statistics_layers(model: nn.Module, kept: bool = False) -> list[str]:
    """The BatchNorm layers of ``model`` that use the batch's statistics
    (:func:`uses_batch_statistics`) or, with ``kept``, the layers that keep their batches'
    statistics unnoised (:func:`keeps_batch_statistics`), as ``"path (Type)"``.

    Parameters
    ----------
    model : torch.nn.Module
        The model that will be trained.
    kept : bool
        The layers keeping the statistics rather than those normalising by them.

    Returns
    -------
    list of str
        One entry per such layer, in the model's order (empty where there is none).
    """
    which = keeps_batch_statistics if kept else uses_batch_statistics
    return [
        f"{path} ({type(m).__name__})" if path else type(m).__name__
        for path, m in model.named_modules()
        if which(m)
    ]


def refusal(name: str, layers: list[str], kept: bool = False) -> str:
    """Why a model named ``name`` with the batch-statistics ``layers`` has no DP-SGD epsilon.

    Parameters
    ----------
    name : str
        The model's name in the message.
    layers : list of str
        :func:`batch_statistics_layers` of the model (at least one), with the same ``kept``.
    kept : bool
        The layers keep their batches' statistics (InstanceNorm) rather than normalise by them.

    Returns
    -------
    str
    """
    shown = ", ".join(layers[:3]) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")
    if kept:
        return (
            f"{name}: {len(layers)} InstanceNorm layer(s) keeping running statistics in training "
            f"mode ({shown}): the batches' statistics are kept in the model without noise, so no "
            "epsilon holds for the model released (use track_running_stats=False)"
        )
    return (
        f"{name}: {len(layers)} BatchNorm layer(s) using batch statistics ({shown}): a "
        "cross-example operation, so per-example clipping does not bound one record's influence "
        "and no epsilon holds (use GroupNorm or LayerNorm, or freeze the layers in eval mode)"
    )
