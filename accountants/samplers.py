"""DP-SGD under the batch samplers people run: Poisson, shuffling, random allocation (balls in bins).

Every library accounts for Poisson sampling; most training runs shuffle the data into fixed-size
batches (PyTorch's ``DataLoader(shuffle=True)``) or allocate each record to one random step of
an epoch.  The Poisson epsilon does not describe those runs: Chua et al. (2024, "How private are
DP-SGD implementations?"; 2024b, "Scalable DP-SGD: shuffling vs. Poisson subsampling") show that
shuffling can leak far more.  privkit therefore reports, per sampler:

* ``poisson``: dp-accounting's PLD (pessimistic, an upper bound), as :func:`accountants.dpsgd_accounting`.
* ``shuffle``: each epoch is a random permutation cut into ``t = 1/q`` batches, so a record is in
  exactly one batch per epoch.

  - *Upper bound* (sound, no amplification): the adversary may know which batch holds the record,
    so each epoch is one Gaussian mechanism with multiplier ``sigma``; ``ceil(T/t)`` started epochs
    compose to a Gaussian with ``sigma / sqrt(ceil(T/t))`` (exact epsilon, Balle & Wang 2018).
    This is tf-privacy's "each example once per epoch" statement.
  - *Lower bound* (certified): the attack of Chua et al. (2024).  All other records have gradient
    ``-C`` and the target ``+C`` (replaced by a zero-gradient record in the neighbour), so the
    target's batch stands out in both worlds and only its shift (2C vs C) differs.  The adversary
    keeps the largest of the ``t`` batch sums of each epoch.  That statistic's distribution is in
    closed form (``Phi((m - mu)/sigma) Phi(m/sigma)^(t-1)``); it is binned (post-processing), its
    exact binned PLD is built with losses rounded *down* (dp-accounting's optimistic estimate)
    and composed over the ``floor(T/t)`` complete epochs without tail truncation.  Every step
    can only lower the divergence, so the resulting epsilon is a lower bound on the epsilon of any
    valid accountant for shuffled DP-SGD at these parameters.

* ``random-allocation``: each record is used in one uniformly random step of each epoch of ``t``
  steps, independently of the others (Chua et al. 2025 "balls and bins"; Feldman & Shenfeld 2025).
  Per epoch the dominating pair is ``P = (1/t) sum_j N(e_j, sigma^2 I_t)`` vs ``Q = N(0, sigma^2 I_t)``.

  - *Upper bound*: the smallest of three sound bounds.  (a) The no-amplification Gaussian above.
    (b) A PLD bound without Monte Carlo (:mod:`accountants.allocation_pld`): both directions'
    hockey-stick curves are expectations of convex functions of the likelihood ratio, a mean of
    ``t`` i.i.d. lognormals; each lognormal is replaced by a mean-preserving spread onto a grid
    (which can only raise them), the ``t``-fold sum is computed exactly up to float rounding, and
    the epochs compose by dp-accounting with losses rounded up.  Second-order tight: at the
    configuration of docs/budgets.md it gives 0.882 where the attack certifies 0.451 and Poisson
    gives 0.918.
    (c) An RDP bound taking the worse of the two directions: remove direction ``D_a(P||Q)``
    *exactly* at integer orders (the multinomial expansion of ``E_Q[(P/Q)^a]`` over the partitions
    of ``a``; Feldman & Shenfeld 2025, Cor. 6.2, re-derived in :func:`random_allocation_rdp_remove`),
    add direction ``D_a(Q||P) <= (a - 1 + t) / (2 t sigma^2)`` (arithmetic-geometric mean
    inequality, :func:`random_allocation_rdp_add`; loose, 4.86 at that configuration).
  - *Lower bound*: the same max-of-batch-sums attack (record with gradient ``C`` against no
    record; other records contribute nothing).

``steps`` need not be a whole number of epochs: upper bounds count started epochs, lower bounds
complete ones.  Neighbouring relation: add/remove one record, where for shuffling the removed
record's slot stays empty (its batch sums one record fewer; the normalisation is the fixed batch
size), the relation under which both shuffle bounds hold.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

import dp_accounting as dpa
import numpy as np
from dp_accounting.pld import privacy_loss_distribution as _pld
from scipy import special

from accountants._validate import check_choice, check_int, check_open_unit, check_positive
from accountants.allocation_pld import random_allocation_pld_epsilon
from accountants.choices import SAMPLERS
from accountants.dpsgd import _check_sample_rate, dpsgd_accounting
from accountants.gaussian import safe_gaussian_epsilon

__all__ = [
    "SAMPLERS",
    "SamplerAccounting",
    "account_loader",
    "describe_loader",
    "random_allocation_rdp_add",
    "random_allocation_rdp_remove",
    "sampler_accounting",
    "shuffle_lower_epsilon",
]

RDP_ORDERS = tuple(range(2, 33))
LOWER_VDI = 1e-3
POISSON_NOTE = (
    "the Poisson epsilon does not apply to this sampler: it assumes each record joins each "
    "step independently with probability q"
)


@dataclass(frozen=True)
class SamplerAccounting:
    """Epsilon bounds of DP-SGD under one batch sampler.

    ``epsilon`` is a sound upper bound; ``epsilon_lower`` (None for Poisson) a certified lower
    bound on what any valid accountant can report for this sampler and these parameters.
    """

    sampler: str
    epsilon: float
    epsilon_lower: float | None
    delta: float
    noise_multiplier: float
    sample_rate: float
    steps: int
    batches_per_epoch: int | None
    epochs: float
    upper_method: str
    lower_method: str | None
    notes: tuple[str, ...]


def _batch_counts(q: float, batches_per_epoch: int | None) -> tuple[int, int, list[str]]:
    """(t for upper bounds, t for lower bounds, notes).

    Fewer batches per epoch means more epochs in the same steps and less hiding, so upper bounds
    take ``floor(1/q)`` and lower bounds ``ceil(1/q)`` when ``1/q`` is not a whole number.
    """
    if batches_per_epoch is not None:
        t = check_int(batches_per_epoch, "batches_per_epoch")
        return t, t, []
    inv = 1.0 / q
    t_up, t_low = max(1, math.floor(inv + 1e-9)), math.ceil(inv - 1e-9)
    if t_up == t_low:
        return t_up, t_low, []
    return (
        t_up,
        t_low,
        [
            f"1/sample_rate = {inv:.6g} is not a whole number of batches per epoch: upper bounds "
            f"use {t_up}, lower bounds {t_low} (pass batches_per_epoch for the exact count)"
        ],
    )


def sampler_accounting(
    sampler: str,
    sample_rate: float,
    noise_multiplier: float,
    steps: int,
    delta: float,
    *,
    batches_per_epoch: int | None = None,
    value_discretization_interval: float = 1e-4,
) -> SamplerAccounting:
    """Epsilon of ``steps`` DP-SGD steps with multiplier ``noise_multiplier`` under ``sampler``.

    Parameters
    ----------
    sampler : {"poisson", "shuffle", "random-allocation"}
    sample_rate : float
        Poisson: the sampling probability q.  Shuffle / random allocation: batch size / dataset
        size, i.e. 1 / (batches per epoch).
    noise_multiplier, steps, delta
        As in :func:`accountants.dpsgd_accounting`.
    batches_per_epoch : int, optional
        Shuffle / random allocation: the exact number of batches per epoch (e.g. ``len(loader)``);
        by default derived from ``sample_rate``.
    value_discretization_interval : float
        PLD grid of the Poisson accountant.

    Returns
    -------
    SamplerAccounting
    """
    check_choice(sampler, "sampler", SAMPLERS)
    q = _check_sample_rate(sample_rate)
    sigma = check_positive(noise_multiplier, "noise_multiplier")
    steps = check_int(steps, "steps")
    delta = check_open_unit(delta, "delta")
    if sampler == "poisson":
        res = dpsgd_accounting(
            q,
            sigma,
            steps,
            delta,
            accountant="pld",
            value_discretization_interval=value_discretization_interval,
        )
        return SamplerAccounting(
            "poisson",
            res.epsilon,
            None,
            delta,
            sigma,
            q,
            steps,
            None,
            steps * q,
            "dp-accounting PLD (pessimistic)",
            None,
            res.warnings,
        )
    t_up, t_low, notes = _batch_counts(q, batches_per_epoch)
    started, complete = math.ceil(steps / t_up), steps // t_low
    no_amp = safe_gaussian_epsilon(sigma / math.sqrt(started), delta)
    notes.insert(0, POISSON_NOTE)
    if sampler == "shuffle":
        upper, upper_method = (
            no_amp,
            f"Gaussian per started epoch, no amplification ({started} epochs)",
        )
        lower = shuffle_lower_epsilon(t_low, sigma, complete, delta) if complete else None
        notes.append(
            "upper bound: the record is in exactly one batch per epoch and the adversary may know "
            "which; lower bound: Chua et al. (2024) attack (other records' gradients -C reveal the "
            "target's batch), max batch sum per epoch"
        )
    else:
        bounds = {
            f"Gaussian per started epoch, no amplification ({started} epochs)": no_amp,
            "PLD of a mean-preserving spread of the likelihood ratio (no Monte Carlo)": (
                random_allocation_pld_epsilon(
                    t_up, sigma, started, delta, value_discretization_interval
                )
            ),
            "RDP: remove direction exact, add direction AM-GM bound": (
                _random_allocation_rdp_epsilon(t_up, sigma, started, delta)
            ),
        }
        upper_method = min(bounds, key=lambda method: bounds[method])
        upper = bounds[upper_method]
        lower = random_allocation_lower_epsilon(t_low, sigma, complete, delta) if complete else None
        notes.append(
            "upper bound: the smallest of three sound bounds (see upper_method); lower bound: max "
            "batch sum per epoch (the record against no record)"
        )
    if lower is None:
        notes.append(f"no complete epoch in {steps} steps of {t_low} batches: no lower bound")
    return SamplerAccounting(
        sampler,
        upper,
        lower,
        delta,
        sigma,
        q,
        steps,
        t_up,
        steps / t_up,
        upper_method,
        None if lower is None else "max batch sum per epoch, optimistic PLD",
        tuple(notes),
    )


# ----------------------------------------------------------------------------- random allocation RDP
@functools.lru_cache(maxsize=64)
def _partition_stats(alpha: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For every partition of ``alpha``: its number of parts, sum log(part!), sum part^2 and
    sum log(multiplicity!) (the parts of equal size are interchangeable)."""
    parts, log_fact, squares, log_mult = [], [], [], []

    def walk(remaining: int, largest: int, acc: list[int]) -> None:
        if remaining == 0:
            counts = np.bincount(acc)
            parts.append(len(acc))
            log_fact.append(float(np.sum(special.gammaln(np.asarray(acc) + 1.0))))
            squares.append(float(np.sum(np.square(acc))))
            log_mult.append(float(np.sum(special.gammaln(counts[counts > 0] + 1.0))))
            return
        for part in range(min(remaining, largest), 0, -1):
            acc.append(part)
            walk(remaining - part, part, acc)
            acc.pop()

    walk(alpha, alpha, [])
    return tuple(np.asarray(v, dtype=float) for v in (parts, log_fact, squares, log_mult))  # type: ignore[return-value]


