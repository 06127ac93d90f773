"""L2 sensitivities of L2-regularised logistic regression (output perturbation) and feature scaling.

All bounds assume every feature vector (including the constant bias coordinate, if any) has L2 norm
at most 1, and are for the *replace-one* neighbouring relation on a dataset of fixed size ``n``
(Chaudhuri et al. 2011; FedAUX Thm 1; FedAUXfdp Thm 1): ``n`` is the number of examples the ERM
is actually solved on (for FedAUX's scoring head, ``|D_i| + |D^-|``).
"""

from __future__ import annotations

import math

import numpy as np

from accountants._validate import check_int, check_positive

__all__ = [
    "logreg_binary_sensitivity",
    "logreg_multinomial_sensitivity",
    "logreg_multinomial_sensitivity_cfree",
    "project_to_unit_ball",
]


def logreg_binary_sensitivity(n: int, lam: float) -> float:
    """``2 / (lam * n)``: binary L2-regularised logistic regression (Chaudhuri et al. 2011, Cor. 8).

    Parameters
    ----------
    n : int
        Number of training examples of the ERM (>= 1).
    lam : float
        L2 regularisation strength of ``J = mean loss + lam/2 ||beta||^2`` (> 0).
    """
    n = check_int(n, "n")
    lam = check_positive(lam, "lambda")
    return 2.0 / (lam * n)


def logreg_multinomial_sensitivity(n: int, lam: float, classes: int) -> float:
    """``2 sqrt(C) / (lam * n)``: multinomial logistic regression, FedAUXfdp Theorem 1.

    Parameters
    ----------
    n : int
        Number of training examples (>= 1).
    lam : float
        L2 regularisation strength (> 0).
    classes : int
        Number of classes C (>= 2).
    """
    n = check_int(n, "n")
    lam = check_positive(lam, "lambda")
    classes = check_int(classes, "classes", minimum=2)
    return 2.0 * math.sqrt(classes) / (lam * n)


def logreg_multinomial_sensitivity_cfree(n: int, lam: float) -> float:
    """``2 sqrt(2) / (lam * n)``: privkit's class-count-free multinomial bound.

    The proof of FedAUXfdp Theorem 1 bounds each of the C gradient blocks by ``||x||`` separately,
    giving ``sqrt(C) ||x||``.  The blocks are not independent: for softmax cross-entropy with
    probabilities ``p`` and label ``y``, block k of the gradient is ``(p_k - [k = y]) x``, so

        ||grad||^2 = ||x||^2 [ (1 - p_y)^2 + sum_{k != y} p_k^2 ]
                   <= ||x||^2 [ (1 - p_y)^2 + (sum_{k != y} p_k)^2 ]
                   =  2 ||x||^2 (1 - p_y)^2  <=  2 ||x||^2.

    Plugging ``||grad|| <= sqrt(2) ||x|| <= sqrt(2)`` into the same strong-convexity argument
    (FedAUXfdp Eq. 14-19) gives ``2 sqrt(2) / (lam * n)``, which is below Theorem 1's bound for
    every C >= 3 and equal at C = 2.
    """
    n = check_int(n, "n")
    lam = check_positive(lam, "lambda")
    return 2.0 * math.sqrt(2.0) / (lam * n)


def project_to_unit_ball(X: np.ndarray) -> np.ndarray:
    """Project each row of ``X`` onto the L2 unit ball: ``x / max(1, ||x||)``.

    This meets the ``||x|| <= 1`` assumption of the sensitivity bounds in a data-independent way:
    each row is transformed using only itself, so adding, removing or replacing one record
    changes only that record's row.  Rows already inside the ball are left unchanged.

    By contrast, scaling every row by the maximum norm over the private data (the papers' Eq. 4,
    ``h(x) / max_{x in D} ||h(x)||``) makes the scale itself a function of the private data: one
    record can change every other row, so the sensitivity bound no longer covers the release
    unless that maximum is itself privatised or fixed in advance.

    Parameters
    ----------
    X : numpy.ndarray
        Array of shape (n, d) (a 1-D array is treated as a single row).

    Returns
    -------
    numpy.ndarray
        Float array of the same shape with every row norm <= 1.
    """
    arr = np.asarray(X, dtype=np.float64)
    if arr.ndim not in (1, 2):
        raise ValueError(f"X must be a 1-D or 2-D array; found shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError("X must contain only finite values; found nan or inf")
    rows = arr.reshape(1, -1) if arr.ndim == 1 else arr
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    out = rows / np.maximum(norms, 1.0)
    return out.reshape(arr.shape)
