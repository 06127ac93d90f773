"""Per-example signals computed from a model's logits: probabilities, loss, logit-scaled confidence."""

from __future__ import annotations

import numpy as np
from scipy.special import log_softmax, logsumexp


def _check(logits: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    z = np.asarray(logits, dtype=np.float64)
    y = np.asarray(labels, dtype=np.int64)
    if z.ndim < 2 or y.ndim != 1 or z.shape[-2] != y.shape[0]:
        raise ValueError(
            f"logits (..., N, C) and labels (N,) disagree; found {z.shape} and {y.shape}"
        )
    if y.size and (y.min() < 0 or y.max() >= z.shape[-1]):
        raise ValueError(f"labels must be in [0, {z.shape[-1]}); found {y.min()}..{y.max()}")
    return z, y


def probabilities(logits: np.ndarray) -> np.ndarray:
    """Softmax over the last axis (stable)."""
    z = np.asarray(logits, dtype=np.float64)
    return np.exp(log_softmax(z, axis=-1))


def _true(z: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.take_along_axis(z, np.broadcast_to(y, z.shape[:-1])[..., None], axis=-1)[..., 0]


def loss(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Cross-entropy of the true label, shape ``logits.shape[:-1]``."""
    z, y = _check(logits, labels)
    return -_true(log_softmax(z, axis=-1), y)


def logit_confidence(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """LiRA's ``log(p_y / (1 - p_y))``, computed as ``z_y - logsumexp_{j != y} z_j`` (no overflow)."""
    z, y = _check(logits, labels)
    zy = _true(z, y)
    others = z.copy()
    np.put_along_axis(others, np.broadcast_to(y, z.shape[:-1])[..., None], -np.inf, axis=-1)
    return zy - logsumexp(others, axis=-1)


def shadow_features(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Shokri-style attack features: probability vector sorted descending, plus the true-label loss."""
    z, y = _check(logits, labels)
    p = -np.sort(-probabilities(z), axis=-1)
    return np.concatenate([p, loss(z, y)[..., None]], axis=-1)
