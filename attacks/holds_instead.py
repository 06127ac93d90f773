"""The epsilon that holds instead, when a conformance test rejects a claim.

A verdict that only says "violation" leaves a reviewer with nothing to write down. Where the part
that failed has a measured size, the claim is re-stated with that size and accounted again:

* ``releases``: more releases than claimed; the claim over the releases observed.
* ``noise``: the noise's scale at its *lower* confidence limit (the side of less privacy).
* ``sampling`` (rate): the claimed Poisson rates times the rate's *upper* confidence limit.
* ``influence`` measured per appearance and clearly below the canaries' raw norm: records are
  clipped at a larger norm than claimed; the noise divided by that norm's upper confidence limit.
* ``sampling`` (regularity, with constant batch sizes): the run shuffles or fixes its batches;
  privkit's shuffle accounting (:func:`accountants.samplers.sampler_accounting`): a sound upper
  bound without amplification and a certified lower bound (Chua et al. 2024's attack).

Each is an upper bound of the epsilon that ran *if every other part of the claim is as stated*,
at the confidence of the part that measured it, from the RDP accountant (sound and fast; the
shuffle bracket from privkit's shuffle accounting). Where the failed part has no size a claim can
carry (noise reused or not Gaussian, clipping that does not bound the influence, a release
scaled by its batch, a record drawn twice in one release), no finite epsilon is vouched for:
``inf`` with the reason.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
from scipy import stats

if TYPE_CHECKING:  # pragma: no cover
    from attacks.conformance import ConformanceResult, ProbeEvidence

__all__ = ["holds_instead"]

UNBOUNDED = {
    "independence": "the noise is reused across releases or coordinates",
    "distribution": "the noise is not Gaussian",
    "normalisation": "the release is scaled by its realised batch size (data-dependent)",
    "influence": "a record's influence exceeds what clipping and the claimed rate allow",
    "sensitivity": "a record's influence exceeds the claimed sensitivity",
}


def _noise_lower(res: ConformanceResult, ev: ProbeEvidence) -> float:
    """Lower confidence limit of the noise scale (measured / claimed std)."""
    t = res.tests["noise"]
    upto = min(ev.steps, res.claim.steps)
    s2 = res.claim.noise_multipliers[:upto] ** 2
    stat = float(np.sum(ev.noise_squares[:upto] / s2))
    dof = float(np.sum(ev.noise_coordinates[:upto]))
    return math.sqrt(stat / stats.chi2.ppf(1 - t.level, dof)) if dof >= 1 else 0.0


def _rate_upper(res: ConformanceResult, ev: ProbeEvidence) -> float:
    """Upper confidence limit of the rate, as a multiple of the claimed mean rate."""
    rec, t = ev.sampling, res.tests["sampling"]
    assert rec is not None  # the sampling part ran
    q = res.claim.over(ev.steps).sample_rates
    total = int(np.asarray(rec.counts).sum())
    trials = rec.population * q.size
    upper = (
        1.0
        if total >= trials
        else float(stats.beta.ppf(1 - t.level / 3, total + 1, trials - total))
    )
    return upper / float(q.mean())


def _explained_by_rate(res: ConformanceResult, ev: ProbeEvidence, ratio: float) -> set[str]:
    """The rejections a Poisson sampler at ``ratio`` x the claimed rate accounts for: the
    influence (an included record moves the releases ``ratio`` x more often) and the heaviest
    record (no record drawn more often than that rate allows, Bonferroni over the records)."""
    out = set()
    influence = res.tests["influence"]
    if influence.rejected and influence.confidence_limit <= ratio:
        out.add("influence")
    rec = ev.sampling
    assert rec is not None  # the sampling part ran
    q = np.minimum(res.claim.over(ev.steps).sample_rates * ratio, 1.0)
    top = int(np.asarray(rec.counts).max())
    tail = float(stats.binom.sf(top - 1, q.size, float(q.mean())))
    if not rec.repeats and rec.population * tail >= res.tests["sampling"].level / 3:
        out.add("heaviest")
    return out


def _clipped_at(res: ConformanceResult, ev: ProbeEvidence) -> float | None:
    """Where the influence per appearance was rejected but stayed clearly below the canaries' raw
    norm, the records are clipped, at a larger norm than claimed: its upper confidence limit (in
    units of ``C``). ``None`` otherwise (not rejected, not measured per appearance, or as large as
    the raw norm: no clipping to speak of)."""
    t = res.tests["influence"]
    if not t.rejected or ev.appearances is None or ev.raw_norm is None:
        return None
    upper = t.measured + (t.measured - t.confidence_limit)
    return upper if upper < 0.95 * ev.raw_norm else None


def _shuffle(claim, delta: float, noise: float) -> tuple[float, float | None, str]:
    from accountants.samplers import sampler_accounting

    q, s = claim.sample_rates, claim.noise_multipliers * noise
    if not (np.all(q == q[0]) and np.all(s == s[0])):
        return math.inf, None, "shuffle accounting needs one rate and one noise for every release"
    acc = sampler_accounting("shuffle", float(q[0]), float(s[0]), claim.steps, delta)
    return float(acc.epsilon), acc.epsilon_lower, "shuffled batches"


def holds_instead(
    res: ConformanceResult, ev: ProbeEvidence, delta: float
) -> tuple[float | None, str]:
    """``(epsilon, note)``: the epsilon that holds instead of the claim's (see the module
    docstring); ``(None, "")`` where the claim stands."""
    rejected = res.rejected
    if not rejected:
        return None, ""
    sampling = res.tests.get("sampling")
    failed_sampling = set(sampling.failed) if sampling is not None and sampling.rejected else set()
    ratio = _rate_upper(res, ev) if "rate" in failed_sampling else 1.0
    explained = _explained_by_rate(res, ev, ratio) if ratio > 1 else set()
    clip = _clipped_at(res, ev)
    if clip is not None:
        explained.add("influence")
    hard = [UNBOUNDED[n] for n in rejected if n in UNBOUNDED and n not in explained]
    if "heaviest" in failed_sampling and "heaviest" not in explained:
        hard.append("some record is drawn more often than a Poisson sampler allows")
    if hard:
        return math.inf, "no finite epsilon can be vouched for: " + "; ".join(hard)
    claim = res.claim.over(ev.steps)
    noise = _noise_lower(res, ev) if "noise" in rejected else 1.0
    if noise <= 0:
        return math.inf, "no finite epsilon can be vouched for: no noise was measured"
    notes = []
    if "releases" in rejected:
        notes.append(f"{ev.steps} releases observed")
    if noise < 1:
        notes.append(f"noise at its lower confidence limit {noise:.3f} x the claimed")
    if clip is not None:  # clipping at clip x C: the noise is 1/clip of what that sensitivity needs
        noise /= clip
        notes.append(f"records clipped at up to {clip:.3f} x the claimed norm")
    if ratio > 1:
        claim = type(claim)(
            np.minimum(claim.sample_rates * ratio, 1.0), claim.noise_multipliers, claim.sensitivity
        )
        notes.append(f"rate at its upper confidence limit {ratio:.3f} x the claimed")
    if "regularity" in failed_sampling:
        batches = ev.sampling.batch_sizes if ev.sampling is not None else None
        if batches is None or np.unique(np.asarray(batches)).size > 2:  # last partial batches
            return (
                math.inf,
                "no finite epsilon can be vouched for: the sampler is neither Poisson nor shuffling",
            )
        upper, lower, why = _shuffle(claim, delta, noise)
        notes.append(why)
        low = "" if lower is None else f", at least {lower:.3f} (Chua et al.'s attack)"
        return upper, (
            f"epsilon {upper:.3f} at delta={delta:g} holds instead ({', '.join(notes)}: no "
            f"amplification by sampling{low}), if the rest of the claim is as stated"
        )
    # RDP's bound (sound, milliseconds): one per failing audit, where the certified PLD would
    # cost seconds for a number that only has to be an upper bound
    eps = claim.epsilon(delta, noise_scale=noise, accountant="rdp")
    return eps, (
        f"epsilon {eps:.3f} at delta={delta:g} (RDP) holds instead ({', '.join(notes)}), if the "
        "rest of the claim is as stated"
    )
