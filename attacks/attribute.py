"""Attribute (property) inference: infer a property of a client's private data from what it shares.

Generic protocol: the adversary is trained on artifacts of shadow runs whose property is known and
tested on held-out runs (or the target run). The result is the test accuracy next to the chance
level (the best constant guess) with a two-sided Clopper-Pearson interval: an interval that
excludes chance is evidence of leakage.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator, clone
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.utils.validation import check_is_fitted

from attacks.epsilon import clopper_pearson_interval


@dataclass
class AttributeResult:
    """Accuracy of an attribute-inference adversary on held-out runs."""

    accuracy: float
    ci_low: float
    ci_high: float
    chance: float
    n_test: int
    confidence: float
    notes: str = ""
    error: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def above_chance(self) -> bool:
        """True when the whole confidence interval lies above chance."""
        return self.ci_low > self.chance


def evaluate_predictions(
    pred: np.ndarray,
    truth: np.ndarray,
    *,
    chance: float | None = None,
    alpha: float = 0.05,
    notes: str = "",
) -> AttributeResult:
    """Accuracy of ``pred`` against ``truth`` with a (1 - alpha) Clopper-Pearson interval.

    ``chance`` defaults to the frequency of the most common true value (the best constant guess
    in hindsight; 0.5 for a balanced binary property).
    """
    pred, truth = np.asarray(pred), np.asarray(truth)
    if pred.shape != truth.shape or truth.size == 0:
        raise ValueError(
            f"pred and truth must be non-empty and equally long; found {pred.size} and {truth.size}"
        )
    k = int((pred == truth).sum())
    lo, hi = clopper_pearson_interval(k, truth.size, alpha)
    if chance is None:
        _, counts = np.unique(truth, return_counts=True)
        chance = float(counts.max() / truth.size)
    return AttributeResult(
        accuracy=k / truth.size,
        ci_low=lo,
        ci_high=hi,
        chance=float(chance),
        n_test=int(truth.size),
        confidence=1 - alpha,
        notes=notes,
    )


class AttributeInferenceAttack(BaseEstimator):
    """An adversary mapping an artifact's feature vector to a property.

    Parameters
    ----------
    classifier : ``"logreg"`` (standardised logistic regression, default) or any scikit-learn
        classifier (cloned).
    C : inverse regularisation of the logistic regression.
    random_state : seed of the classifier.
    """

    def __init__(self, classifier: Any = "logreg", C: float = 1.0, random_state: int = 0):
        self.classifier = classifier
        self.C = C
        self.random_state = random_state

    def fit(self, features: np.ndarray, prop: np.ndarray) -> AttributeInferenceAttack:
        x = np.asarray(features, dtype=np.float64).reshape(len(features), -1)
        y = np.asarray(prop)
        if len(np.unique(y)) < 2:
            raise ValueError(
                f"prop must take at least two values in training; found {np.unique(y).tolist()}"
            )
        if isinstance(self.classifier, str):
            if self.classifier != "logreg":
                raise ValueError(
                    f"classifier must be 'logreg' or an estimator; found {self.classifier!r}"
                )
            clf = make_pipeline(
                StandardScaler(),
                LogisticRegression(C=self.C, max_iter=2000, random_state=self.random_state),
            )
        else:
            clf = clone(self.classifier)
        self.model_ = clf.fit(x, y)
        self.classes_ = np.unique(y)
        return self

    def predict(self, features: np.ndarray) -> np.ndarray:
        check_is_fitted(self, "model_")
        return self.model_.predict(
            np.asarray(features, dtype=np.float64).reshape(len(features), -1)
        )

    def evaluate(
        self,
        features: np.ndarray,
        prop: np.ndarray,
        *,
        alpha: float = 0.05,
        chance: float | None = None,
        notes: str = "",
    ) -> AttributeResult:
        """Accuracy on held-out artifacts with a Clopper-Pearson interval."""
        return evaluate_predictions(
            self.predict(features), np.asarray(prop), chance=chance, alpha=alpha, notes=notes
        )
