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

import numpy as np
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


def distillation_hook(
    federation,
    cfg: FedDFConfig,
    seed: int,
    scores: np.ndarray | None = None,
    store: dict | None = None,
    teachers: Callable | None = None,
):
    """Server step of FedDF (``scores=None``) or FedAUX (``scores``: clients x distill points).

    ``store`` (optional dict) receives the last round's soft labels under ``"soft_labels"``.
    ``teachers(client_models, x, device)``: the clients' logits on the distillation points,
    ``(clients, points, classes)``, or None where it cannot take them (then each client's own
    forward): an audit's reference runs take them together
    (:mod:`privkit.batched.many_fedavg`).
    """
    x_distill, _ = federation.public_arrays("distill")
    device = resolve_device(cfg)

    def teacher_logits(client_models: list[nn.Module]) -> np.ndarray:
        logits = teachers(client_models, x_distill, device) if teachers is not None else None
        if logits is not None:
            return logits
        return np.stack(
            [predict_logits(m, x_distill, device, cfg.eval_batch_size) for m in client_models]
        )

    def hook(model: nn.Module, client_models: list[nn.Module], ids: list[int], t: int) -> dict:
        logits = teacher_logits(client_models)
        weights = None if scores is None else scores[ids]
        targets = ensemble_targets(logits, weights)
        kl = distill(
            model,
            x_distill,
            targets,
            epochs=cfg.distill_epochs,
            batch_size=cfg.distill_batch_size,
            lr=cfg.distill_lr,
            device=device,
            seed=derive_seed(seed, f"distill-{t}"),
        )
        if store is not None:
            store["soft_labels"] = targets
        return {"distill_kl": kl}

    return hook


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


__all__ = ["FedDFConfig", "distillation_hook", "ensemble_targets", "feddf_run", "train_feddf"]
