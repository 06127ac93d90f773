"""Centralised DP-SGD (:mod:`privkit.trainers.dpsgd`): its settings and registration, and the
settings shared with the non-private centralised baseline."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from privkit.methods.base import TrainerConfig
from privkit.methods.registry import declare

PAPER = "Abadi et al., Deep Learning with Differential Privacy, CCS 2016 (opacus implementation)"

Positive = Annotated[float, Field(gt=0)]


class CentralConfig(TrainerConfig):
    """Training settings shared by the centralised baselines (``dpsgd`` and ``centralized``)."""

    epochs: Annotated[int, Field(ge=1)] = 10
    batch_size: Annotated[int, Field(ge=1)] = 64  # expected batch size (Poisson) / batch size
    lr: Positive = 0.1
    optimizer: Literal["sgd", "adam"] = "sgd"


class DpsgdConfig(CentralConfig):
    """DP-SGD settings.

    ``noise_multiplier`` (noise std / clip norm), when set, is used as is and ``target_epsilon``
    is not used; when it is ``None`` (default) it is calibrated so that the PLD epsilon at
    ``delta`` is at most ``target_epsilon``.
    """

    clip_norm: Positive = 1.0
    noise_multiplier: Positive | None = None
    target_epsilon: Positive = 3.0
    delta: Annotated[float, Field(gt=0, lt=1)] = 1e-5
    calibration_accountant: Literal["pld", "rdp"] = "pld"  # also the per-epoch epsilon in rounds


declare(
    "dpsgd",
    DpsgdConfig,
    "privkit.trainers.dpsgd:train_dpsgd",
    "Centralised DP-SGD on the pooled client data (opacus, Poisson sampling), noise given or "
    "calibrated to a target (epsilon, delta)",
    paper=PAPER,
    formal_dp=True,
    quick={
        "arch": "mlp",
        "feature_dim": 64,
        "epochs": 10,
        "lr": 0.5,
        "batch_size": 128,
        "calibration_accountant": "rdp",
    },
    batched="privkit.batched.many_dpsgd:train_dpsgd_runs",
)
