"""FedKADP (:mod:`privkit.trainers.fedkadp`): its settings and registration. Its baseline,
record-level DP-FedAvg, is :mod:`privkit.methods.dp_fedavg`.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from privkit.methods.dp_fedavg import PAPER, QUICK, DpFedConfig, Positive
from privkit.methods.registry import declare


class FedKADPConfig(DpFedConfig):
    """FedKADP: adaptive temperature (Eq. 17) and noise multiplier (Eq. 20).

    ``feedback=false`` turns the feedback off (ablation): the loss runs at the fixed
    ``temperature`` and the noise multiplier stays at ``noise_multiplier``.
    """

    feedback: bool = True
    temperature: Annotated[float, Field(gt=0)] = 2.5  # feedback off: midpoint of [rho_min, rho_max]

    rho_min: Positive = 2.0  # paper: 2 (also the temperature of round 1)
    rho_max: Positive = 3.0  # paper: 3
    decay: Annotated[float, Field(gt=0, le=1)] = 0.95  # p in Eq. 20 (paper: not given)
    weight_gradient: Annotated[float, Field(ge=0)] = 0.25  # w_g (paper: not given)
    weight_loss: Annotated[float, Field(ge=0)] = 0.25  # w_l
    weight_accuracy: Annotated[float, Field(ge=0)] = 0.25  # w_a
    weight_time: Annotated[float, Field(ge=0)] = 0.25  # w_t
    metric_dp: float = 60.0  # Metric_DP threshold of Eq. 20 (paper: not given)
    metric_kd: float = 50.0  # Metric_KD threshold of Eq. 17 (paper: not given)
    steepness: Positive = 0.1  # k in Eq. 17 (paper: not given)
    accuracy_clip: Positive = 100.0  # |M_a| cap: the paper's ratio is unbounded (privkit choice)


declare(
    "fedkadp",
    FedKADPConfig,
    "privkit.trainers.fedkadp:train_fedkadp",
    "FedKADP: KD from the global model + DP-SGD with adaptive temperature and noise "
    "(bidirectional feedback), stopped at the privacy budget",
    paper=PAPER,
    formal_dp=True,
    quick=QUICK,
    batched="privkit.batched.many_dpfed:train_dpfed_many",
    flower="privkit.flower_engine.apps:DpFedPort",
)
