"""Canary records for one-run audits (Steinke, Nasr & Jagielski 2023): make them, insert each by a
fair coin, score them from a model's outputs.

A canary is a record the auditor adds to the training data with probability 1/2, independently of
every other canary, with coins from the audit's own random stream (never the trainer's). After one
training run, the auditor scores each canary from the model's outputs on it (higher = "was
trained on") and the one-run bound is computed over the canaries alone: only their inclusion was
randomised, so only they carry the theorem's premise.

Two kinds:

* ``mislabel`` (default): copies of pool records with a label drawn uniformly among the *other*
  classes. The source records leave the training set, so a canary is never contradicted by its
  correctly labelled original. In-distribution inputs with a wrong label are what a model must
  memorise to fit (Jagielski et al. 2020; ML Privacy Meter's DP audit uses them).
* ``ood``: out-of-distribution inputs: the pool's mean input with a few randomly chosen
  coordinates raised far above the pool's range (a sparse bright pattern), with a uniformly random
  label. Each canary lights its own coordinates, so one included canary's effect on the model
  hardly touches the others'; measured here they are memorised much sooner than mislabelled
  records (``benchmarks/audit_power.py``).

Black-box canaries see what the final model memorised. They catch missing clipping; with
clipping in place, a canary's influence per step is bounded and the noise hides it (issue 13's
measurement: 0 of the bound with clipping kept, noise removed). The white-box mode
(:mod:`attacks.whitebox`) audits the noise of each step.

"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from attacks.experiment import stream

KINDS = ("mislabel", "ood")
SCORES = ("loss", "logit-gap")
#: Guesses of a canary audit, fixed in advance: "in" on the top 5%, 10% or 20% of the scores, or
#: "out" on the bottom 5%, 10% or 20% (Bonferroni over the six). One-sided sets because the clean
#: evidence sits at one end: white-box, an included canary the sampling never picked scores like an
#: excluded one (the top is clean, the bottom is not); black-box, a memorised canary has a tiny
#: loss while an excluded one can land on its random label by chance (the bottom is clean).
ONE_SIDED_GUESSES = [(0.05, 0), (0.1, 0), (0.2, 0), (0, 0.05), (0, 0.1), (0, 0.2)]

__all__ = [
    "KINDS",
    "ONE_SIDED_GUESSES",
    "SCORES",
    "CanaryData",
    "audit_canaries",
    "canary_scores",
    "insert_canaries",
    "make_canaries",
]


@dataclass
class CanaryData:
    """Training data with canaries inserted, and what the auditor keeps aside.

    Attributes
    ----------
    x_train, y_train : what the recipe trains on: the pool without the canaries' sources, plus the
        included canaries appended at the end.
    canary_index : (m,) position of each canary in ``x_train`` (-1 where not included).
    included : (m,) bool, the fair coins (kept by the auditor; the model never sees them).
    canary_x, canary_y : (m, ...) and (m,) every canary, included or not (to score them all).
    source : (m,) index in the pool of the record each ``mislabel`` canary copies (-1 for ``ood``).
    kind, seed : how they were made.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    canary_index: np.ndarray
    included: np.ndarray
    canary_x: np.ndarray
    canary_y: np.ndarray
    source: np.ndarray
    kind: str
    seed: int

    def __iter__(self):  # ``x_train, y_train, canary_index, included = insert_canaries(...)``
        return iter((self.x_train, self.y_train, self.canary_index, self.included))

    @property
    def m(self) -> int:
        return int(self.included.size)

    def summary(self) -> dict:
        return {
            "kind": self.kind,
            "canaries": self.m,
            "included": int(self.included.sum()),
            "seed": self.seed,
            "train_size": len(self.y_train),
        }


def _check(x: np.ndarray, y: np.ndarray, n: int, kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}; found {kind!r}")
    if len(x) != len(y):
        raise ValueError(f"x and y must have the same length; found {len(x)} and {len(y)}")
    if not isinstance(n, (int, np.integer)) or n < 2:
        raise ValueError(f"n (number of canaries) must be an integer >= 2; found {n!r}")
    if kind == "mislabel" and n > len(y):
        raise ValueError(f"n must be <= the pool size {len(y)} for mislabelled canaries; found {n}")


