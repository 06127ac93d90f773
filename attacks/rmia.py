"""RMIA: relative membership inference (Zarifzadeh, Liu & Shokri, ICML 2024, "Low-Cost High-Power
Membership Inference Attacks"), as a scikit-learn style estimator beside :class:`attacks.mia.LiRA`.

For a target model theta, an audited example x and population examples z (data the target did not
train on)::

    LR(x, z) = [P(x | theta) / P(x)] / [P(z | theta) / P(z)]
    score(x) = fraction of z with LR(x, z) >= gamma

``P(. | theta)`` is the model's softmax probability of the true label; ``P(x)`` is its average
over reference models trained on random halves of the audit pool, i.e. ``(P_IN(x) + P_OUT(x))/2``.
*Online* (IN and OUT reference models per example) estimates both halves; *offline* (OUT models
only, the low-cost setting) uses the paper's linear approximation ``P_IN ~ a P_OUT + (1 - a)``::

    P(x) = ((1 + a) P_OUT(x) + (1 - a)) / 2

with ``a = offline_a`` (0.3 and gamma = 2, the authors' settings for CIFAR-10 with 1 to 4
reference models, ml_privacy_meter commit d327341 ``research/2024_rmia``).  Population points are
OUT in every reference model unless ``population_keep`` says otherwise, so their ``P(z)`` uses the
same approximation.

Memory: ``LR(x, z) >= gamma`` iff ``ratio_z <= ratio_x / gamma``, so the score is one binary search
of each ``ratio_x / gamma`` in the sorted ``ratio_z``: O((N + Z) log Z) time and O(N + Z) memory,
never an N x Z matrix (ml_privacy_meter forms one).  Scores come in steps of ``1/|Z|``.
"""

from __future__ import annotations

import numpy as np
from sklearn.base import BaseEstimator
from sklearn.utils.validation import check_is_fitted

from attacks import signals

__all__ = ["RMIA"]


def _true_prob(logits: np.ndarray, labels: np.ndarray, temperature: float) -> np.ndarray:
    """Softmax probability of the true label, ``logits (..., N, C) -> (..., N)``."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    return np.exp(-signals.loss(z, labels))


def _mean_where(p: np.ndarray, sel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-column mean of ``p`` over rows where ``sel`` (nan where none), and the counts."""
    cnt = sel.sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(cnt > 0, (p * sel).sum(0) / np.maximum(cnt, 1), np.nan), cnt


