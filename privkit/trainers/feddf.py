"""FedDF / FedD: federated ensemble distillation (Lin et al. 2020), with or without "+P"/"+F".

Each round runs FedAvg's local training and size-weighted averaging, then the server distils the
client ensemble into the averaged model on the public distillation data ``D_distill``:
soft labels ``softmax(mean_i f_i(x))`` (FedAUX Eq. 2, the mean of the selected clients' logits) and
loss ``KL(soft || softmax f_theta(x))``, ``distill_epochs`` epochs of Adam at ``distill_lr``, batch
128 (FedAUX Sec. 4.1: 1 epoch, 5e-5). The embedded distillation set is small (about 1.4k images
against FedAUX's 80k), so a run at the paper's step size makes only ~12 optimiser steps per round;
``distill_epochs`` / ``distill_lr`` scale that up when needed (the reproduction scripts say what
they use).

Privacy: as FedAvg, client models are sent in the clear (``NonPrivateEvent`` per round and
participating client); the logits on public data are post-processing of those models.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from privkit.methods.contract import TrainResult
from privkit.methods.feddf import FedDFConfig
from privkit.seeding import derive_seed
from privkit.trainers.common import distill, predict_logits, resolve_device
from privkit.trainers.fedavg import NO_DP_CLAIM, FederatedRun, drive, result_from_outcome


def ensemble_targets(client_logits: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """``softmax(sum_i w_i(x) f_i(x) / sum_i w_i(x))`` for logits ``(clients, N, C)``.

    ``weights`` ``(clients, N)``: None for FedDF's plain mean (Eq. 2), certainty scores for FedAUX
    (Eq. 3).
    """
    logits = np.asarray(client_logits, dtype=np.float64)
    w = np.ones(logits.shape[:2]) if weights is None else np.asarray(weights, dtype=np.float64)
    mean = (w[:, :, None] * logits).sum(0) / w.sum(0)[:, None]
    mean -= mean.max(axis=1, keepdims=True)
    p = np.exp(mean)
    return (p / p.sum(axis=1, keepdims=True)).astype(np.float32)


@dataclass
class DistillJob:
    """One server step's distillation: ``model`` trained towards ``targets`` on ``x`` as
    :func:`~privkit.trainers.common.distill` trains it (Adam)."""

    model: nn.Module
    x: np.ndarray
    targets: np.ndarray
    epochs: int
    batch_size: int
    lr: float
    seed: int
    device: torch.device

    def run(self) -> float:
        """The distillation itself (:func:`~privkit.trainers.common.distill`): ``model`` trained
        in place; the last epoch's mean KL."""
        return distill(
            self.model,
            self.x,
            self.targets,
            epochs=self.epochs,
            batch_size=self.batch_size,
            lr=self.lr,
            device=self.device,
            seed=self.seed,
        )


class DistillationStep:
    """Server step of FedDF (``scores=None``) or FedAUX (``scores``: clients x distill points), as
    :func:`distillation_hook` makes it: called as a server hook it distils at once; :meth:`job`
    gives the same step's teachers, soft labels and settings without training, for an engine
    that distils many runs' models together (an audit's reference runs,
    :mod:`privkit.batched.many_fedavg`)."""

    def __init__(self, federation, cfg: FedDFConfig, seed: int, scores, store, teachers):
        self.x_distill, _ = federation.public_arrays("distill")
        self.device = resolve_device(cfg)
        self.cfg, self.seed, self.scores = cfg, seed, scores
        self.store, self.teachers = store, teachers

    def _teacher_logits(self, client_models: list[nn.Module]) -> np.ndarray:
        x, device = self.x_distill, self.device
        logits = self.teachers(client_models, x, device) if self.teachers is not None else None
        if logits is not None:
            return logits
        return np.stack(
            [predict_logits(m, x, device, self.cfg.eval_batch_size) for m in client_models]
        )

    def job(self, model: nn.Module, client_models: list[nn.Module], ids: list[int], t: int):
        """Round ``t``'s distillation of ``model`` (the soft labels stored as the hook stores
        them)."""
        weights = None if self.scores is None else self.scores[ids]
        targets = ensemble_targets(self._teacher_logits(client_models), weights)
        if self.store is not None:
            self.store["soft_labels"] = targets
        cfg = self.cfg
        return DistillJob(
            model,
            self.x_distill,
            targets,
            cfg.distill_epochs,
            cfg.distill_batch_size,
            cfg.distill_lr,
            derive_seed(self.seed, f"distill-{t}"),
            self.device,
        )

    def __call__(
        self, model: nn.Module, client_models: list[nn.Module], ids: list[int], t: int
    ) -> dict:
        return {"distill_kl": self.job(model, client_models, ids, t).run()}


def distillation_hook(
    federation,
    cfg: FedDFConfig,
    seed: int,
    scores: np.ndarray | None = None,
    store: dict | None = None,
    teachers: Callable | None = None,
) -> DistillationStep:
    """Server step of FedDF (``scores=None``) or FedAUX (``scores``: clients x distill points).

    ``store`` (optional dict) receives the last round's soft labels under ``"soft_labels"``.
    ``teachers(client_models, x, device)``: the clients' logits on the distillation points,
    ``(clients, points, classes)``, or None where it cannot take them (then each client's own
    forward): an audit's reference runs take them together
    (:mod:`privkit.batched.many_fedavg`).
    """
    return DistillationStep(federation, cfg, seed, scores, store, teachers)


def feddf_run(
    federation,
    config: FedDFConfig,
    seed: int,
    progress: bool = False,
    teachers: Callable | None = None,
):
    """FedDF's run (the distillation as its server hook) and what turns its outcome into the result
    (``teachers``: :func:`distillation_hook`)."""
    store: dict = {}
    hook = distillation_hook(federation, config, seed, store=store, teachers=teachers)
    run = FederatedRun(federation, config, seed, progress=progress, server_hook=hook)

    def finish(out) -> TrainResult:
        artifacts = {"soft_labels": store["soft_labels"]} if "soft_labels" in store else {}
        return result_from_outcome(
            "feddf",
            seed,
            config,
            out,
            artifacts=artifacts,
            claims=dict(NO_DP_CLAIM),
            federation=federation,
        )

    return run, finish


# method "feddf": config and registration in privkit.methods.feddf
def train_feddf(federation, config: FedDFConfig, seed: int, progress: bool = False) -> TrainResult:
    """FedDF (+P / +F). See the module docstring."""
    run, finish = feddf_run(federation, config, seed, progress)
    return finish(drive(run, progress, "feddf rounds"))


__all__ = [
    "DistillJob",
    "DistillationStep",
    "FedDFConfig",
    "distillation_hook",
    "ensemble_targets",
    "feddf_run",
    "train_feddf",
]
