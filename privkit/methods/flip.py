"""FLiP (:mod:`privkit.trainers.flip`): its settings, its paper's attackers, and its registration."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from privkit.config import StrictModel
from privkit.methods.base import TrainerConfig
from privkit.methods.registry import declare

PAPER = "Xu et al., Privacy-Preserving Federated Learning via Dataset Distillation (FLiP)"


class FlipAttackConfig(StrictModel):
    """The paper's attackers (Sec. V, VI-D); defaults are the paper's values.

    Sec. VI-D2 (membership inference): 128 shadow models, a CatBoost attack model of depth 1 and
    10 000 iterations, attacking the models of rounds 1, 25, 50, 75 and 100. Sec. V-A / Table II
    (task-irrelevant attribute inference): psi_{s1-s2} trained on the distilled data shared during
    the whole training ("collected during the training procedure"), i.e. every round's release.
    Lower values are reductions: :meth:`reductions` names each one, and the trainer lists them in
    its warnings (the report shows them). The Table II attack
    (:func:`privkit.audit.instantiations.flip_table2_attack`) and ``benchmarks/repro_flip.py`` read
    these fields; a run directory's membership audit takes its shadows and CatBoost iterations
    from the run's audit settings (reported with the audit).
    """

    shadows: Annotated[int, Field(ge=2)] = 128
    catboost_iterations: Annotated[int, Field(ge=1)] = 10_000
    catboost_depth: Annotated[int, Field(ge=1)] = 1
    mia_rounds: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=lambda: [1, 25, 50, 75, 100]
    )
    table2_rounds: Literal["all", "last"] = "all"
    table2_classifier: Literal["catboost", "logreg"] = "catboost"

    def reductions(self) -> list[str]:
        """Each setting below the paper's, as ``"<field> <value> (paper <value>)"``."""
        paper = FlipAttackConfig()
        out = [
            f"{name} {getattr(self, name)} (paper {getattr(paper, name)})"
            for name in ("shadows", "catboost_iterations")
            if getattr(self, name) < getattr(paper, name)
        ]
        if self.table2_rounds != paper.table2_rounds:
            out.append("table2_rounds last (paper: every round's release)")
        if self.table2_classifier != paper.table2_classifier:
            out.append(f"table2_classifier {self.table2_classifier} (paper's attacker: catboost)")
        return out


class FlipConfig(TrainerConfig):
    """FLiP settings.

    Paper (Sec. VI-A): 5 clients, 100 rounds, Eps=30, batch 1024, gamma=0.01 halved every 40
    rounds, k in {10, 15, 20}; Wang et al.'s code: softplus rates initialised at 0.02, Adam
    betas (0.5, 0.999).  Scaled to a CPU (the sequential K-step unroll dominates the cost): an
    MLP, k=5, 20 rounds of Eps=10 (15x fewer outer steps than the paper), which a larger step
    gamma=0.05, initial rates 0.05, label logits initialised at 3 for the slot's class and
    samples initialised N(0, 0.3^2) compensate for (measured on mnist5k, 5 IID clients: 87 %
    after 10 rounds; the cost grows with the number of clients, each unrolling K steps per
    local epoch).
    """

    arch: Literal["cnn", "mlp"] = "mlp"
    feature_dim: Annotated[int, Field(ge=2)] = 64
    k: Annotated[int, Field(ge=1)] = 5  # distilled samples per class; K = k * classes
    rounds: Annotated[int, Field(ge=0)] = 20
    local_epochs: Annotated[int, Field(ge=1)] = 10  # Eps of Algorithm 1 (paper: 30)
    batch_size: Annotated[int, Field(ge=1)] = 1024
    distill_lr: Annotated[float, Field(gt=0)] = 0.05  # gamma (paper: 0.01)
    lr_decay_every: Annotated[int, Field(ge=1)] = 40
    lr_decay: Annotated[float, Field(gt=0, le=1)] = 0.5
    adam_beta1: Annotated[float, Field(ge=0, lt=1)] = 0.5
    adam_beta2: Annotated[float, Field(ge=0, lt=1)] = 0.999
    init_rate: Annotated[float, Field(gt=0)] = 0.05  # Wang et al.: 0.02
    min_rate: Annotated[float, Field(ge=0)] = 0.0
    max_rate: Annotated[float, Field(gt=0)] = 0.5  # clip: the single-sample unroll is high-variance
    label_init: Annotated[float, Field(ge=0)] = 3.0  # initial label logit of the slot's class
    sample_init_std: Annotated[float, Field(gt=0)] = 0.3
    record_every: Annotated[int, Field(ge=0)] = 0  # also keep uploads every n rounds (0: last only)
    attack: FlipAttackConfig = Field(default_factory=FlipAttackConfig)


declare(
    "flip",
    FlipConfig,
    "privkit.trainers.flip:train_flip",
    "FLiP: clients share distilled samples (local-global dataset distillation)",
    paper=PAPER,
    formal_dp=False,
    quick={
        "k": 2,
        "rounds": 4,
        "local_epochs": 8,
        "feature_dim": 32,
        "attack": {"shadows": 2, "catboost_iterations": 200},
    },
    batched="privkit.batched.many_flip:train_flip_many",
    batched_references_only=True,
)
