"""DP-FedAvg and FedKADP runs batched (:mod:`privkit.trainers.many`).

Each run is a :class:`~privkit.trainers.fedkadp.DpFedRun` (the single run's own object: client
sampling, budget check, Renyi filter, accounting, averaging, evaluation, feedback). Per round every
run that goes on samples its clients, and all (run, client) pairs run their ``local_steps``
DP-SGD steps as one stacked computation (:func:`~privkit.trainers.many.local_dp_sgd`): the
pair's model starts from its run's global model, draws its batches and noise from the streams of
:func:`~privkit.trainers.fedkadp._local_update` for that client and round, and FedKADP's
distillation loss reads the logits of its run's global model (the teacher) at that round's
temperature. The states go back to each run in its sampled order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from privkit.seeding import noise_generator
from privkit.trainers.dp_sgd_step import DpSgdStep
from privkit.trainers.fedkadp import DpFedRun, run_for
from privkit.trainers.many import LocalDp, ce_losses, local_dp_sgd, stack_states, unstack
from privkit.trainers.stacked import StackedModels


def kd_losses(rho: torch.Tensor):
    """Per-example :func:`~privkit.trainers.fedkadp.kd_loss` with model j's temperature ``rho[j]``."""

    def losses(out: torch.Tensor, models: torch.Tensor, s: slice, y: torch.Tensor, teacher: torch.Tensor):
        r = rho[models].view(-1, 1, 1)
        ce = ce_losses(out, models, s, y, None)
        log_q = F.log_softmax(out / r, dim=-1)
        log_p = F.log_softmax(teacher / r, dim=-1)
        kl = (log_p.exp() * (log_p - log_q)).sum(-1)
        return ce + r[..., 0] ** 2 * kl

    return losses


def _round(runs: list[DpFedRun], sampled: list[list[int]]) -> list[list[dict[str, torch.Tensor]]]:
    """One round's local updates of every (run, client) pair; per run, its states in sampled order."""
    pairs = [(r, k) for r, ks in zip(runs, sampled) for k in ks]
    cfg, device = runs[0].cfg, runs[0].device
    models = [r.model for r, _ in pairs]
    params, buffers = stack_states(models)
    params = {k: v.to(device) for k, v in params.items()}
    buffers = {k: v.to(device) for k, v in buffers.items()}
    jobs = []
    for r, k in pairs:
        x, y = r.data[k]
        n, seed = len(y), r.client_seed(k)
        jobs.append(LocalDp(x, y, DpSgdStep(cfg.clip_norm, r.sigma, min(1.0, cfg.batch_size / n), n),
                            noise_generator(seed, "poisson", reproducible=cfg.reproducible_noise),
                            noise_generator(seed, "noise", reproducible=cfg.reproducible_noise, device=device)))
    net = StackedModels(models[0], len(pairs))
    aux, losses = None, ce_losses
    if runs[0].distill:
        teacher = {k: v.clone() for k, v in params.items()}
        rho = torch.tensor([r.rho for r, _ in pairs], device=device)

        def aux(xb: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return net.forward(teacher, buffers, xb)[0]

        losses = kd_losses(rho)
    local_dp_sgd(net, params, buffers, jobs, cfg.local_steps, lr=cfg.lr, optimizer=cfg.optimizer,
                 losses=losses, aux=aux)
    keys = list(models[0].state_dict())
    out: list[list[dict[str, torch.Tensor]]] = [[] for _ in runs]
    at = 0
    for i, ks in enumerate(sampled):
        for _ in ks:
            state = {**unstack(params, at), **unstack(buffers, at)}
            out[i].append({k: state[k] for k in keys})
            at += 1
    return out


def train_dpfed_many(method: str, federations: list, config, seeds: list[int]) -> list:
    """``train(method, federations[j], config, seeds[j])`` for every j (``dp-fedavg`` or
    ``fedkadp``), the clients of all runs' rounds batched."""
    runs = [run_for(method, f, config, s) for f, s in zip(federations, seeds)]
    if len({str(r.spec) for r in runs}) != 1:
        raise ValueError("batched runs need one model architecture; found several")
    while True:
        sampled = [r.next_round() for r in runs]
        going = [i for i, s in enumerate(sampled) if s]
        if not going:
            break
        states = _round([runs[i] for i in going], [sampled[i] for i in going])
        for i, st in zip(going, states):
            runs[i].finish_round(st)
    return [r.result() for r in runs]


__all__ = ["kd_losses", "train_dpfed_many"]
