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
from privkit.batched.stacked_local import stacked_form, stacked_logits_on, train_stacked
from privkit.mechanisms.stacked import UnsupportedModelError
from privkit.trainers.fedmd import FedMDRun, PartyJob


class Architectures:
    """Each party model's kind for the stacked kernels, found once per model for a whole batched
    training: a privkit MLP's :func:`~privkit.batched.exact_mlp.architecture` (:meth:`of`), or
    for a model :func:`~privkit.batched.stacked_local.stacked_form` covers (FedMD's default CNN
    parties) its parameters' names and shapes (:meth:`form`). Its parties are the same modules
    from phase to phase, whose layers and trainable flags FedMD never changes; the checks walked
    every party's parameters again at every phase (about 0.3 s of a FedMD audit's 8.5). Kept by
    ``id`` with the module held, so that no id is reused while it is here."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[torch.nn.Module, tuple | None]] = {}

    def form(self, model: torch.nn.Module) -> tuple | None:
        """``("mlp", architecture)``, ``("stacked", class name, architecture)`` or None (the
        model trains and runs on its own): models of one form train and run together."""
        entry = self._seen.get(id(model))
        if entry is None or entry[0] is not model:
            entry = (model, _form(model))
            self._seen[id(model)] = entry
        return entry[1]

    def of(self, model: torch.nn.Module) -> tuple | None:
        """The model's architecture where it is a privkit MLP, else None."""
        form = self.form(model)
        return form[1] if form is not None and form[0] == "mlp" else None


def _form(model: torch.nn.Module) -> tuple | None:
    try:
        mlp_layers(model)
        return ("mlp", architecture(model))
    except UnsupportedModelError:
        pass
    try:
        stacked_form(model, 1)
    except UnsupportedModelError:
        return None
    return ("stacked", type(model).__qualname__, architecture(model))


def run_jobs(
    jobs: list[PartyJob],
    config,
    device,
    fast: frozenset[int] = frozenset(),
    kept: dict[int, tuple] | None = None,
    kinds: Architectures | None = None,
    buffers: dict[tuple, dict] | None = None,
) -> None:
    """Train every job (in place on its party's model) as :meth:`PartyJob.run` would; the jobs
    whose ``id`` is in ``fast`` with the stacked kernels: a privkit MLP's (``train_exact(...,
    stacked=True)``), a CNN's (:func:`~privkit.batched.stacked_local.train_stacked`; outside
    ``fast`` a CNN party trains on its own). ``kept``: the inputs each party's own
    records use (:attr:`~privkit.batched.exact_mlp.Model.inputs_used`) by the array's ``id``,
    kept from phase to phase (a party trains on the same array in its initialisation and every
    revisit; a digest's public subset is new each round and is not kept). ``kinds``: the party
    models' architectures, kept from phase to phase (default: found for this call). ``buffers``:
    each architecture's stacked-kernel buffers (:mod:`privkit.batched.buffers`), kept from phase
    to phase (default: made for this call)."""
    kept = {} if kept is None else kept
    kinds = Architectures() if kinds is None else kinds
    buffers = {} if buffers is None else buffers
    groups: dict[tuple, list[PartyJob]] = {}
    for job in jobs:
        if (
            job.epochs == 0 or len(job.x) == 0
        ):  # revisit / digest / train_supervised leave these alone
            continue
        form = kinds.form(job.model)
        # a CNN party trains stacked only in an audit's reference runs (float rounding apart
        # from its own training, as the MLPs' stacked kernels); a digest towards shared logits
        # (an L1 regression) has no stacked kernel
        alone = form is None or (form[0] == "stacked" and id(job) not in fast)
        if alone or (job.digest and config.knowledge == "logits"):
            job.run(config, device)
            continue
        key = (form, job.digest, id(job) in fast)
        groups.setdefault(key, []).append(job)
    for (form, digest, stacked), group in groups.items():
        mlp = form[0] == "mlp"
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
                inputs_used=_kept_inputs(kept, j.x) if mlp else None,
            )
            for j in group
        ]
        # one architecture's digests and revisits take turns: they share its buffers
        scratch = buffers.setdefault(form, {})
        if not mlp:
            train_stacked(group[0].model, models, optimizer="adam", lr=config.lr, scratch=scratch)
            continue
        train_exact(
            group[0].model, models, optimizer="adam", lr=config.lr, stacked=stacked, scratch=scratch
        )
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
    one architecture in one stacked forward pass (privkit MLPs: :func:`~privkit.batched.exact_mlp.
    stacked_logits`, CNNs: :func:`~privkit.batched.stacked_local.stacked_logits_on`; equal to
    their own up to float rounding; it reads their parameters only); an architecture neither
    covers runs each model's own forward pass on its own device, its training mode restored
    after (``torch_logits``: the models are left as they were, which
    :func:`~privkit.audit.instantiations.soft_label_artifacts` needs of the released models it
    is given; the same logits as ``predict_logits``, float32 as it gives them).
    ``kinds``: the models' architectures, where the caller keeps them (:class:`Architectures`)."""
    from attacks.recipe import torch_logits

    kinds = Architectures() if kinds is None else kinds
    device = next(models[0].parameters()).device
    out: list[np.ndarray | None] = [None] * len(models)
    groups: dict[tuple, list[int]] = {}
    for p, m in enumerate(models):
        form = kinds.form(m)
        if form is not None and (form[0] == "mlp" or len(x)):  # no stacked CNN pass on no records
            groups.setdefault(form, []).append(p)
        else:
            out[p] = torch_logits(m, x).astype(np.float32)
    mlps = any(form[0] == "mlp" for form in groups)
    inputs = Inputs.of(x, device) if mlps else None  # narrowed once for every architecture
    for form, members in groups.items():
        chosen = [models[p] for p in members]
        rows = (
            stacked_logits(chosen, inputs, device).numpy()
            if form[0] == "mlp"
            else stacked_logits_on(chosen, x, device)
        )
        for p, row in zip(members, rows):
            out[p] = row
    return [cast(np.ndarray, o) for o in out]


