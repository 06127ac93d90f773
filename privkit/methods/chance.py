"""Near-chance accuracy: a trained model that is no better than guessing must say so.

Chance is the test accuracy of always predicting the test set's most frequent class (0.1 on the
balanced 10-class embedded data, 0.5 on a balanced binary task). A run is *near chance* when its
test accuracy is at most ``chance + NEAR_CHANCE_MARGIN * (1 - chance)``: within a tenth of the
way from chance to perfect (0.19 on 10 balanced classes, 0.55 on 2). Such a run has learnt
(almost) nothing, so its privacy numbers describe a model nobody would deploy; the warning names
the method and its accuracy, and travels in ``TrainResult.warnings`` (``train.json``, which the
report lists) and in ``metrics.json``.
"""

from __future__ import annotations

import math

import numpy as np

NEAR_CHANCE_MARGIN = 0.1


def chance_level(federation) -> float:
    """Accuracy of predicting the most frequent test class (nan for an empty test set)."""
    _, y = federation.test_arrays()
    if len(y) == 0:
        return float("nan")
    return float(np.bincount(y).max() / len(y))


def near_chance_threshold(chance: float) -> float:
    """The accuracy at or below which a run counts as near chance."""
    return chance + NEAR_CHANCE_MARGIN * (1.0 - chance)


def chance_warning(method: str, accuracy: float, chance: float) -> str | None:
    """A one-line warning when ``accuracy`` is at or near ``chance``; None otherwise (or if unknown)."""
    if not (math.isfinite(accuracy) and math.isfinite(chance)):
        return None
    limit = near_chance_threshold(chance)
    if accuracy > limit:
        return None
    return (
        f"near-chance accuracy: {method} ends at test accuracy {accuracy:.4f}, chance is {chance:.4f} "
        f"(most frequent test class); at or below {limit:.4f} the model has learnt almost nothing, "
        "so its privacy and audit numbers describe an unusable model"
    )


__all__ = ["NEAR_CHANCE_MARGIN", "chance_level", "chance_warning", "near_chance_threshold"]
