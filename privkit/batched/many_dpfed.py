"""DP-FedAvg, FedKADP and FedKD+DP runs batched (:mod:`privkit.batched.many`).

Each run is a :class:`~privkit.trainers.dp_fedavg.DpFedRun` (the single run's own object: client
sampling, budget check, Renyi filter, accounting, averaging, evaluation, feedback). Per round every
run that goes on samples its clients, and all (run, client) pairs run their ``local_steps``
DP-SGD steps as one stacked computation (:func:`~privkit.batched.many.local_dp_sgd`): the
pair's model starts from its run's global model, draws its batches and noise from the streams of
:func:`~privkit.trainers.dp_fedavg._local_update` for that client and round, and FedKADP's
distillation loss reads the logits of its run's global model (the teacher) at that round's
temperature. The states go back to each run in its sampled order, with each client's release
receipts (one per local step, :attr:`LocalDp.receipts <privkit.batched.many.LocalDp.receipts>`),
which :meth:`DpFedRun.finish_round <privkit.trainers.dp_fedavg.DpFedRun.finish_round>` composes
into the ledger as the single run does (refusing releases other than the budget check admitted).

FedKD+DP (:class:`~privkit.trainers.fedkd.FedKdRun`) runs the same way on each sampled client's
mentor-mentee pair: :class:`StackedPairs` gives the joint per-example norms of mentor, mentee and
``W_h`` from each layer's inputs and output gradients (the single run uses the same class with one
model, through ``MentorMentee.stacked_form``), the loss reading the mentor's and the projected
mentee's features as well as both models' logits; each client's receipts go to
:meth:`FedKdRun.finish_round <privkit.trainers.fedkd.FedKdRun.finish_round>`.

An audit's reference runs (``fast``) draw the noise of all their clients of a step in one draw
(:class:`~privkit.batched.many.LocalDp`: seeded, the same law, not their single runs' numbers),
and with plain SGD train apart from the other clients, their first layers over the inputs their
records use (:mod:`privkit.batched.used_inputs`: the other inputs' weights take the round's
summed noise in one draw, the same law).
Inside an audit's probing block each probed client's model takes the canaries its single run's
step takes (:meth:`~privkit.mechanisms.dp_sgd_step.DpSgdStep.probes`, label ``dp-sgd``).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

from privkit.batched.class_axis import log_softmax
from privkit.batched.exact_mlp import stacked_logits
from privkit.batched.many import (
    LocalDp,
    ce_losses,
    local_dp_sgd,
    lockstep,
    stacked_on,
    unreported,
    unstack,
)
from privkit.batched.used_inputs import (
    SpanCache,
    first_layers,
    narrowable,
    train_over_used_inputs,
)
from privkit.mechanisms.dp_sgd_step import DpSgdStep
from privkit.mechanisms.stacked import StackedModels, UnsupportedModelError
from privkit.mechanisms.stacked_pairs import StackedPairs
from privkit.seeding import noise_generator
from privkit.trainers.dp_fedavg import DpFedRun
from privkit.trainers.fedkadp import run_for
from privkit.trainers.fedkd import FedKdRun


def kd_losses(rho: torch.Tensor):
    """Per-example :func:`~privkit.trainers.dp_fedavg.kd_loss` with model j's temperature ``rho[j]``."""

    def losses(
        out: torch.Tensor, models: torch.Tensor, s: slice, y: torch.Tensor, teacher: torch.Tensor
    ):
        r = rho[models].view(-1, 1, 1)
        ce = ce_losses(out, models, s, y, None)
        log_q = log_softmax(out / r)
        log_p = log_softmax(teacher / r)
        kl = (log_p.exp() * (log_p - log_q)).sum(-1)
        return ce + r[..., 0] ** 2 * kl

    return losses


