"""Dominant-class attribute inference on what each client shares, in a run audit."""

from __future__ import annotations

from typing import cast

import numpy as np

from attacks.attribute import AttributeInferenceAttack
from privkit.audit.instantiations import (
    client_artifact_features,
    dominant_classes,
    soft_label_artifacts,
)


class NotApplicable(ValueError):
    """The attack does not apply to this method (e.g. nothing per-client is shared): the audit
    records the reason under ``not_applicable``, not as a failure."""


def dominant_class_entry(
    fed, result, reference_details: list[dict], *, seed: int, alpha: float
) -> dict:
    """Generic dominant-class inference from per-client artifacts.

    The adversary (logistic regression) trains on the reference runs' clients (their artifacts
    and class counts, from :class:`~privkit.audit.recipes.FederationRecipe` details) and is tested
    on the released run's clients.
    """
    xs, ys = [], []
    for d in reference_details:
        feats = client_artifact_features(d["artifacts"], fed)
        if feats is None:
            raise NotApplicable(f"method {result.method} shares no per-client artifacts to attack")
        xs.append(feats)
        ys.append(dominant_classes(d["class_counts"]))
    x_train, y_train = np.concatenate(xs), np.concatenate(ys)
    x_test = cast(  # the released run shares what its reference runs share
        np.ndarray,
        client_artifact_features(
            {**result.artifacts, **soft_label_artifacts(result.client_models, fed)}, fed
        ),
    )
    y_test = dominant_classes(fed.client_class_counts())
    att = AttributeInferenceAttack(random_state=seed).fit(x_train, y_train)
    res = att.evaluate(
        x_test,
        y_test,
        alpha=alpha,
        notes=(
            "dominant class of each client's private data inferred from the "
            "artifacts it shares; adversary (logistic regression) trained on "
            f"{len(y_train)} reference-run clients, tested on the {len(y_test)} "
            "released run's clients"
        ),
    )
    return {**res.to_dict(), "error": None}
