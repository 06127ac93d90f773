"""Record-level DP-FedAvg (:mod:`privkit.trainers.dp_fedavg`), FedKADP's baseline: its settings
(shared by FedKADP and FedKD+DP) and registration. Client-level DP-FedAvg (McMahan et al. 2018) is
:mod:`privkit.methods.dp_fedavg_client`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from privkit.methods.base import TrainerConfig
from privkit.methods.registry import declare

PAPER = (
    "Jiang et al., A Personalized Federated Learning Method Based on Knowledge Distillation and "
    "Differential Privacy (FedKADP), Electronics 13(17) 3538, 2024"
)

Positive = Annotated[float, Field(gt=0)]
Unit = Annotated[float, Field(gt=0, le=1)]


class DpFedConfig(TrainerConfig):
    """Settings shared by DP-FedAvg, FedKD+DP and FedKADP (paper values where Sec. 5 gives them).

    Scaled to the embedded data and a CPU (the paper: MNIST, 100 clients, CNN with 2 conv + 2 dense
    layers, eta=0.005): ``arch="mlp"`` with one hidden layer of 64 units (DP-SGD noise grows with
    the number of parameters, and per-sample gradients of an MLP are ~5x cheaper; ``arch="cnn"``
    gives the paper's architecture family); ``client_fraction=0.5`` so that, as in the paper
    (s=0.1 of 100), 10 clients take part per round of the 20-client federation; ``lr=0.1``
    (0.005 barely moves the model within the rounds the embedded data allows).
    """

    arch: Literal["cnn", "mlp"] = "mlp"
    feature_dim: Annotated[int, Field(ge=2)] = 64
    rounds: Annotated[int, Field(ge=1)] = 100  # T (paper: 100)
    local_steps: Annotated[int, Field(ge=1)] = 20  # E, DP-SGD steps per round (paper: 20)
    batch_size: Annotated[int, Field(ge=1)] = 32  # B, expected Poisson batch (paper: 32)
    lr: Positive = 0.1  # eta (paper: 0.005, see class docstring)
    optimizer: Literal["sgd", "adam"] = "sgd"
    client_fraction: Unit = 0.5  # s (paper: 0.1 of 100 clients; see class docstring)
    clip_norm: Positive = 1.0  # c (paper: not given)
    noise_multiplier: Positive = 5.0  # sigma_0 (paper default 5)
    target_epsilon: Positive = 3.0  # eps_T (paper: not given)
    delta: Annotated[float, Field(gt=0, lt=1)] = 1e-5  # (paper: not given)
    accountant: Literal["rdp", "pld"] = "rdp"  # accountant of the budget check and round epsilons


QUICK = {
    "rounds": 12,
    "local_steps": 10,
    "noise_multiplier": 1.0,
    "target_epsilon": 16.0,
    "lr": 0.5,
    "client_fraction": 0.25,
}

declare(
    "dp-fedavg",
    DpFedConfig,
    "privkit.trainers.dp_fedavg:train_dp_fedavg",
    "Record-level DP-FedAvg (FedKADP's baseline): FedAvg whose clients run record-level DP-SGD "
    "(Poisson sampling, fixed noise), stopped at the privacy budget; McMahan et al.'s "
    "client-level DP-FedAvg is dp-fedavg-client",
    paper=PAPER,
    formal_dp=True,
    quick=QUICK,
    batched="privkit.batched.many_dpfed:train_dpfed_many",
    flower="privkit.flower_engine.apps:DpFedPort",
)
