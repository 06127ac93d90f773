"""Settings of the public-data pretraining of h0 (:mod:`privkit.trainers.pretrain`), shared by the
FedAvg family and the DP-head methods."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from privkit.methods.base import TrainerConfig


class PretrainConfig(TrainerConfig):
    """Fields of every method that may start from (``pretrain``) or freeze (``freeze``) h0."""

    pretrain: bool = False
    freeze: bool = False
    pretrain_data: Literal["all", "negative", "distill"] = "all"
    pretrain_epochs: Annotated[int, Field(ge=1)] = 40
    pretrain_batch_size: Annotated[int, Field(ge=2)] = 256
    pretrain_lr: Annotated[float, Field(gt=0)] = 1e-3
    pretrain_temperature: Annotated[float, Field(gt=0)] = 0.5
    pretrain_proj_dim: Annotated[int, Field(ge=2)] = 64
    # h0 sees public data only, so its seed need not follow the trainer's: a fixed pretrain_seed
    # gives the target and every shadow run the same h0 (one pretraining per process, cached).
    pretrain_seed: int | None = None  # None: derived from the trainer seed

    @model_validator(mode="after")
    def _freeze_needs_pretrain(self) -> PretrainConfig:
        if self.freeze and not self.pretrain:
            raise ValueError(
                "freeze=true freezes the pretrained h0, so it needs pretrain=true; "
                f"found pretrain={self.pretrain}"
            )
        return self