def _jobs(
    pairs: list[tuple],
    modules: Sequence[torch.nn.Module],
    device: torch.device,
    fast: frozenset[int] = frozenset(),
) -> list[LocalDp]:
    """Each (run, client) pair's local DP-SGD: the client's records, the step with the run's noise
    multiplier, the client's batch and noise streams of this round, and an audit's canaries of
    the client's mechanism over its trained module (``modules``, one per pair: the probes the
    single run's step takes, :meth:`DpSgdStep.probes`; ``fast``: the ids of the runs whose jobs
    draw their noise together, :class:`LocalDp`)."""
    jobs = []
    for (r, k), module in zip(pairs, modules):
        cfg, (x, y) = r.cfg, r.data[k]
        n, seed = len(y), r.client_seed(k)
        sigma = getattr(r, "sigma", cfg.noise_multiplier)
        step = DpSgdStep(cfg.clip_norm, sigma, min(1.0, cfg.batch_size / n), n)
        jobs.append(
            LocalDp(
                x,
                y,
                step,
                noise_generator(seed, "poisson", reproducible=cfg.reproducible_noise),
                noise_generator(seed, "noise", reproducible=cfg.reproducible_noise, device=device),
                fast=id(r) in fast,
                canaries=step.probes(module, k),
            )
        )
    return jobs


def _per_run(sampled: list[list[int]], jobs: list[LocalDp]) -> list[list[list]]:
    """Each run's clients' release receipts, in its sampled order (``jobs``: one per (run, client)
    pair, runs in order)."""
    out: list[list[list]] = []
    at = 0
    for ks in sampled:
        out.append([jobs[at + i].receipts for i in range(len(ks))])
        at += len(ks)
    return out


def _round(
    runs: list[DpFedRun],
    sampled: list[list[int]],
    fast: frozenset[int] = frozenset(),
    spans: SpanCache | None = None,
) -> list[tuple[list[dict[str, torch.Tensor]], list[list]]]:
    """One round's local updates of every (run, client) pair; per run, its states in sampled order
    and its clients' release receipts (what :meth:`DpFedRun.finish_round` takes; ``fast``:
    :func:`_jobs`). The pairs whose jobs are :func:`~privkit.batched.used_inputs.narrowable`
    (an audit's reference clients) train apart, over the inputs their records use or in their
    records' span (:class:`~privkit.batched.used_inputs.Narrowed`; ``spans``: the records' spans
    kept across the rounds), where the model and optimiser allow it."""
    pairs = [(r, k) for r, ks in zip(runs, sampled) for k in ks]
    models = [r.model for r, _ in pairs]
    jobs = _jobs(pairs, models, runs[0].device, fast)
    states: list[dict[str, torch.Tensor]] = [{} for _ in pairs]
    for part, weights in _parts(jobs, first_layers(models[0], runs[0].cfg.optimizer)):
        trained = _local(runs[0], [pairs[i] for i in part], [jobs[i] for i in part], weights, spans)
        for i, state in zip(part, trained):
            states[i] = state
    out: list[list[dict[str, torch.Tensor]]] = []
    at = 0
    for ks in sampled:
        out.append(states[at : at + len(ks)])
        at += len(ks)
    return list(zip(out, _per_run(sampled, jobs)))


def _parts(jobs: list[LocalDp], weights: list[str]) -> list[tuple[list[int], list[str]]]:
    """The jobs trained together, as positions, each part with the weights it narrows: the
    :func:`~privkit.batched.used_inputs.narrowable` jobs apart with ``weights`` (where there are
    any), the others with none; empty parts left out."""
    narrow = [i for i, j in enumerate(jobs) if weights and narrowable(j)]
    whole = [i for i in range(len(jobs)) if i not in set(narrow)]
    return [(part, w) for part, w in ((whole, []), (narrow, weights)) if part]