def make_canaries(
    x: np.ndarray,
    y: np.ndarray,
    n: int,
    *,
    kind: str = "mislabel",
    num_classes: int | None = None,
    seed: int = 0,
    ood_fraction: float = 0.04,
    ood_amplitude: float = 5.0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``n`` canaries from the pool ``(x, y)``: returns ``(canary_x, canary_y, source)``.

    Parameters
    ----------
    kind : ``mislabel`` (copies of ``n`` distinct pool records, label moved to another class
        uniformly) or ``ood`` (pool mean input, ``ood_fraction`` of the coordinates set to
        ``mean + ood_amplitude * (max - min)`` of the pool; label uniform).
    num_classes : number of classes (default: ``max(y) + 1``).
    """
    x = np.asarray(x)
    y = np.asarray(y, dtype=np.int64)
    _check(x, y, n, kind)
    k = int(num_classes) if num_classes is not None else int(y.max()) + 1
    if k < 2:
        raise ValueError(f"num_classes must be >= 2; found {k}")
    rng = stream(seed, f"canaries/{kind}")
    if kind == "mislabel":
        source = np.sort(rng.choice(len(y), n, replace=False))
        # shift by 1..k-1 (mod k): uniform among the other classes
        return x[source].copy(), (y[source] + rng.integers(1, k, n)) % k, source
    if not 0 < ood_fraction <= 1:
        raise ValueError(f"ood_fraction must be in (0, 1]; found {ood_fraction}")
    if ood_amplitude <= 0:
        raise ValueError(f"ood_amplitude must be > 0; found {ood_amplitude}")
    flat = x.reshape(len(x), -1).astype(np.float32)
    d = flat.shape[1]
    lit = max(1, round(ood_fraction * d))
    span = float(flat.max() - flat.min()) or 1.0
    if math.comb(d, lit) < 4 * n:  # distinct patterns must be plentiful, or canaries repeat
        raise ValueError(
            f"ood canaries light {lit} of {d} coordinates: only {math.comb(d, lit)} "
            f"patterns for n = {n} canaries; raise ood_fraction or use kind='mislabel'"
        )
    cx = np.repeat(flat.min(0, keepdims=True), n, axis=0)
    seen: set[tuple[int, ...]] = set()
    for i in range(n):
        coords = tuple(sorted(rng.choice(d, lit, replace=False)))
        while (
            coords in seen
        ):  # each canary its own pattern (two copies would share one coin's effect)
            coords = tuple(sorted(rng.choice(d, lit, replace=False)))
        seen.add(coords)
        cx[i, list(coords)] += ood_amplitude * span
    return (
        cx.reshape((n,) + x.shape[1:]).astype(x.dtype, copy=False),
        rng.integers(0, k, n),
        np.full(n, -1, dtype=np.int64),
    )


def insert_canaries(
    x: np.ndarray,
    y: np.ndarray,
    n: int,
    *,
    kind: str = "mislabel",
    seed: int = 0,
    num_classes: int | None = None,
    **options,
) -> CanaryData:
    """Make ``n`` canaries from the pool ``(x, y)`` and include each by an independent fair coin.

    The coins come from the audit stream ``(seed, "canaries/coins")``, drawn after and apart
    from the canaries themselves. The training set is the pool without the canaries' sources (for
    ``mislabel``) plus the included canaries appended at the end: its non-canary part does not
    depend on the coins. ``options`` go to :func:`make_canaries`.

    Returns a :class:`CanaryData`; it unpacks as ``x_train, y_train, canary_index, included``.
    """
    cx, cy, source = make_canaries(
        x, y, n, kind=kind, num_classes=num_classes, seed=seed, **options
    )
    included = stream(seed, "canaries/coins").random(n) < 0.5
    keep = np.ones(len(y), dtype=bool)
    keep[source[source >= 0]] = False
    base_x, base_y = np.asarray(x)[keep], np.asarray(y, dtype=np.int64)[keep]
    index = np.full(n, -1, dtype=np.int64)
    index[included] = len(base_y) + np.arange(int(included.sum()))
    x_train = np.concatenate([base_x, cx[included].astype(base_x.dtype, copy=False)])
    y_train = np.concatenate([base_y, cy[included]])
    return CanaryData(
        x_train=x_train,
        y_train=y_train,
        canary_index=index,
        included=included,
        canary_x=cx,
        canary_y=cy,
        source=source,
        kind=kind,
        seed=int(seed),
    )


def canary_scores(logits: np.ndarray, labels: np.ndarray, score: str = "loss") -> np.ndarray:
    """Score each canary from a model's outputs on it (higher = more likely trained on).

    ``logits`` are (m, C) logits or log-probabilities (both give the same scores). ``loss`` is the
    negative cross-entropy of the canary's label; ``logit-gap`` is the label's logit minus the
    largest other logit (Carlini et al. 2022's hinge score).
    """
    z = np.asarray(logits, dtype=np.float64)
    lab = np.asarray(labels, dtype=np.int64)
    if z.ndim != 2 or z.shape[0] != lab.size:
        raise ValueError(
            f"logits must be (m, C) with m = len(labels) = {lab.size}; found shape {z.shape}"
        )
    if score not in SCORES:
        raise ValueError(f"score must be one of {', '.join(SCORES)}; found {score!r}")
    rows = np.arange(lab.size)
    if score == "loss":
        zmax = z.max(1, keepdims=True)
        logsum = np.log(np.exp(z - zmax).sum(1)) + zmax[:, 0]
        return z[rows, lab] - logsum
    others = z.copy()
    others[rows, lab] = -np.inf
    return z[rows, lab] - others.max(1)


def audit_canaries(
    recipe,
    x: np.ndarray,
    y: np.ndarray,
    n: int,
    *,
    delta: float,
    accounted_epsilon: float | None = None,
    kind: str = "mislabel",
    score: str = "loss",
    confidence: float = 0.95,
    seed: int = 0,
    curve="generic",
    guesses=ONE_SIDED_GUESSES,
    num_classes: int | None = None,
    **options,
):
    """One-run canary audit of a training recipe: insert ``n`` canaries into the pool ``(x, y)``,
    train once, score every canary, bound epsilon over the canaries alone.

    Parameters
    ----------
    recipe : ``train_fn(x, y, seed) -> model`` or an :class:`attacks.Recipe` (scikit-learn, torch
        or probability model).
    x, y : the pool; every record not used as a canary source is in the training data.
    n, kind, options : see :func:`insert_canaries` (``mislabel`` or ``ood``).
    score : ``loss`` or ``logit-gap`` (:func:`canary_scores`).
    delta, accounted_epsilon, confidence, curve, guesses : as in :func:`attacks.audit_scores`
        (default guesses: :data:`ONE_SIDED_GUESSES`).
    seed : audit seed (canaries, coins, the recipe's seed and the tie-break all derive from it).

    Returns
    -------
    :class:`attacks.AuditResult` whose one attack is named ``canaries-<kind>``; its notes say how
    many canaries were inserted.
    """
    from attacks.audit_scores import audit_scores
    from attacks.experiment import stream_seeds
    from attacks.recipe import as_recipe

    rec = as_recipe(recipe)
    data = insert_canaries(x, y, n, kind=kind, seed=seed, num_classes=num_classes, **options)
    model = rec.fit(data.x_train, data.y_train, stream_seeds(seed, 1, "canaries/recipe")[0])
    scores = canary_scores(rec.logits(model, data.canary_x, num_classes), data.canary_y, score)
    name = f"canaries-{kind}"
    res = audit_scores(
        {name: scores},
        data.included,
        accounted_epsilon=accounted_epsilon,
        delta=delta,
        confidence=confidence,
        seed=seed,
        curve=curve,
        guesses=guesses,
        inclusion="random",
        notes={
            name: f"{data.m} {kind} canaries, {int(data.included.sum())} included by "
            f"fair coins; score = {score}"
        },
    )
    res.notes.append(
        f"one-run audit over {data.m} {kind} canaries only (each included by an "
        "independent fair coin); the other training records are not audited"
    )
    return res
