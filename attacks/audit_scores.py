"""``audit_scores``: membership scores -> family-wise empirical epsilon, ceiling, detectable epsilon, verdict.

Which bound, and why. The records audited against one trained model are not independent trials:
they were all seen (or not) by the same training run, so the per-record counts of false positives
and false negatives are not binomial, and the Clopper-Pearson threshold bound of
:mod:`attacks.epsilon` (valid for independent training runs, one IN/OUT trial each) is not valid
for them. The one-run theorem of Steinke, Nasr & Jagielski (NeurIPS 2023) is: if each audited
record was included in training by an independent fair coin, and the auditor guesses "in" on the
k+ highest scores and "out" on the k- lowest, then under (epsilon, delta)-DP the number of correct
guesses is dominated by Bin(k+ + k-, e^eps / (1 + e^eps)) plus a delta term
(:mod:`attacks.one_run`). That is the bound used here; the Clopper-Pearson bound is not reported,
because a number labelled "epsilon lower bound" that does not hold would be worse than none.

Family-wise confidence. Each attack (and each (k+, k-) pair of a guess grid) is a separate test.
The verdict's bound holds at ``confidence`` for the whole family by Bonferroni: every bound in the
family is computed at ``beta / (attacks x pairs)`` (``beta = 1 - confidence``), and the family-wise
bound is their maximum. Alternatively one attack can be declared ``primary`` before looking at the
scores: the verdict then rests on it alone (at ``beta / pairs``) and the others are descriptive.
Each attack's own bound is also given, at its own confidence ``1 - beta`` (corrected for the grid
only); it is not the verdict's bound.

Ties. Guesses break ties at random from ``seed`` (see :mod:`attacks.one_run`): no guess depends on
the order of the input, and constant scores give bounds whose median over seeds is 0.

Numbers a reader needs besides the bound:

* ``epsilon_ceiling``: the largest family-wise bound any outcome of this audit could give (every
  guess correct). If it is not above the accounted epsilon, no outcome could contradict the claim.
* ``detectable_epsilon``: the smallest true epsilon this audit flags at least half the time, for
  the strongest attack an epsilon-DP mechanism allows (each guess correct with probability
  e^eps / (1 + e^eps), independently: randomised response on the membership bit). Exact binomial
  computation: with v* the fewest correct guesses whose family-wise bound exceeds the accounted
  epsilon (0 without a claim), it is the epsilon at which the median of Bin(r, e^eps / (1 + e^eps))
  reaches v*; then P[bound > accounted] >= 1/2. A real attack on a real model guesses less well
  than this ideal one and needs a larger true epsilon to be flagged: the detectable epsilon is the
  audit's best case.

Which claim. ``curve="generic"`` (the default) tests the bare (epsilon, delta) claim with Steinke et
al.'s bound. Where the mechanism is known, a stronger claim can be tested with the f-DP analysis of
the same guesses (Mahloujifar, Melis & Chaudhuri 2024, :mod:`attacks.one_run_fdp`):
``curve="gaussian"`` tests "as private as the Gaussian mechanism at (epsilon, delta)", and a
trade-off curve of the ledger (:func:`accountants.ledger_curve`) tests "as private as the ledger's
PLD" (its family is anchored at ``accounted_epsilon``, so a bound above it means exactly that the
ledger's curve is rejected). Such a bound is valid only if the curve is true of the mechanism: on
randomized response, which is (epsilon, delta)-DP but not Gaussian, the Gaussian curve reports
false violations in most runs. Bound, ceiling and detectable epsilon all use the same curve, and the
result names the claim tested (``claim_tested``). For these curves the detectable epsilon's ideal
attack is the one the family's member allows (:func:`attacks.one_run_fdp.ideal_precision`; for the
generic curve it is randomized response, as above).

The verdict: ``no-claim`` without a finite accounted epsilon; ``violation`` when the family-wise
bound exceeds it; ``consistent`` when it does not and the ceiling is above it (the audit could
have seen a violation); otherwise ``inconclusive`` ("this audit can detect at most epsilon X").
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from scipy import optimize, stats

from accountants.tradeoff import CurveFamily, curve_family
from attacks.metrics import _validate, summarize
from attacks.one_run import epsilon_lower_bound as one_run_bound
from attacks.one_run import guess
from attacks.one_run_fdp import fdp_detectable_epsilon, fdp_epsilon_lower_bound

VERDICTS = ("violation", "consistent", "inconclusive", "no-claim")
CURVES = (
    "generic",
    "gaussian",
)  # or a trade-off curve / CurveFamily (e.g. accountants.ledger_curve)
STEINKE = "one-run (Steinke, Nasr & Jagielski 2023), guesses fixed in advance, random tie-break"
FDP = (
    "one-run f-DP (Mahloujifar, Melis & Chaudhuri 2024), guesses fixed in advance, random tie-break"
)
INCLUSION = ("random", "unverified")
DEFAULT_NAME = "scores"  # the attack's name when ``scores`` is one array


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3f}"


def _strict(x):
    """Non-finite floats as the strings report.json uses ("Infinity", "NaN"); numpy as Python."""
    if isinstance(x, dict):
        return {str(k): _strict(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_strict(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")
    return x


# ---------------------------------------------------------------------------------- the bound
def _resolve_curve(curve, delta: float, accounted: float | None) -> str | CurveFamily:
    """``"generic"``, or the CurveFamily the f-DP analysis searches (profiles anchored at the claim)."""
    if isinstance(curve, str) and curve == "generic":
        return "generic"
    if (isinstance(curve, str) and curve not in CURVES) or not (
        isinstance(curve, str) or callable(curve) or isinstance(curve, CurveFamily)
    ):
        raise ValueError(
            f"curve must be one of {', '.join(CURVES)}, a trade-off curve (a callable FPR -> "
            f"FNR) or a CurveFamily; found {curve!r}"
        )
    return curve_family(curve, delta).anchored(accounted)


@functools.lru_cache(maxsize=4096)
def _fdp_bound(m: int, r: int, v: int, delta: float, beta: float, family: CurveFamily) -> float:
    # the f-DP search costs milliseconds; ceilings and repeated outcomes recur across attacks/seeds
    return fdp_epsilon_lower_bound(m, r, v, delta=delta, curve=family, beta=beta)


def epsilon_bound(m: int, r: int, v: int, *, delta: float, beta: float, curve="generic") -> float:
    """The (1 - beta) lower bound on epsilon from ``v`` correct of ``r`` guesses on ``m`` records.

    ``curve="generic"``: Steinke, Nasr & Jagielski's bound for a bare (epsilon, delta) claim; a
    :class:`~accountants.tradeoff.CurveFamily`: the f-DP analysis against that family.
    """
    if isinstance(curve, CurveFamily):
        return _fdp_bound(m, r, v, delta, beta, curve)
    if curve != "generic":
        raise ValueError(f"curve must be 'generic' or a CurveFamily; found {curve!r}")
    return one_run_bound(m, r, v, delta=delta, beta=beta)


@functools.lru_cache(maxsize=1024)
def detectable_epsilon(
    m: int,
    r: int,
    *,
    delta: float,
    beta: float,
    target: float = 0.0,
    curve="generic",
    k_pos: int | None = None,
) -> float:
    """Smallest true epsilon whose ideal attack (r guesses, each right w.p. e^eps/(1+e^eps)) gives a
    bound above ``target`` at least half the time; ``inf`` if no outcome can (ceiling <= target).

    v* = the fewest correct guesses whose bound exceeds ``target`` (bisection over v: the bound
    increases with v); the answer is the epsilon where the median of Bin(r, q) reaches v*, i.e.
    where ``P[Bin(r, q) <= v* - 1] = 1/2`` (scipy's median is the smallest k with cdf >= 1/2).
    With a :class:`~accountants.tradeoff.CurveFamily` the bound is the f-DP one and the ideal
    attack the one that family's members allow
    (:func:`attacks.one_run_fdp.fdp_detectable_epsilon`; ``k_pos`` of the r guesses are "in",
    default half).
    """
    if isinstance(curve, CurveFamily):
        kp = r - r // 2 if k_pos is None else k_pos
        return fdp_detectable_epsilon(
            m, kp, r - kp, delta=delta, curve=curve, beta=beta, target=target
        )
    if r == 0 or epsilon_bound(m, r, r, delta=delta, beta=beta, curve=curve) <= target:
        return math.inf
    lo, hi = -1, r  # bound(lo) <= target < bound(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if mid >= 0 and epsilon_bound(m, r, mid, delta=delta, beta=beta, curve=curve) > target:
            hi = mid
        else:
            lo = mid
    v_star = hi
    if v_star == 0 or stats.binom.cdf(v_star - 1, r, 0.5) < 0.5:
        return 0.0
    if v_star == r:  # the median reaches r only when q^r >= 1/2
        q = 0.5 ** (1.0 / r)
    else:
        q = optimize.brentq(lambda p: stats.binom.cdf(v_star - 1, r, p) - 0.5, 0.5, 1.0, xtol=1e-14)
    return float(math.log(q / (1.0 - q)))


# ---------------------------------------------------------------------------------- results
@dataclass
class AttackAudit:
    """One attack's metrics and one-run bounds on its audited records."""

    name: str
    epsilon_lower_bound: float
    confidence: float
    ceiling: float
    family_epsilon_lower_bound: float | None
    family_confidence: float | None
    auc: float
    balanced_accuracy: float
    advantage: float
    tpr_at_fpr: dict[str, float]
    roc: dict[str, list[float]]
    m: int
    n_members: int
    n_nonmembers: int
    k_pos: int
    k_neg: int
    guesses: int
    correct: int
    delta: float
    in_verdict: bool = True
    notes: str = ""
    tests: str = "(eps, delta)-DP"
    method: str = STEINKE

    def to_dict(self) -> dict:
        """The audit.json record of one attack (the keys of ``reports.schema.AttackResult`` and more)."""
        return _strict(
            {
                "auc": self.auc,
                "balanced_accuracy": self.balanced_accuracy,
                "advantage": self.advantage,
                "tpr_at_fpr": self.tpr_at_fpr,
                "roc": self.roc,
                "epsilon_lower_bound": self.epsilon_lower_bound,
                "confidence": self.confidence,
                "ceiling": self.ceiling,
                "family_epsilon_lower_bound": self.family_epsilon_lower_bound,
                "family_confidence": self.family_confidence,
                "in_verdict": self.in_verdict,
                "delta": self.delta,
                "n_trials": self.m,
                "m": self.m,
                "n_members": self.n_members,
                "n_nonmembers": self.n_nonmembers,
                "k_pos": self.k_pos,
                "k_neg": self.k_neg,
                "guesses": self.guesses,
                "correct": self.correct,
                "bound": self.method,
                "tests": self.tests,
                "notes": self.notes,
                "error": None,
            }
        )


@dataclass
class AuditResult:
    """The outcome of :func:`audit_scores`; ``to_dict()`` is strict JSON."""

    verdict: str
    message: str
    epsilon_lower_bound: float
    attack: str | None
    epsilon_ceiling: float
    detectable_epsilon: float
    accounted_epsilon: float | None
    delta: float
    confidence: float
    correction: str
    family: list[str]
    guess_grid: list[tuple[float, float]]
    curve: str
    inclusion: str | dict[str, str]
    seed: int
    attacks: dict[str, AttackAudit]
    notes: list[str] = field(default_factory=list)
    claim_tested: str = "(eps, delta)-DP"

    @property
    def m(self) -> int | dict[str, int]:
        """Records audited: one number when every attack audited the same records."""
        ms = {n: a.m for n, a in self.attacks.items()}
        return next(iter(ms.values())) if len(set(ms.values())) == 1 else ms

    def to_dict(self, with_attacks: bool = True) -> dict:
        """Strict JSON; ``with_attacks=False`` leaves out the per-attack records (audit.json keeps
        them beside the verdict)."""
        d = _strict(
            {
                "status": self.verdict,
                "message": self.message,
                "epsilon_lower_bound": self.epsilon_lower_bound,
                "attack": self.attack,
                "epsilon_ceiling": self.epsilon_ceiling,
                "detectable_epsilon": self.detectable_epsilon,
                "accounted_epsilon": self.accounted_epsilon,
                "delta": self.delta,
                "confidence": self.confidence,
                "correction": self.correction,
                "family": self.family,
                "family_size": len(self.family) * len(self.guess_grid),
                "guess_grid": [list(p) for p in self.guess_grid],
                "m": self.m,
                "curve": self.curve,
                "claim_tested": self.claim_tested,
                "inclusion": self.inclusion,
                "seed": self.seed,
                "notes": self.notes,
            }
        )
        if with_attacks:
            d["attacks"] = {n: a.to_dict() for n, a in self.attacks.items()}
        return d


# ---------------------------------------------------------------------------------- validation
def _as_family(scores, is_member) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    if isinstance(scores, Mapping):
        if not scores:
            raise ValueError("scores must be an array or a non-empty dict of arrays; found {}")
        fam = {str(k): v for k, v in scores.items()}
    else:
        fam = {DEFAULT_NAME: scores}
    if isinstance(is_member, Mapping):
        missing = sorted(set(fam) - set(map(str, is_member)))
        if missing:
            raise ValueError(
                f"is_member must give membership for every attack; found none for {missing}"
            )
        members = {str(k): v for k, v in is_member.items()}
    else:
        members = dict.fromkeys(fam, is_member)
    out = {}
    for name, s in fam.items():
        s = np.asarray(s)
        if s.ndim != 1:
            raise ValueError(f"scores[{name!r}] must be 1-D; found shape {s.shape}")
        out[name] = _validate(s, members[name])
    return out


def _grid(guesses) -> list[tuple[float, float]]:
    if isinstance(guesses, (int, float, np.integer, np.floating)) and not isinstance(guesses, bool):
        f = float(guesses)
        if not 0 < f <= 0.5:
            raise ValueError(
                f"guesses must be a fraction in (0, 0.5] or a list of (k_pos, k_neg) pairs; "
                f"found {guesses}"
            )
        return [(f, f)]
    pairs = [tuple(p) for p in guesses]
    if not pairs or any(len(p) != 2 for p in pairs):
        raise ValueError(
            f"guesses must be a fraction in (0, 0.5] or a list of (k_pos, k_neg) pairs; "
            f"found {guesses}"
        )
    return pairs


def _counts(k: float, m: int, name: str) -> int:
    """A fraction f in [0, 1) means floor(f m) guesses (at least 1 unless f = 0); an int is a count."""
    if isinstance(k, (float, np.floating)) and 0 <= k < 1:
        return 0 if k == 0 else max(1, math.floor(k * m))
    if isinstance(k, (int, np.integer)) and not isinstance(k, bool) and 0 <= k <= m:
        return int(k)
    raise ValueError(f"{name} must be a count in [0, m={m}] or a fraction in [0, 1); found {k!r}")


def _check(
    accounted_epsilon, delta, confidence, seed, curve, inclusion, primary, names
) -> float | None:
    if not 0 <= delta < 1:
        raise ValueError(f"delta must be in [0, 1); found {delta}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1); found {confidence}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer; found {seed!r}")
    for how in inclusion.values() if isinstance(inclusion, Mapping) else [inclusion]:
        if how not in INCLUSION:
            raise ValueError(
                f"inclusion must be one of {', '.join(INCLUSION)} (or a dict of them per "
                f"attack); found {how!r}"
            )
    if primary is not None and primary not in names:
        raise ValueError(f"primary must name one of the attacks {sorted(names)}; found {primary!r}")
    if accounted_epsilon is None:
        return None
    eps = float(accounted_epsilon)
    if eps < 0:
        raise ValueError(
            f"accounted_epsilon must be >= 0 (or None / inf for no claim); found {accounted_epsilon}"
        )
    return eps if math.isfinite(eps) else None


# ---------------------------------------------------------------------------------- per attack
@dataclass(frozen=True)
class _Pair:
    k_pos: int
    k_neg: int
    correct: int

    @property
    def r(self) -> int:
        return self.k_pos + self.k_neg


def _pairs(name: str, s: np.ndarray, member: np.ndarray, grid, seed: int) -> list[_Pair]:
    # one tie-break key per attack, so the pairs of a grid nest; derived from the seed and the name
    # only: independent of the membership bits, of the input order and of the order of the attacks
    tie_seed = np.random.SeedSequence([seed, zlib.crc32(name.encode())])
    out = []
    for kp_spec, kn_spec in grid:
        kp, kn = _counts(kp_spec, s.size, "k_pos"), _counts(kn_spec, s.size, "k_neg")
        g = guess(s, kp, kn, seed=tie_seed)
        out.append(_Pair(kp, kn, int(((g == 1) & member).sum() + ((g == -1) & ~member).sum())))
    return out


def _audit_one(
    name: str,
    s: np.ndarray,
    member: np.ndarray,
    pairs: list[_Pair],
    *,
    delta: float,
    beta: float,
    beta_family: float | None,
    curve,
) -> AttackAudit:
    m, n_pairs = s.size, len(pairs)
    own = [
        epsilon_bound(m, p.r, p.correct, delta=delta, beta=beta / n_pairs, curve=curve)
        for p in pairs
    ]
    fam = (
        [
            epsilon_bound(m, p.r, p.correct, delta=delta, beta=beta_family, curve=curve)
            for p in pairs
        ]
        if beta_family is not None
        else own
    )
    i = int(np.argmax(fam))
    best = pairs[i]
    summ = summarize(s, member).to_dict()
    n_in = int(member.sum())
    return AttackAudit(
        name=name,
        epsilon_lower_bound=max(own),
        confidence=1 - beta,
        ceiling=max(
            epsilon_bound(m, p.r, p.r, delta=delta, beta=beta / n_pairs, curve=curve) for p in pairs
        ),
        family_epsilon_lower_bound=max(fam) if beta_family is not None else None,
        family_confidence=1 - beta_family if beta_family is not None else None,
        auc=summ["auc"],
        balanced_accuracy=summ["balanced_accuracy"],
        advantage=summ["advantage"],
        tpr_at_fpr=summ["tpr_at_fpr"],
        roc=summ["roc"],
        m=m,
        n_members=n_in,
        n_nonmembers=m - n_in,
        k_pos=best.k_pos,
        k_neg=best.k_neg,
        guesses=best.r,
        correct=best.correct,
        delta=delta,
        in_verdict=beta_family is not None,
        tests=_tests(curve),
        method=STEINKE if curve == "generic" else FDP,
    )


def _tests(curve) -> str:
    """The claim a bound under ``curve`` refutes when it exceeds an epsilon."""
    return "(eps, delta)-DP" if curve == "generic" else curve.description


# ---------------------------------------------------------------------------------- entry point


def _family_bound(attack: AttackAudit) -> float:
    """An attack's bound at the family-wise confidence (set for every attack of the family)."""
    if attack.family_epsilon_lower_bound is None:
        raise ValueError(
            f"attack {attack.name!r} has no family-wise bound: it is not in the family"
        )
    return attack.family_epsilon_lower_bound


def audit_scores(
    scores,
    is_member,
    *,
    accounted_epsilon: float | None = None,
    delta: float,
    confidence: float = 0.95,
    seed: int = 0,
    curve="generic",
    guesses=0.1,
    primary: str | None = None,
    inclusion: str | Mapping[str, str] = "unverified",
    notes: Mapping[str, str] | None = None,
) -> AuditResult:
    """Family-wise empirical epsilon lower bound, its ceiling, the detectable epsilon and the verdict.

    Parameters
    ----------
    scores : 1-D array (one score per audited record, higher = more likely a member), or a dict
        attack name -> such array (a family of attacks on the same release).
    is_member : bool (or 0/1) array, which records were in the training data; or a dict attack name
        -> array when the attacks audited different records (e.g. canaries of another run).
    accounted_epsilon : the epsilon the release claims at ``delta``; ``None`` or not finite: no claim.
    delta : delta of the claim (the one-run bound's delta term grows with m * delta).
    confidence : confidence of the verdict's bound for the whole family (Bonferroni, or ``primary``).
    seed : audit seed of the random tie-break (must not depend on ``is_member``).
    curve : the claim the bound tests. ``"generic"`` (default): the bare (epsilon, delta) claim,
        Steinke et al.'s bound. ``"gaussian"``: "as private as the Gaussian mechanism at (epsilon,
        delta)", f-DP analysis (valid only for Gaussian-like mechanisms). A trade-off curve (e.g.
        ``accountants.ledger_curve(ledger)``: "as private as the ledger's PLD", anchored at
        ``accounted_epsilon``), a ``CurveFamily``, or any callable FPR -> smallest FNR.
    guesses : k+ = k- = ``floor(guesses * m)`` (a fraction in (0, 0.5]), or a list of (k_pos, k_neg)
        pairs (counts or fractions) tried with Bonferroni over the grid. Fixed before looking.
    primary : the one attack, declared before looking at the scores, on which the verdict rests
        (at full confidence); the other attacks are then descriptive. ``None``: Bonferroni over all.
    inclusion : ``"random"`` when every audited record was included by an independent fair coin
        (the premise of the one-run theorem), ``"unverified"`` when members and non-members were
        chosen otherwise (e.g. handed over by a user): the result then says so. A dict attack
        name -> one of these when the attacks audited records drawn differently.
    notes : optional attack name -> text stored with that attack (what the scores are).

    Returns
    -------
    AuditResult (``verdict``, ``message``, ``epsilon_lower_bound``, ``epsilon_ceiling``,
    ``detectable_epsilon``, ``attacks``, ``notes``); ``to_dict()`` is the verdict record of
    audit.json / report.json (``status`` = the verdict), strict JSON.
    """
    family_data = _as_family(scores, is_member)
    claim = _check(
        accounted_epsilon, delta, confidence, seed, curve, inclusion, primary, family_data
    )
    how_included = _per_attack(inclusion, family_data)
    curve = _resolve_curve(curve, delta, claim)
    grid, beta = _grid(guesses), 1.0 - confidence
    family = [primary] if primary is not None else list(family_data)
    beta_family = beta / (len(family) * len(grid))
    attacks, pairs = {}, {}
    for name, (s, member) in family_data.items():
        pairs[name] = _pairs(name, s, member, grid, seed)
        attacks[name] = _audit_one(
            name,
            s,
            member,
            pairs[name],
            delta=delta,
            beta=beta,
            curve=curve,
            beta_family=beta_family if name in family else None,
        )
        attacks[name].notes = (notes or {}).get(name, "")
    family_bounds = {n: _family_bound(attacks[n]) for n in family}
    best = max(family, key=lambda n: family_bounds[n])
    bound = family_bounds[best]
    shapes = {(attacks[n].m, p.k_pos, p.k_neg) for n in family for p in pairs[n]}
    ceiling = max(
        epsilon_bound(m, kp + kn, kp + kn, delta=delta, beta=beta_family, curve=curve)
        for m, kp, kn in shapes
    )
    detectable = min(
        detectable_epsilon(
            m, kp + kn, delta=delta, beta=beta_family, target=claim or 0.0, curve=curve, k_pos=kp
        )
        for m, kp, kn in shapes
    )
    correction = (
        f"primary attack {primary!r} declared in advance"
        if primary is not None
        else f"Bonferroni over {len(family)} attack(s)"
    ) + (f" x {len(grid)} (k+, k-) pairs" if len(grid) > 1 else "")
    verdict, message = _verdict(
        claim,
        accounted_epsilon,
        bound,
        best,
        ceiling,
        detectable,
        delta,
        confidence,
        correction,
        None if curve == "generic" else _tests(curve),
    )
    return AuditResult(
        verdict=verdict,
        message=message,
        epsilon_lower_bound=bound,
        attack=best,
        epsilon_ceiling=ceiling,
        detectable_epsilon=detectable,
        accounted_epsilon=None if accounted_epsilon is None else float(accounted_epsilon),
        delta=float(delta),
        confidence=float(confidence),
        correction=correction,
        family=family,
        guess_grid=grid,
        curve=curve if curve == "generic" else curve.kind,
        claim_tested=_tests(curve),
        inclusion=inclusion if isinstance(inclusion, str) else dict(inclusion),
        seed=int(seed),
        attacks=attacks,
        notes=_notes(how_included, family_data, primary),
    )


def decide(bound: float, ceiling: float, accounted_epsilon: float | None) -> str:
    """The verdict from three numbers, so a reader can re-derive it from report.json alone:
    ``no-claim`` (no finite accounted epsilon), ``violation`` (bound > accounted), ``consistent``
    (ceiling > accounted: the audit could have seen a violation), else ``inconclusive``."""
    if accounted_epsilon is None or not math.isfinite(accounted_epsilon):
        return "no-claim"
    if bound > accounted_epsilon:
        return "violation"
    return "consistent" if ceiling > accounted_epsilon else "inconclusive"


def _verdict(
    claim, accounted, bound, best, ceiling, detectable, delta, confidence, correction, tested=None
):
    at = f"at delta={delta:g}"
    lb = (
        f"family-wise lower bound {_fmt(bound)} ({best}; {confidence:.0%} for the whole family, "
        f"{correction})"
    )
    if tested is not None:  # an f-DP bound refutes a stronger claim than (eps, delta)-DP
        lb = f"{lb}, testing the claim '{tested}'"
    reach = (
        f"a mechanism whose true epsilon is {_fmt(detectable)} or more is flagged at least half the "
        "time (detectable epsilon)"
        if math.isfinite(detectable)
        else "no true epsilon is flagged half the time (detectable epsilon: inf)"
    )
    status = decide(bound, ceiling, claim)
    if status == "no-claim":
        why = (
            "no DP claim to check"
            if accounted is None
            else f"the accounted epsilon is {accounted} {at}: no finite guarantee to check"
        )
        return status, f"{why}; {lb} describes leakage only; {reach}"
    if status == "violation":
        return status, (
            f"VIOLATION: {lb} exceeds the accounted epsilon {_fmt(claim)} {at}: the "
            "implementation or the privacy claim is broken (e.g. missing noise, wrong "
            "sampling rate or sensitivity), or the audited records were not included "
            "at random"
        )
    if status == "consistent":
        return status, (
            f"no violation: {lb} <= accounted epsilon {_fmt(claim)} {at}; this audit "
            f"could show at most {_fmt(ceiling)} (ceiling) and {reach}"
        )
    return status, (
        f"inconclusive: this audit can detect at most epsilon {_fmt(ceiling)} (its ceiling), "
        f"not above the accounted epsilon {_fmt(claim)} {at}: no outcome could contradict "
        "the claim (more audited records, more guesses or fewer attacks raise it)"
    )


def _per_attack(inclusion, family_data) -> dict[str, str]:
    if isinstance(inclusion, Mapping):
        missing = sorted(set(family_data) - set(inclusion))
        if missing:
            raise ValueError(
                f"inclusion must name every attack when it is a dict; found none for {missing}"
            )
        return {n: inclusion[n] for n in family_data}
    return dict.fromkeys(family_data, inclusion)


def _notes(inclusion: dict[str, str], family_data, primary) -> list[str]:
    notes = []
    unverified = [n for n, how in inclusion.items() if how == "unverified"]
    if unverified:
        which = "" if len(unverified) == len(inclusion) else f" ({', '.join(unverified)})"
        notes.append(
            f"the bound assumes random inclusion (each audited record in training by an "
            f"independent fair coin, Steinke et al. 2023); not verified for these records{which}: "
            "if members and non-members differ otherwise (e.g. a train/test distribution "
            "shift), the bound can exceed the true epsilon"
        )
    seen = set()
    for name, (_, member) in family_data.items():
        if inclusion[name] == "random":
            m, k = member.size, int(member.sum())
            if (m, k) in seen:  # one check per membership vector (a family usually shares one)
                continue
            seen.add((m, k))
            # two-sided binomial test of fair coins (symmetric at 1/2: twice the smaller tail)
            p = min(1.0, 2 * float(min(stats.binom.cdf(k, m, 0.5), stats.binom.sf(k - 1, m, 0.5))))
            if p < 1e-3:
                notes.append(
                    f"{name}: {k} members of {m} records is unlikely under fair-coin inclusion "
                    f"(two-sided binomial p = {p:.2g}); check how membership was drawn"
                )
    if primary is not None:
        notes.append(
            f"the verdict rests on the primary attack {primary!r} alone; the other attacks' "
            "bounds are descriptive (each at its own confidence)"
        )
    return notes
