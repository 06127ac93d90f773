"""FedAvg, FedProx and FedDF runs batched (:mod:`privkit.trainers.many`).

Each run is a :class:`~privkit.trainers.fedavg.FederatedRun` (the single run's own object: client
selection, ledger, size-weighted averaging, the server hook, evaluation). Per round the selected
clients of every run train together (:func:`local_epochs`): each (run, client) model starts from
its run's global model and runs :func:`~privkit.trainers.common.train_supervised`'s schedule (per
epoch a permutation from the client's seeded generator cut into batches, the last one partial; the
mean cross-entropy, plus FedProx's proximal term towards its run's global model; a fresh SGD or
Adam per round), models with fewer batches idling once theirs have run out. These methods train
with Adam, which amplifies float rounding (:mod:`privkit.trainers.exact_mlp`), so each model runs
exactly the single run's kernels: the batch saves the per-step overhead, not the arithmetic.
FedDF's distillation (the server hook) runs per run, as in the single run.
"""

from __future__ import annotations

import copy

import torch

from privkit.errors import PrivkitError
from privkit.seeding import torch_generator
from privkit.trainers.common import as_tensor, minibatches
from privkit.trainers.exact_mlp import Model, mlp_layers, train_exact
from privkit.trainers.fedavg import NO_DP_CLAIM, FederatedRun, result_from_outcome
from privkit.trainers.many import lockstep
from privkit.trainers.stacked import UnsupportedModelError


def local_epochs(runs: list[FederatedRun], selected: list[list[int]]) -> list[list[tuple[torch.nn.Module, float]]]:
    """The selected clients of every run trained at once; per run, ``(trained copy, last epoch's
    mean loss)`` per client in the selected order, as :meth:`FederatedRun.train_local` gives them
    (bit for bit: :mod:`privkit.trainers.exact_mlp`; a model it does not cover trains one client
    after the other)."""
    jobs = [(r, i) for r, ids in zip(runs, selected) for i in ids]
    if not jobs:
        return [[] for _ in runs]
    try:
        mlp_layers(runs[0].model)
    except UnsupportedModelError:
        return [[r.train_local(i) for i in ids] for r, ids in zip(runs, selected)]
    cfg, device = runs[0].cfg, runs[0].device
    models, locals_, sizes = [], [], []
    for r, i in jobs:
        x, y = r.federation.client_arrays(i)
        xt, yt = as_tensor(x, device, torch.float32), as_tensor(y, device, torch.long)
        gen = torch_generator(r.local_seed(i))  # train_supervised's batches: one permutation per epoch
        batches = [idx.to(device) for _ in range(cfg.local_epochs) for idx in minibatches(len(yt), cfg.batch_size, gen)]
        local = copy.deepcopy(r.model).to(device).train()
        models.append(Model({k: q.detach() for k, q in local.named_parameters()}, xt, yt, batches))
        locals_.append(local)
        sizes.append(len(yt))
    per_epoch = [len(m.batches) // cfg.local_epochs for m in models]
    totals = train_exact(runs[0].model, models, optimizer=cfg.optimizer, lr=cfg.lr, mu=[r.mu for r, _ in jobs],
                         anchors=[r.anchor for r, _ in jobs],
                         loss_from=[(cfg.local_epochs - 1) * k for k in per_epoch])
    out: list[list[tuple[torch.nn.Module, float]]] = [[] for _ in runs]
    owner = {id(r): n for n, r in enumerate(runs)}
    for (r, _), local, total, n in zip(jobs, locals_, totals, sizes):
        out[owner[id(r)]].append((local, total / max(n, 1)))
    return out


def train_fedavg_many(method: str, federations: list, config, seeds: list[int]) -> list:
    """``train(method, federations[j], config, seeds[j])`` for every j (``fedavg``, ``fedprox``),
    the selected clients of all runs' rounds trained together."""
    mu = float(getattr(config, "mu", 0.0)) if method == "fedprox" else 0.0
    if method == "fedprox" and mu <= 0:
        raise PrivkitError(f"mu must be > 0 for fedprox; found {mu}")
    runs = [FederatedRun(f, config, s, mu=mu) for f, s in zip(federations, seeds)]
    lockstep(runs, local_epochs)
    return [result_from_outcome(method, s, config, r.outcome(), claims=dict(NO_DP_CLAIM), federation=f)
            for r, f, s in zip(runs, federations, seeds)]


def train_feddf_many(method: str, federations: list, config, seeds: list[int]) -> list:
    """``train("feddf", federations[j], config, seeds[j])`` for every j: local training batched,
    each run's distillation its own."""
    from privkit.trainers.feddf import distillation_hook, feddf_result

    stores: list[dict] = [{} for _ in federations]
    runs = [FederatedRun(f, config, s, server_hook=distillation_hook(f, config, s, store=st))
            for f, s, st in zip(federations, seeds, stores)]
    lockstep(runs, local_epochs)
    return [feddf_result(f, config, s, r.outcome(), st) for r, f, s, st in zip(runs, federations, seeds, stores)]


__all__ = ["local_epochs", "train_fedavg_many", "train_feddf_many"]
