"""Trainers: one module per method, each holding the training function of the methods declared in
the torch-free :mod:`privkit.methods` module of the same name (config models, metadata, registry).

Use :func:`train` (``privkit.trainers.train("fedavg", federation, {...}, seed=0)``) or the CLI
``privkit train METHOD``. Importing this package does not import torch: a method's module (and
torch) is imported when it trains (``get_trainer(name).fn``).
"""

from privkit.methods.contract import (
    REGISTRY,
    TrainerConfig,
    TrainerSpec,
    TrainResult,
    get_trainer,
    make_config,
    register_trainer,
    train,
)

__all__ = [
    "REGISTRY",
    "TrainResult",
    "TrainerConfig",
    "TrainerSpec",
    "get_trainer",
    "make_config",
    "register_trainer",
    "train",
]
