"""FedKD+DP (:mod:`privkit.trainers.fedkd`): its settings and registration."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from privkit.methods.dp_fedavg import QUICK as FEDKADP_QUICK
from privkit.methods.dp_fedavg import DpFedConfig
from privkit.methods.registry import declare

PAPER = (
    "Wu et al., Communication-efficient federated learning via knowledge distillation, "
    "Nature Communications 13:2032 (2022); with DP as FedKADP's baseline 'FedKD (with DP)'"
)


class FedKDConfig(DpFedConfig):
    """FedKD+DP: mentee = the shared model (``arch``/``feature_dim``), mentor = a larger local model.

    Defaults follow DP-FedAvg's (:class:`~privkit.methods.dp_fedavg.DpFedConfig`) so the three DP
    baselines of FedKADP's comparison share one setting; ``energy_start``/``energy_end`` are the
    paper's SVD energy thresholds.
    """

    mentor_arch: Literal["cnn", "mlp"] | None = None  # None: the mentee's arch
    mentor_width: Annotated[int, Field(ge=1)] = 32
    mentor_feature_dim: Annotated[int, Field(ge=2)] = 128
    mentor_depth: Annotated[int, Field(ge=1)] = (
        1  # hidden layers (mlp); a deeper mentor shares the clip norm with more weights
    )
    hidden_loss: bool = True  # the MSE(h_t, W_h h_s) term
    compress: bool = True  # truncated-SVD compression of the up- and downloads
    energy_start: Annotated[float, Field(gt=0, le=1)] = 0.95  # T_start (paper)
    energy_end: Annotated[float, Field(gt=0, le=1)] = 0.98  # T_end (paper)

    @model_validator(mode="after")
    def _energy_order(self) -> FedKDConfig:
        if self.energy_start > self.energy_end:
            raise ValueError(
                f"energy_start must be <= energy_end; found {self.energy_start} > {self.energy_end}"
            )
        return self


declare(
    "fedkd-dp",
    FedKDConfig,
    "privkit.trainers.fedkd:train_fedkd_dp",
    "FedKD+DP (Wu et al. 2022): local mentor + shared mentee, adaptive mutual distillation, "
    "SVD-compressed mentee updates, joint DP-SGD",
    paper=PAPER,
    formal_dp=True,
    quick={**FEDKADP_QUICK, "mentor_feature_dim": 96},
    batched="privkit.batched.many_dpfed:train_fedkd_many",
)
