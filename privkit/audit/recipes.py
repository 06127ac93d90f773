"""privkit's methods as audit recipes: ``train_fn(x, y, seed)`` runs a whole federation.

The audit layer (:mod:`attacks`) decides which records each audited run trains on; for a
federated method the recipe turns those records into a federation exactly like the released
one except for its private data: the same number of clients, the target's partition scheme
(re-drawn over the given records, seeded by the run's seed), the same public/auxiliary data and
test set, the same trainer config. Its "model" is the whole :class:`~privkit.trainers.TrainResult`,
so the auditor also gets each run's own ledger (its accounted epsilon) and shared artifacts.

A method with a batched form (its registry entry's ``batched``) trains all the audited runs
at once (:meth:`FederationRecipe.fit_many`, taken by :func:`attacks.experiment.train_models` on
the serial executor): every client of every run steps together, each with the streams and the
result it has when run alone.

Reference runs. With ``release_seeds`` (what :func:`privkit.audit.audit_run` passes: the audited
target run's seed) only the runs of those seeds train as the trainer config says, drawing the
release mechanism's randomness; every other run, a reference run the auditor trains for itself and
never releases, trains with ``reproducible_noise=True`` (the same Gaussian noise, Poisson sampling
and subsets drawn from fast seeded generators derived from the run's seed instead of the AES
stream and the exact grid) and, batched, with the stacked kernels where the method's batched form
would run Adam's exact per-model ones (:func:`privkit.batched.many.train_many`'s
``references``). docs/auditing-methods.md says why the audit's validity does not depend on either.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from attacks.recipe import Recipe, torch_logits
from privkit.data import ArrayDataset, Federation
from privkit.data.partition import dirichlet_partition, iid_partition, shard_partition
from privkit.seeding import derive_seed, make_rng

if TYPE_CHECKING:  # pragma: no cover
    from privkit.methods.contract import TrainResult


def partition_like(federation: Federation, y: np.ndarray, seed: int) -> list[np.ndarray]:
    """Split records with labels ``y`` among ``federation``'s number of clients with its partition
    scheme, seeded by ``seed``; returns index arrays into ``y``."""
    cfg = federation.config
    rng = make_rng(seed, "shadow-partition")
    n = federation.num_clients
    if cfg.partition == "dirichlet":
        return dirichlet_partition(y, n, cfg.alpha, rng, federation.num_classes)
    if cfg.partition == "iid":
        return iid_partition(len(y), n, rng)
    return shard_partition(y, n, cfg.shards_per_client, rng)


def _records_then_test(base: Federation, x: np.ndarray, y: np.ndarray, name: str) -> ArrayDataset:
    """A private dataset of the records ``x``, ``y`` followed by ``base``'s test records."""
    x_test, y_test = base.test_arrays()
    return ArrayDataset(
        name=f"{base.private.name}[{name}]",
        x=np.ascontiguousarray(np.concatenate([x, x_test]), dtype=np.float32),
        y=np.concatenate([np.asarray(y, dtype=np.int64), y_test]),
        num_classes=base.num_classes,
    )


def _on(base: Federation, private: ArrayDataset, clients: list, name: str) -> Federation:
    """``base``'s layout on ``private`` (:func:`_records_then_test`'s) with these clients: its
    test set the last records, no shadow pool."""
    n = len(private.y)
    return Federation(
        config=base.config,
        private=private,
        public=base.public,
        clients=[np.asarray(c, dtype=np.int64) for c in clients],
        test=np.arange(n - len(base.test), n, dtype=np.int64),
        shadow_pool=np.zeros(0, np.int64),
        distill=base.distill,
        negative=base.negative,
        name=name,
    )


def federation_over(
    base: Federation, x: np.ndarray, y: np.ndarray, seed: int, name: str = "audit-run"
) -> Federation:
    """``base`` with the given records as its clients' private data (partitioned like ``base``).

    The private dataset of the new federation is the given records followed by ``base``'s test
    records (so test accuracy is measured on the same test set); it has no shadow pool.
    """
    private = _records_then_test(base, x, y, name)
    return _on(base, private, partition_like(base, private.y[: len(y)], seed), name)


def federations_over(
    base: Federation, x: np.ndarray, y: np.ndarray, index_sets, seeds, name: str = "audit-run"
) -> list[Federation]:
    """``federation_over(base, x[ix], y[ix], seed)`` for each index set ``ix`` and seed, the
    federations sharing one private dataset: ``x`` and ``y`` followed by ``base``'s test records,
    each federation's clients index sets into it (its partition of ``ix``, mapped through ``ix``).
    Each client holds the same records in the same order as in :func:`federation_over`'s
    federation, so every run trains as on it; where :func:`federation_over` copies its records
    and the test set once per run (an audit's 17 runs: 17 fresh copies of the pool), this copies
    them once. Index sets must be increasing (then the clients' indices are sorted, as a
    federation's are, and the pooled records keep their order); any other set gets its own
    :func:`federation_over`."""
    private = _records_then_test(base, x, y, name)
    out = []
    for ix, seed in zip(index_sets, seeds):
        ix = np.asarray(ix, dtype=np.int64)
        if ix.size > 1 and not bool(np.all(np.diff(ix) > 0)):
            out.append(federation_over(base, x[ix], y[ix], seed, name))
        else:
            parts = partition_like(base, private.y[ix], seed)
            out.append(_on(base, private, [ix[c] for c in parts], name))
    return out


