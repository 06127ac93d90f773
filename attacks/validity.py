"""Checking an audit's statistics on mechanisms whose epsilon is known.

A lower bound claimed at 95% must exceed the true epsilon in at most 5% of audits. This module
simulates one-run audits (:func:`attacks.audit_scores`) of mechanisms applied to each record's
membership bit, where the true epsilon is known exactly, and counts how often the verdict says
"violation" against a claim that is true:

* ``constant``: every score equal (a model whose output does not depend on its data; 0-DP);
* ``independent``: scores independent of membership (0-DP);
* ``rr``: randomised response on the membership bit at epsilon (the score is the reported bit:
  ties everywhere). epsilon-DP and tight: the best attack is right with probability
  e^eps / (1 + e^eps), exactly what the one-run bound allows;
* ``gaussian``: the membership bit plus Gaussian noise calibrated by the analytic Gaussian
  mechanism (Balle & Wang 2018) to (epsilon, delta);
* ``exact``: the membership bit itself (not private at all): the positive control.

Each audited record is included by an independent fair coin, as the one-run theorem assumes. A
family of attacks is a set of post-processings of the same release (which DP allows): the same
scores with independent tie-breaks, or the scores plus independent noise of growing scale, so the
attacks' guesses differ and the family's multiplicity is real. ``order="members-first"`` lists
members before non-members (where a stable sort used to credit every tie as a correct guess);
``order="shuffled"`` permutes the records at random: the two give the same distribution of bounds.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats

from attacks.audit_scores import audit_scores

SCENARIOS = ("constant", "independent", "rr", "gaussian", "exact")
ORDERS = ("members-first", "shuffled")
NOISE_SCALES = (
    0.0,
    0.5,
    1.0,
    2.0,
)  # extra noise (x the mechanism's own scale) per attack of a family


@functools.lru_cache(maxsize=64)
def gaussian_sigma(epsilon: float, delta: float) -> float:
    """Noise std making the sensitivity-1 Gaussian mechanism exactly (epsilon, delta)-DP."""
    from accountants.gaussian import analytic_gaussian_sigma  # dp-accounting: loaded only here

    return analytic_gaussian_sigma(epsilon, delta)


def release(
    scenario: str,
    member: np.ndarray,
    rng: np.random.Generator,
    *,
    epsilon: float = 0.0,
    delta: float = 0.0,
) -> tuple[np.ndarray, float]:
    """One release of ``scenario`` on the membership bits: (scores, the noise's scale)."""
    b = member.astype(np.float64)
    if scenario == "constant":
        return np.zeros_like(b), 1.0
    if scenario == "independent":
        return rng.normal(size=b.size), 1.0
    if scenario == "rr":
        keep = rng.random(b.size) < 1.0 / (1.0 + math.exp(-epsilon))
        return np.where(keep, b, 1.0 - b), 1.0
    if scenario == "gaussian":
        sigma = gaussian_sigma(epsilon, delta)
        return b + sigma * rng.normal(size=b.size), sigma
    if scenario == "exact":
        return b, 1.0
    raise ValueError(f"scenario must be one of {', '.join(SCENARIOS)}; found {scenario!r}")


def family_scores(
    scores: np.ndarray, scale: float, n_attacks: int, rng: np.random.Generator
) -> dict:
    """``n_attacks`` post-processings of one release: the scores plus independent noise of growing
    scale (discrete scores get the same scores; their attacks differ by their random tie-breaks)."""
    if n_attacks > len(NOISE_SCALES):
        raise ValueError(f"n_attacks must be <= {len(NOISE_SCALES)}; found {n_attacks}")
    discrete = np.unique(scores).size <= 2
    return {
        f"attack{j}": scores
        if discrete or c == 0
        else scores + c * scale * rng.normal(size=scores.size)
        for j, c in enumerate(NOISE_SCALES[:n_attacks])
    }


@dataclass
class SimulationResult:
    """Bounds of ``seeds`` audits of one scenario, and the violation rate with its binomial test."""

    scenario: str
    epsilon: float
    claim: float
    delta: float
    m: int
    n_attacks: int
    order: str
    seeds: int
    confidence: float
    bounds: list[float]
    violations: int
    rate: float
    rate_upper: float
    p_value: float
    median_bound: float
    mean_ceiling: float
    detectable_epsilon: float

    def to_dict(self, with_bounds: bool = False) -> dict:
        d = asdict(self)
        if not with_bounds:
            d.pop("bounds")
        return {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()
        }


def simulate(
    scenario: str,
    *,
    epsilon: float = 0.0,
    claim: float | None = None,
    delta: float = 0.0,
    m: int = 1000,
    n_attacks: int = 1,
    seeds: int = 200,
    order: str = "shuffled",
    confidence: float = 0.95,
    guesses: float = 0.1,
    seed0: int = 0,
    curve="generic",
) -> SimulationResult:
    """Audit ``seeds`` independent releases of ``scenario`` against ``claim`` (default: the truth).

    ``rate_upper`` is the one-sided 95% Clopper-Pearson upper limit of the violation rate and
    ``p_value`` the binomial test of "rate <= 1 - confidence" (small: the audit's claim is false).
    ``curve`` is handed to :func:`audit_scores` (the claim tested; see there).
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}; found {order!r}")
    claim = epsilon if claim is None else claim
    bounds, ceilings, detectable, violations = [], [], math.nan, 0
    for s in range(seed0, seed0 + seeds):
        rng = np.random.default_rng(
            [s, 7919]
        )  # the mechanism's stream, apart from the audit's seed
        member = rng.random(m) < 0.5  # random inclusion by fair coins
        scores, scale = release(scenario, member, rng, epsilon=epsilon, delta=delta)
        fam = family_scores(scores, scale, n_attacks, rng)
        idx = np.argsort(~member, kind="stable") if order == "members-first" else rng.permutation(m)
        res = audit_scores(
            {k: v[idx] for k, v in fam.items()},
            member[idx],
            accounted_epsilon=claim,
            delta=delta,
            confidence=confidence,
            seed=s,
            guesses=guesses,
            inclusion="random",
            curve=curve,
        )
        bounds.append(res.epsilon_lower_bound)
        ceilings.append(res.epsilon_ceiling)
        detectable = res.detectable_epsilon
        violations += res.verdict == "violation"
    beta = 1.0 - confidence
    upper = (
        1.0
        if violations == seeds
        else float(stats.beta.ppf(0.95, violations + 1, seeds - violations))
    )
    return SimulationResult(
        scenario=scenario,
        epsilon=epsilon,
        claim=claim,
        delta=delta,
        m=m,
        n_attacks=n_attacks,
        order=order,
        seeds=seeds,
        confidence=confidence,
        bounds=bounds,
        violations=violations,
        rate=violations / seeds,
        rate_upper=upper,
        p_value=float(stats.binomtest(violations, seeds, beta, alternative="greater").pvalue),
        median_bound=float(np.median(bounds)),
        mean_ceiling=float(np.mean(ceilings)),
        detectable_epsilon=float(detectable),
    )


def permutation_test(a: SimulationResult, b: SimulationResult) -> float:
    """p-value of "same distribution of bounds" (two-sample Kolmogorov-Smirnov; 1 if both constant)."""
    if np.ptp(np.r_[a.bounds, b.bounds]) == 0:
        return 1.0
    return float(stats.ks_2samp(a.bounds, b.bounds).pvalue)


def probe_evidence(
    rng: np.random.Generator,
    *,
    steps: int = 40,
    m: int = 200,
    free: int = 300,
    q: float = 0.1,
    sigma: float = 1.2,
    noise: float = 1.0,
    influence: float = 1.0,
    q_real: float | None = None,
    clean_known: bool = True,
):
    """What white-box probes at a Poisson-subsampled Gaussian mechanism observe, in clip norms
    (:class:`attacks.conformance.ProbeEvidence`): ``m`` probes, each included by a fair coin, each
    included one appearing in a release with rate ``q_real`` (default ``q``) and adding
    ``influence``; noise ``noise * sigma`` on every component, ``free`` probe-free coordinates
    per release. With ``noise = influence = 1`` and ``q_real = q`` it is exactly the mechanism
    ``SelfComposed(PoissonSampled(q, Gaussian(sigma)), steps)`` claims: the conformance test's
    null hypothesis at its boundary."""
    from attacks.conformance import ProbeEvidence

    q_real = q if q_real is None else q_real
    included = rng.random(m) < 0.5
    appear = (rng.random((steps, m)) < q_real) & included
    proj = appear * influence + rng.normal(0.0, noise * sigma, (steps, m))
    free_noise = rng.normal(0.0, noise * sigma, (steps, free))
    return ProbeEvidence(
        proj, included, (free_noise**2).sum(1), np.full(steps, free), clean_known=clean_known
    )


SAMPLERS = ("poisson", "shuffle", "weighted")


def release_evidence(
    rng: np.random.Generator,
    *,
    steps: int = 60,
    m: int = 100,
    records: int = 400,
    witness: int = 64,
    q: float = 0.05,
    sigma: float = 1.2,
    sampler: str = "poisson",
    q_real: float | None = None,
    noise: float = 1.0,
    noise_law: str = "gaussian",
    reuse_every: int = 0,
    by_batch: bool = False,
    correlation: float = 0.0,
    heavy: float = 10.0,
    df: float = 5.0,
    influence: float = 1.0,
):
    """What canary records in a user's loader observe of a DP-SGD run, in clip norms
    (:class:`attacks.conformance.ProbeEvidence` with witnesses and the sampler's record): ``records``
    records of which the first ``m`` are probes (each included by a fair coin; an excluded probe is
    not in the data), drawn per release by ``sampler`` (``poisson`` at ``q_real``, default ``q``;
    ``shuffle``: a random permutation cut into batches of ``q`` x records; ``weighted``: one record
    in 20 drawn ten times as often, Poisson otherwise), each included probe adding 1 when drawn;
    noise ``noise * sigma`` of law ``noise_law`` (``gaussian``, ``uniform``, ``laplace`` or
    ``student`` with ``df`` degrees of freedom, each of that standard deviation) on every probe and
    on ``witness`` probe-free coordinates, the same noise again every ``reuse_every`` releases
    (0: never) or each release's noise correlated with the previous one's by ``correlation``, and
    with ``by_batch`` each release divided by its realised batch size over the expected one. The
    ``weighted`` sampler draws one record in 20 ``heavy`` times as often; each appearance of an
    included probe adds ``influence`` (1: clipped to ``C`` as claimed; probes' raw norm is 4). With the defaults it is exactly the
    claim ``SelfComposed(PoissonSampled(q, Gaussian(sigma)), steps)``: the null hypothesis."""
    from attacks.conformance import ProbeEvidence
    from attacks.sampling_law import SamplingRecord

    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}; found {sampler!r}")
    included = rng.random(m) < 0.5
    present = np.ones(records, dtype=bool)
    present[:m] = included
    drawn = np.zeros((steps, records), dtype=bool)  # an excluded probe is not in the data
    rate = q if q_real is None else q_real
    drawn[:, present] = _draws(rng, sampler, steps, int(present.sum()), rate, heavy)
    std = noise * sigma

    def draw_noise(shape):
        if noise_law == "uniform":
            return rng.uniform(-math.sqrt(3) * std, math.sqrt(3) * std, shape)
        if noise_law == "laplace":
            return rng.laplace(0.0, std / math.sqrt(2), shape)
        if noise_law == "student":
            return rng.standard_t(df, shape) * std / math.sqrt(df / (df - 2))
        return rng.normal(0.0, std, shape)

    z = draw_noise((steps, m + witness))
    if reuse_every:
        z = z[np.arange(steps) // reuse_every * reuse_every]
    for t in range(1, steps) if correlation else ():
        z[t] = correlation * z[t - 1] + math.sqrt(1 - correlation**2) * z[t]
    batch = drawn.sum(1)
    scale = (q * present.sum() / np.maximum(batch, 1))[:, None] if by_batch else 1.0
    obs = (influence * drawn[:, :m] + z[:, :m]) * scale
    wit = z[:, m:] * scale
    free = np.c_[obs[:, ~included], wit]
    return ProbeEvidence(
        obs,
        included,
        (free**2).sum(1),
        np.full(steps, free.shape[1]),
        clean_known=True,
        witness=wit,
        sampling=SamplingRecord(drawn[:, present].sum(0), batch, 0, "loader"),
        appearances=drawn[:, :m].astype(np.int64),
        raw_norm=4.0,
    )


def _draws(
    rng: np.random.Generator, sampler: str, steps: int, n: int, q: float, heavy: float
) -> np.ndarray:
    """(steps, n) which records each release draws."""
    if sampler == "poisson":
        return rng.random((steps, n)) < q
    if sampler == "weighted":
        rate = np.full(n, q)
        rate[::20] = min(1.0, heavy * q)
        return rng.random((steps, n)) < rate
    size = max(1, round(q * n))
    per_epoch = math.ceil(n / size)
    out = np.zeros((steps, n), dtype=bool)
    for t in range(steps):
        if t % per_epoch == 0:
            order = rng.permutation(n)
        k = t % per_epoch
        out[t, order[k * size : (k + 1) * size]] = True
    return out