def record(runs: list[FedMDRun], stacked: list[bool], kinds: Architectures | None = None) -> None:
    """Each run's :meth:`FedMDRun.record`, the runs ``stacked`` marks (an audit's reference runs)
    after their last round only (their per-round accuracies are read by nothing; the audit
    reports each reference run's final one) and with their parties evaluated together, grouped
    by architecture and test set, where the stacked passes cover them (privkit MLPs, CNNs on a
    test set that is not empty; ``kinds``: their architectures, where the caller keeps them)."""
    kinds = Architectures() if kinds is None else kinds
    groups: dict[tuple, list[tuple[int, int]]] = {}
    tests: list[int] = []  # a run per distinct test set (each run holds its own copy)
    for i, (run, fast) in enumerate(zip(runs, stacked)):
        if fast and run.t < run.config.rounds:
            continue
        forms = [kinds.form(m) for m in run.models]
        covered = all(f is not None and (f[0] == "mlp" or len(run.yt)) for f in forms)
        if not (fast and covered):
            run.record()
            continue
        same = (j for j in tests if _same_test_set(runs[j], run))
        test = next(same, None)
        if test is None:
            tests.append(test := i)
        for p, form in enumerate(forms):
            groups.setdefault((form, test), []).append((i, p))
    accs: dict[int, list[float]] = {}
    inputs: dict[int, Inputs] = {}  # each test set narrowed once for every architecture
    for (form, test), members in groups.items():
        run0 = runs[members[0][0]]
        models = [runs[i].models[p] for i, p in members]
        if form[0] != "mlp":
            logits = stacked_logits_on(models, run0.xt, run0.device)
        else:
            if test not in inputs:
                inputs[test] = Inputs.of(run0.xt, run0.device)
            logits = stacked_logits(models, inputs[test], run0.device).numpy()
        hits = logits.argmax(-1) == run0.yt
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
    buffers: dict[tuple, dict] = {}  # the stacked kernels' buffers, from phase to phase
    shared = partial(stacked_party_logits, kinds=kinds)

    def phase(per_run: dict[int, list[PartyJob]]) -> None:
        jobs = [j for i in per_run for j in per_run[i]]
        stacked = frozenset(id(j) for i in per_run if quick[i] for j in per_run[i])
        run_jobs(jobs, config, device, stacked, kept, kinds, buffers)

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