def _local(
    run: DpFedRun,
    pairs: list[tuple],
    jobs: list[LocalDp],
    weights: list[str],
    spans: SpanCache | None = None,
) -> list[dict[str, torch.Tensor]]:
    """The pairs' local DP-SGD steps as one stacked computation (``run``: any run of the round,
    for the config and device), each pair's state after them; ``weights``: the first layer's
    weight where the jobs train it over their used inputs or records' span
    (:func:`train_over_used_inputs`, with the ``spans`` cache), else none."""
    cfg, device = run.cfg, run.device
    models = [r.model for r, _ in pairs]
    params, buffers = stacked_on(models, device)
    net = StackedModels(models[0], len(pairs))

    def train(params: dict[str, torch.Tensor], jobs: list[LocalDp]) -> None:
        aux, losses = None, ce_losses
        if run.distill:  # the teacher: the round's global model, over the inputs trained
            teacher = {k: v.clone() for k, v in params.items()}
            rho = torch.tensor([r.rho for r, _ in pairs], device=device)

            def aux(xb: torch.Tensor) -> torch.Tensor:
                with torch.no_grad():
                    return net.forward(teacher, buffers, xb)[0]

            losses = kd_losses(rho)
        local_dp_sgd(
            net,
            params,
            buffers,
            jobs,  # each job's receipts appended as its releases run
            cfg.local_steps,
            lr=cfg.lr,
            optimizer=cfg.optimizer,
            losses=losses,
            aux=aux,
        )

    params = train_over_used_inputs(
        weights, params, jobs, train, steps=cfg.local_steps, lr=cfg.lr, spans=spans
    )
    keys = list(models[0].state_dict())
    states = []
    for at in range(len(pairs)):
        state = {**unstack(params, at), **unstack(buffers, at)}
        states.append({k: state[k] for k in keys})
    return states


# ---------------------------------------------------------------------------- FedKD+DP
def mutual_losses(num_classes: int, hidden: bool):
    """Per-example :func:`~privkit.trainers.fedkd.mutual_loss` on :class:`StackedPairs`' output."""
    C = num_classes

    def losses(
        out: torch.Tensor, models: torch.Tensor, s: slice, y: torch.Tensor, aux
    ) -> torch.Tensor:
        t, st = out[..., :C], out[..., C : 2 * C]
        ce_t, ce_s = ce_losses(t, models, s, y, None), ce_losses(st, models, s, y, None)
        weight = 1.0 / (ce_t + ce_s).detach().clamp_min(1e-6)
        log_t, log_s = log_softmax(t), log_softmax(st)
        kl_t = (log_s.detach().exp() * (log_s.detach() - log_t)).sum(-1)
        kl_s = (log_t.detach().exp() * (log_t.detach() - log_s)).sum(-1)
        total = ce_t + ce_s + weight * (kl_t + kl_s)
        if hidden:
            d = (out.shape[-1] - 2 * C) // 2
            h_t, proj = out[..., 2 * C : 2 * C + d], out[..., 2 * C + d :]
            total = total + weight * (
                (h_t - proj.detach()).pow(2).mean(-1) + (proj - h_t.detach()).pow(2).mean(-1)
            )
        return total

    return losses


def _kd_round(
    runs: list[FedKdRun],
    sampled: list[list[int]],
    fast: frozenset[int] = frozenset(),
    spans: SpanCache | None = None,
) -> list[tuple[list[list]]]:
    """One round's local rounds of every (run, client) pair, written back into the pairs; per
    run, its clients' release receipts in sampled order (what :meth:`FedKdRun.finish_round`
    takes; ``fast``: :func:`_jobs`; ``spans``: :func:`_round`)."""
    pairs = [(r, k) for r, ks in zip(runs, sampled) for k in ks]
    modules = [r.pairs[k] for r, k in pairs]
    jobs = _jobs(pairs, modules, runs[0].device, fast)
    for part, weights in _parts(jobs, first_layers(modules[0], runs[0].cfg.optimizer)):
        _kd_local(runs[0], [modules[i] for i in part], [jobs[i] for i in part], weights, spans)
    return [(receipts,) for receipts in _per_run(sampled, jobs)]


def _kd_local(
    run: FedKdRun, modules: list, jobs: list[LocalDp], weights: list[str], spans: SpanCache | None
) -> None:
    """The pairs' (``modules``) local DP-SGD steps as one stacked computation, written back into
    them (``weights``, ``spans``: :func:`_local`)."""
    cfg = run.cfg
    params, buffers = stacked_on(modules, run.device)
    net = StackedPairs(modules[0], len(modules))
    losses = mutual_losses(run.num_classes, cfg.hidden_loss)

    def train(params: dict[str, torch.Tensor], jobs: list[LocalDp]) -> None:
        local_dp_sgd(
            net,
            params,
            buffers,
            jobs,
            cfg.local_steps,
            lr=cfg.lr,
            optimizer=cfg.optimizer,
            losses=losses,
        )

    params = train_over_used_inputs(
        weights, params, jobs, train, steps=cfg.local_steps, lr=cfg.lr, spans=spans
    )
    with torch.no_grad():
        for j, mod in enumerate(modules):
            for name, p in mod.named_parameters():
                p.copy_(params[name][j])


