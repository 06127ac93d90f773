"""FedAvg, FedProx, FedDF and FedAUX runs batched (:mod:`privkit.batched.many`).

Each run is a :class:`~privkit.trainers.fedavg.FederatedRun` (the single run's own object: client
selection, ledger, size-weighted averaging, the server hook, evaluation). Per round the selected
clients of every run train together (:func:`local_epochs`): each (run, client) model starts from
its run's global model and runs :func:`~privkit.trainers.common.train_supervised`'s schedule (per
epoch a permutation from the client's seeded generator cut into batches, the last one partial; the
mean cross-entropy, plus FedProx's proximal term towards its run's global model; a fresh SGD or
Adam per round), models with fewer batches idling once theirs have run out. These methods train
with Adam, which amplifies float rounding (:mod:`privkit.batched.exact_mlp`), so each model runs
exactly the single run's kernels: the batch saves the per-step overhead, not the arithmetic. An
audit's reference runs (``fast``) train with the stacked kernels instead
(``train_exact(..., stacked=True)``: equal up to float rounding; a CNN's clients, which the exact
kernels do not cover, on stacked parameters with grouped convolutions,
:func:`~privkit.batched.stacked_local.train_stacked`). Their FedDF and FedAUX server
steps take each run's teachers' logits in one batched product (:func:`stacked_teachers`) and
distil all of the runs' models together (:func:`distil_together`). Every other run's server step,
and FedAUX's score release, run per run, as in the single run.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from privkit.batched.exact_mlp import (
    Inputs,
    Model,
    mlp_layers,
    model_for,
    stacked_logits,
    train_exact,
)
from privkit.batched.many import lockstep, unreported
from privkit.batched.stacked_local import stacked_form, stacked_logits_on, train_stacked
from privkit.mechanisms.stacked import UnsupportedModelError
from privkit.trainers.fedaux import fedaux_run
from privkit.trainers.fedavg import FederatedRun, fedavg_run, fedprox_run
from privkit.trainers.feddf import DistillationStep, DistillJob, feddf_run


def local_epochs(
    runs: list[FederatedRun],
    selected: list[list[int]],
    fast: frozenset[int] = frozenset(),
    scratch: dict | None = None,
) -> list[list[tuple[torch.nn.Module, float]]]:
    """The selected clients of every run trained at once; per run, ``(trained copy, last epoch's
    mean loss)`` per client in the selected order, as :meth:`FederatedRun.train_local` gives them
    (bit for bit: :mod:`privkit.batched.exact_mlp`; a model it does not cover trains one client
    after the other). The clients of the runs whose ``id`` is in ``fast`` train with the stacked
    kernels instead (equal up to float rounding; a CNN's with :func:`_other_clients`), in
    ``scratch``'s buffers (kept across the rounds: :mod:`privkit.batched.buffers`, with each
    client's records and the inputs they use)."""
    jobs = [(r, i) for r, ids in zip(runs, selected) for i in ids]
    if not jobs:
        return [[] for _ in runs]
    try:
        mlp_layers(runs[0].model)
    except UnsupportedModelError:
        return _other_clients(runs, selected, fast, {} if scratch is None else scratch)
    cfg = runs[0].cfg
    # which inputs each client's records use, kept from round to round
    used = {} if scratch is None else scratch.setdefault("inputs_used", {})
    models, locals_, sizes = _client_models(jobs, fast, used, scratch)
    per_epoch = [m.steps // cfg.local_epochs for m in models]
    totals = [0.0] * len(jobs)
    for stacked in (False, True):
        group = [at for at, (r, _) in enumerate(jobs) if (id(r) in fast) == stacked]
        if not group:
            continue
        got = train_exact(
            runs[0].model,
            [models[at] for at in group],
            optimizer=cfg.optimizer,
            lr=cfg.lr,
            mu=[jobs[at][0].mu for at in group],
            anchors=[jobs[at][0].anchor for at in group],
            loss_from=[(cfg.local_epochs - 1) * per_epoch[at] for at in group],
            stacked=stacked,
            scratch=scratch,
        )
        for at, total in zip(group, got):
            totals[at] = total
    for (r, i), m in zip(jobs, models):
        if m.inputs_used is not None:  # the stacked form computed it (the exact one needs none)
            used[(id(r), i)] = m.inputs_used
    out: list[list[tuple[torch.nn.Module, float]]] = [[] for _ in runs]
    owner = {id(r): n for n, r in enumerate(runs)}
    for (r, _), local, total, n in zip(jobs, locals_, totals, sizes):
        out[owner[id(r)]].append((local, total / max(n, 1)))
    return out


def _client_models(
    jobs: list[tuple[FederatedRun, int]],
    fast: frozenset[int],
    used: dict,
    scratch: dict | None,
) -> tuple[list[Model], list[torch.nn.Module], list[int]]:
    """Each job's (run, client) :class:`~privkit.batched.exact_mlp.Model` (its records, its
    batches, where it starts), the module it trains in and its record count. A stacked run's
    (``fast``) clients start from its global model itself (the round's anchor: its parameters as
    the round began), not from copies of it in their modules. The records are kept from round to
    round in ``scratch``: they are the same, and Federation.client_arrays gathers a fresh copy at
    every call (a FedDF audit's 1,700 calls took 0.13 s)."""
    cfg, device = jobs[0][0].cfg, jobs[0][0].device
    starts = {id(r): r.anchor for r, _ in jobs if id(r) in fast}
    records = {} if scratch is None else scratch.setdefault("client_records", {})
    models, locals_, sizes = [], [], []
    for r, i in jobs:
        if (id(r), i) not in records:
            records[(id(r), i)] = r.federation.client_arrays(i)
        x, y = records[(id(r), i)]
        start = starts.get(id(r))
        local = r.local_copy() if start is None else r.local_module()
        models.append(
            model_for(
                local,
                x,
                y,
                epochs=cfg.local_epochs,
                batch_size=cfg.batch_size,
                seed=r.local_seed(i),
                device=device,
                start=start,
                inputs_used=used.get((id(r), i)),
            )
        )
        locals_.append(local)
        sizes.append(len(y))
    return models, locals_, sizes


def _other_clients(
    runs: list[FederatedRun],
    selected: list[list[int]],
    fast: frozenset[int],
    scratch: dict,
) -> list[list[tuple[torch.nn.Module, float]]]:
    """:func:`local_epochs` for a model that is not a privkit MLP: each client of a run that is
    not ``fast`` trains alone (:meth:`FederatedRun.train_local`, the single run's own path); the
    ``fast`` runs' clients train together on stacked parameters where
    :func:`~privkit.batched.stacked_local.train_stacked` covers the model (a CNN: grouped
    convolutions), else alone too."""
    trainer = _stacked_trainer(runs[0].model)
    if trainer is None:
        fast = frozenset()
    jobs = [(r, i) for r, ids in zip(runs, selected) if id(r) in fast for i in ids]
    trained: dict[tuple[int, int], tuple[torch.nn.Module, float]] = {}
    if jobs and trainer is not None:
        cfg = runs[0].cfg
        models, locals_, sizes = _client_models(jobs, fast, {}, scratch)
        totals = trainer(
            runs[0].model,
            models,
            optimizer=cfg.optimizer,
            lr=cfg.lr,
            mu=[r.mu for r, _ in jobs],
            anchors=[r.anchor for r, _ in jobs],
            loss_from=[(cfg.local_epochs - 1) * (m.steps // cfg.local_epochs) for m in models],
            scratch=scratch.setdefault("stacked_local", {}),
        )
        for (r, i), local, total, n in zip(jobs, locals_, totals, sizes):
            trained[(id(r), i)] = (local, total / max(n, 1))
    return [
        [trained[(id(r), i)] if id(r) in fast else r.train_local(i) for i in ids]
        for r, ids in zip(runs, selected)
    ]


class SameRecords:
    """One array per content among the record arrays met, each array compared once, when first
    met, and remembered by ``id`` (with the array itself, so that its ``id`` stays its own): an
    audit's runs each hold their own copy of the public distillation records
    (``Federation.public_arrays`` gathers them per federation), equal copies, which the stacked
    distillation would copy and scan once per run every round and the teachers narrow once per
    run. Kept by the batched runs' server steps from round to round."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._firsts: list[np.ndarray] = []
        self._inputs: dict[int, Inputs] = {}

    def first(self, x: np.ndarray) -> np.ndarray:
        """The first array met with ``x``'s shape, dtype and values (``x`` itself if none)."""
        hit = self._seen.get(id(x))
        if hit is not None and hit[0] is x:
            return hit[1]
        same = (
            f for f in self._firsts if f.shape == x.shape and f.dtype == x.dtype and (f == x).all()
        )
        first = next(same, None)
        if first is None:
            self._firsts.append(first := x)
        self._seen[id(x)] = (x, first)
        return first

    def inputs(self, x: np.ndarray, device: torch.device) -> Inputs:
        """``x``'s :class:`~privkit.batched.exact_mlp.Inputs`, narrowed once per content."""
        first = self.first(x)
        if id(first) not in self._inputs:
            self._inputs[id(first)] = Inputs.of(first, device)
        return self._inputs[id(first)]


def stacked_teachers(
    client_models: list[torch.nn.Module],
    x,
    device: torch.device,
    same: SameRecords | None = None,
) -> np.ndarray | None:
    """The clients' logits on ``x`` in one batched product per layer (:func:`~privkit.batched.
    exact_mlp.stacked_logits`: equal to each client's own forward up to float rounding, the inputs
    0 in every record left out of the first layer; a CNN's in grouped convolutions,
    :func:`~privkit.batched.stacked_local.stacked_logits_on`), or None where neither covers the
    models: the server step of FedDF's and FedAUX's reference runs
    (:func:`~privkit.trainers.feddf.distillation_hook`'s ``teachers``). ``same``: the records
    narrowed once for every round and every run that holds equal ones (:class:`SameRecords`)."""
    try:
        mlp_layers(client_models[0])
    except UnsupportedModelError:  # a CNN's teachers in grouped convolutions, where covered
        try:
            return stacked_logits_on(client_models, x, device)
        except UnsupportedModelError:
            return None
    inputs = same.inputs(x, device) if same is not None else Inputs.of(x, device)
    try:
        return stacked_logits(client_models, inputs, device).numpy()
    except UnsupportedModelError:
        return None


def _train_runs(
    setup: Callable,
    federations: list,
    configs: list,
    seeds: list[int],
    fast: list[bool] | None,
    reference_setup: Callable | None = None,
    same: SameRecords | None = None,
) -> list:
    """The runs ``setup(federation, config, seed) -> (FederatedRun, finish)`` sets up, the selected
    clients of all runs' rounds trained together, each run's server step its own; the runs
    ``fast`` marks set up by ``reference_setup`` where given (an audit's reference runs), their
    distillations reading equal records once (``same``, the teachers' too)."""
    marks = fast or [False] * len(seeds)
    pairs = [
        (reference_setup if reference_setup is not None and ref else setup)(f, c, s)
        for f, c, s, ref in zip(federations, configs, seeds, marks)
    ]
    stacked = frozenset(id(run) for (run, _), f in zip(pairs, marks) if f)
    unreported([run for run, _ in pairs], marks)
    lockstep(
        [run for run, _ in pairs],
        partial(local_epochs, fast=stacked, scratch={}),
        partial(finish_rounds, together=stacked, same=same),
    )
    return [finish(run.outcome()) for run, finish in pairs]


def finish_rounds(
    runs: list[FederatedRun],
    trained: list,
    together: frozenset[int] = frozenset(),
    same: SameRecords | None = None,
) -> None:
    """Each run's :meth:`~FederatedRun.finish_round` on its clients' ``trained`` copies; the runs
    whose ``id`` is in ``together`` and whose server step is FedDF's or FedAUX's distillation
    (:class:`~privkit.trainers.feddf.DistillationStep`) distil together
    (:func:`distil_together`: equal to each run's own distillation up to float rounding)."""
    jobs: list[tuple[FederatedRun, DistillJob]] = []
    for run, got in zip(runs, trained):
        step = run.server_hook
        if id(run) not in together or not isinstance(step, DistillationStep):
            run.finish_round(got)
            continue
        locals_ = run.average_round(got)
        if locals_:
            jobs.append((run, step.job(run.model, locals_, list(run.selected), run.t)))
        else:  # no client this round: no server step, as finish_round
            run.end_round({})
    for (run, _), kl in zip(jobs, distil_together([job for _, job in jobs], same)):
        run.end_round({"distill_kl": kl})


def distil_together(jobs: list[DistillJob], same: SameRecords | None = None) -> list[float]:
    """Every job's distillation (:func:`~privkit.trainers.common.distill`: Adam on
    ``KL(targets || softmax)``, its batches drawn from its seed), the models trained in place in
    one stacked computation (``train_exact(..., stacked=True)``, soft targets); each job's last
    epoch's mean KL, as ``distill`` returns it; a CNN's on stacked parameters
    (:func:`~privkit.batched.stacked_local.train_stacked`). Models neither covers, an empty
    distillation set or jobs of different step sizes are distilled one after the other."""
    if not jobs:
        return []
    trainer = _stacked_trainer(jobs[0].model)
    if trainer is None or len({j.lr for j in jobs}) != 1 or not all(len(j.x) for j in jobs):
        return [j.run() for j in jobs]
    models = [
        model_for(
            j.model,
            same.first(j.x) if same is not None else j.x,  # equal records: one copy, one scan
            j.targets,
            epochs=j.epochs,
            batch_size=j.batch_size,
            seed=j.seed,
            device=j.device,
            soft=True,
        )
        for j in jobs
    ]
    totals = trainer(
        jobs[0].model,
        models,
        optimizer="adam",  # distill's
        lr=jobs[0].lr,
        loss_from=[(j.epochs - 1) * (m.steps // j.epochs) for j, m in zip(jobs, models)],
    )
    return [total / len(j.x) for j, total in zip(jobs, totals)]


def _stacked_trainer(model: torch.nn.Module) -> Callable | None:
    """The stacked kernels that train copies of ``model``: the MLPs' (``train_exact(...,
    stacked=True)``), a CNN's (``train_stacked``), or None where neither covers it."""
    try:
        mlp_layers(model)
        return partial(train_exact, stacked=True)
    except UnsupportedModelError:
        pass
    try:
        stacked_form(model, 1)
        return train_stacked
    except UnsupportedModelError:
        return None


def train_fedavg_many(
    method: str, federations: list, configs: list, seeds: list[int], fast: list[bool] | None = None
) -> list:
    """``train("fedavg", federations[j], configs[j], seeds[j])`` for every j, batched (the registry
    entry's ``batched`` form: :attr:`privkit.methods.registry.TrainerSpec.batched`).

    Parameters
    ----------
    method : str
        ``"fedavg"`` (the registry passes the method's name to every batched form).
    federations : list
        One federation per run.
    configs : list
        One trainer config per run.
    seeds : list of int
        One seed per run.
    fast : list of bool, optional
        Per run: it may train with the stacked kernels (an audit's reference run).
    """
    return _train_runs(fedavg_run, federations, configs, seeds, fast)


def train_fedprox_many(
    method: str, federations: list, configs: list, seeds: list[int], fast: list[bool] | None = None
) -> list:
    """FedProx's runs batched (:func:`train_fedavg_many`'s parameters)."""
    return _train_runs(fedprox_run, federations, configs, seeds, fast)


def train_feddf_many(
    method: str, federations: list, configs: list, seeds: list[int], fast: list[bool] | None = None
) -> list:
    """FedDF's runs batched (:func:`train_fedavg_many`'s parameters); each run's distillation is its
    own server step (a reference run's teachers' logits stacked: :func:`stacked_teachers`)."""
    same = SameRecords()
    return _train_runs(
        feddf_run,
        federations,
        configs,
        seeds,
        fast,
        partial(feddf_run, teachers=partial(stacked_teachers, same=same)),
        same,
    )


def train_fedaux_many(
    method: str, federations: list, configs: list, seeds: list[int], fast: list[bool] | None = None
) -> list:
    """FedAUX's runs batched (:func:`train_fedavg_many`'s parameters); each run's score release and
    distillation are its own (a reference run's teachers' logits stacked, as FedDF's)."""
    same = SameRecords()
    return _train_runs(
        fedaux_run,
        federations,
        configs,
        seeds,
        fast,
        partial(fedaux_run, teachers=partial(stacked_teachers, same=same)),
        same,
    )


__all__ = [
    "SameRecords",
    "distil_together",
    "finish_rounds",
    "local_epochs",
    "stacked_teachers",
    "train_fedaux_many",
    "train_fedavg_many",
    "train_feddf_many",
    "train_fedprox_many",
]
