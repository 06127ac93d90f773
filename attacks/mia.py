"""Membership-inference attacks as scikit-learn style estimators (higher score = member).

Every attack takes parameters only in ``__init__``, learns in ``fit`` (which returns ``self``),
keeps fitted state in trailing-underscore attributes, and takes a ``random_state`` where it draws
randomness. ``score_samples(logits, labels)`` returns one membership score per example.

* :class:`ThresholdAttack`: loss / confidence threshold (Yeom et al. 2018).
* :class:`ShadowModelAttack`: classifier on shadow models' outputs (Shokri et al. 2017), CatBoost
  with depth 1 by default (FLiP's set-up), per-class or global, on sorted probabilities + loss.
* :class:`LiRA`: likelihood-ratio attack (Carlini et al. 2022), online / offline, per-example or
  fixed variance, on logit-scaled confidence; offline is scored one-sided as in the paper.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy import stats
from sklearn.base import BaseEstimator, clone
from sklearn.utils.validation import check_is_fitted

from attacks import signals
from attacks.metrics import roc_points

SIGNALS = ("loss", "confidence", "logit_confidence")


def _signal(name: str, logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    if name == "loss":
        return -signals.loss(logits, labels)  # low loss = member
    if name == "confidence":
        return signals.probabilities(logits)[np.arange(len(labels)), labels]
    if name == "logit_confidence":
        return signals.logit_confidence(logits, labels)
    raise ValueError(f"signal must be one of {', '.join(SIGNALS)}; found {name!r}")


class ThresholdAttack(BaseEstimator):
    """Member iff the signal (negative loss by default) is above a threshold (Yeom et al. 2018).

    ``fit`` on shadow outputs with known membership picks the threshold with the best balanced
    accuracy (``threshold_``); ``score_samples`` needs no fitting (the signal itself).
    """

    def __init__(self, signal: str = "loss"):
        self.signal = signal

    def fit(
        self, logits: np.ndarray, labels: np.ndarray, membership: np.ndarray
    ) -> ThresholdAttack:
        s = _signal(self.signal, logits, labels)
        fpr, tpr, thr = roc_points(s, membership)
        i = int(np.argmax(tpr - fpr))
        self.threshold_ = float(thr[i])
        return self

    def score_samples(self, logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
        return _signal(self.signal, logits, labels)

    def predict(self, logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
        check_is_fitted(self, "threshold_")
        return self.score_samples(logits, labels) >= self.threshold_


def _catboost(
    iterations: int, depth: int, learning_rate: float | None, random_state: int, thread_count: int
):
    from catboost import CatBoostClassifier

    return CatBoostClassifier(
        iterations=iterations,
        depth=depth,
        learning_rate=learning_rate,
        random_seed=random_state,
        thread_count=thread_count,
        verbose=False,
        allow_writing_files=False,
    )


class ShadowModelAttack(BaseEstimator):
    """Shadow-model attack (Shokri et al. 2017).

    Parameters
    ----------
    classifier : ``"catboost"`` (default; FLiP: depth 1, 10 000 iterations) or any scikit-learn
        classifier (cloned per attack model).
    iterations, depth, learning_rate : CatBoost settings.
    per_class : one attack model per true class (Shokri) instead of one global model; a class
        whose shadow data has a single membership value falls back to the global model.
    random_state : seed of the attack classifier.
    thread_count : CatBoost threads.
    """

    def __init__(
        self,
        classifier: Any = "catboost",
        iterations: int = 200,
        depth: int = 1,
        learning_rate: float | None = None,
        per_class: bool = False,
        random_state: int = 0,
        thread_count: int = 1,
    ):
        self.classifier = classifier
        self.iterations = iterations
        self.depth = depth
        self.learning_rate = learning_rate
        self.per_class = per_class
        self.random_state = random_state
        self.thread_count = thread_count

    def _new(self):
        if isinstance(self.classifier, str):
            if self.classifier != "catboost":
                raise ValueError(
                    f"classifier must be 'catboost' or an estimator; found {self.classifier!r}"
                )
            if self.iterations < 1 or self.depth < 1:
                raise ValueError(
                    f"iterations and depth must be >= 1; found {self.iterations}, {self.depth}"
                )
            return _catboost(
                self.iterations,
                self.depth,
                self.learning_rate,
                self.random_state,
                self.thread_count,
            )
        return clone(self.classifier)

    def fit(
        self, logits: np.ndarray, labels: np.ndarray, membership: np.ndarray
    ) -> ShadowModelAttack:
        """Train on shadow models' outputs (rows of all shadows stacked) and their membership."""
        x = signals.shadow_features(logits, labels)
        m = np.asarray(membership, dtype=bool)
        if m.all() or (~m).all():
            raise ValueError(
                "membership must contain both members and non-members; found one value only"
            )
        self.global_ = self._new().fit(x, m)
        self.models_ = {}
        if self.per_class:
            for c in np.unique(labels):
                sel = labels == c
                if m[sel].all() or (~m[sel]).all() or sel.sum() < 10:
                    continue
                self.models_[int(c)] = self._new().fit(x[sel], m[sel])
        self.classes_ = np.array([False, True])
        return self

    def predict_proba(self, logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
        check_is_fitted(self, "global_")
        x = signals.shadow_features(logits, labels)
        p = self._proba(self.global_, x)
        for c, model in self.models_.items():
            sel = labels == c
            if sel.any():
                p[sel] = self._proba(model, x[sel])
        return np.column_stack([1 - p, p])

    @staticmethod
    def _proba(model, x: np.ndarray) -> np.ndarray:
        proba = model.predict_proba(x)
        cls = list(np.asarray(model.classes_).astype(bool))
        return proba[:, cls.index(True)].astype(np.float64)

    def score_samples(self, logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
        return self.predict_proba(logits, labels)[:, 1]

    def predict(self, logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
        return self.score_samples(logits, labels) >= 0.5


class LiRA(BaseEstimator):
    """Likelihood-ratio attack (Carlini et al. 2022) on logit-scaled confidence.

    Parameters
    ----------
    online : use IN and OUT reference models (two-Gaussian likelihood ratio); ``False`` = offline,
        OUT models only, scored one-sided: ``-log P[Z > c]``, ``Z ~ N(mu_out, sigma_out^2)`` (the
        paper's one-sided test; the reference code's two-sided logpdf is not used).
    fix_variance : one global sigma for IN and one for OUT (pooled separately, unlike the
        reference code's ``std_out = std(dat_in)``) instead of per-example sigmas.
    min_std : floor on sigmas.
    """

    def __init__(self, online: bool = True, fix_variance: bool = False, min_std: float = 1e-4):
        self.online = online
        self.fix_variance = fix_variance
        self.min_std = min_std

    def fit(self, shadow_logits: np.ndarray, labels: np.ndarray, keep: np.ndarray) -> LiRA:
        """``shadow_logits`` (M, N, C) of M reference models on the N audited examples; ``keep``
        (M, N) True where the example was in that model's training data."""
        conf = signals.logit_confidence(shadow_logits, labels)  # (M, N)
        keep = np.asarray(keep, dtype=bool)
        if keep.shape != conf.shape:
            raise ValueError(f"keep must have shape {conf.shape}; found {keep.shape}")
        self.mean_in_, self.std_in_ = self._stats(conf, keep)
        self.mean_out_, self.std_out_ = self._stats(conf, ~keep)
        if not np.all(np.isfinite(self.mean_out_)):
            raise ValueError(
                "every example needs at least one OUT reference model; found none for "
                f"{int((~np.isfinite(self.mean_out_)).sum())} examples"
            )
        if self.online and not np.all(np.isfinite(self.mean_in_)):
            raise ValueError(
                "online LiRA needs at least one IN reference model per example; found none "
                f"for {int((~np.isfinite(self.mean_in_)).sum())} examples"
            )
        return self

    def _stats(self, conf: np.ndarray, sel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        cnt = sel.sum(0)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = np.where(cnt > 0, (conf * sel).sum(0) / cnt, np.nan)
            if self.fix_variance:
                std = np.full(conf.shape[1], conf[sel].std() if sel.any() else np.nan)
            else:
                var = np.where(
                    cnt > 1, ((conf - mean) ** 2 * sel).sum(0) / np.maximum(cnt, 1), np.nan
                )
                std = np.sqrt(var)
                # a single reference model gives no spread: fall back to the pooled spread
                pooled = conf[sel].std() if sel.any() else np.nan
                std = np.where(np.isfinite(std), std, pooled)
        return mean, np.maximum(std, self.min_std)

    def score_samples(self, logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """Scores of the target model's ``logits`` (N, C) on the same N examples as ``fit``."""
        check_is_fitted(self, "mean_out_")
        c = signals.logit_confidence(logits, labels)
        if c.shape != self.mean_out_.shape:
            raise ValueError(
                f"logits must cover the {self.mean_out_.size} fitted examples; found {c.size}"
            )
        if self.online:
            return stats.norm.logpdf(c, self.mean_in_, self.std_in_) - stats.norm.logpdf(
                c, self.mean_out_, self.std_out_
            )
        return -stats.norm.logsf(c, self.mean_out_, self.std_out_)


def lira_leave_one_out(
    shadow_logits: np.ndarray,
    labels: np.ndarray,
    keep: np.ndarray,
    *,
    online: bool = True,
    fix_variance: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Each shadow model in turn as the target, the others as references (LiRA's evaluation).

    Returns ``(scores, membership)`` flattened over (models x examples).
    """
    m = shadow_logits.shape[0]
    if m < 3:
        raise ValueError(f"leave-one-out LiRA needs >= 3 models; found {m}")
    scores, member = [], []
    for j in range(m):
        rest = np.r_[0:j, j + 1 : m]
        att = LiRA(online=online, fix_variance=fix_variance).fit(
            shadow_logits[rest], labels, keep[rest]
        )
        scores.append(att.score_samples(shadow_logits[j], labels))
        member.append(keep[j])
    return np.concatenate(scores), np.concatenate(member)