def random_allocation_rdp_remove(alpha: int, steps_per_epoch: int, sigma: float) -> float:
    """Exact ``D_alpha(P || Q)`` of one epoch of random allocation (one of ``t`` steps, Gaussian).

    With ``Z_j = exp((Y_j - 1/2)/sigma^2)`` and ``Y ~ Q = N(0, sigma^2 I_t)``, ``P/Q = (1/t) sum_j Z_j``
    and ``E[prod_j Z_j^{a_j}] = exp(sum_j a_j (a_j - 1) / (2 sigma^2))``, so the multinomial expansion
    of ``E_Q[(P/Q)^alpha]`` groups by the partition ``lambda`` of ``alpha`` formed by the non-zero
    exponents: each partition with ``m <= t`` parts occurs ``t!/((t-m)! prod mult!)`` times with
    coefficient ``alpha!/prod lambda_i!`` and value ``exp((sum lambda_i^2 - alpha) / (2 sigma^2))``,
    all divided by ``t^alpha``.  (Feldman & Shenfeld 2025, Corollary 6.2.)
    """
    t = int(steps_per_epoch)
    parts, log_fact, squares, log_mult = _partition_stats(int(alpha))
    ok = parts <= t
    log_assign = special.gammaln(t + 1.0) - special.gammaln(t - parts[ok] + 1.0) - log_mult[ok]
    terms = (
        log_assign + (special.gammaln(alpha + 1.0) - log_fact[ok]) + squares[ok] / (2 * sigma**2)
    )
    log_moment = float(special.logsumexp(terms)) - alpha * math.log(t) - alpha / (2 * sigma**2)
    return max(0.0, log_moment) / (alpha - 1)