class RMIA(BaseEstimator):
    """Relative membership inference attack (Zarifzadeh et al. 2024); higher score = member.

    Parameters
    ----------
    online : bool
        ``True``: ``P(x) = (P_IN + P_OUT)/2`` from IN and OUT reference models; an example
        without one of the two falls back to the offline approximation (counted in
        ``n_approximated_``).  ``False`` (offline): OUT models only, with the linear
        approximation above; an example that is IN in every reference model (possible with one
        or two LiRA-style models) gets ``P_OUT`` from its IN models by inverting
        ``P_IN = a P_OUT + (1 - a)`` (clipped to [0, 1]), as ml_privacy_meter does.
    offline_a : float in (0, 1]
        The offline scaling parameter ``a``.
    gamma : float >= 1
        ``LR(x, z)`` must reach gamma for z to count against x.
    temperature : float > 0
        Softmax temperature applied to every logit.
    """

    def __init__(
        self,
        online: bool = True,
        offline_a: float = 0.3,
        gamma: float = 2.0,
        temperature: float = 1.0,
    ):
        self.online = online
        self.offline_a = offline_a
        self.gamma = gamma
        self.temperature = temperature

    def _check_params(self) -> None:
        if not 0 < self.offline_a <= 1:
            raise ValueError(f"offline_a must be in (0, 1]; found {self.offline_a!r}")
        if not self.gamma >= 1:
            raise ValueError(f"gamma must be >= 1; found {self.gamma!r}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0; found {self.temperature!r}")

    def _marginal(self, p: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, int]:
        """``P(.)`` per column of reference probabilities ``p (M, K)`` with membership ``keep``,
        and how many columns used the offline approximation."""
        a = self.offline_a
        p_in, n_in = _mean_where(p, keep)
        p_out, n_out = _mean_where(p, ~keep)
        if np.any((n_in == 0) & (n_out == 0)):
            raise ValueError(
                "every example needs at least one reference model; found none for "
                f"{int(((n_in == 0) & (n_out == 0)).sum())}"
            )
        # offline approximation; where no OUT model exists, P_OUT from the IN models
        p_out_est = np.where(n_out > 0, p_out, np.clip((p_in - (1 - a)) / a, 0.0, 1.0))
        marginal = ((1 + a) * p_out_est + (1 - a)) / 2
        if not self.online:
            return marginal, int(p.shape[1])
        both = (n_in > 0) & (n_out > 0)
        return np.where(both, (p_in + p_out) / 2, marginal), int((~both).sum())

    def fit(
        self,
        shadow_logits: np.ndarray,
        labels: np.ndarray,
        keep: np.ndarray,
        *,
        population_logits: np.ndarray,
        population_labels: np.ndarray,
        population_keep: np.ndarray | None = None,
    ) -> RMIA:
        """Estimate ``P(x)`` and ``P(z)`` from reference models.

        Parameters
        ----------
        shadow_logits : (M, N, C) reference models' logits on the N audited examples.
        labels : (N,) true labels.
        keep : (M, N) True where the example was in that reference model's training data.
        population_logits : (M, Z, C) the same models' logits on Z population examples.
        population_labels : (Z,) their labels.
        population_keep : (M, Z), optional; default: no population example trained any model.
        """
        self._check_params()
        p = _true_prob(shadow_logits, labels, self.temperature)  # (M, N)
        keep = np.asarray(keep, dtype=bool)
        if keep.shape != p.shape:
            raise ValueError(f"keep must have shape {p.shape}; found {keep.shape}")
        pz = _true_prob(population_logits, population_labels, self.temperature)  # (M, Z)
        if pz.shape[0] != p.shape[0] or pz.shape[1] < 1:
            raise ValueError(
                f"population_logits must be ({p.shape[0]}, Z >= 1, C); found {np.shape(population_logits)}"
            )
        zkeep = (
            np.zeros(pz.shape, dtype=bool)
            if population_keep is None
            else np.asarray(population_keep, dtype=bool)
        )
        if zkeep.shape != pz.shape:
            raise ValueError(f"population_keep must have shape {pz.shape}; found {zkeep.shape}")
        self.marginal_x_, self.n_approximated_ = self._marginal(p, keep)
        self.marginal_z_, _ = self._marginal(pz, zkeep)
        self.population_labels_ = np.asarray(population_labels)
        self.n_reference_models_ = p.shape[0]
        return self

    def score_samples(
        self, logits: np.ndarray, labels: np.ndarray, *, population_logits: np.ndarray
    ) -> np.ndarray:
        """Scores of the target's ``logits (N, C)`` given its ``population_logits (Z, C)``.

        The same N examples and Z population examples as in :meth:`fit`.
        """
        check_is_fitted(self, "marginal_x_")
        self._check_params()
        px = _true_prob(logits, labels, self.temperature)
        if px.shape != self.marginal_x_.shape:
            raise ValueError(
                f"logits must cover the {self.marginal_x_.size} fitted examples; found {px.size}"
            )
        pz = _true_prob(population_logits, self.population_labels_, self.temperature)
        if pz.shape != self.marginal_z_.shape:
            raise ValueError(
                f"population_logits must cover the {self.marginal_z_.size} fitted "
                f"population examples; found {pz.size}"
            )
        tiny = np.finfo(np.float64).tiny  # a zero marginal only arises from a clipped estimate
        ratio_x = px / np.maximum(self.marginal_x_, tiny)
        ratio_z = np.sort(pz / np.maximum(self.marginal_z_, tiny))
        # LR(x, z) >= gamma  <=>  ratio_z <= ratio_x / gamma
        return np.searchsorted(ratio_z, ratio_x / self.gamma, side="right") / ratio_z.size
