"""The audit experiment: which records each model trains on, and the training itself.

One pool of n records. The *audited* records are those whose membership the audit tests; every
other pool record is in every model's training data. The target includes each audited record by
an independent fair coin (the premise of the one-run theorem, Steinke, Nasr & Jagielski 2023);
reference (shadow) models each include exactly half of the audited records, every audited record
in exactly half of them (LiRA's design, Carlini et al. 2022). Target and references therefore
train on data of the same size, from the same pool, with the same recipe.

Randomness: every stream comes from ``numpy.random.SeedSequence([seed, purpose])``: the coins,
the reference mask and the seeds handed to the recipe are independent streams, so the recipe
cannot reproduce (or be correlated with) the coins whatever it does with its seed, and the
outcome does not depend on the executor that trains the models.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from attacks.checkpoints import ModelCheckpoints, fingerprint
from attacks.executor import get_executor
from attacks.recipe import Recipe, as_recipe


def _sequence(seed: int, purpose: str) -> np.random.SeedSequence:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer; found {seed!r}")
    return np.random.SeedSequence([int(seed), zlib.crc32(purpose.encode())])


def stream(seed: int, purpose: str) -> np.random.Generator:
    """The audit's random stream for ``purpose`` under ``seed``."""
    return np.random.default_rng(_sequence(seed, purpose))


def stream_seeds(seed: int, n: int, purpose: str) -> list[int]:
    """``n`` independent 32-bit seeds for ``purpose`` under ``seed`` (the i-th does not depend on n)."""
    return [int(c.generate_state(1)[0]) for c in _sequence(seed, purpose).spawn(n)]


def inclusion_coins(n: int, seed: int) -> np.ndarray:
    """(n,) independent fair coins from the audit's own stream: True = in the target's data."""
    return stream(seed, "inclusion").integers(0, 2, n).astype(bool)


def membership_mask(n_models: int, n_examples: int, seed: int) -> np.ndarray:
    """(M, N) bool mask, each column with exactly M/2 True entries (LiRA's ``keep``)."""
    if n_models < 2 or n_models % 2:
        raise ValueError(f"n_models must be an even number >= 2; found {n_models}")
    if n_examples < 1:
        raise ValueError(f"n_examples must be >= 1; found {n_examples}")
    return (
        np.argsort(stream(seed, "lira-mask").random((n_models, n_examples)), axis=0) < n_models // 2
    )


@dataclass(frozen=True)
class Design:
    """Which pool records each model of one audit experiment trains on.

    Attributes
    ----------
    seed : the audit seed every stream derives from.
    audited : (n,) bool, records whose inclusion is random (the others are in every model's data).
    included : (n,) bool, the target's training data.
    keep : (M, n) bool, reference model j's training data.
    target_seed, reference_seeds : the seeds handed to the recipe.
    """

    seed: int
    audited: np.ndarray
    included: np.ndarray
    keep: np.ndarray
    target_seed: int
    reference_seeds: tuple[int, ...]

    @property
    def n_references(self) -> int:
        return self.keep.shape[0]

    @property
    def is_member(self) -> np.ndarray:
        """The target's membership of the audited records (the coins), in pool order."""
        return self.included[self.audited]

    @property
    def reference_keep(self) -> np.ndarray:
        """(M, m) the references' membership of the audited records."""
        return self.keep[:, self.audited]

    def index_sets(self) -> list[np.ndarray]:
        """Training indices into the pool: the target's first, then each reference model's."""
        return [np.flatnonzero(self.included)] + [np.flatnonzero(k) for k in self.keep]

    def seeds(self) -> list[int]:
        return [self.target_seed, *self.reference_seeds]

    def summary(self) -> dict:
        """Sizes a reader needs to judge the experiment (JSON-ready)."""
        ref = self.keep.sum(1)
        m = int(self.audited.sum())
        return {
            "pool": int(self.audited.size),
            "audited": m,
            "always_in": int(self.audited.size - m),
            "audited_members": int(self.is_member.sum()),
            "target_train_size": int(self.included.sum()),
            "references": self.n_references,
            "reference_train_size": (
                {"min": int(ref.min()), "mean": float(ref.mean()), "max": int(ref.max())}
                if ref.size
                else None
            ),
            "inclusion": "independent fair coin per audited record (audit's own stream)",
            "references_design": "each audited record in exactly half of the reference models",
        }


def design_experiment(
    n: int, *, shadows: int, seed: int, audited: np.ndarray | None = None
) -> Design:
    """Draw the target's coins, the reference models' halves and the recipe's seeds.

    Parameters
    ----------
    n : pool size.
    shadows : number of reference models M (0, or an even number >= 2).
    seed : audit seed.
    audited : (n,) bool, which records are audited (default: all); the rest are always in.
    """
    if n < 1:
        raise ValueError(f"pool size must be >= 1; found {n}")
    if shadows < 0 or shadows % 2:
        raise ValueError(f"shadows must be 0 or an even number >= 2; found {shadows}")
    aud = np.ones(n, bool) if audited is None else np.asarray(audited, dtype=bool)
    if aud.shape != (n,):
        raise ValueError(f"audited must be a bool array of length {n}; found shape {aud.shape}")
    m = int(aud.sum())
    if m < 2:
        raise ValueError(f"at least 2 records must be audited; found {m}")
    included = ~aud | inclusion_coins(n, seed)
    keep = np.ones((shadows, n), bool)
    if shadows:
        keep[:, aud] = membership_mask(shadows, m, seed)
    return Design(
        seed=int(seed),
        audited=aud,
        included=included,
        keep=keep,
        target_seed=stream_seeds(seed, 1, "target-train")[0],
        reference_seeds=tuple(stream_seeds(seed, shadows, "reference-train")),
    )


