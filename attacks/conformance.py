"""Conformance test of a Gaussian mechanism against its claim, from white-box probes.

A ledger entry such as ``SelfComposed(PoissonSampled(q, Gaussian(sigma)), T)`` is a precise claim
about what ran: at most ``T`` releases; in each, every record joins with probability ``q`` and
moves the released sum by at most ``C`` (the clip norm, or the sensitivity of an output
perturbation); Gaussian noise of standard deviation ``sigma * C`` on every coordinate. Probes at
the mechanism (:class:`attacks.whitebox.GradientCanaries`) see each release minus the other records'
contribution, so every part of the claim can be measured where it happens:

``releases``
    The number of releases the probes observed. More than the claim's ``T`` is a violation outright
    (a ledger that undercounts steps or rounds); no statistics involved.
``noise``
    The noise's scale along coordinates no included probe touches: there the observation is pure
    noise, ``N(0, sigma_t^2)`` in units of ``C``, so ``sum_t SS_t / sigma_t^2`` is chi-square with
    as many degrees of freedom as coordinates observed. The one-sided lower tail rejects noise
    smaller than claimed (noise halved, divided by the number of clients). With every other
    record's contribution unknown (``know_batch=False``) the statistic only grows: still valid,
    less powerful.
``sensitivity`` (where measured)
    A probe *record*'s exact influence on the pre-noise release (a minimiser refitted with and
    without it) above the claimed sensitivity ``C``: the sensitivity bound does not hold (e.g.
    features left unnormalised). Deterministic up to the solver's precision.
``influence``
    Each included probe is a record whose gradient (or output shift) is larger than ``C`` before
    the mechanism's own sampling and clipping; an excluded probe is not in the data. Under the claim
    an included probe adds exactly ``q_t * C`` per release in expectation (clipped to ``C``,
    sampled with rate ``q_t``) and an excluded one nothing, so the difference of the two groups'
    mean totals is at most ``sum_t q_t``. A one-sided Welch t-test rejects a larger influence
    (clipping off, unbounded sensitivity, a sampling rate above the claimed one).

Each of the two statistical tests runs at ``beta / 2`` (Bonferroni); a rejection of any part is a
``violation`` of the claim at the stated confidence. Every part is one-sided towards *less* privacy
(more releases, less noise, more influence), in each of which the subsampled Gaussian's epsilon
increases, so a mechanism more private than claimed is never flagged.

The numbers: the noise ratio (measured / claimed noise standard deviation, with its upper
confidence limit), the influence ratio (measured / claimed, with its lower confidence limit), and
``measured_epsilon``: the accountant's epsilon of the claimed mechanism over the releases observed,
with the noise at the upper confidence limit of its measured scale. It is a lower confidence bound
on the true epsilon *if* sampling and sensitivity are at least as claimed (the influence test checks
them); it is labelled as such and is a measurement, not the model-free lower bound of
:mod:`attacks.one_run`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
from scipy import stats

from attacks.claim_parts import ConformanceTest, finite, not_measured, pct
from attacks.holds_instead import holds_instead
from attacks.noise_law import distribution_test, independence_test, normalisation_test
from attacks.sampling_law import SamplingRecord, sampling_test

TESTS = (
    "releases",
    "noise",
    "influence",
    "sensitivity",
    "sampling",
    "independence",
    "distribution",
    "normalisation",
)

__all__ = [
    "TESTS",
    "ConformanceResult",
    "MechanismClaim",
    "ProbeEvidence",
    "claim_from_events",
    "conformance_test",
]


@dataclass(frozen=True)
class MechanismClaim:
    """What a ledger claims of one mechanism, release by release.

    Attributes
    ----------
    sample_rates : (T,) each release's claimed Poisson rate ``q_t`` (1 for an unsampled release).
    noise_multipliers : (T,) each release's claimed noise standard deviation in units of ``C``.
    sensitivity : ``C``: the clip norm or L2 sensitivity a record's influence is claimed bounded by.
    """

    sample_rates: np.ndarray
    noise_multipliers: np.ndarray
    sensitivity: float

    def __post_init__(self) -> None:
        q = np.asarray(self.sample_rates, dtype=np.float64).reshape(-1)
        s = np.asarray(self.noise_multipliers, dtype=np.float64).reshape(-1)
        if q.shape != s.shape:
            raise ValueError(
                f"sample_rates and noise_multipliers must have the same length; found "
                f"{q.size} and {s.size}"
            )
        if q.size and (not np.all((q > 0) & (q <= 1))):
            raise ValueError(f"sample_rates must be in (0, 1]; found {q[~((q > 0) & (q <= 1))][0]}")
        if q.size and not np.all(s > 0):
            raise ValueError(
                f"noise_multipliers must be > 0 (a release without noise claims no DP); "
                f"found {s[~(s > 0)][0]}"
            )
        if not (self.sensitivity > 0 and math.isfinite(self.sensitivity)):
            raise ValueError(f"sensitivity must be a finite number > 0; found {self.sensitivity}")
        object.__setattr__(self, "sample_rates", q)
        object.__setattr__(self, "noise_multipliers", s)

    @classmethod
    def repeated(
        cls, sample_rate: float, noise_multiplier: float, steps: int, sensitivity: float
    ) -> MechanismClaim:
        """``steps`` identical releases: ``SelfComposed(PoissonSampled(q, Gaussian(sigma)), steps)``."""
        if not isinstance(steps, (int, np.integer)) or steps < 1:
            raise ValueError(f"steps must be an integer >= 1; found {steps!r}")
        return cls(
            np.full(int(steps), float(sample_rate)),
            np.full(int(steps), float(noise_multiplier)),
            float(sensitivity),
        )

    @property
    def steps(self) -> int:
        return int(self.sample_rates.size)

    def over(self, steps: int) -> MechanismClaim:
        """This claim over ``steps`` releases: its first ``steps``, or all of them followed by
        copies of its last (how releases the claim does not count are scored and measured)."""
        extra = max(0, int(steps) - self.steps)
        take = min(int(steps), self.steps)
        return MechanismClaim(
            np.r_[self.sample_rates[:take], np.full(extra, self.sample_rates[-1])],
            np.r_[self.noise_multipliers[:take], np.full(extra, self.noise_multipliers[-1])],
            self.sensitivity,
        )

    def epsilon(
        self,
        delta: float,
        noise_scale: float = 1.0,
        fallback: bool = True,
        grid: float = 1e-4,
        accountant: str = "best",
    ) -> float:
        """Epsilon at ``delta`` of this claim (privkit's accountants, ``best``) with every noise
        multiplier multiplied by ``noise_scale``. Where the PLD grid cannot hold the loss (noise far
        below the claim: epsilon in the hundreds) the RDP upper bound is used (``fallback``), and
        ``inf`` where neither can answer: an upper bound of the mechanism's epsilon either way.

        The PLD grid is ``grid`` (the accountants' default 1e-4) up to epsilon 20; above, where a
        fine grid costs minutes and adds nothing a reader needs, it is 1/2000 of the RDP epsilon
        (still a pessimistic upper bound of the PLD epsilon). ``accountant="rdp"``: RDP's upper
        bound alone (milliseconds; looser), for bounds computed per audit. Results are cached per
        claim."""
        if noise_scale <= 0:
            return math.inf
        if accountant not in ("best", "rdp"):
            raise ValueError(f"accountant must be 'best' or 'rdp'; found {accountant!r}")
        return _claim_epsilon(
            self.sample_rates.tobytes(),
            self.noise_multipliers.tobytes(),
            float(delta),
            float(noise_scale),
            bool(fallback),
            float(grid),
            accountant == "rdp",
        )

    def to_dict(self) -> dict:
        return {
            "steps": self.steps,
            "sensitivity": self.sensitivity,
            "sample_rates": _compress(self.sample_rates),
            "noise_multipliers": _compress(self.noise_multipliers),
        }


def _runs(q: np.ndarray, s: np.ndarray) -> list[tuple[tuple[float, float], int]]:
    """Consecutive equal (q, sigma) pairs as ((q, sigma), count)."""
    out: list[tuple[tuple[float, float], int]] = []
    for pair in zip(q.tolist(), s.tolist()):
        if out and out[-1][0] == pair:
            out[-1] = (pair, out[-1][1] + 1)
        else:
            out.append((pair, 1))
    return out


@functools.lru_cache(maxsize=256)
def _claim_epsilon(
    rates: bytes,
    noises: bytes,
    delta: float,
    scale: float,
    fallback: bool,
    grid: float,
    rdp_only: bool = False,
) -> float:
    from accountants import Ledger, dpsgd_event

    events = [
        dpsgd_event(q, s, count)
        for (q, s), count in _runs(np.frombuffer(rates), np.frombuffer(noises) * scale)
    ]

    def ledger_at(vdi: float) -> Ledger:
        ledger = Ledger(value_discretization_interval=vdi)
        for ev in events:
            ledger.add(0, ev, "claimed mechanism")
        return ledger

    try:
        rough = float(ledger_at(grid).epsilon(delta, accountant="rdp"))
    except (ValueError, MemoryError, IndexError, OverflowError, FloatingPointError):
        rough = math.inf
    if not math.isfinite(rough) or rdp_only:
        return rough
    vdi = grid if rough <= 20 else max(grid, rough / 2000)
    try:
        with np.errstate(all="ignore"):  # far outside the grid the PLD overflows, then raises
            if not fallback:  # a measurement (no upper bound is claimed): the plain PLD
                return _plain_pld_epsilon(events, vdi, delta)
            return float(ledger_at(vdi).epsilon(delta, accountant="best"))
    except (ValueError, MemoryError, IndexError, OverflowError, FloatingPointError):
        return rough if fallback else math.inf


def _plain_pld_epsilon(events: list, vdi: float, delta: float) -> float:
    """dp-accounting's PLD epsilon of ``events`` (pessimistic discretisation, no allowance for the
    FFT's rounding): what a *measured* epsilon needs, a lower confidence bound of the epsilon that
    ran, where the certified allowance (seconds per value) would buy nothing. Upper bounds a
    report states go through the ledger's certified accountant."""
    from accountants.fast import PldAccountant

    acc = PldAccountant(value_discretization_interval=vdi)
    for ev in events:
        acc.compose(ev)
    return float(acc.raw_epsilon(delta))


def _compress(a: np.ndarray) -> list[list[float]]:
    """``[[value, count], ...]`` run-length form of a per-release array (JSON-sized)."""
    out: list[list[float]] = []
    for v in a.tolist():
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return out


def claim_from_events(events: Iterable, sensitivity: float) -> MechanismClaim:
    """The per-release claim of a sequence of dp-accounting events, in order.

    Understood: ``GaussianDpEvent`` (one unsampled release), ``PoissonSampledDpEvent`` of a Gaussian
    (one sampled release), ``SelfComposedDpEvent`` and ``ComposedDpEvent`` of those. Any other event
    is an error naming it: a conformance test of a claim it cannot read would test nothing.
    """
    import dp_accounting as dpa

    q: list[float] = []
    s: list[float] = []

    def walk(ev, times: int) -> None:
        if isinstance(ev, dpa.SelfComposedDpEvent):
            walk(ev.event, times * int(ev.count))
        elif isinstance(ev, dpa.ComposedDpEvent):
            for _ in range(times):
                for e in ev.events:
                    walk(e, 1)
        elif isinstance(ev, dpa.PoissonSampledDpEvent) and isinstance(
            ev.event, dpa.GaussianDpEvent
        ):
            q.extend([float(ev.sampling_probability)] * times)
            s.extend([float(ev.event.noise_multiplier)] * times)
        elif isinstance(ev, dpa.GaussianDpEvent):
            q.extend([1.0] * times)
            s.extend([float(ev.noise_multiplier)] * times)
        else:  # an event privkit cannot read as a claim is a bad value, as in the accountants
            raise ValueError(
                f"claim_from_events reads Gaussian, Poisson-sampled Gaussian, self-composed "
                f"and composed events; found {type(ev).__name__}"
            )

    for event in events:
        walk(event, 1)
    if not q:
        raise ValueError("claim_from_events needs at least one event; found none")
    return MechanismClaim(np.array(q), np.array(s), float(sensitivity))


@dataclass(frozen=True)
class ProbeEvidence:
    """What probes observed of one mechanism, in units of ``C``.

    Attributes
    ----------
    projections : (T, m) each release's component along each probe's direction, divided by ``C``.
    included : (m,) the probes' fair coins.
    noise_squares : (T,) sum of squares (units of ``C^2``) of each release over coordinates that no
        included probe touches (after subtracting the other records' contribution where known).
    noise_coordinates : (T,) how many coordinates each ``noise_squares`` entry sums.
    clean_known : whether the other records' contribution was subtracted (white-box, the auditor
        knows every other record): an excluded probe's component is then pure zero-mean noise, and
        the influence test compares the included probes with 0 instead of with the excluded ones
        (half the variance).
    record_influence : where the mechanism could compute it exactly (an output perturbation of a
        deterministic minimiser, refitted with and without a probe record), each probe record's
        influence on the pre-noise release, in units of ``C``; the ``sensitivity`` test rejects
        when one exceeds ``1 + influence_tolerance`` (the solver's guaranteed precision).
    witness : (T, w) the noise on ``w`` fixed coordinates that no probe touches and where the other
        records' contribution is zero or subtracted (units of ``C``): the independence,
        distribution and normalisation parts (:mod:`attacks.noise_law`). ``None``: not observed.
    sampling : what the sampler drew (:class:`attacks.sampling_law.SamplingRecord`): the sampling
        part, and with its batch sizes the normalisation part. ``None``: not observed (the auditor
        sampled the probes itself, so the user's sampler was not exercised).
    appearances : (T, m) how many times the sampler put each probe record in each release (canary
        records: the auditor sees the loader's draws). With it the influence part measures what
        one appearance adds (the clipping alone; the rate is the sampling part's), on the
        releases each included probe joined, against the noise of the releases it did not join.
    raw_norm : a probe record's gradient norm before clipping, in units of ``C`` (to tell clipping
        at a larger norm from no clipping at all).
    """

    projections: np.ndarray
    included: np.ndarray
    noise_squares: np.ndarray
    noise_coordinates: np.ndarray
    clean_known: bool = False
    record_influence: np.ndarray | None = None
    influence_tolerance: float = 1e-6
    witness: np.ndarray | None = None
    sampling: SamplingRecord | None = None
    appearances: np.ndarray | None = None
    raw_norm: float | None = None

    @property
    def steps(self) -> int:
        return int(self.projections.shape[0])

    @property
    def m(self) -> int:
        return int(self.included.size)


@dataclass
class ConformanceResult:
    """The conformance test's outcome: ``verdict`` (``violation`` or ``consistent``), its parts."""

    verdict: str
    message: str
    confidence: float
    tests: dict[str, ConformanceTest]
    claim: MechanismClaim
    steps_observed: int
    measured_epsilon: float | None = None
    claimed_epsilon: float | None = None
    delta: float | None = None
    notes: list[str] = field(default_factory=list)
    holds_epsilon: float | None = None
    holds_note: str = ""

    @property
    def rejected(self) -> list[str]:
        return [n for n, t in self.tests.items() if t.rejected]

    @property
    def failed(self) -> list[str]:
        """The rejected parts, with the subtests that rejected (``"sampling: regularity"``)."""
        return [
            f"{n}: {', '.join(t.failed)}" if t.failed else n
            for n, t in self.tests.items()
            if t.rejected
        ]

    def to_dict(self) -> dict:
        return {
            "analysis": "conformance",
            "status": self.verdict,
            "message": self.message,
            "confidence": self.confidence,
            "steps_observed": self.steps_observed,
            "rejected": self.rejected,
            "tests": {n: t.to_dict() for n, t in self.tests.items()},
            "claim": self.claim.to_dict(),
            "claimed_epsilon": _finite_or_none(self.claimed_epsilon),
            "measured_epsilon": _finite_or_none(self.measured_epsilon),
            "failed": self.failed,
            "holds_epsilon": _finite_or_none(self.holds_epsilon),
            "holds_note": self.holds_note,
            "delta": self.delta,
            "notes": list(self.notes),
        }


def _finite_or_none(v):
    return None if v is None else finite(float(v))


def _releases_test(steps: int, claim: MechanismClaim) -> ConformanceTest:
    over = steps > claim.steps
    return ConformanceTest(
        "releases",
        over,
        0.0 if over else 1.0,
        0.0,
        float(steps),
        float(steps),
        float(claim.steps),
        f"{steps} releases observed, {claim.steps} claimed"
        + (": the ledger undercounts the releases" if over else ""),
    )


def _noise_test(
    ev: ProbeEvidence, claim: MechanismClaim, level: float, upto: int
) -> ConformanceTest:
    s2 = claim.noise_multipliers[:upto] ** 2
    stat = float(np.sum(ev.noise_squares[:upto] / s2))
    dof = float(np.sum(ev.noise_coordinates[:upto]))
    if dof < 1:
        return ConformanceTest(
            "noise",
            False,
            1.0,
            level,
            math.nan,
            math.inf,
            1.0,
            "no coordinate free of included probes: noise scale not measured",
        )
    p = float(stats.chi2.cdf(stat, dof))
    ratio = math.sqrt(stat / dof)  # measured / claimed noise standard deviation
    upper = math.sqrt(stat / stats.chi2.ppf(level, dof)) if stat > 0 else 0.0
    # noise f x the claim makes stat ~ f^2 chi2(dof): flagged half the time when f^2 median = critical
    detectable = math.sqrt(stats.chi2.ppf(level, dof) / stats.chi2.median(dof))
    return ConformanceTest(
        "noise",
        p < level,
        p,
        level,
        ratio,
        upper,
        1.0,
        f"noise std {ratio:.4f} x the claimed (upper {pct(1 - level)} limit {upper:.4f}) "
        f"over {int(dof)} coordinate-releases free of probes",
        detectable,
    )


def _influence_per_appearance(ev: ProbeEvidence, level: float, upto: int) -> ConformanceTest:
    """Influence part where the sampler's draws are known: each release an included probe joined
    ``a`` times carries ``a`` clipped probes plus noise; the releases it did not join carry noise
    only. Under the claim ``S = sum (x - a)`` over the joined cells is ``N(0, s^2 n)`` with ``s^2``
    the noise's variance, estimated from the unjoined cells (independent of ``S``): ``S / (s_hat
    sqrt(n))`` is Student-t with as many degrees of freedom as unjoined cells (exact for Gaussian
    noise). One-sided: a probe that moves a release by more than ``C`` per appearance."""
    assert ev.appearances is not None  # only called with appearances
    a = ev.appearances[:upto][:, ev.included].astype(np.float64)
    x = ev.projections[:upto][:, ev.included]
    joined, free = a > 0, a == 0
    n, dof = int(joined.sum()), int(free.sum())
    if n < 2 or dof < 2:
        return not_measured("influence", "fewer than two appearances or unjoined releases")
    s = math.sqrt(float(np.mean(np.square(x[free]))))
    total = float(a.sum())
    ratio = float(x[joined].sum()) / total
    if s == 0:
        p = 0.0 if ratio > 1 else 1.0
        margin = 0.0
    else:
        z = float((x[joined] - a[joined]).sum()) / (s * math.sqrt(n))
        p = float(stats.t.sf(z, dof))
        margin = float(stats.t.ppf(1 - level, dof)) * s * math.sqrt(n) / total
    return ConformanceTest(
        "influence",
        p < level,
        p,
        level,
        ratio,
        ratio - margin,
        1.0,
        f"one appearance of a probe record moved its release by {ratio:.3f} x the claimed "
        f"sensitivity (lower {pct(1 - level)} limit {ratio - margin:.3f}; {int(total)} "
        f"appearances, noise from {dof} releases the probes did not join)",
        1.0 + margin,
    )


def _influence_test(
    ev: ProbeEvidence, claim: MechanismClaim, level: float, upto: int
) -> ConformanceTest:
    if ev.appearances is not None and ev.clean_known:
        return _influence_per_appearance(ev, level, upto)
    totals = ev.projections[:upto].sum(0)
    inc, exc = totals[ev.included], totals[~ev.included]
    expected = float(claim.sample_rates[:upto].sum())  # each appearance adds exactly C (clipped)
    if inc.size < 2 or (exc.size < 2 and not ev.clean_known) or expected <= 0:
        return ConformanceTest(
            "influence",
            False,
            1.0,
            level,
            math.nan,
            0.0,
            1.0,
            "fewer than two included or excluded probes: influence not measured",
        )
    var = inc.var(ddof=1) / inc.size
    if ev.clean_known:  # an excluded probe sees zero-mean noise only: compare with 0 (one sample)
        diff, dof = float(inc.mean()), inc.size - 1
        against = "0 (the other records' contribution subtracted)"
    else:  # the other records' gradients may have a mean along a probe: compare the two groups
        vb = exc.var(ddof=1) / exc.size
        diff = float(inc.mean() - exc.mean())
        dof = (
            (var + vb) ** 2 / (var**2 / (inc.size - 1) + vb**2 / (exc.size - 1))
            if var + vb > 0
            else 1e9
        )
        var += vb
        against = f"the {exc.size} excluded probes"
    se = math.sqrt(var)
    if se == 0:
        p, lower, margin = (0.0 if diff > expected else 1.0), diff, 0.0
    else:
        margin = float(stats.t.ppf(1 - level, dof)) * se
        p = float(stats.t.sf((diff - expected) / se, dof))
        lower = diff - margin
    ratio, lower_ratio = diff / expected, lower / expected
    return ConformanceTest(
        "influence",
        p < level,
        p,
        level,
        ratio,
        lower_ratio,
        1.0,
        f"an included probe moved the releases by {ratio:.3f} x the claimed "
        f"sampling rate x sensitivity (lower {pct(1 - level)} limit {lower_ratio:.3f}); "
        f"{inc.size} included probes against {against}",
        1.0 + margin / expected,
    )


def _sensitivity_test(ev: ProbeEvidence) -> ConformanceTest:
    if ev.record_influence is None:
        raise ValueError("the sensitivity test needs the probe records' influence; found None")
    influence = np.asarray(ev.record_influence)
    worst = float(np.max(influence))
    over = worst > 1 + ev.influence_tolerance
    return ConformanceTest(
        "sensitivity",
        over,
        0.0 if over else 1.0,
        0.0,
        worst,
        worst,
        1.0,
        f"largest exact influence of {influence.size} probe record(s) "
        f"{worst:.4g} x the claimed sensitivity"
        + (": the sensitivity bound does not hold" if over else ""),
    )


def conformance_test(
    evidence: ProbeEvidence,
    claim: MechanismClaim,
    *,
    confidence: float = 0.95,
    delta: float | None = None,
) -> ConformanceResult:
    """Test the mechanism the probes observed against ``claim`` (see the module docstring).

    Parameters
    ----------
    evidence : what the probes observed (:meth:`attacks.whitebox.GradientCanaries.evidence`).
    claim : the claimed mechanism, release by release (:class:`MechanismClaim`,
        :func:`claim_from_events`).
    confidence : family-wise confidence of the verdict (each statistical part at ``beta / 2``).
    delta : where given, the claimed and the measured epsilon at this delta are computed.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1); found {confidence}")
    if evidence.steps < 1:
        raise ValueError("no release was observed; run the mechanism with the probes first")
    level = (1.0 - confidence) / _statistical_parts(evidence)
    upto = min(evidence.steps, claim.steps)
    observed = claim.over(evidence.steps)
    tests = {
        "releases": _releases_test(evidence.steps, claim),
        "noise": _noise_test(evidence, claim, level, upto),
        "influence": _influence_test(evidence, claim, level, upto),
    }
    if evidence.record_influence is not None and np.size(evidence.record_influence):
        tests["sensitivity"] = _sensitivity_test(evidence)
    if evidence.sampling is not None:
        tests["sampling"] = sampling_test(evidence.sampling, observed.sample_rates, level)
    if evidence.witness is not None:
        sig = observed.noise_multipliers
        tests["independence"] = independence_test(evidence.witness, sig, level)
        tests["distribution"] = (
            distribution_test(evidence.witness, sig, level)
            if not tests["independence"].rejected
            # dependent values are no sample of one law; not testing can only lower the error rate
            else not_measured("distribution", "the noise is not independent across releases")
        )
        if evidence.sampling is not None and evidence.sampling.batch_sizes is not None:
            tests["normalisation"] = normalisation_test(
                evidence.witness, sig, evidence.sampling.batch_sizes, level
            )
    rejected = [n for n, t in tests.items() if t.rejected]
    verdict = "violation" if rejected else "consistent"
    res = ConformanceResult(
        verdict, "", float(confidence), tests, claim, evidence.steps, delta=delta
    )
    if delta is not None:
        res.claimed_epsilon = claim.epsilon(delta)
        res.measured_epsilon = _measured_epsilon(evidence, claim, tests, delta)
        res.holds_epsilon, res.holds_note = holds_instead(res, evidence, delta)
    res.message = _message(res)
    return res


def _statistical_parts(evidence: ProbeEvidence) -> int:
    """How many statistical parts share the error rate: fixed by what the evidence holds (never by
    what it shows), so that the family-wise level is exact (Bonferroni)."""
    k = 2  # noise scale and influence
    if evidence.sampling is not None:
        k += 1
    if evidence.witness is not None:
        k += 2  # independence and distribution
        if evidence.sampling is not None and evidence.sampling.batch_sizes is not None:
            k += 1  # normalisation
    return k


def _measured_epsilon(
    evidence: ProbeEvidence, claim: MechanismClaim, tests: dict[str, ConformanceTest], delta: float
) -> float:
    """Epsilon of the claim over the observed releases (each extra release as the claim's last),
    with the noise at its upper confidence limit (and, where the sampler was observed drawing more
    often than claimed, the rates at the rate's lower confidence limit): a lower confidence bound
    of the epsilon that ran (when sampling is Poisson and clipping as claimed), just below the
    claim for a correct mechanism and closer to it the more noise was observed."""
    noise = tests["noise"]
    scale = noise.confidence_limit if math.isfinite(noise.confidence_limit) else 1.0
    if scale <= 0:
        return math.inf
    observed = claim.over(evidence.steps)
    sampling = tests.get("sampling")
    if sampling is not None and "rate" in sampling.failed and sampling.confidence_limit > 1:
        rates = np.minimum(observed.sample_rates * sampling.confidence_limit, 1.0)
        observed = MechanismClaim(rates, observed.noise_multipliers, observed.sensitivity)
    # PLD only (tight to its grid): RDP's looser upper bound would overstate a measurement; a 1e-3
    # grid (10x faster, pessimistic by about 0.1-0.4%) is ample for a measurement
    return observed.epsilon(delta, noise_scale=scale, fallback=False, grid=1e-3)


def _message(res: ConformanceResult) -> str:
    conf = pct(res.confidence)
    parts = "; ".join(t.detail for t in res.tests.values())
    eps = ""
    if res.measured_epsilon is not None:
        eps = (
            f" Claimed epsilon {res.claimed_epsilon:.3f}; epsilon of the claimed mechanism at the "
            f"measured noise and releases {res.measured_epsilon:.3f} at delta={res.delta:g} (valid if "
            "sampling and sensitivity are as claimed)."
        )
    if res.verdict == "violation":
        holds = f" {res.holds_note[0].upper()}{res.holds_note[1:]}." if res.holds_note else ""
        return (
            f"VIOLATION of the claimed mechanism ({'; '.join(res.failed)}) at {conf} confidence: "
            f"{parts}.{eps}{holds}"
        )
    return f"the mechanism conforms to its claim at {conf} confidence: {parts}.{eps}"
