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

__all__ = ["batch_statistics_layers", "refusal"]


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
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
        and (m.training or not m.track_running_stats)
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
