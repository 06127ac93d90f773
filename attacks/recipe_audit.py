"""``audit_recipe``: audit a training recipe end to end, from one pool of records to a verdict.

The experiment (:mod:`attacks.experiment`): every record of the pool is audited. The target is
trained by the recipe on the records its fair coins include (about half the pool); each of the
``shadows`` reference models by the same recipe on a random half, every record in exactly half of
them. All models therefore see data of the same size from the same pool, and the target's
membership is the random inclusion the one-run theorem (Steinke, Nasr & Jagielski 2023) assumes.
The applicable attacks of :mod:`attacks.family` score the audited records and
:func:`attacks.audit_scores` turns the whole family into one verdict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from attacks.audit_scores import AuditResult, audit_scores
from attacks.checkpoints import ModelCheckpoints
from attacks.experiment import Design, design_experiment, train_models
from attacks.family import Options, Outputs, applicable, score
from attacks.progress import progress_bar
from attacks.recipe import as_recipe


@dataclass
class RecipeAudit(AuditResult):
    """:class:`attacks.AuditResult` of a recipe audit, plus how the experiment was run.

    ``experiment`` (JSON-ready, also in ``to_dict()``): pool and training-set sizes, the coins'
    balance, the models' accuracy on audited records they did not see. ``design``: the
    coins and masks themselves (not serialised).
    """

    experiment: dict = field(default_factory=dict)
    design: Design | None = field(default=None, repr=False)

    @classmethod
    def of(cls, result: AuditResult, experiment: dict, design: Design) -> RecipeAudit:
        base = {f.name: getattr(result, f.name) for f in fields(AuditResult)}
        return cls(**base, experiment=experiment, design=design)

    def to_dict(self, with_attacks: bool = True) -> dict:
        return {**super().to_dict(with_attacks), "experiment": self.experiment}


def _check(x: Any, y: np.ndarray, accounted_epsilon, delta: float, confidence: float) -> np.ndarray:
    y = np.asarray(y)
    if y.ndim != 1 or y.size < 4:
        raise ValueError(f"y must be a 1-D array of at least 4 labels; found shape {y.shape}")
    if not np.issubdtype(y.dtype, np.integer) or y.min() < 0:
        raise ValueError(
            f"y must hold integer class labels >= 0; found dtype {y.dtype}, min {y.min()}"
        )
    if len(x) != y.size:
        raise ValueError(f"x and y must have equal lengths; found {len(x)} and {y.size}")
    if not 0 <= delta < 1:
        raise ValueError(f"delta must be in [0, 1); found {delta}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1); found {confidence}")
    if accounted_epsilon is not None and not float(accounted_epsilon) >= 0:
        raise ValueError(
            f"accounted_epsilon must be >= 0 (or None for no claim); found {accounted_epsilon}"
        )
    return y.astype(np.int64)


def unseen_accuracy(logits: np.ndarray, labels: np.ndarray, trained_on: np.ndarray) -> float | None:
    """Accuracy of one model on the records it did not train on (None if it trained on all)."""
    out = ~np.asarray(trained_on, dtype=bool)
    if not out.any():
        return None
    return float((logits[out].argmax(-1) == labels[out]).mean())


def experiment_record(design: Design, logits: np.ndarray, labels: np.ndarray) -> dict:
    """The design's sizes plus the accuracy of the target and of the reference models (mean, range)
    on audited records each did not see: a reader can check that the references behave like the
    target. ``logits``: (1 + M, m, C), the target's first, on the audited records."""
    rec = design.summary()
    refs = [unseen_accuracy(z, labels, k) for z, k in zip(logits[1:], design.reference_keep)]
    seen = [a for a in refs if a is not None]
    rec.update(
        target_accuracy_unseen=unseen_accuracy(logits[0], labels, design.is_member),
        reference_accuracy_unseen=(
            {"mean": float(np.mean(seen)), "min": min(seen), "max": max(seen)} if seen else None
        ),
    )
    return rec


