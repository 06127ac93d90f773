"""Client-level DP-FedAvg (:mod:`privkit.trainers.dp_fedavg_client`): its settings and registration.

McMahan, Ramage, Talwar & Zhang, "Learning Differentially Private Recurrent Language Models"
(ICLR 2018), with fixed clipping: the algorithm Flower's ``DifferentialPrivacyServerSideFixedClipping``
implements. Not to be confused with privkit's ``dp-fedavg`` (record-level DP-SGD inside each
client, FedKADP's baseline).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from privkit.methods.base import TrainerConfig
from privkit.methods.registry import declare

PAPER = (
    "McMahan, Ramage, Talwar & Zhang, Learning Differentially Private Recurrent Language Models, "
    "ICLR 2018 (DP-FedAvg with fixed clipping; Flower's DifferentialPrivacyServerSideFixedClipping)"
)


class DpFedAvgClientConfig(TrainerConfig):
    """Client-level DP-FedAvg settings (the paper's symbols in the comments).

    Each round every client is sampled independently with probability ``client_rate`` (Poisson
    sampling, the paper's ``q``: the number of clients varies from round to round), trains
    ``local_epochs`` epochs of plain SGD from the global model, and its update is clipped to L2
    norm ``clip_norm``; the server adds ``N(0, (noise_multiplier clip_norm)^2 I)`` to the sum of
    the clipped updates and divides by the expected number of clients ``client_rate N`` (the
    fixed-denominator estimator). ``noise_multiplier = 0`` is the noise-free twin (clipped
    FedAvg, no DP guarantee: its ledger says so).
    """

    arch: Literal["cnn", "mlp"] = "mlp"
    feature_dim: Annotated[int, Field(ge=2)] = 64
    rounds: Annotated[int, Field(ge=1)] = 100  # T
    client_rate: Annotated[float, Field(gt=0, le=1)] = 0.5  # q (Poisson rate per client per round)
    local_epochs: Annotated[int, Field(ge=1)] = 1  # E
    batch_size: Annotated[int, Field(ge=1)] = 32  # B (local minibatches, shuffled epochs)
    lr: Annotated[float, Field(gt=0)] = 0.1  # client learning rate (plain SGD)
    clip_norm: Annotated[float, Field(gt=0)] = 1.0  # S
    noise_multiplier: Annotated[float, Field(ge=0)] = 1.0  # z (noise std z S on the sum)
    delta: Annotated[float, Field(gt=0, lt=1)] = 1e-5  # delta of the round epsilons and budget
    target_epsilon: Annotated[float, Field(gt=0)] | None = None  # stop before passing it
    accountant: Literal["rdp", "pld"] = "rdp"  # accountant of the budget check and round epsilons


# CPU-sized: 20 rounds of one local epoch with about half the clients each; z = 0.5 keeps the
# noise on the mean (z S / (q N) = 0.05 with 20 clients) small enough for the model to learn
# (client-level DP with 20 clients is costly: the ledger's epsilon says how costly).
QUICK = {
    "rounds": 20,
    "client_rate": 0.5,
    "local_epochs": 1,
    "lr": 0.2,
    "noise_multiplier": 0.5,
}

declare(
    "dp-fedavg-client",
    DpFedAvgClientConfig,
    "privkit.trainers.dp_fedavg_client:train_dp_fedavg_client",
    "Client-level DP-FedAvg (McMahan et al. 2018): Poisson-sampled clients, each update clipped "
    "to S, Gaussian noise z S on the sum at the server (Flower's server-side fixed clipping)",
    paper=PAPER,
    formal_dp=True,
    quick=QUICK,
    level="client",
)
