"""The floating-point attack on the Gaussian mechanism (Mironov 2012; Jin et al. 2022), run against
naive float noise and against privkit's release-mode noise (privkit.mechanisms.grid_noise).

Neighbouring inputs ``x0 = 0`` and ``x1 = 1024`` (sensitivity 1024), noise ``sigma = 1024`` (noise
multiplier 1): the Gaussian mechanism is (eps, 1e-5)-DP with ``eps`` from its closed form
(Balle & Wang 2018), about 4.4.  Naive noise ``x + sigma * z`` in float32 reaches from ``x1`` only
multiples of ``2**-14`` (``1024 * fl(1 + z)``, and ``fl(1 + z)`` is a multiple of ``2**-24``),
while from ``x0`` a quarter of the releases (``1024 * z`` with ``|z| < 1/2``) carry finer bits: the
event "finer than ``2**-14``" is impossible under ``x1`` and frequent under ``x0``, the reachable-set
distinguisher of the attack.  The test runs the family of events "finer than ``2**j``" for every
``j`` (both directions), and turns each into an empirical epsilon lower bound with Clopper-Pearson
intervals (Bonferroni over the family), over independent trials: the naive noise's bound exceeds
the mechanism's ``eps`` in every trial; privkit's never does.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import optimize, stats

from privkit.mechanisms import gaussian_release
from privkit.mechanisms.dp_random import DpRandom
from privkit.mechanisms.output_perturbation import gaussian_output_perturbation
from privkit.seeding import noise_rng

SIGMA = SENSITIVITY = 1024.0
DELTA = 1e-5
N = 20_000  # releases per input and trial
TRIALS = 8
GRAINS = range(-60, -3)  # the events "finer than 2**j"
ALPHA = 1e-3 / (2 * len(GRAINS))  # Bonferroni over the events and both directions


def _claimed_epsilon() -> float:
    mu = SENSITIVITY / SIGMA

    def delta(eps: float) -> float:
        return stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(
            -eps / mu - mu / 2
        )

    return float(optimize.brentq(lambda e: delta(e) - DELTA, 0.0, 50.0))


def _finer_than(y: np.ndarray, j: int) -> np.ndarray:
    """Whether each float is not a multiple of ``2**j`` (exact: scaling by a power of two)."""
    scaled = np.ldexp(y.astype(np.float64), -j)
    return scaled != np.floor(scaled)


def _empirical_epsilon(y0: np.ndarray, y1: np.ndarray) -> float:
    """The largest Clopper-Pearson lower bound on epsilon over the events and both directions."""
    best = -math.inf
    for j in GRAINS:
        c0, c1 = int(_finer_than(y0, j).sum()), int(_finer_than(y1, j).sum())
        for a, b in ((c0, c1), (c1, c0)):
            lo = stats.beta.ppf(ALPHA, a, N - a + 1) if a > 0 else 0.0
            hi = stats.beta.ppf(1 - ALPHA, b + 1, N - b) if b < N else 1.0
            if lo > DELTA:
                best = max(best, math.log((lo - DELTA) / hi))
    return best


def _naive_torch(x: float, trial: int) -> np.ndarray:
    g = torch.Generator().manual_seed(1000 + trial)
    return (torch.full((N,), x) + torch.normal(0.0, SIGMA, (N,), generator=g)).numpy()


def _privkit_torch(x: float, trial: int) -> np.ndarray:
    out, _ = gaussian_release(
        {"w": torch.full((N,), x)}, std=SIGMA, sensitivity=SENSITIVITY, source=DpRandom.secret()
    )
    return out["w"].numpy()


def _naive_numpy(x: float, trial: int) -> np.ndarray:
    return np.full(N, x) + np.random.default_rng(2000 + trial).normal(0.0, SIGMA, N)


def _privkit_numpy(x: float, trial: int) -> np.ndarray:
    rng = noise_rng(0, "attack", reproducible=False)  # the AES stream, fresh key
    return gaussian_output_perturbation(
        np.full(N, x), sigma=SIGMA, sensitivity=SENSITIVITY, rng=rng
    )


@pytest.mark.parametrize(
    "naive,ours",
    [(_naive_torch, _privkit_torch), (_naive_numpy, _privkit_numpy)],
    ids=["float32-torch", "float64-numpy"],
)
def test_the_float_attack_distinguishes_naive_noise_and_not_privkits(naive, ours):
    claimed = _claimed_epsilon()
    assert 4.0 < claimed < 5.0
    naive_eps = [_empirical_epsilon(naive(0.0, t), naive(SENSITIVITY, t)) for t in range(TRIALS)]
    ours_eps = [_empirical_epsilon(ours(0.0, t), ours(SENSITIVITY, t)) for t in range(TRIALS)]
    assert min(naive_eps) > claimed + 1.0, naive_eps  # distinguished in every trial
    assert max(ours_eps) <= claimed, ours_eps  # never beyond what the mechanism allows


def test_the_reachable_set_of_naive_float32_noise():
    """The attack's premise, checked: from x1 every naive release is a multiple of 2**-14, from x0
    about a quarter are not."""
    y0, y1 = _naive_torch(0.0, 0), _naive_torch(SENSITIVITY, 0)
    assert not _finer_than(y1, -14).any()
    assert 0.2 < _finer_than(y0, -14).mean() < 0.35
