"""FedMD-NFDP, FedMD-NP and FedMD-LDP (:mod:`privkit.trainers.fedmd`): their settings and
registrations."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from privkit.config import StrictModel
from privkit.methods.base import TrainerConfig
from privkit.methods.registry import declare

PAPER = "Sun & Lyu, Federated Model Distillation with Noise-Free Differential Privacy (IJCAI'21)"


class PartyModel(StrictModel):
    """Architecture of one party's model (:func:`privkit.models.build_model` arguments)."""

    arch: Literal["cnn", "mlp"] = "cnn"
    width: Annotated[int, Field(ge=1)] = 16
    feature_dim: Annotated[int, Field(ge=2)] = 128
    depth: Annotated[int, Field(ge=1)] = 1


class FedMDConfig(TrainerConfig):
    """Settings shared by FedMD-NFDP, FedMD-NP and FedMD-LDP (defaults: the paper, Sec. 5).

    ``party_models`` lists the party architectures, assigned cyclically (party i gets entry
    ``i % len``).  Empty: a heterogeneous cycle derived from ``arch``/``width``/``feature_dim``
    (the base model, one at half width, one 1.5x wider with two hidden layers for mlp).
    """

    party_models: list[PartyModel] = Field(default_factory=list)
    heterogeneous: bool = True
    rounds: Annotated[int, Field(ge=0)] = 20
    init_epochs: Annotated[int, Field(ge=0)] = 20  # T1
    digest_epochs: Annotated[int, Field(ge=0)] = 2  # T2
    revisit_epochs: Annotated[int, Field(ge=0)] = 1  # T3
    public_subset: Annotated[int, Field(ge=1)] = 5000  # |X_p| per round, capped at the public size
    knowledge: Literal["logits", "softmax", "argmax"] = "argmax"
    pretrain_epochs: Annotated[int, Field(ge=0)] = 20
    pretrain_batch_size: Annotated[int, Field(ge=1)] = 128
    digest_batch_size: Annotated[int, Field(ge=1)] = 256
    revisit_batch_size: Annotated[int, Field(ge=1)] = 5
    lr: Annotated[float, Field(gt=0)] = 1e-3
    released_party: Annotated[int, Field(ge=0)] = 0
    # Label spaces (Sec. 5): the paper's public data (MNIST / CIFAR-10) and private data (FEMNIST
    # letters / CIFAR-100 subclasses) have disjoint labels, so pretraining teaches features, never
    # the private classes. "disjoint": public data restricted to ``public_classes`` (default: the
    # first half of the classes), private data and test set to ``private_classes`` (default: the
    # rest); "shared": every class on both sides (then pretraining alone already solves much of
    # the private task).
    labels: Literal["disjoint", "shared"] = "disjoint"
    public_classes: list[Annotated[int, Field(ge=0)]] | None = None
    private_classes: list[Annotated[int, Field(ge=0)]] | None = None


class FedMDNfdpConfig(FedMDConfig):
    """FedMD-NFDP: each party trains on one random subset of ``k`` records, drawn once."""

    k: Annotated[int, Field(ge=1)] = 16
    replacement: bool = True  # Theorem 2 (with) is the paper's choice (Lemma 1); False: Theorem 1


class FedMDNpConfig(FedMDConfig):
    """FedMD-NP: all private records, no noise, no guarantee."""


class FedMDLdpConfig(FedMDConfig):
    """FedMD-LDP: all private records; Gaussian noise on every shared prediction vector.

    The target (epsilon, delta) per party is NFDP's theorem pair for subsets of ``match_k``
    records (``match_replacement``) from that party's n, unless ``epsilon`` and ``delta`` are given.
    """

    knowledge: Literal["logits", "softmax", "argmax"] = "softmax"
    match_k: Annotated[int, Field(ge=1)] = 16
    match_replacement: bool = True
    epsilon: Annotated[float, Field(gt=0)] | None = None
    delta: Annotated[float, Field(gt=0, lt=1)] | None = None
    logit_clip: Annotated[float, Field(gt=0)] = (
        10.0  # L2 clip of shared logit vectors (logits mode)
    )


# CPU-sized: 5 rounds, 500 public records per round; NFDP's k=16 subsets train with the paper's
# revisit batch 5 (T1=20 epochs), the all-data variants with batch 16 (T1=10) at a similar cost.
QUICK = {
    "arch": "mlp",
    "feature_dim": 64,
    "rounds": 5,
    "init_epochs": 10,
    "pretrain_epochs": 2,
    "public_subset": 500,
    "digest_epochs": 1,
    "revisit_batch_size": 16,
    "heterogeneous": True,
}

declare(
    "fedmd-nfdp",
    FedMDNfdpConfig,
    "privkit.trainers.fedmd:train_fedmd_nfdp",
    "FedMD with noise-free DP: parties train on one random k-subset, share predictions",
    paper=PAPER,
    formal_dp=True,
    quick={**QUICK, "k": 16, "init_epochs": 20, "revisit_batch_size": 5},
    batched="privkit.batched.many_fedmd:train_fedmd_many",
)
declare(
    "fedmd-np",
    FedMDNpConfig,
    "privkit.trainers.fedmd:train_fedmd_np",
    "FedMD without privacy: parties train on all private data, share predictions",
    paper=PAPER,
    formal_dp=False,
    quick=QUICK,
    batched="privkit.batched.many_fedmd:train_fedmd_many",
)
declare(
    "fedmd-ldp",
    FedMDLdpConfig,
    "privkit.trainers.fedmd:train_fedmd_ldp",
    "FedMD with Gaussian noise on shared predictions, at NFDP's (epsilon, delta)",
    paper=PAPER,
    formal_dp=False,
    quick={**QUICK, "knowledge": "softmax"},
    batched="privkit.batched.many_fedmd:train_fedmd_many",
)
