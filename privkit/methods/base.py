"""Settings every trainer shares (:class:`TrainerConfig`); each method's config subclasses it."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from privkit.config import StrictModel


class TrainerConfig(StrictModel):
    """Settings every trainer shares; each method subclasses it with its own fields and defaults."""

    device: str = "auto"
    # False (release mode): DP noise and privacy-amplifying sampling come from AES-CTR keyed from
    # OS entropy, never stored (privkit.mechanisms.dp_random). True: derived from the run seed, bit-reproducible, stamped "not for release".
    reproducible_noise: bool = False
    arch: Literal["cnn", "mlp"] = "cnn"
    width: Annotated[int, Field(ge=1)] = 16
    feature_dim: Annotated[int, Field(ge=2)] = 128
    eval_batch_size: Annotated[int, Field(ge=1)] = 1024