def _fast_ids(runs: list, fast: list[bool] | None) -> frozenset[int]:
    return frozenset(id(r) for r, f in zip(runs, fast or []) if f)


def stacked_validation(runs: list[DpFedRun]) -> list[tuple[float, float]]:
    """Each run's global model's (loss, accuracy) on its public validation data (the same
    records for all of them, as in every run of an audit), as :func:`~privkit.trainers.dp_fedavg._public_eval`
    gives them up to float rounding: one stacked pass over every model
    (:func:`~privkit.batched.exact_mlp.stacked_logits`: a batched product per layer, over the
    inputs some record uses), where a pass per model is a product over all 784 inputs each
    (half of them 0 in every public digit). Privkit MLPs only (else
    :class:`~privkit.mechanisms.stacked.UnsupportedModelError`)."""
    first = runs[0].federation
    if any(
        r.federation.public is not first.public
        or not np.array_equal(r.federation.distill, first.distill)
        for r in runs
    ):
        raise ValueError("stacked validation needs the same validation records for every run")
    x, y = runs[0].x_val, torch.as_tensor(runs[0].y_val, dtype=torch.long)
    logits = stacked_logits([r.model for r in runs], x, runs[0].device)
    return [
        (float(F.cross_entropy(z, y)), float((z.argmax(1) == y).float().mean())) for z in logits
    ]


def _finish_rounds(runs: list[DpFedRun], outputs: list[tuple], fast: frozenset[int]) -> None:
    """Each run's :meth:`~privkit.trainers.dp_fedavg.DpFedRun.finish_round` with its states and
    receipts (``outputs``), the validation of the reference runs (``fast``) that read it in one
    :func:`stacked_validation` pass; every other run validates as its single run does."""
    for run, (states, receipts) in zip(runs, outputs):
        run.average_round(states, receipts)
    together = [r for r in runs if id(r) in fast and r.validates]
    validation: dict[int, tuple[float, float]] = {}
    if len(together) > 1:
        try:
            validation = {id(r): v for r, v in zip(together, stacked_validation(together))}
        except (UnsupportedModelError, ValueError):  # a CNN, or runs of other validation data
            validation = {}
    for run in runs:
        run.conclude_round(validation.get(id(run)))


def train_dpfed_many(
    method: str, federations: list, configs: list, seeds: list[int], fast: list[bool] | None = None
) -> list:
    """``train(method, federations[j], configs[j], seeds[j])`` for every j (``dp-fedavg`` or
    ``fedkadp``), the clients of all runs' rounds batched (each client's streams from its run's
    config; the clients of the runs ``fast`` marks draw their noise together, :class:`LocalDp`,
    and their global models are validated together, :func:`stacked_validation`)."""
    runs = [run_for(method, f, c, s) for f, c, s in zip(federations, configs, seeds)]
    unreported(runs, fast)
    ids = _fast_ids(runs, fast)
    lockstep(
        runs,
        partial(_round, fast=ids, spans=SpanCache()),
        partial(_finish_rounds, fast=ids),
    )
    return [r.result() for r in runs]


def train_fedkd_many(
    method: str, federations: list, configs: list, seeds: list[int], fast: list[bool] | None = None
) -> list:
    """``train("fedkd-dp", federations[j], configs[j], seeds[j])`` for every j, batched (``fast``:
    :func:`train_dpfed_many`)."""
    runs = [FedKdRun(f, c, s) for f, c, s in zip(federations, configs, seeds)]
    unreported(runs, fast)
    lockstep(runs, partial(_kd_round, fast=_fast_ids(runs, fast), spans=SpanCache()))
    return [r.result() for r in runs]


__all__ = [
    "StackedPairs",
    "kd_losses",
    "mutual_losses",
    "stacked_validation",
    "train_dpfed_many",
    "train_fedkd_many",
]
