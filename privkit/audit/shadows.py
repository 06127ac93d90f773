"""Shadow and reference models made by re-running the *same trainer recipe* on shadow federations.

Membership design as in LiRA: a universe of N examples the target did not necessarily see and a
saved (M x N) boolean mask, each example IN for exactly half of the M models. Shadow j's private
data is ``universe[mask[j]]`` re-partitioned among the same number of clients with the target's
partition scheme (:meth:`privkit.data.Federation.with_clients`); it is trained by
``privkit.trainers.train`` with the target's method and trainer config. Every shadow run is an
independent task with its own seeds (:func:`privkit.seeding.child_seeds`), so the results do not
depend on the executor that runs them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from attacks.executor import get_executor
from attacks.experiment import membership_mask
from privkit.data import Federation
from privkit.data.partition import dirichlet_partition, iid_partition, shard_partition
from privkit.seeding import child_seeds, make_rng


def repartition(federation: Federation, indices: np.ndarray, seed: int) -> list[np.ndarray]:
    """Split ``indices`` (into ``federation.private``) among the federation's number of clients
    with its partition scheme, seeded by ``seed``."""
    cfg = federation.config
    idx = np.asarray(indices, dtype=np.int64)
    rng = make_rng(seed, "shadow-partition")
    n = federation.num_clients
    if cfg.partition == "dirichlet":
        local = dirichlet_partition(federation.private.y[idx], n, cfg.alpha, rng, federation.num_classes)
    elif cfg.partition == "iid":
        local = iid_partition(idx.size, n, rng)
    else:
        local = shard_partition(federation.private.y[idx], n, cfg.shards_per_client, rng)
    return [idx[ix] for ix in local]


@dataclass(frozen=True)
class ShadowTask:
    """One training run of the recipe on given client data (picklable; executor-independent)."""

    method: str
    trainer_config: dict
    federation: str  # Federation.to_dict() as JSON (the data is reloaded from its config)
    clients: tuple
    query: np.ndarray
    seed: int
    name: str
    keep_artifacts: bool = False


@lru_cache(maxsize=4)
def _base_federation(fed_json: str) -> Federation:
    return Federation.from_dict(json.loads(fed_json))


def run_shadow_task(task: ShadowTask) -> dict:
    """Train one shadow model; return its logits on the query points (and artifacts if asked)."""
    from attacks.recipe import torch_logits
    from privkit.trainers import train

    base = _base_federation(task.federation)
    fed = base.with_clients([np.asarray(c, dtype=np.int64) for c in task.clients], task.name)
    result = train(task.method, fed, task.trainer_config, seed=task.seed)
    logits = torch_logits(result.model, fed.private.x[task.query]).astype(np.float32)
    out = {"logits": logits, "test_accuracy": float(result.test_accuracy)}
    if task.keep_artifacts:
        from privkit.audit.instantiations import soft_label_artifacts

        arts = {k: np.asarray(v) for k, v in result.artifacts.items()}
        arts.update(soft_label_artifacts(result.client_models, fed))
        out["artifacts"] = arts
        out["class_counts"] = fed.client_class_counts()
    return out


def federation_json(federation: Federation) -> str:
    """The federation as JSON with empty client lists (shadow tasks carry their own clients)."""
    d = federation.to_dict()
    d["clients"] = []
    return json.dumps(d)


@dataclass
class ShadowSet:
    """Shadow models' outputs on the universe and the membership design that produced them."""

    universe: np.ndarray
    mask: np.ndarray
    logits: np.ndarray
    seeds: list[int]
    test_accuracy: list[float]
    artifacts: list[dict] = field(default_factory=list)
    class_counts: list[np.ndarray] = field(default_factory=list)

    def save(self, path: str | Path) -> None:
        """Save the design (universe, mask, seeds) and the logits to one ``.npz``."""
        np.savez_compressed(path, universe=self.universe, mask=self.mask, logits=self.logits,
                            seeds=np.asarray(self.seeds, dtype=np.int64),
                            test_accuracy=np.asarray(self.test_accuracy))


def train_shadows(federation: Federation, method: str, trainer_config: dict, universe: np.ndarray,
                  *, n_models: int, seed: int = 0, executor: str = "serial", workers: int | None = None,
                  progress: bool = False, keep_artifacts: bool = False,
                  query: np.ndarray | None = None) -> ShadowSet:
    """Train ``n_models`` shadows of the recipe on halves of ``universe`` (LiRA design).

    Parameters
    ----------
    federation : the target's federation (public data, test set and client count are reused).
    method, trainer_config : the target's recipe.
    universe : indices into ``federation.private`` the shadows draw their private data from.
    n_models : M (even); each universe example is IN for exactly M/2 shadows.
    seed : root seed (mask, partitions, trainer seeds).
    executor, workers : ``serial``, ``process`` or ``ray``.
    query : points whose logits each shadow returns (default: the universe).
    """
    universe = np.asarray(universe, dtype=np.int64)
    mask = membership_mask(n_models, universe.size, seed)
    part_seeds = child_seeds(seed, n_models, "shadow-partition")
    train_seeds = child_seeds(seed, n_models, "shadow-train")
    fed_json = federation_json(federation)
    q = universe if query is None else np.asarray(query, dtype=np.int64)
    tasks = [ShadowTask(method=method, trainer_config=dict(trainer_config), federation=fed_json,
                        clients=tuple(repartition(federation, universe[mask[j]], part_seeds[j])),
                        query=q, seed=train_seeds[j], name=f"shadow-{j}", keep_artifacts=keep_artifacts)
             for j in range(n_models)]
    outs = get_executor(executor, workers).map(run_shadow_task, tasks, progress=progress,
                                                description=f"shadow models ({method})")
    return ShadowSet(universe=universe, mask=mask, logits=np.stack([o["logits"] for o in outs]),
                     seeds=train_seeds, test_accuracy=[o["test_accuracy"] for o in outs],
                     artifacts=[o.get("artifacts", {}) for o in outs],
                     class_counts=[o.get("class_counts") for o in outs])


def canary_task(federation: Federation, method: str, trainer_config: dict, canaries: np.ndarray,
                included: np.ndarray, *, seed: int) -> ShadowTask:
    """A run of the recipe on the target's clients plus the included canaries (one-run audit).

    Each included canary is added to one client drawn uniformly at random (seeded).
    """
    rng = make_rng(seed, "canary-clients")
    clients = [list(c) for c in federation.clients]
    for c in np.asarray(canaries)[np.asarray(included, dtype=bool)]:
        clients[int(rng.integers(len(clients)))].append(int(c))
    return ShadowTask(method=method, trainer_config=dict(trainer_config),
                      federation=federation_json(federation),
                      clients=tuple(np.sort(np.asarray(c, dtype=np.int64)) for c in clients),
                      query=np.asarray(canaries, dtype=np.int64), seed=derive_seed_int(seed),
                      name="canary-run")


def derive_seed_int(seed: int) -> int:
    from privkit.seeding import derive_seed

    return derive_seed(seed, "canary-train")
