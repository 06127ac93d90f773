"""FedAUX (:mod:`privkit.trainers.fedaux`): its settings and registration."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from privkit.methods.feddf import QUICK as FEDDF_QUICK
from privkit.methods.feddf import FedDFConfig
from privkit.methods.registry import declare


class FedAUXConfig(FedDFConfig):
    """FedAUX settings: FedDF's (pretraining on by default) plus the DP scoring heads.

    ``score_epsilon`` defaults to 4 (paper 0.1) and ``calibration`` to ``analytic`` (paper:
    classic): the scoring head's noise scales as 1/(lam n eps) with n = |D_i| + |D^-|, about 520
    on the embedded data against the paper's 22 500, so 4 keeps the paper's n * eps; at 0.1 the
    embedded scores are noise. ``privkit/configs/full.toml`` sets the paper's values.
    """

    pretrain: bool = True
    score_epsilon: Annotated[float, Field(gt=0)] = 4.0  # paper 0.1 (see the class docstring)
    score_delta: Annotated[float, Field(gt=0, lt=1)] = 1e-5
    score_lambda: Annotated[float, Field(gt=0)] = 0.1
    score_dp: bool = True
    calibration: Literal["classic", "analytic"] = "analytic"  # paper: "classic"
    xi: Annotated[float, Field(gt=0)] = 1e-8
    center_features: bool = True


# CPU-sized: FedDF's quick setting; h0 is the same as FedAUXfdp's quick h0 (cached per process).
declare(
    "fedaux",
    FedAUXConfig,
    "privkit.trainers.fedaux:train_fedaux",
    "FedAUX: pretrained h0, DP certainty scores (binary logistic heads vs public negatives), "
    "certainty-weighted ensemble distillation; client models sent in the clear (epsilon inf for "
    "the pipeline, scores DP)",
    paper="Sattler et al., FedAUX (IEEE TNNLS 2021)",
    formal_dp=False,
    quick=FEDDF_QUICK,
    batched="privkit.batched.many_fedavg:train_fedaux_many",
)
