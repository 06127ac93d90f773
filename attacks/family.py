"""The family of membership attacks an audit experiment runs on the audited records.

Every attack turns the target's outputs (and the reference models', with their membership) into
one score per audited record, higher = more likely a member; none ever sees the target's coins.
Which attacks apply depends on the reference models available: ``threshold`` needs none, the
others need at least two. The scores of the whole family go to :func:`attacks.audit_scores`
together, so the verdict holds at one confidence for all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from attacks.mia import LiRA, ShadowModelAttack, ThresholdAttack
from attacks.rmia import RMIA


@dataclass(frozen=True)
class Outputs:
    """Model outputs on the m audited records.

    Attributes
    ----------
    target : (m, C) the target's logits.
    references : (M, m, C) the reference models' logits.
    labels : (m,) true labels.
    keep : (M, m) True where the record was in that reference model's training data.
    """

    target: np.ndarray
    references: np.ndarray
    labels: np.ndarray
    keep: np.ndarray

    @property
    def n_references(self) -> int:
        return self.references.shape[0]


@dataclass(frozen=True)
class Options:
    """Settings of the attacks (fixed before any score is seen)."""

    seed: int = 0
    shadow_iterations: int = 200  # CatBoost iterations of the shadow-model attack

    def lira_fixed_variance(self, n_references: int) -> bool:
        return n_references < 64  # the LiRA paper's advice: few reference models -> global variance


def _threshold(o: Outputs, opt: Options) -> tuple[np.ndarray, str]:
    return (
        ThresholdAttack("loss").score_samples(o.target, o.labels),
        "loss threshold (Yeom et al. 2018); score = -loss",
    )


def _shadow(o: Outputs, opt: Options) -> tuple[np.ndarray, str]:
    # trained on the reference models' outputs with their known membership, applied to the target
    m_models = o.n_references
    att = ShadowModelAttack(iterations=opt.shadow_iterations, depth=1, random_state=opt.seed)
    att.fit(
        o.references.reshape(-1, o.references.shape[-1]),
        np.tile(o.labels, m_models),
        o.keep.ravel(),
    )
    return (
        att.score_samples(o.target, o.labels),
        f"Shokri et al. 2017 shadow-model attack, CatBoost depth 1, {opt.shadow_iterations} "
        f"iterations, trained on {m_models} reference models' outputs",
    )


def _lira(online: bool) -> Callable[[Outputs, Options], tuple[np.ndarray, str]]:
    def run(o: Outputs, opt: Options) -> tuple[np.ndarray, str]:
        fixed = opt.lira_fixed_variance(o.n_references)
        att = LiRA(online=online, fix_variance=fixed).fit(o.references, o.labels, o.keep)
        mode = "online" if online else "offline (one-sided)"
        return (
            att.score_samples(o.target, o.labels),
            f"LiRA {mode}, {'fixed' if fixed else 'per-example'} variance, "
            f"{o.n_references} reference models",
        )

    return run


def _rmia(online: bool) -> Callable[[Outputs, Options], tuple[np.ndarray, str]]:
    def run(o: Outputs, opt: Options) -> tuple[np.ndarray, str]:
        # population z: the audited records themselves (the pool is all the auditor holds); the
        # reference models' membership of them is known, the target's is not used
        att = RMIA(online=online).fit(
            o.references,
            o.labels,
            o.keep,
            population_logits=o.references,
            population_labels=o.labels,
            population_keep=o.keep,
        )
        return (
            att.score_samples(o.target, o.labels, population_logits=o.target),
            f"RMIA {'online' if online else 'offline'} (Zarifzadeh et al. 2024), gamma {att.gamma:g}, "
            f"{o.n_references} reference models, population = the audited records",
        )

    return run


#: name -> (attack, reference models it needs at least)
ATTACKS: dict[str, tuple[Callable[[Outputs, Options], tuple[np.ndarray, str]], int]] = {
    "threshold": (_threshold, 0),
    "shadow": (_shadow, 2),
    "lira": (_lira(True), 2),
    "lira-offline": (_lira(False), 2),
    "rmia": (_rmia(True), 2),
    "rmia-offline": (_rmia(False), 2),
}


def applicable(n_references: int, names: Sequence[str] | None = None) -> list[str]:
    """The attacks that ``n_references`` reference models allow: all of them by default, else
    ``names`` (each of which must be applicable)."""
    if names is None:
        return [n for n, (_, need) in ATTACKS.items() if n_references >= need]
    wanted = list(names)
    bad = [n for n in wanted if n not in ATTACKS]
    if bad or not wanted:
        raise ValueError(f"attacks must be among {', '.join(ATTACKS)}; found {bad or 'none'}")
    short = [n for n in wanted if n_references < ATTACKS[n][1]]
    if short:
        raise ValueError(
            f"attacks {', '.join(short)} need >= 2 reference models; found shadows={n_references}"
        )
    return wanted


def score(name: str, outputs: Outputs, options: Options) -> tuple[np.ndarray, str]:
    """One attack's scores on the audited records and a note saying what they are."""
    fn, need = ATTACKS[name]
    if outputs.n_references < need:
        raise ValueError(
            f"attack {name} needs >= {need} reference models; found {outputs.n_references}"
        )
    return fn(outputs, options)
