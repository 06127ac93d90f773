"""FedMD-NFDP, FedMD-NP and FedMD-LDP runs batched (:mod:`privkit.batched.many`).

Each run is a :class:`~privkit.trainers.fedmd.FedMDRun` (the single run's own object: private
subsets, the ledger, knowledge sharing with its noise, evaluation). Its phases (the pretraining,
the initialisation, then per round the digests and the revisits) are lists of independent party
jobs; the jobs of all runs' current phase train together, grouped by party architecture, each
exactly as the single run trains it (:mod:`privkit.batched.exact_mlp`: FedMD trains with Adam).
A digest towards shared logits (``knowledge="logits"``, an L1 regression) trains one job at a time.
The jobs of an audit's reference runs (``fast``), their pretraining excepted, train with the
stacked kernels (``train_exact(..., stacked=True)``: equal up to float rounding).
"""

from __future__ import annotations

from privkit.batched.exact_mlp import architecture, mlp_layers, model_for, train_exact
from privkit.mechanisms.stacked import UnsupportedModelError
from privkit.trainers.fedmd import FedMDRun, PartyJob


def run_jobs(jobs: list[PartyJob], config, device, fast: frozenset[int] = frozenset()) -> None:
    """Train every job (in place on its party's model) as :meth:`PartyJob.run` would; the jobs
    whose ``id`` is in ``fast`` with the stacked kernels."""
    groups: dict[tuple, list[PartyJob]] = {}
    for job in jobs:
        if (
            job.epochs == 0 or len(job.x) == 0
        ):  # revisit / digest / train_supervised leave these alone
            continue
        try:
            mlp_layers(job.model)
        except UnsupportedModelError:
            job.run(config, device)
            continue
        if job.digest and config.knowledge == "logits":
            job.run(config, device)
            continue
        key = (architecture(job.model), job.digest, id(job) in fast)
        groups.setdefault(key, []).append(job)
    for (_, _, stacked), group in groups.items():
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
            )
            for j in group
        ]
        train_exact(group[0].model, models, optimizer="adam", lr=config.lr, stacked=stacked)


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
    # every run's pretraining together, with the single run's kernels (the reference runs' too:
    # it is each run's own pretraining, bit for bit), then each run's parties copy it
    run_jobs([j for r in runs for j in r.pretrain_jobs()], config, device)
    for r in runs:
        r.start()
    quick = [bool(f) for f in fast] if fast is not None else [False] * len(runs)

    def phase(per_run: dict[int, list[PartyJob]]) -> None:
        jobs = [j for i in per_run for j in per_run[i]]
        stacked = frozenset(id(j) for i in per_run if quick[i] for j in per_run[i])
        run_jobs(jobs, config, device, stacked)

    phase({i: r.init_jobs() for i, r in enumerate(runs)})
    for r in runs:
        r.record()
    while True:
        digests = [r.next_round() for r in runs]
        going = [i for i, d in enumerate(digests) if d is not None]
        if not going:
            break
        phase({i: digests[i] for i in going})  # type: ignore[misc]  # going: not None
        phase({i: runs[i].revisit_jobs() for i in going})
        for i in going:
            runs[i].record()
    return [r.result() for r in runs]


__all__ = ["run_jobs", "train_fedmd_many"]