@lru_cache(maxsize=4)
def _base_federation(fed_json: str) -> Federation:
    return Federation.from_dict(json.loads(fed_json))


def federation_json(federation: Federation) -> str:
    """The federation as JSON without its client lists (the data reloads from its config)."""
    d = federation.to_dict()
    d["clients"] = [[] for _ in federation.clients]  # keeps the client count
    return json.dumps(d)


@dataclass
class AuditRun:
    """One run of a federation recipe: the trainer's result and the federation it ran on."""

    result: TrainResult
    federation: Federation


class FederationRecipe(Recipe):
    """A privkit method with its trainer config and federation layout, as an audit recipe.

    Each trained model is an :class:`AuditRun`; its details (returned from worker processes) hold
    the run's test accuracy, training-set size and ledger, and, with ``keep_artifacts``, what its
    clients shared.

    Parameters
    ----------
    federation : the released run's federation (public data, test set, client count, partition).
    method, trainer_config : the released run's method and full trainer config.
    keep_artifacts : each run's details carry its shared artifacts and class counts (attribute
        inference trains on them).
    engine : where each run trains, as the released run did: ``inprocess`` or ``flower`` (the
        method's Flower apps; :meth:`fit_many` then runs every audited run in one simulation).
    release_seeds : the seeds of the runs that train as ``trainer_config`` says (an audit's target
        run); every other run is a reference run (:meth:`reference`: seeded noise, stacked
        kernels). ``None`` (default): every run as ``trainer_config`` says.
    """

    def __init__(
        self,
        federation: Federation,
        method: str,
        trainer_config: dict,
        *,
        keep_artifacts: bool = False,
        engine: str = "inprocess",
        release_seeds: Collection[int] | None = None,
    ):
        on = "" if engine == "inprocess" else f", on {engine}"
        super().__init__(
            self, name=f"{method} (whole federation, {federation.num_clients} clients{on})"
        )
        self.federation_json = federation_json(federation)
        self.method = method
        self.trainer_config = dict(trainer_config)
        self.keep_artifacts = keep_artifacts
        self.engine = engine
        self.release_seeds = None if release_seeds is None else frozenset(map(int, release_seeds))

    @property
    def reference_noise(self) -> str:
        """How the runs not in ``release_seeds`` draw their noise: ``seeded`` or ``as configured``."""
        return "as configured" if self.release_seeds is None else "seeded"

    def reference(self, seed: int) -> bool:
        """Whether the run of ``seed`` is a reference run (seeded noise, stacked kernels): with
        ``release_seeds``, every run not in them."""
        return self.release_seeds is not None and int(seed) not in self.release_seeds

    def config_for(self, seed: int) -> dict:
        """The trainer config of the run of ``seed``: a reference run's with
        ``reproducible_noise``."""
        if not self.reference(seed):
            return dict(self.trainer_config)
        return {**self.trainer_config, "reproducible_noise": True}

    def __call__(self, x: np.ndarray, y: np.ndarray, seed: int) -> AuditRun:
        from privkit.flower_engine.engine import train

        fed = federation_over(_base_federation(self.federation_json), x, y, seed)
        return AuditRun(
            train(
                self.method,
                fed,
                self.config_for(seed),
                seed=derive_seed(seed, "audit-run-train"),
                engine=self.engine,
            ),
            fed,
        )

    @property
    def batched(self) -> bool:
        """Whether the method's runs train as one computation: batched (:mod:`privkit.batched.many`)
        or, on Flower, one simulation."""
        from privkit.batched.many import has_batched

        return self.engine == "flower" or has_batched(self.method)

    def fit_many(self, x: np.ndarray, y: np.ndarray, index_sets, seeds) -> list[AuditRun]:
        """Run j on ``x[index_sets[j]]`` with ``seeds[j]``, as :meth:`__call__` would, all at once."""
        from privkit.batched.many import train_many
        from privkit.flower_engine.engine import train_jobs_on_flower

        feds = federations_over(_base_federation(self.federation_json), x, y, index_sets, seeds)
        run_seeds = [derive_seed(s, "audit-run-train") for s in seeds]
        if self.engine == "flower":
            results = train_jobs_on_flower(
                [
                    (self.method, f, self.config_for(s), int(rs))
                    for f, s, rs in zip(feds, seeds, run_seeds)
                ]
            )
        else:
            results = train_many(
                self.method,
                feds,
                self.trainer_config,
                run_seeds,
                references=[self.reference(s) for s in seeds],
            )
        return [AuditRun(r, f) for r, f in zip(results, feds)]

    def logits(self, model: AuditRun, x: np.ndarray, n_classes: int | None = None) -> np.ndarray:
        return torch_logits(model.result.model, x)

    def details(self, model: AuditRun) -> dict:
        res, fed = model.result, model.federation
        # the run's own ledger: its accounted epsilon is what an audit of this run is checked against
        out: dict = {
            "test_accuracy": float(res.test_accuracy),
            "train_size": int(fed.members.size),
            "ledger": res.ledger,
        }
        if self.keep_artifacts:
            from privkit.audit.instantiations import soft_label_artifacts

            arts = {k: np.asarray(v) for k, v in res.artifacts.items()}
            arts.update(soft_label_artifacts(res.client_models, fed))
            out["artifacts"] = arts
            out["class_counts"] = fed.client_class_counts()
        return out