def random_allocation_rdp_add(alpha: float, steps_per_epoch: int, sigma: float) -> float:
    """Upper bound on ``D_alpha(Q || P)`` of one epoch of random allocation.

    ``E_Q[(Q/P)^(alpha-1)] = E[(mean_j Z_j)^-(alpha-1)] <= E[prod_j Z_j^-((alpha-1)/t)]`` (the mean is
    at least the geometric mean), and the right side factorises into Gaussian moments:
    ``exp((alpha - 1)((alpha - 1)/t + 1) / (2 sigma^2))``.  Hence ``D_alpha <= (alpha - 1 + t)/(2 t sigma^2)``.
    """
    t = float(steps_per_epoch)
    return (alpha - 1 + t) / (2 * t * sigma**2)


def _random_allocation_rdp_epsilon(t: int, sigma: float, epochs: int, delta: float) -> float:
    orders = np.asarray(RDP_ORDERS, dtype=float)
    remove = epochs * np.array([random_allocation_rdp_remove(int(a), t, sigma) for a in RDP_ORDERS])
    add = epochs * np.array([random_allocation_rdp_add(a, t, sigma) for a in RDP_ORDERS])
    eps = [
        dpa.rdp.rdp_privacy_accountant.compute_epsilon(orders, rdp, delta)[0]
        for rdp in (remove, add)
    ]
    return float(max(eps))


