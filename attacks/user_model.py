"""Audit a user's own PyTorch model: the same attacks, bounds and verdict as ``privkit audit``.

The auditor holds the model, the records it was trained on (members) and records from the same
distribution it never saw (non-members). The loss-threshold attack needs nothing else. LiRA needs
reference models trained the way the target was: when the target's architecture is a privkit spec
and its training a plain (DP-)SGD recipe, privkit trains them all at once on the vectorised path
(:mod:`privkit.trainers.batched_sgd`), each audited record IN for exactly half of them.
"""

from __future__ import annotations

import numpy as np
import torch

from attacks.audit import AttackScores, analyse
from attacks.audit_scores import INCLUSION
from attacks.mia import LiRA, ThresholdAttack
from attacks.target import Target
from privkit.models import select_device
from privkit.trainers.batched_sgd import SGDRecipe, reference_models


def audit_model(model: torch.nn.Module, x_members: np.ndarray, y_members: np.ndarray,
                x_nonmembers: np.ndarray, y_nonmembers: np.ndarray, *,
                model_spec: dict | None = None, recipe: SGDRecipe | None = None,
                n_reference: int = 8, accounted_epsilon: float | None = None, delta: float = 1e-5,
                alpha: float = 0.05, guess_fraction: float = 0.1, seed: int = 0,
                inclusion: str = "unverified", device: str = "auto") -> dict:
    """Membership-inference audit of ``model`` with an empirical epsilon lower bound per attack.

    Parameters
    ----------
    model : the released model (logits out).
    x_members, y_members : records the model was trained on.
    x_nonmembers, y_nonmembers : records it never saw, from the same distribution.
    model_spec, recipe : a privkit model spec (:func:`privkit.models.model_spec`) and the
        :class:`~privkit.trainers.batched_sgd.SGDRecipe` the target was trained with; given both, LiRA (online and
        offline) runs with ``n_reference`` reference models trained on halves of the audited records.
    accounted_epsilon : the epsilon the training claims at ``delta``; the verdict compares the
        family-wise lower bound with it (``None``: no formal claim to check).
    delta, alpha : delta of the bounds; 1 - confidence of the verdict's bound for the whole family
        of attacks (Bonferroni) and of each attack's own bound.
    guess_fraction : the one-run audit guesses on the top and bottom ``guess_fraction`` of scores,
        fixed before looking at membership.
    seed : audit seed (reference models, random tie-break of the guesses).
    inclusion : ``"random"`` if each audited record was put in the training data by an independent
        fair coin (the one-run theorem's premise); ``"unverified"`` (default) otherwise: the result
        then notes that the bound assumes random inclusion, not verified.

    Returns
    -------
    dict with ``attacks`` (name -> the same record as in audit.json), ``accounted_epsilon``,
    ``delta``, ``verdict`` and ``assumptions``.
    """
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1); found {delta}")
    if (model_spec is None) != (recipe is None):
        raise ValueError("model_spec and recipe go together (LiRA reference models need both); "
                         f"found model_spec={'set' if model_spec else None}, recipe={recipe}")
    if inclusion not in INCLUSION:
        raise ValueError(f"inclusion must be one of {', '.join(INCLUSION)}; found {inclusion!r}")
    if n_reference < 2 or n_reference % 2:
        raise ValueError(f"n_reference must be an even number >= 2; found {n_reference}")
    target = Target.from_arrays(model, x_members, y_members, x_nonmembers, y_nonmembers, device=device)
    logits, labels, member = target.logits(), target.y, target.membership
    attacks: dict = {"threshold": AttackScores(ThresholdAttack("loss").score_samples(logits, labels), member,
                                               "loss threshold (Yeom et al. 2018)", inclusion=inclusion)}
    if model_spec is not None:
        ref_logits, keep = reference_models(model_spec, target.x, labels, n_models=n_reference,
                                            recipe=recipe, seed=seed, device=select_device(device))
        for name, online in (("lira", True), ("lira-offline", False)):
            scores = LiRA(online=online, fix_variance=True).fit(ref_logits, labels, keep).score_samples(logits, labels)
            attacks[name] = AttackScores(
                scores, member, f"LiRA {'online' if online else 'offline'}, fixed variance, "
                f"{n_reference} reference models", inclusion=inclusion)
    ver = analyse(attacks, accounted=accounted_epsilon, delta=delta, alpha=alpha, seed=seed,
                  guess_fraction=guess_fraction)
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
            "reference_models": n_reference if model_spec is not None else 0,
            "confidence": 1 - alpha,
        },
    }
