"""FedMD-NFDP, FedMD-NP and FedMD-LDP runs batched (:mod:`privkit.batched.many`).

Each run is a :class:`~privkit.trainers.fedmd.FedMDRun` (the single run's own object: private
subsets, the ledger, knowledge sharing with its noise, evaluation). Its phases (the pretraining,
the initialisation, then per round the digests and the revisits) are lists of independent party
jobs; the jobs of all runs' current phase train together, grouped by party architecture, each
exactly as the single run trains it (:mod:`privkit.batched.exact_mlp`: FedMD trains with Adam).
A digest towards shared logits (``knowledge="logits"``, an L1 regression) trains one job at a time.
The jobs of an audit's reference runs (``fast``), their pretraining included, train with the
stacked kernels (``train_exact(..., stacked=True)``: equal up to float rounding); their parties'
shared logits come from one stacked forward pass per architecture
(:func:`stacked_party_logits`), and their parties' test accuracies are taken after the last round
only, in one stacked pass for all of them (:func:`record`). One module at a time, every round,
the evaluation was about 2.8 s and the shared logits 2.5 s of a 26 s FedMD-NP audit.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import cast

import numpy as np
import torch

from privkit.batched.exact_mlp import (
    Inputs,
    architecture,
    mlp_layers,
    model_for,
    stacked_logits,
    train_exact,
)
from privkit.mechanisms.stacked import UnsupportedModelError
from privkit.trainers.fedmd import FedMDRun, PartyJob


class Architectures:
    """Each party model's :func:`~privkit.batched.exact_mlp.architecture`, or None where it is
    not a privkit MLP, found once per model for a whole batched training. Its parties are the
    same modules from phase to phase, whose layers and trainable flags FedMD never changes; the
    checks walked every party's parameters again at every phase (about 0.3 s of a FedMD audit's
    8.5). Kept by ``id`` with the module held, so that no id is reused while it is here."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[torch.nn.Module, tuple | None]] = {}

    def of(self, model: torch.nn.Module) -> tuple | None:
        entry = self._seen.get(id(model))
        if entry is None or entry[0] is not model:
            try:
                mlp_layers(model)
                entry = (model, architecture(model))
            except UnsupportedModelError:
                entry = (model, None)
            self._seen[id(model)] = entry
        return entry[1]


def run_jobs(
    jobs: list[PartyJob],
    config,
    device,
    fast: frozenset[int] = frozenset(),
    kept: dict[int, tuple] | None = None,
    kinds: Architectures | None = None,
) -> None:
    """Train every job (in place on its party's model) as :meth:`PartyJob.run` would; the jobs
    whose ``id`` is in ``fast`` with the stacked kernels. ``kept``: the inputs each party's own
    records use (:attr:`~privkit.batched.exact_mlp.Model.inputs_used`) by the array's ``id``,
    kept from phase to phase (a party trains on the same array in its initialisation and every
    revisit; a digest's public subset is new each round and is not kept). ``kinds``: the party
    models' architectures, kept from phase to phase (default: found for this call)."""
    kept = {} if kept is None else kept
    kinds = Architectures() if kinds is None else kinds
    groups: dict[tuple, list[PartyJob]] = {}
    for job in jobs:
        if (
            job.epochs == 0 or len(job.x) == 0
        ):  # revisit / digest / train_supervised leave these alone
            continue
        arch = kinds.of(job.model)
        if arch is None:
            job.run(config, device)
            continue
        if job.digest and config.knowledge == "logits":
            job.run(config, device)
            continue
        key = (arch, job.digest, id(job) in fast)
        groups.setdefault(key, []).append(job)
    for (_, digest, stacked), group in groups.items():
        models = [
            model_for(
                j.model,
                j.x,
                j.targets,
                epochs=j.epochs,
                batch_size=j.batch_size,
                seed=j.seed,
                device=device,
                soft=j.digest,
                inputs_used=_kept_inputs(kept, j.x),
            )
            for j in group
        ]
        train_exact(group[0].model, models, optimizer="adam", lr=config.lr, stacked=stacked)
        if not digest:  # the array is kept too: its id stays its own while it is here
            for j, m in zip(group, models):
                if m.inputs_used is not None:
                    kept[id(j.x)] = (j.x, m.inputs_used)


def _kept_inputs(kept: dict[int, tuple], x) -> torch.Tensor | None:
    """The inputs ``x``'s records use, where :func:`run_jobs` has kept them for this array."""
    entry = kept.get(id(x))
    return entry[1] if entry is not None and entry[0] is x else None