def audit_recipe(
    train_fn: Any,
    x: Any,
    y: np.ndarray,
    *,
    accounted_epsilon: float | None = None,
    delta: float,
    shadows: int = 16,
    confidence: float = 0.95,
    seed: int = 0,
    executor: Any = None,
    progress: bool = False,
    workers: int | None = None,
    attacks: list[str] | None = None,
    guesses: float = 0.1,
    shadow_iterations: int = 200,
    checkpoints: str | Path | ModelCheckpoints | None = None,
) -> RecipeAudit:
    """Audit a training recipe: fair-coin target, reference models, every applicable attack, verdict.

    Parameters
    ----------
    train_fn : ``train_fn(x, y, seed) -> model`` (scikit-learn classifier, torch module returning
        logits, or callable returning probabilities) or an :class:`attacks.Recipe` (e.g. with a
        batched form). Called on subsets of ``(x, y)`` the auditor chooses, with seeds it chooses.
    x, y : the pool: inputs (indexable by an integer array) and integer labels.
    accounted_epsilon : the epsilon the recipe claims at ``delta`` when trained on about half of
        the pool (``None``: no claim; the verdict is then ``no-claim``).
    delta : delta of the claim.
    shadows : reference models (0, or even >= 2; with 0 only the threshold attack applies).
    confidence : confidence of the verdict's bound for the whole family of attacks.
    seed : audit seed: the coins, the reference halves, the seeds handed to the recipe, the
        attacks' own randomness and the tie-break all derive from it (independent streams).
    executor, workers : where models train: ``None``/``"serial"``, ``"process"``, ``"ray"`` or an
        executor object (:func:`attacks.executor.get_executor`); same result on each.
    progress : show progress bars.
    attacks : a subset of :data:`attacks.family.ATTACKS` (default: every applicable one).
    guesses : the one-run guesses: k+ = k- = ``floor(guesses * m)``, fixed in advance.
    shadow_iterations : CatBoost iterations of the shadow-model attack.
    checkpoints : a folder (or :class:`attacks.checkpoints.ModelCheckpoints`) where each trained
        model is stored as soon as it finishes: the same audit, killed and re-run, trains only the
        models it had not finished, and ends with the same result.

    Returns
    -------
    RecipeAudit: the :func:`attacks.audit_scores` result (``verdict``, ``epsilon_lower_bound``,
    ``epsilon_ceiling``, ``detectable_epsilon``, ``attacks``, ``to_dict()``) with ``experiment``.
    """
    labels = _check(x, y, accounted_epsilon, delta, confidence)
    recipe = as_recipe(train_fn)
    names = applicable(shadows, attacks)
    design = design_experiment(labels.size, shadows=shadows, seed=seed)
    audited = np.flatnonzero(design.audited)
    logits, _ = train_models(
        recipe,
        x,
        labels,
        design.index_sets(),
        design.seeds(),
        query=audited,
        executor=executor,
        workers=workers,
        progress=progress,
        description=f"training target + {shadows} reference models",
        checkpoints=(
            checkpoints
            if checkpoints is None or isinstance(checkpoints, ModelCheckpoints)
            else ModelCheckpoints(Path(checkpoints))
        ),
    )
    out = Outputs(
        target=logits[0], references=logits[1:], labels=labels[audited], keep=design.reference_keep
    )
    opts = Options(seed=seed, shadow_iterations=shadow_iterations)
    scores, notes = {}, {}
    with progress_bar(progress) as bar:
        tid = bar.add_task("membership attacks", total=len(names))
        for name in names:
            scores[name], notes[name] = score(name, out, opts)
            bar.advance(tid)
    result = audit_scores(
        scores,
        design.is_member,
        accounted_epsilon=accounted_epsilon,
        delta=delta,
        confidence=confidence,
        seed=seed,
        guesses=guesses,
        inclusion="random",
        notes=notes,
    )
    exp = experiment_record(design, logits, out.labels)
    exp.update(
        recipe=recipe.name,
        batched=recipe.batched and executor in (None, "serial"),
        executor=executor or "serial"
        if isinstance(executor, (str, type(None)))
        else type(executor).__name__,
    )
    if accounted_epsilon is not None and math.isfinite(float(accounted_epsilon)):
        exp["claim"] = (
            f"accounted epsilon {float(accounted_epsilon):g} at delta {delta:g}, as stated by the caller"
        )
    return RecipeAudit.of(result, exp, design)