# ----------------------------------------------------------------------------- lower bounds (attack)
def _max_statistic_log_pmf(t: int, sigma: float, mu: float, edges: np.ndarray) -> dict[int, float]:
    """Binned distribution of ``max_j Y_j``: one coordinate ~ N(mu, sigma^2), ``t - 1`` ~ N(0, sigma^2)."""
    z = edges / sigma
    log_cdf = special.log_ndtr(z - mu / sigma) + (t - 1) * special.log_ndtr(z)
    log_cdf = np.concatenate([[-np.inf], log_cdf, [0.0]])
    # P(bin) = F(b) - F(a) = F(b) (1 - F(a)/F(b)), in logs
    with np.errstate(divide="ignore"):
        log_p = log_cdf[1:] + np.log(-np.expm1(log_cdf[:-1] - log_cdf[1:]))
    return {i: float(v) for i, v in enumerate(log_p) if np.isfinite(v)}


def _lower_epsilon(
    t: int, sigma: float, epochs: int, delta: float, mu_with: float, mu_without: float
) -> float:
    """Epsilon of the binned max-statistic pair (optimistic PLD), composed over ``epochs``."""
    lo, hi = min(mu_with, mu_without) - 12 * sigma, max(mu_with, mu_without) + 12 * sigma
    edges = np.linspace(lo, hi + sigma * math.sqrt(2 * math.log(max(t, 2))), 4001)
    upper = _max_statistic_log_pmf(t, sigma, mu_with, edges)
    lower = _max_statistic_log_pmf(t, sigma, mu_without, edges)
    pld = _pld.from_two_probability_mass_functions(
        lower,
        upper,
        pessimistic_estimate=False,
        value_discretization_interval=LOWER_VDI,
        symmetric=False,
    )
    if epochs > 1:
        pld = pld.self_compose(epochs, tail_mass_truncation=0)  # no truncation: stays a lower bound
    return float(pld.get_epsilon_for_delta(delta))


def shuffle_lower_epsilon(batches_per_epoch: int, sigma: float, epochs: int, delta: float) -> float:
    """Certified lower bound on the epsilon of shuffled DP-SGD (see the module docstring).

    In units of the clipping norm, the target's batch sum sits 2 above the others with the record
    and 1 above them with the zero-gradient neighbour.
    """
    return _lower_epsilon(int(batches_per_epoch), float(sigma), int(epochs), delta, 2.0, 1.0)


def random_allocation_lower_epsilon(
    batches_per_epoch: int, sigma: float, epochs: int, delta: float
) -> float:
    """Certified lower bound on the epsilon of random allocation: the record (shift 1) against none."""
    return _lower_epsilon(int(batches_per_epoch), float(sigma), int(epochs), delta, 1.0, 0.0)


