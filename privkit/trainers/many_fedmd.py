"""FedMD-NFDP, FedMD-NP and FedMD-LDP runs batched (:mod:`privkit.trainers.many`).

Each run is a :class:`~privkit.trainers.fedmd.FedMDRun` (the single run's own object: pretraining,
private subsets, the ledger, knowledge sharing with its noise, evaluation). Its phases (the
initialisation, then per round the digests and the revisits) are lists of independent party
jobs; the jobs of all runs' current phase train together, grouped by party architecture, each
exactly as the single run trains it (:mod:`privkit.trainers.exact_mlp`: FedMD trains with Adam).
A digest towards shared logits (``knowledge="logits"``, an L1 regression) trains one job at a time.
"""

from __future__ import annotations

from privkit.trainers.exact_mlp import architecture, mlp_layers, model_for, train_exact
from privkit.trainers.fedmd import FedMDRun, PartyJob
from privkit.trainers.stacked import UnsupportedModelError


def run_jobs(jobs: list[PartyJob], config, device) -> None:
    """Train every job (in place on its party's model) as :meth:`PartyJob.run` would."""
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
        groups.setdefault((architecture(job.model), job.digest), []).append(job)
    for group in groups.values():
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
        train_exact(group[0].model, models, optimizer="adam", lr=config.lr)


def train_fedmd_many(method: str, federations: list, configs: list, seeds: list[int]) -> list:
    """``train(method, federations[j], configs[j], seeds[j])`` for every j (``fedmd-nfdp``,
    ``fedmd-np``, ``fedmd-ldp``), each phase's party jobs of all runs trained together (the
    configs are equal but for ``reproducible_noise``, which only the runs' own draws read)."""
    runs = [
        FedMDRun(f, c, s, method.removeprefix("fedmd-"))
        for f, c, s in zip(federations, configs, seeds)
    ]
    config = configs[0]
    device = runs[0].device
    run_jobs([j for r in runs for j in r.init_jobs()], config, device)
    for r in runs:
        r.record()
    while True:
        digests = [r.next_round() for r in runs]
        going = [i for i, d in enumerate(digests) if d is not None]
        if not going:
            break
        run_jobs([j for i in going for j in digests[i]], config, device)  # type: ignore[union-attr]  # going: not None
        run_jobs([j for i in going for j in runs[i].revisit_jobs()], config, device)
        for i in going:
            runs[i].record()
    return [r.result() for r in runs]


__all__ = ["run_jobs", "train_fedmd_many"]
