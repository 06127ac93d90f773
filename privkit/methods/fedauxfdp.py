"""FedAUXfdp and its DP-head baselines (:mod:`privkit.trainers.fedauxfdp`): their settings and
registrations."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from privkit.methods.pretrain import PretrainConfig
from privkit.methods.registry import declare


class DpHeadConfig(PretrainConfig):
    """Settings shared by FedAUXfdp and its DP-head baselines.

    Defaults follow FedAUXfdp Sec. 5 except where the embedded data (~160 records per client
    against the paper's 2500, 1.4k distillation images against 80k) would leave the method at
    chance; ``privkit/configs/full.toml`` sets the paper's values:

    * ``class_epsilon`` 8 and ``score_epsilon`` 4 (paper 0.5 and 0.1): the noise scales as
      1/(lam n eps), so these keep the paper's n * eps (2500 x 0.5 for the class heads,
      (2500 + 20000) x 0.1 for the scores at n = 160 + 360);
    * ``calibration="analytic"`` and ``sensitivity_bound="cfree"`` (paper: classic, 2 sqrt(C)):
      both sound and tighter (the classic formula is stated for epsilon < 1 only);
    * the student trains 30 epochs at 1e-3 (paper: 10 epochs at 5e-5, ~6k steps on 80k images;
      on 1.4k images that is ~120 steps, which leaves its fresh head near chance).
    """

    pretrain: bool = True
    freeze: bool = True
    pretrain_data: Literal["all", "negative", "distill"] = "negative"
    class_epsilon: Annotated[float, Field(gt=0)] = 8.0  # paper 0.5 (see the class docstring)
    class_delta: Annotated[float, Field(gt=0, lt=1)] = 1e-5
    class_lambda: Annotated[float, Field(gt=0)] = 0.01
    class_dp: bool = True
    score_epsilon: Annotated[float, Field(gt=0)] = 4.0  # paper 0.1
    score_delta: Annotated[float, Field(gt=0, lt=1)] = 1e-5
    score_lambda: Annotated[float, Field(gt=0)] = 0.01
    score_dp: bool = True
    sensitivity_bound: Literal["paper", "cfree"] = "cfree"  # paper: "paper"
    calibration: Literal["classic", "analytic"] = "analytic"  # paper: "classic"
    xi: Annotated[float, Field(gt=0)] = 1e-8
    center_features: bool = True
    student_epochs: Annotated[int, Field(ge=1)] = 30  # paper 10
    student_lr: Annotated[float, Field(gt=0)] = 1e-3  # paper 5e-5
    student_batch_size: Annotated[int, Field(ge=1)] = 128
    student_freeze: bool = False
    keep_client_models: bool = True

    @model_validator(mode="after")
    def _needs_frozen_h0(self) -> DpHeadConfig:
        # The DP argument needs a feature extractor that never saw private data: heads on frozen h0.
        if not (self.pretrain and self.freeze):
            raise ValueError(
                "the DP heads sit on the frozen pretrained h0: pretrain and freeze must be "
                f"true; found pretrain={self.pretrain}, freeze={self.freeze}"
            )
        return self

    def budget(self) -> tuple[float, float]:
        """The paper's cumulative (epsilon, delta) by basic composition (Sec. 4.3)."""
        return self.class_epsilon + self.score_epsilon, self.class_delta + self.score_delta


class FedAuxFdpConfig(DpHeadConfig):
    """FedAUXfdp: DP class heads + DP scoring heads, score-weighted labels, student from h0."""


class DpHeadBaselineConfig(DpHeadConfig):
    """FedAvg+P / FedD+P: one DP release of each class head at the whole budget, no scores.

    The class head is released at ``(class_epsilon + score_epsilon, class_delta + score_delta)``,
    the same total budget FedAUXfdp spends; ``score_lambda``/``score_dp`` are unused.
    ``ensemble`` (``fedd-dphead`` only): ``logits`` = FedD's ``softmax(mean logits)`` (the paper's
    baseline), ``probabilities`` = mean of the heads' softmax outputs (diagnostic variant).
    """

    ensemble: Literal["logits", "probabilities"] = "logits"


# CPU-sized: an MLP h0 pretrained on all the public data (the 20 % negative part alone, ~360
# digits28 images, gives a weaker h0: linear probe 81 % against 85 %), student head-only.
QUICK = {
    "arch": "mlp",
    "feature_dim": 64,
    "pretrain_epochs": 20,
    "pretrain_data": "all",
    "pretrain_seed": 0,
    "student_epochs": 30,
    "student_lr": 1e-2,
    "student_freeze": True,
}
_TRAINERS = "privkit.trainers.fedauxfdp"

declare(
    "fedauxfdp",
    FedAuxFdpConfig,
    f"{_TRAINERS}:train_fedauxfdp",
    "FedAUXfdp: one-shot, frozen h0, DP multinomial class heads + DP scoring heads, score-weighted "
    "soft labels, student from h0",
    paper="Hoech et al., FedAUXfdp (FL-IJCAI'22)",
    formal_dp=True,
    quick=QUICK,
    flower="privkit.flower_engine.apps:DpHeadsPort",
)
declare(
    "fedavg-dphead",
    DpHeadBaselineConfig,
    f"{_TRAINERS}:train_fedavg_dphead",
    "FedAvg+P with DP heads (FedAUXfdp Table 2 baseline): mean of the clients' DP class heads on "
    "frozen h0, one round",
    paper="Hoech et al., FedAUXfdp (FL-IJCAI'22), Table 2",
    formal_dp=True,
    quick=QUICK,
)
declare(
    "fedd-dphead",
    DpHeadBaselineConfig,
    f"{_TRAINERS}:train_fedd_dphead",
    "FedD+P with DP heads (FedAUXfdp Table 2 baseline): student distilled from the mean-logit "
    "DP-head ensemble (FedD), one round",
    paper="Hoech et al., FedAUXfdp (FL-IJCAI'22), Table 2",
    formal_dp=True,
    quick=QUICK,
)