# ----------------------------------------------------------------------------- a user's DataLoader
def describe_loader(loader: Any) -> dict:
    """Which sampler a PyTorch / opacus ``DataLoader`` runs, and its rate and batch count.

    Read from the loader's attributes (no torch import): opacus's ``DPDataLoader`` /
    ``UniformWithReplacementSampler`` is Poisson sampling at its ``sample_rate``;
    ``RandomSampler`` (``shuffle=True``), ``SubsetRandomSampler`` and a shuffling
    ``DistributedSampler`` are shuffling; ``SequentialSampler`` (``shuffle=False``) is a fixed order,
    for which shuffling's no-amplification upper bound is exact.  Sampling with replacement
    (``WeightedRandomSampler``, ``RandomSampler(replacement=True)``) has no accountant here and
    raises ``ValueError`` (opacus issue 813: such loaders are easy to mis-account).

    Returns
    -------
    dict
        ``{"sampler", "sample_rate", "batches_per_epoch", "dataset_size", "batch_size", "notes"}``.
    """
    batch_sampler = getattr(loader, "batch_sampler", None)
    if batch_sampler is None or not hasattr(loader, "dataset"):
        raise ValueError(f"loader must be a torch DataLoader; found {type(loader).__name__}")
    n = len(loader.dataset)
    if type(batch_sampler).__name__ == "UniformWithReplacementSampler":  # opacus Poisson sampling
        q = float(batch_sampler.sample_rate)
        return {
            "sampler": "poisson",
            "sample_rate": q,
            "batches_per_epoch": len(loader),
            "dataset_size": n,
            "batch_size": q * n,
            "notes": ["opacus Poisson sampling (DPDataLoader)"],
        }
    sampler: Any = getattr(batch_sampler, "sampler", None) or getattr(loader, "sampler", None)
    kind = type(sampler).__name__
    notes: list[str] = []
    if kind in ("WeightedRandomSampler",) or (
        kind == "RandomSampler" and getattr(sampler, "replacement", False)
    ):
        raise ValueError(
            f"loader samples with replacement ({kind}); privkit has no sound accountant for it: "
            "use opacus's DPDataLoader (Poisson) or shuffle without replacement"
        )
    if kind == "SequentialSampler":
        notes.append(
            "fixed order (shuffle=False): every record's batch is known, so the shuffle upper bound "
            "(no amplification) is exact here"
        )
    elif kind == "DistributedSampler" and not getattr(sampler, "shuffle", True):
        notes.append(
            "DistributedSampler without shuffling: fixed order, the no-amplification bound is exact"
        )
    elif kind not in ("RandomSampler", "SubsetRandomSampler", "DistributedSampler"):
        raise ValueError(
            f"loader's sampler must be a torch RandomSampler, SequentialSampler, SubsetRandomSampler "
            f"or DistributedSampler, or opacus's Poisson sampler; found {kind}"
        )
    t = len(loader)
    batch = getattr(loader, "batch_size", None) or getattr(batch_sampler, "batch_size", None)
    notes.append(f"{t} batches of {batch} per epoch from {len(sampler)} records")
    return {
        "sampler": "shuffle",
        "sample_rate": 1.0 / t,
        "batches_per_epoch": t,
        "dataset_size": len(sampler),
        "batch_size": batch,
        "notes": notes,
    }


def account_loader(
    loader: object,
    noise_multiplier: float,
    delta: float,
    *,
    epochs: int | None = None,
    steps: int | None = None,
) -> SamplerAccounting:
    """Epsilon bounds of DP-SGD run with ``loader`` (see :func:`describe_loader`) for ``epochs`` or ``steps``."""
    info = describe_loader(loader)
    if (epochs is None) == (steps is None):
        raise ValueError(
            "give exactly one of epochs or steps; found "
            + ("both" if epochs is not None else "neither")
        )
    if steps is None:
        steps = check_int(epochs, "epochs") * info["batches_per_epoch"]
    if info["sampler"] == "poisson":
        res = sampler_accounting("poisson", info["sample_rate"], noise_multiplier, steps, delta)
    else:
        res = sampler_accounting(
            "shuffle",
            info["sample_rate"],
            noise_multiplier,
            steps,
            delta,
            batches_per_epoch=info["batches_per_epoch"],
        )
    return dataclasses.replace(res, notes=tuple(info["notes"]) + res.notes)
