"""Audit a model that was already trained: the same attacks, bounds and verdict as a recipe audit.

The auditor holds the model, the records it was trained on (members) and records from the same
distribution it never saw (non-members). The loss-threshold attack needs nothing else; the
shadow-model, LiRA and RMIA attacks (:mod:`attacks.family`) need reference models trained the way
the target was: given the training recipe
(:mod:`attacks.recipe`), reference models are trained on halves of the audited records, each
record in exactly half of them (on the recipe's batched form when it has one).

Members and non-members chosen by the user were not included by a fair coin: the bounds assume
they were (see ``assumptions``). :func:`attacks.audit_recipe` draws the coins itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attacks.audit_scores import INCLUSION
from attacks.entry import AttackScores, analyse
from attacks.experiment import membership_mask, stream_seeds, train_models
from attacks.family import Options, Outputs, applicable, score
from attacks.recipe import as_recipe, predict_logits


def audit_model(
    model: Any,
    x_members: np.ndarray,
    y_members: np.ndarray,
    x_nonmembers: np.ndarray,
    y_nonmembers: np.ndarray,
    *,
    recipe: Any = None,
    n_reference: int = 8,
    accounted_epsilon: float | None = None,
    delta: float = 1e-5,
    alpha: float = 0.05,
    guess_fraction: float = 0.1,
    seed: int = 0,
    inclusion: str = "unverified",
    executor: Any = None,
    progress: bool = False,
    shadow_iterations: int = 200,
) -> dict:
    """Membership-inference audit of ``model`` with an empirical epsilon lower bound per attack.

    Parameters
    ----------
    model : the released model: scikit-learn classifier, torch module (logits) or callable
        (probabilities); see :func:`attacks.recipe.predict_logits`.
    x_members, y_members : records the model was trained on.
    x_nonmembers, y_nonmembers : records it never saw, from the same distribution.
    recipe : how the model was trained (``train_fn(x, y, seed) -> model`` or an
        :class:`attacks.Recipe`); given, the shadow-model, LiRA and RMIA attacks run with
        ``n_reference`` reference models trained on halves of the audited records.
    accounted_epsilon : the epsilon the training claims at ``delta``; the verdict compares the
        family-wise lower bound with it (``None``: no formal claim to check).
    delta, alpha : delta of the bounds; 1 - confidence of the verdict's bound for the whole family
        of attacks (Bonferroni) and of each attack's own bound.
    guess_fraction : the one-run audit guesses on the top and bottom ``guess_fraction`` of scores,
        fixed before looking at membership.
    seed : audit seed (reference models' halves, the seeds handed to the recipe, random tie-break
        of the guesses).
    inclusion : ``"random"`` if each audited record was put in the training data by an independent
        fair coin (the one-run theorem's premise); ``"unverified"`` (default) otherwise: the result
        then notes that the bound assumes random inclusion, not verified.
    executor, progress : where reference models train (:func:`attacks.executor.get_executor`);
        progress bar.
    shadow_iterations : CatBoost iterations of the shadow-model attack (with a recipe).

    Returns
    -------
    dict with ``attacks`` (name -> the same record as in audit.json), ``accounted_epsilon``,
    ``delta``, ``verdict`` and ``assumptions``.
    """
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1); found {delta}")
    if inclusion not in INCLUSION:
        raise ValueError(f"inclusion must be one of {', '.join(INCLUSION)}; found {inclusion!r}")
    if n_reference < 2 or n_reference % 2:
        raise ValueError(f"n_reference must be an even number >= 2; found {n_reference}")
    x = np.concatenate([np.asarray(x_members), np.asarray(x_nonmembers)])
    labels = np.concatenate([np.asarray(y_members), np.asarray(y_nonmembers)]).astype(np.int64)
    member = np.r_[np.ones(len(x_members), bool), np.zeros(len(x_nonmembers), bool)]
    n_classes = int(labels.max()) + 1
    logits = predict_logits(model, x, n_classes)
    m_ref = n_reference if recipe is not None else 0
    keep = (
        membership_mask(n_reference, len(labels), seed)
        if m_ref
        else np.zeros((0, len(labels)), bool)
    )
    ref_logits = np.zeros((0, *logits.shape))
    if m_ref:
        ref_logits, _ = train_models(
            as_recipe(recipe),
            x,
            labels,
            [np.flatnonzero(k) for k in keep],
            stream_seeds(seed, n_reference, "reference-train"),
            n_classes=n_classes,
            executor=executor,
            progress=progress,
            description="reference models",
        )
    # the same family of attacks as a recipe audit: all that the reference models allow
    out = Outputs(target=logits, references=ref_logits, labels=labels, keep=keep)
    opts = Options(seed=seed, shadow_iterations=shadow_iterations)
    attacks: dict = {}
    for name in applicable(m_ref):
        scores, note = score(name, out, opts)
        attacks[name] = AttackScores(scores, member, note, inclusion=inclusion)
    ver = analyse(
        attacks,
        accounted=accounted_epsilon,
        delta=delta,
        alpha=alpha,
        seed=seed,
        guess_fraction=guess_fraction,
    )
    return {
        "schema_version": 1,
        "attacks": attacks,
        "accounted_epsilon": accounted_epsilon,
        "delta": delta,
        "verdict": ver,
        "assumptions": {
            "trials": "records scored in one trained model are not independent trials; bounds use the "
            "one-run theorem (Steinke, Nasr & Jagielski 2023), which assumes each audited record "
            f"was included by an independent fair coin (inclusion: {inclusion})",
            "reference_models": n_reference if recipe is not None else 0,
            "confidence": 1 - alpha,
        },
    }
