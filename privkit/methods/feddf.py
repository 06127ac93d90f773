"""FedDF (:mod:`privkit.trainers.feddf`): its settings and registration."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from privkit.methods.fedavg import QUICK as FEDAVG_QUICK
from privkit.methods.fedavg import FedAvgConfig
from privkit.methods.registry import declare


class FedDFConfig(FedAvgConfig):
    """FedDF settings: FedAvg's plus the server distillation step."""

    distill_epochs: Annotated[int, Field(ge=1)] = 1
    distill_lr: Annotated[float, Field(gt=0)] = 5e-5
    distill_batch_size: Annotated[int, Field(ge=1)] = 128


# CPU-sized: FedAvg's quick setting plus one distillation epoch per round at 1e-4 (FedAUX Table 8's
# best distillation step size at alpha=0.01; the paper's 5e-5 makes ~12 steps on 1.4k images).
QUICK = {**FEDAVG_QUICK, "distill_epochs": 1, "distill_lr": 1e-4}

declare(
    "feddf",
    FedDFConfig,
    "privkit.trainers.feddf:train_feddf",
    "FedDF/FedD: FedAvg + server distillation of the mean-logit client ensemble on public data "
    "(pretrain/freeze: '+P'/'+F'); models sent in the clear",
    paper="Lin et al. 2020; FedAUX (Sattler et al.) baselines",
    formal_dp=False,
    quick=QUICK,
    batched="privkit.batched.many_fedavg:train_feddf_many",
)
