"""The sampling part of a conformance test: did the sampler that ran draw records as the claim says?

A claim ``SelfComposed(PoissonSampled(q, Gaussian(sigma)), T)`` says that in every release each
record joins independently with probability ``q_t``. Where the auditor sees what the sampler drew
(canary records put into the user's own data loader, :mod:`attacks.canary_records`; or a
mechanism that reports which of its probe records it sampled), it records, per record, how many
releases it joined (``counts``), per release how many records joined (``batch_sizes``), and how
often one record joined one release twice (``repeats``: sampling with replacement). Under the
claim the counts are independent Poisson-binomial(``q_1..q_T``) and the batch sizes independent
Binomial(``N``, ``q_t``). Three one-sided tests, each at a third of the part's level
(Bonferroni), look for the departures that make DP-SGD less private than accounted:

``rate``
    The total number of appearances against its law: too many means records join more often
    than claimed (a larger rate, a wrong ``q`` in the accountant). The binomial upper tail at the
    mean claimed rate is a valid p-value (Hoeffding 1956: a Poisson-binomial sum is less spread
    than the binomial of the same mean).
``heaviest``
    The record that joined most often against the binomial tail, Bonferroni over the ``N``
    records: one record drawn far more often than the others (a weighted sampler, opacus issues
    813/815). A record in one release twice is impossible under Poisson sampling: rejected
    outright.
``regularity``
    Too little spread: the batch sizes' dispersion ``sum_t (B_t - N q_t)^2 / sum_t N q_t (1-q_t)``
    (its null law by Monte Carlo simulation of the claim, exact up to the simulation's
    resolution) and the counts' dispersion (its law by the central limit theorem over the
    ``N`` independent records, the fourth moment computed exactly), each at half the subtest's
    level. Shuffled or fixed batches make both nearly constant (Chua et al. 2024: shuffling
    accounted as Poisson understates epsilon by up to 4x).

Only the record counts of the releases observed are used; records the sampler could draw but
never did count as zeros (they are records of the data set, ``population`` in all).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

from attacks.claim_parts import ConformanceTest, not_measured, pct

__all__ = ["SamplingRecord", "sampling_test"]

#: Monte Carlo simulations of the batch-size dispersion's null law (p-values down to 1/1000)
SIMULATIONS = 999
#: releases used for the batch-size dispersion (the first ones; its power saturates long before)
MAX_STEPS = 4000


@dataclass(frozen=True)
class SamplingRecord:
    """What the sampler drew over the observed releases.

    Attributes
    ----------
    counts : (N,) how many releases each record of the sampled population joined.
    batch_sizes : (T,) how many records joined each release (None where not observed).
    repeats : how many times a record joined one release more than once.
    source : where the record comes from ("loader": canary records in the user's data loader;
        "mechanism": the probe records a mechanism sampled).
    """

    counts: np.ndarray
    batch_sizes: np.ndarray | None = None
    repeats: int = 0
    source: str = "loader"

    @property
    def population(self) -> int:
        return int(np.asarray(self.counts).size)

    def to_dict(self) -> dict:
        c = np.asarray(self.counts)
        b = None if self.batch_sizes is None else np.asarray(self.batch_sizes)
        return {
            "source": self.source,
            "population": self.population,
            "appearances": int(c.sum()),
            "max_count": int(c.max()) if c.size else 0,
            "repeats": int(self.repeats),
            "releases": None if b is None else int(b.size),
            "batch_size_mean": None if b is None or not b.size else float(b.mean()),
            "batch_size_std": None if b is None or not b.size else float(b.std()),
        }


def _pb_moments(q: np.ndarray) -> tuple[float, float, float]:
    """Mean, variance and fourth central moment of a Poisson-binomial(q) count (exact, from its
    probability mass function by convolution)."""
    pmf = np.array([1.0])
    for qt in q:
        pmf = np.convolve(pmf, [1.0 - qt, qt])
    k = np.arange(pmf.size)
    mu = float(q.sum())
    var = float(np.sum(pmf * (k - mu) ** 2))
    m4 = float(np.sum(pmf * (k - mu) ** 4))
    return mu, var, m4


@functools.lru_cache(maxsize=32)
def _count_moments(rates: bytes) -> tuple[float, float, float]:
    q = np.frombuffer(rates)
    if q.size > 2000 and np.all(q == q[0]):  # binomial: closed forms, no convolution
        n, p = q.size, float(q[0])
        var = n * p * (1 - p)
        return n * p, var, var * (1 + 3 * (n - 2) * p * (1 - p))
    return _pb_moments(q)


def _binom_upper(k: int, n: int, p: float) -> float:
    """P[Bin(n, p) >= k]."""
    return float(stats.binom.sf(k - 1, n, p)) if k > 0 else 1.0


def _rate(rec: SamplingRecord, q: np.ndarray, level: float) -> tuple[float, str, float, float]:
    total = int(np.asarray(rec.counts).sum())
    trials = rec.population * q.size
    qbar = float(q.mean())
    p = _binom_upper(total, trials, qbar) if total > trials * qbar else 1.0
    measured = total / trials if trials else math.nan
    lower = float(stats.beta.ppf(level, total, trials - total + 1)) if total else 0.0
    return p, f"rate {measured:.4g} per record and release (claimed {qbar:.4g})", measured, lower


def _heaviest(rec: SamplingRecord, q: np.ndarray) -> tuple[float, str, int]:
    counts = np.asarray(rec.counts)
    top = int(counts.max()) if counts.size else 0
    if rec.repeats:
        return 0.0, f"a record joined one release twice ({rec.repeats} times): not Poisson", top
    qbar = float(q.mean())
    tail = _binom_upper(top, q.size, qbar) if top > q.size * qbar else 1.0
    p = min(1.0, rec.population * tail)
    return p, f"heaviest record in {top} of {q.size} releases", top


def _batch_dispersion(b: np.ndarray, n: int, q: np.ndarray, seed: int) -> float:
    b, q = b[:MAX_STEPS].astype(np.float64), q[:MAX_STEPS]
    var = n * q * (1 - q)
    stat = float(np.sum((b - n * q) ** 2) / var.sum())
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0xBA7C5]))
    sims = rng.binomial(n, q, size=(SIMULATIONS, q.size))
    null = np.sum((sims - n * q) ** 2, axis=1) / var.sum()
    return float((1 + np.sum(null <= stat)) / (SIMULATIONS + 1))


def _count_dispersion(counts: np.ndarray, q: np.ndarray) -> float:
    mu, var, m4 = _count_moments(q.tobytes())
    if var <= 0:
        return 1.0
    n = counts.size
    dev2 = (counts.astype(np.float64) - mu) ** 2
    # mean of (c - mu)^2 is var under the claim, with variance (m4 - var^2) / n (independent records)
    z = (dev2.mean() - var) / math.sqrt(max(m4 - var**2, 1e-300) / n)
    return float(stats.norm.cdf(z))


def sampling_test(
    rec: SamplingRecord, sample_rates: np.ndarray, level: float, seed: int = 0
) -> ConformanceTest:
    """The sampling part (see the module docstring) at ``level``, against the claimed per-release
    rates ``sample_rates`` of the releases observed."""
    q = np.asarray(sample_rates, dtype=np.float64)
    if rec.population < 2 or q.size < 1:
        return not_measured("sampling", "fewer than two records or no release observed")
    if np.all(q >= 1):
        return not_measured("sampling", "every release claims all records (no sampling)")
    sub = level / 3
    p_rate, rate_note, measured, lower = _rate(rec, q, sub)
    p_heavy, heavy_note, _ = _heaviest(rec, q)
    regular = [_count_dispersion(np.asarray(rec.counts), q)]
    if rec.batch_sizes is not None and np.asarray(rec.batch_sizes).size >= 2:
        regular.append(_batch_dispersion(np.asarray(rec.batch_sizes), rec.population, q, seed))
    p_regular = min(1.0, len(regular) * min(regular))
    failed = [
        name
        for name, p in (("rate", p_rate), ("heaviest", p_heavy), ("regularity", p_regular))
        if p < sub
    ]
    p = min(1.0, 3 * min(p_rate, p_heavy, p_regular))
    why = {
        "rate": "records join more often than the claimed rate",
        "heaviest": "some record is drawn far more often than the claimed rate allows",
        "regularity": "appearances are too regular for independent Poisson sampling "
        "(shuffled or fixed-size batches)",
    }
    detail = (
        f"{rate_note}; {heavy_note}; dispersion p-value {p_regular:.3g} over "
        f"{rec.population} records ({rec.source})"
        + (": " + "; ".join(why[f] for f in failed) if failed else "")
    )
    qbar = float(q.mean())
    return ConformanceTest(
        "sampling",
        bool(failed),
        p,
        level,
        measured,
        lower / qbar if qbar else math.nan,
        1.0,
        detail + f" (rate lower {pct(1 - sub)} limit {lower / qbar:.3f} x the claimed)",
        None,
        True,
        tuple(failed),
    )
