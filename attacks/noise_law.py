"""Parts of a conformance test that look at the noise beyond its scale: independence, shape, and
independence from the batch.

The evidence is the noise itself: ``witness`` coordinates (a fixed set of coordinates no probe
touches and where the other records' contribution is zero or subtracted) of every release, a
(T, w) array in units of the clipping norm. Under the claim ``Gaussian(sigma_t)`` its rows are
independent ``N(0, sigma_t^2 I_w)``. Three parts, each run at its own share of the family's
error rate:

``independence``
    Noise reused across releases (a generator re-seeded inside the step) or across coordinates
    (one draw broadcast to many). The statistics read the *signs* of the witness values: under
    the claim (indeed under any noise law symmetric about zero, independent across releases and
    coordinates) they are independent fair coins, so every law below is exact whatever the
    noise's shape, which is the distribution part's to test. Three statistics at a third of the
    level each: the largest absolute cosine between two releases' sign vectors (every pair of
    releases up to a lag that keeps the count of pairs near two million) and, where the releases
    look independent, between two coordinates' sign columns, each against its exact law (``d``
    fair coins agree ``Binomial(d, 1/2)`` times), Bonferroni over the pairs; and the sum of
    consecutive releases' cosines (independent terms of variance ``1/w`` under the claim, normal
    by the central limit theorem; needs 30 releases), which sees a weak dependence that lasts.
    Dependence in either direction makes the releases together less private (reused noise
    cancels in differences, antithetic noise in sums), so these are two-sided.
``distribution``
    The shape of the noise: the Anderson-Darling statistic of the witness values (each divided by
    its release's claimed ``sigma_t``) against a centred normal whose scale is estimated from them
    (so the scale, which the noise part tests, does not enter), its null law by Monte Carlo
    simulation of the same number of Gaussian values. A noise of the claimed variance but another
    law can be far less private (a mixture mostly near zero; a bounded uniform).
``normalisation``
    A release divided by its realised batch size is data-dependent (jax_privacy's pitfall:
    division by the batch size): its noise scale moves with the batch size. Spearman's rank
    correlation between each release's realised batch size and its witness mean square, two-sided
    (under the claim the noise is independent of the batch: its rank null law holds exactly,
    the p-value from its t approximation). Needs the batch sizes (canary records in the loader).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from scipy import stats

from attacks.claim_parts import ConformanceTest, not_measured

__all__ = ["distribution_test", "independence_test", "normalisation_test"]

#: pairs of releases compared by the largest-cosine statistic (a lag limit keeps them near this)
MAX_PAIRS = 2_000_000
#: witness values the distribution part uses (the first rows'); its null law is simulated per size
MAX_VALUES = 20_000
DISTRIBUTION_SIMULATIONS = 999


def _cosine_tail(c: float, d: int) -> float:
    """P[|cos| >= c] for the cosine of two independent vectors of ``d`` fair signs: they agree
    ``d (1 + cos) / 2 ~ Binomial(d, 1/2)`` times."""
    if d < 1:
        return 1.0
    agree = math.ceil(d * (1 + min(abs(c), 1.0)) / 2 - 1e-9)
    if agree <= d / 2:
        return 1.0
    return min(1.0, float(2 * stats.binom.sf(agree - 1, d, 0.5)))


def _signs(a: np.ndarray) -> np.ndarray:
    return np.where(a >= 0, 1.0, -1.0)


def _max_release_cosine(u: np.ndarray) -> tuple[float, int, tuple[int, int]]:
    """Largest |cosine| between two rows of ``u`` (unit rows) within a lag limit; pairs compared."""
    t = u.shape[0]
    lag = t - 1 if t * (t - 1) // 2 <= MAX_PAIRS else max(1, MAX_PAIRS // t)
    best, where, pairs = 0.0, (0, 1), 0
    block = 512
    for start in range(0, t, block):
        rows = u[start : start + block]
        hi = min(t, start + rows.shape[0] + lag)
        cols = u[start + 1 : hi]
        if not cols.size:
            continue
        g = np.abs(rows @ cols.T)
        i = np.arange(rows.shape[0])[:, None] + start
        j = np.arange(cols.shape[0])[None, :] + start + 1
        keep = (j > i) & (j - i <= lag)
        pairs += int(keep.sum())
        g = np.where(keep, g, -1.0)
        k = int(np.argmax(g))
        if g.flat[k] > best:
            best, where = (
                float(g.flat[k]),
                (int(k // g.shape[1] + start), int(k % g.shape[1] + start + 1)),
            )
    return best, pairs, where


def _coordinate_cosine(w: np.ndarray, t: int, d: int) -> tuple[float, float]:
    """Largest |cosine| between two witness coordinates' sign columns and its Bonferroni p-value
    over the pairs."""
    cols = _signs(w).T / math.sqrt(t)
    g = np.abs(cols @ cols.T)
    np.fill_diagonal(g, 0.0)
    c = float(g.max())
    return min(1.0, d * (d - 1) / 2 * _cosine_tail(c, t)), c


def independence_test(
    witness: np.ndarray, noise_multipliers: np.ndarray, level: float
) -> ConformanceTest:
    """The independence part (see the module docstring) at ``level`` (``noise_multipliers`` are
    not needed: signs do not depend on the scale)."""
    w = np.asarray(witness, dtype=np.float64)
    if w.ndim != 2 or w.shape[0] < 3 or w.shape[1] < 3:
        return not_measured("independence", "fewer than three releases or witness coordinates")
    if not np.any(w):
        return not_measured("independence", "the witness coordinates carried no noise at all")
    t, d = w.shape
    sub = level / 3
    rows = _signs(w) / math.sqrt(d)
    c_rel, pairs, (a, b) = _max_release_cosine(rows)
    p_rel = min(1.0, pairs * _cosine_tail(c_rel, d))
    p_lag = 1.0
    lag_sum = math.nan
    if t >= 30:
        lag_sum = float(np.sum(np.einsum("ij,ij->i", rows[:-1], rows[1:])))
        z = lag_sum / math.sqrt((t - 1) / d)
        p_lag = float(2 * stats.norm.sf(abs(z)))
    p_coord, c_coord = 1.0, math.nan
    if min(p_rel, p_lag) >= sub:  # releases dependent: columns are no sample of T releases
        p_coord, c_coord = _coordinate_cosine(w, t, d)
    failed = tuple(
        name
        for name, p in (("releases", p_rel), ("coordinates", p_coord), ("consecutive", p_lag))
        if p < sub
    )
    why = {
        "releases": f"releases {a} and {b} share their noise (cosine {c_rel:.3f})",
        "coordinates": f"two coordinates share their noise across releases (cosine {c_coord:.3f})",
        "consecutive": "consecutive releases' noises are correlated",
    }
    detail = (
        f"largest cosine of the noise's signs between releases {c_rel:.3f} over {pairs} pairs, between "
        "coordinates "
        + ("n/a (releases dependent)" if math.isnan(c_coord) else f"{c_coord:.3f}")
        + "; sum of consecutive cosines "
        + ("n/a (fewer than 30 releases)" if math.isnan(lag_sum) else f"{lag_sum:.3f}")
        + f", over {t} releases x {d} witness coordinates"
        + (": " + "; ".join(why[f] for f in failed) if failed else "")
    )
    return ConformanceTest(
        "independence",
        bool(failed),
        min(1.0, 3 * min(p_rel, p_coord, p_lag)),
        level,
        c_rel,
        c_rel,
        0.0,
        detail,
        None,
        True,
        failed,
    )


def _anderson_darling(z: np.ndarray) -> float:
    """A-D statistic of ``z`` against N(0, s^2), s^2 = mean(z^2) (centre known, scale estimated)."""
    s = math.sqrt(float(np.mean(z * z)))
    if s == 0:
        return math.inf
    u = np.sort(stats.norm.cdf(z / s))
    u = np.clip(u, 1e-300, 1 - 1e-16)
    n = u.size
    i = np.arange(1, n + 1)
    return float(-n - np.mean((2 * i - 1) * (np.log(u) + np.log1p(-u[::-1]))))


@functools.lru_cache(maxsize=16)
def _ad_null(n: int) -> np.ndarray:
    rng = np.random.default_rng(np.random.SeedSequence([n, 0xAD]))
    return np.sort(
        [_anderson_darling(rng.standard_normal(n)) for _ in range(DISTRIBUTION_SIMULATIONS)]
    )


def distribution_test(
    witness: np.ndarray, noise_multipliers: np.ndarray, level: float
) -> ConformanceTest:
    """The distribution part (see the module docstring) at ``level``."""
    w = np.asarray(witness, dtype=np.float64)
    if w.ndim != 2 or w.size < 50:
        return not_measured("distribution", "fewer than 50 witness values")
    if not np.any(w):
        return not_measured("distribution", "the witness coordinates carried no noise at all")
    z = (w / np.asarray(noise_multipliers, dtype=np.float64)[: w.shape[0], None]).reshape(-1)
    z = z[:MAX_VALUES]
    stat = _anderson_darling(z)
    null = _ad_null(int(z.size))
    p = float((1 + np.sum(null >= stat)) / (null.size + 1))
    # excess kurtosis says which way the shape departs (read by a person, not tested)
    kurt = float(stats.kurtosis(z, fisher=True, bias=False))
    rejected = p < level
    detail = (
        f"Anderson-Darling {stat:.3f} against a centred normal over {z.size} witness values "
        f"(Monte Carlo p-value {p:.3g}); excess kurtosis {kurt:+.3f}"
        + (": the noise is not Gaussian" if rejected else "")
    )
    return ConformanceTest(
        "distribution", rejected, p, level, stat, stat, float(np.median(null)), detail, None, True
    )


def normalisation_test(
    witness: np.ndarray, noise_multipliers: np.ndarray, batch_sizes: np.ndarray, level: float
) -> ConformanceTest:
    """The normalisation part (see the module docstring) at ``level``."""
    w = np.asarray(witness, dtype=np.float64)
    b = np.asarray(batch_sizes, dtype=np.float64)
    t = min(w.shape[0] if w.ndim == 2 else 0, b.size)
    if t < 10 or w.shape[1] < 1:
        return not_measured("normalisation", "fewer than ten releases with known batch sizes")
    b = b[:t]
    if np.all(b == b[0]):
        return not_measured("normalisation", "every release had the same batch size")
    ms = np.mean(w[:t] ** 2, axis=1) / np.asarray(noise_multipliers, dtype=np.float64)[:t] ** 2
    if np.all(ms == ms[0]):
        return not_measured(
            "normalisation", "the noise's mean square was the same in every release"
        )
    rho, p = stats.spearmanr(b, ms)
    rho, p = float(rho), float(p)
    if not math.isfinite(p):
        return not_measured("normalisation", "the noise's mean square was constant")
    rejected = p < level
    detail = (
        f"rank correlation {rho:+.3f} between the realised batch size and the noise's mean "
        f"square over {t} releases (p-value {p:.3g})"
        + (": the release is scaled by the realised batch size" if rejected else "")
    )
    return ConformanceTest("normalisation", rejected, p, level, rho, rho, 0.0, detail, None, True)