# ---------------------------------------------------------------------------- training
@dataclass(frozen=True)
class TrainTask:
    """One model: the recipe on ``x[index]`` with ``seed``, queried on ``x[query]`` (picklable)."""

    recipe: Recipe
    x: Any
    y: np.ndarray
    index: np.ndarray
    seed: int
    query: np.ndarray
    n_classes: int


def run_train_task(task: TrainTask) -> dict:
    """Train one model; return its logits on the query records and the recipe's details."""
    model = task.recipe.fit(task.x[task.index], task.y[task.index], task.seed)
    return {
        "logits": task.recipe.logits(model, task.x[task.query], task.n_classes),
        "details": task.recipe.details(model),
    }


@dataclass(frozen=True)
class CheckpointedTask:
    """A :class:`TrainTask` whose output is stored as model ``j``'s checkpoint once trained."""

    task: TrainTask
    store: ModelCheckpoints
    j: int
    fingerprint: str


def run_checkpointed_task(ct: CheckpointedTask) -> dict:
    """Train one model, store its checkpoint (in the process that trained it), return its output."""
    out = run_train_task(ct.task)
    ct.store.save(ct.j, ct.fingerprint, out)
    return out


def _serial(executor: Any) -> bool:
    return executor is None or executor == "serial"


def train_models(
    recipe: Any,
    x: Any,
    y: np.ndarray,
    index_sets: Sequence[np.ndarray],
    seeds: Sequence[int],
    *,
    query: np.ndarray | None = None,
    n_classes: int | None = None,
    executor: Any = None,
    workers: int | None = None,
    progress: bool = False,
    description: str = "training models",
    checkpoints: ModelCheckpoints | None = None,
    say: Callable[[str], None] | None = None,
) -> tuple[np.ndarray, list[dict]]:
    """Train model j on ``x[index_sets[j]]`` with ``seeds[j]``; logits on ``x[query]``.

    A recipe with a batched form trains all models at once when ``executor`` is serial; otherwise
    every model is one task on ``executor`` (``serial``, ``process``, ``ray`` or an executor
    object, :func:`attacks.executor.get_executor`), with identical results on each.

    With ``checkpoints`` (:class:`attacks.checkpoints.ModelCheckpoints`) each model's output is
    stored as soon as it is trained, and a model whose checkpoint is there, intact and made for
    the same task is loaded instead of trained: an audit killed midway, re-run, trains only the
    models it had not finished (``say`` names a corrupted checkpoint, which is retrained).

    Returns
    -------
    logits : (M, Q, C) float64; details : the recipe's details per model.
    """
    rec = as_recipe(recipe)
    y = np.asarray(y, dtype=np.int64)
    if len(index_sets) != len(seeds):
        raise ValueError(
            f"index_sets and seeds must be equally long; found {len(index_sets)} and {len(seeds)}"
        )
    q = np.arange(len(y)) if query is None else np.asarray(query, dtype=np.int64)
    c = int(y.max()) + 1 if n_classes is None else int(n_classes)
    index = [np.asarray(ix, dtype=np.int64) for ix in index_sets]
    outs: list[dict[str, Any] | None] = [None] * len(seeds)
    prints: list[str] = []
    if checkpoints is not None:
        prints = [
            fingerprint(checkpoints.key, str(rec.name), s, ix, q, c) for ix, s in zip(index, seeds)
        ]
        outs = [checkpoints.load(j, fp, say) for j, fp in enumerate(prints)]
    todo = [j for j, o in enumerate(outs) if o is None]
    if todo and rec.batched and _serial(executor):
        from attacks.progress import progress_bar

        with progress_bar(progress) as bar:
            tid = bar.add_task(f"{description} (batched)", total=len(todo))
            models = rec.fit_many(x, y, [index[j] for j in todo], [seeds[j] for j in todo])
            for j, mdl in zip(todo, models):
                out = {"logits": rec.logits(mdl, x[q], c), "details": rec.details(mdl)}
                if checkpoints is not None:
                    checkpoints.save(j, prints[j], out)
                outs[j] = out
            bar.advance(tid, len(todo))
    elif todo:
        tasks = [
            TrainTask(
                recipe=rec, x=x, y=y, index=index[j], seed=int(seeds[j]), query=q, n_classes=c
            )
            for j in todo
        ]
        if checkpoints is None:
            fresh = get_executor(executor, workers).map(
                run_train_task, tasks, progress=progress, description=description
            )
        else:
            fresh = get_executor(executor, workers).map(
                run_checkpointed_task,
                [CheckpointedTask(t, checkpoints, j, prints[j]) for t, j in zip(tasks, todo)],
                progress=progress,
                description=description,
            )
        for j, o in zip(todo, fresh):
            outs[j] = o
    done = [o for o in outs if o is not None]
    return np.stack([np.asarray(o["logits"], dtype=np.float64) for o in done]), [
        o["details"] for o in done
    ]