def stacked_party_logits(
    models: Sequence, x: np.ndarray, kinds: Architectures | None = None
) -> list[np.ndarray]:
    """Every party's logits on ``x`` (:data:`~privkit.trainers.fedmd.PartyLogits`), the parties of
    one architecture in one stacked forward pass (:func:`~privkit.batched.exact_mlp.
    stacked_logits`; equal to their own up to float rounding; it reads their parameters only);
    an architecture that is not a privkit MLP runs each model's own forward pass on its own
    device, its training mode restored after (``torch_logits``: the models are left as they were,
    which :func:`~privkit.audit.instantiations.soft_label_artifacts` needs of the released
    models it is given; the same logits as ``predict_logits``, float32 as it gives them).
    ``kinds``: the models' architectures, where the caller keeps them (:class:`Architectures`)."""
    from attacks.recipe import torch_logits

    kinds = Architectures() if kinds is None else kinds
    device = next(models[0].parameters()).device
    out: list[np.ndarray | None] = [None] * len(models)
    groups: dict[tuple, list[int]] = {}
    for p, m in enumerate(models):
        arch = kinds.of(m)
        if arch is not None:
            groups.setdefault(arch, []).append(p)
        else:
            out[p] = torch_logits(m, x).astype(np.float32)
    inputs = Inputs.of(x, device) if groups else None  # narrowed once for every architecture
    for members in groups.values():
        for p, row in zip(members, stacked_logits([models[p] for p in members], inputs, device)):
            out[p] = row.numpy()
    return [cast(np.ndarray, o) for o in out]


def record(runs: list[FedMDRun], stacked: list[bool], kinds: Architectures | None = None) -> None:
    """Each run's :meth:`FedMDRun.record`, the runs ``stacked`` marks (an audit's reference runs)
    after their last round only (their per-round accuracies are read by nothing; the audit
    reports each reference run's final one) and with their parties evaluated together, grouped
    by architecture and test set, where they are privkit MLPs (``kinds``: their architectures,
    where the caller keeps them)."""
    kinds = Architectures() if kinds is None else kinds
    groups: dict[tuple, list[tuple[int, int]]] = {}
    tests: list[int] = []  # a run per distinct test set (each run holds its own copy)
    for i, (run, fast) in enumerate(zip(runs, stacked)):
        if fast and run.t < run.config.rounds:
            continue
        if not (fast and all(kinds.of(m) is not None for m in run.models)):
            run.record()
            continue
        same = (j for j in tests if _same_test_set(runs[j], run))
        test = next(same, None)
        if test is None:
            tests.append(test := i)
        for p, m in enumerate(run.models):
            groups.setdefault((kinds.of(m), test), []).append((i, p))
    accs: dict[int, list[float]] = {}
    inputs: dict[int, Inputs] = {}  # each test set narrowed once for every architecture
    for (_, test), members in groups.items():
        run0 = runs[members[0][0]]
        models = [runs[i].models[p] for i, p in members]
        if test not in inputs:
            inputs[test] = Inputs.of(run0.xt, run0.device)
        hits = stacked_logits(models, inputs[test], run0.device).argmax(-1).numpy() == run0.yt
        for (i, p), row in zip(members, hits):
            accs.setdefault(i, [0.0] * len(runs[i].models))[p] = (
                float(row.mean()) if len(run0.yt) else float("nan")
            )
    for i, a in accs.items():
        runs[i].record(a)


def _same_test_set(a: FedMDRun, b: FedMDRun) -> bool:
    return a.xt.shape == b.xt.shape and np.array_equal(a.xt, b.xt) and np.array_equal(a.yt, b.yt)


def train_fedmd_many(
    method: str, federations: list, configs: list, seeds: list[int], fast: list[bool] | None = None
) -> list:
    """``train(method, federations[j], configs[j], seeds[j])`` for every j (``fedmd-nfdp``,
    ``fedmd-np``, ``fedmd-ldp``), each phase's party jobs of all runs trained together (the
    configs are equal but for ``reproducible_noise``, which only the runs' own draws read; the
    jobs of the runs ``fast`` marks with the stacked kernels)."""
    runs = [
        FedMDRun(f, c, s, method.removeprefix("fedmd-"), pretrain=False)
        for f, c, s in zip(federations, configs, seeds)
    ]
    config, device = configs[0], runs[0].device
    quick = [bool(f) for f in fast] if fast is not None else [False] * len(runs)

    kept: dict[int, tuple] = {}  # the inputs each party's records use, from phase to phase
    kinds = Architectures()  # the party models' architectures, from phase to phase
    shared = partial(stacked_party_logits, kinds=kinds)

    def phase(per_run: dict[int, list[PartyJob]]) -> None:
        jobs = [j for i in per_run for j in per_run[i]]
        stacked = frozenset(id(j) for i in per_run if quick[i] for j in per_run[i])
        run_jobs(jobs, config, device, stacked, kept, kinds)

    # every run's pretraining together (on the public records only; a reference run's with the
    # stacked kernels, as its other phases), then each run's parties copy it
    phase({i: r.pretrain_jobs() for i, r in enumerate(runs)})
    for r in runs:
        r.start()
    phase({i: r.init_jobs() for i, r in enumerate(runs)})
    record(runs, quick, kinds)
    while True:
        digests = [r.next_round(shared if q else None) for r, q in zip(runs, quick)]
        going = [i for i, d in enumerate(digests) if d is not None]
        if not going:
            break
        phase({i: digests[i] for i in going})  # type: ignore[misc]  # going: not None
        phase({i: runs[i].revisit_jobs() for i in going})
        record([runs[i] for i in going], [quick[i] for i in going], kinds)
    return [r.result() for r in runs]


__all__ = ["Architectures", "record", "run_jobs", "stacked_party_logits", "train_fedmd_many"]
