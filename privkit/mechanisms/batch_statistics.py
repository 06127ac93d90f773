"""Layers that normalise each example by its batch's statistics, so that no example's gradient is
its own.

DP-SGD's sensitivity argument needs each example's gradient to depend on that example alone.
``BatchNorm`` in training mode (or without running statistics) normalises each example by its
batch's mean and variance: one record moves every other example's gradient, so clipping each
example's gradient does not bound the record's influence, and the running statistics it keeps are
released with the model unnoised (jax_privacy's "cross-example operations"; opacus refuses such
modules in ``make_private``). DP-SGD's step refuses them
(:func:`privkit.mechanisms.dp_sgd_step.clipped_gradient_sum`), and ``privkit check`` reports them
in a user's training.
"""

from __future__ import annotations

from torch import nn

__all__ = ["batch_statistics_layers", "refusal", "uses_batch_statistics"]


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


def batch_statistics_layers(model: nn.Module) -> list[str]:
    """The BatchNorm layers of ``model`` that use the batch's statistics, as ``"path (Type)"``.

    Parameters
    ----------
    model : torch.nn.Module
        The model that will be trained.

    Returns
    -------
    list of str
        One entry per such layer, in the model's order (empty where there is none).
    """
    return [
        f"{path} ({type(m).__name__})" if path else type(m).__name__
        for path, m in model.named_modules()
        if uses_batch_statistics(m)
    ]


def refusal(name: str, layers: list[str]) -> str:
    """Why a model named ``name`` with the batch-statistics ``layers`` has no DP-SGD epsilon.

    Parameters
    ----------
    name : str
        The model's name in the message.
    layers : list of str
        :func:`batch_statistics_layers` of the model (at least one).

    Returns
    -------
    str
    """
    shown = ", ".join(layers[:3]) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")
    return (
        f"{name}: {len(layers)} BatchNorm layer(s) using batch statistics ({shown}): a cross-example "
        "operation, so per-example clipping does not bound one record's influence and no epsilon "
        "holds (use GroupNorm or LayerNorm, or freeze the layers in eval mode)"
    )
