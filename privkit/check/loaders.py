"""Findings on a data loader: the batches it draws against the Poisson sampling that is accounted.

Every DP-SGD accountant in common use (opacus', dp-accounting's, privkit's own ``dpsgd``) accounts
Poisson sampling at a rate ``q``.  What a loader really draws, read from its attributes
(:func:`accountants.samplers.describe_loader`):

* opacus' ``DPDataLoader``: Poisson sampling at its ``sample_rate``; a finding only where the
  accounted rate differs from it (the epsilon at the loader's rate is what holds);
* shuffled fixed-size batches (``RandomSampler`` / ``shuffle=True``, ``SubsetRandomSampler``, a
  shuffling ``DistributedSampler``) or a fixed order (``SequentialSampler``): the Poisson epsilon
  does not apply; :func:`accountants.samplers.account_loader` gives a sound upper bound and a
  certified lower bound (Chua et al. 2024's attack);
* a ``DistributedSampler`` over ``R`` processes: each process draws its own batch from its shard,
  so a step holds ``R`` batches and a record's rate is ``R`` times the per-process
  ``batch_size / len(dataset)``;
* sampling with replacement (``WeightedRandomSampler``, ``RandomSampler(replacement=True)``): no
  sound accountant; opacus derives ``1 / len(loader)`` while the heaviest record is in a batch of
  ``B`` draws with probability ``1 - (1 - w_max / W)^B`` per step (opacus issues #813 and #815).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from privkit.check.findings import Finding, bracket, changes

__all__ = ["Accounting", "loader_findings", "loader_steps", "poisson_epsilon"]

_POISSON_SAMPLERS = ("UniformWithReplacementSampler", "DistributedUniformWithReplacementSampler")
_RATE_TOLERANCE = 1e-6
DEFAULT_RATE = "batch_size / len(dataset), as a DP-SGD loop accounts it"


@dataclass(frozen=True)
class Accounting:
    """What the accountant will be told, and the noise that will really be added.

    Attributes
    ----------
    delta : float
        Delta of every epsilon.
    noise_multiplier : float or None
        The multiplier the accountant uses.
    noise_run : float or None
        The multiplier the optimizer adds (opacus' DPOptimizer), else ``noise_multiplier``.
    sample_rate : float or None
        The rate the accountant uses; None: a loader's own ``batch_size / len(dataset)``.
    rate_source : str
        Where ``sample_rate`` comes from, for the messages.
    steps, epochs : int or None
        The length of the training (at most one of them).
    """

    delta: float
    noise_multiplier: float | None
    noise_run: float | None
    sample_rate: float | None
    rate_source: str
    steps: int | None
    epochs: int | None


@functools.lru_cache(maxsize=256)
def poisson_epsilon(sample_rate: float, noise_multiplier: float, steps: int, delta: float) -> float:
    """Epsilon of Poisson-sampled DP-SGD (dp-accounting PLD, pessimistic), the claim a loader is held to.

    Parameters
    ----------
    sample_rate : float
        Poisson rate ``q`` in (0, 1].
    noise_multiplier : float
        Noise std over the clipping norm.
    steps : int
        Number of steps.
    delta : float
        Target delta.

    Returns
    -------
    float
    """
    from accountants.samplers import sampler_accounting

    return sampler_accounting("poisson", sample_rate, noise_multiplier, steps, delta).epsilon


def loader_steps(loader: Any, acc: Accounting) -> int | None:
    """The number of steps ``loader`` will run: ``acc.steps``, or ``acc.epochs * len(loader)``.

    Parameters
    ----------
    loader : torch DataLoader
        The loader.
    acc : Accounting
        The training's length.

    Returns
    -------
    int or None
        None when neither steps nor epochs is known.
    """
    if acc.steps is not None:
        return acc.steps
    return None if acc.epochs is None else acc.epochs * len(loader)


def _sampler(loader: Any) -> Any:
    inner = getattr(loader.batch_sampler, "sampler", None)
    return loader.sampler if inner is None else inner


@dataclass(frozen=True)
class _Read:
    """What a loader draws."""

    kind: str  # poisson, shuffle, fixed_order, with_replacement, unknown_sampler
    sampler: str  # the sampler's class name
    rate: float | None  # a record's rate per step (Poisson q, or 1 / batches per epoch)
    batch_size: int | None
    world_size: int
    text: str  # what it draws, for a message


def _read(loader: Any) -> _Read:
    from accountants.samplers import describe_loader

    batch_sampler = loader.batch_sampler
    if type(batch_sampler).__name__ in _POISSON_SAMPLERS:
        q = float(batch_sampler.sample_rate)
        text = f"Poisson sampling at rate {q:.4g} ({type(batch_sampler).__name__})"
        return _Read("poisson", type(batch_sampler).__name__, q, None, 1, text)
    sampler = _sampler(loader)
    name = type(sampler).__name__
    batch = getattr(loader, "batch_size", None) or getattr(batch_sampler, "batch_size", None)
    if name == "WeightedRandomSampler" or getattr(sampler, "replacement", False):
        return _Read("with_replacement", name, None, batch, 1, f"{name} draws")
    try:
        info = describe_loader(loader)
    except ValueError as exc:
        return _Read("unknown_sampler", name, None, batch, 1, str(exc))
    world = int(getattr(sampler, "num_replicas", 1)) if name == "DistributedSampler" else 1
    fixed = name == "SequentialSampler" or (
        name == "DistributedSampler" and not getattr(sampler, "shuffle", True)
    )
    t = info["batches_per_epoch"]
    text = (
        f"{'batches in a fixed order' if fixed else 'shuffled fixed-size batches'} ({name}: {t} "
        f"batches of {info['batch_size']} per epoch from {info['dataset_size']} records"
        + (f", one of {world} processes" if world > 1 else "")
        + ")"
    )
    return _Read("fixed_order" if fixed else "shuffle", name, 1.0 / t, batch, world, text)


def _claim(acc: Accounting, loader: Any, read: _Read) -> tuple[float | None, str]:
    """The accounted rate and where it comes from."""
    if acc.sample_rate is not None:
        return acc.sample_rate, acc.rate_source
    if read.kind == "poisson":
        return read.rate, "the loader's own rate"
    batch, n = read.batch_size, len(loader.dataset)
    return (None, DEFAULT_RATE) if not batch or not n else (min(1.0, batch / n), DEFAULT_RATE)


def _missing(acc: Accounting, steps: int | None) -> str:
    what = [
        w
        for w, v in (("noise_multiplier", acc.noise_multiplier), ("steps or epochs", steps))
        if v is None
    ]
    return f"give {' and '.join(what)} for the epsilons" if what else ""


def loader_findings(name: str, loader: Any, acc: Accounting) -> list[Finding]:
    """Every mismatch between what ``loader`` draws and the Poisson sampling ``acc`` accounts.

    Parameters
    ----------
    name : str
        The loader's name in the messages.
    loader : torch DataLoader
        A torch ``DataLoader`` or opacus ``DPDataLoader``.
    acc : Accounting
        What will be accounted.

    Returns
    -------
    list of Finding
        ``shuffle`` / ``fixed_order`` (with the shuffle bracket), ``with_replacement`` /
        ``weighted``, ``unknown_sampler``, ``sample_rate`` and ``distributed`` findings.
    """
    read = _read(loader)
    steps = loader_steps(loader, acc)
    q_acc, source = _claim(acc, loader, read)
    known = None not in (q_acc, acc.noise_multiplier, steps)
    claimed = poisson_epsilon(q_acc, acc.noise_multiplier, steps, acc.delta) if known else None
    accounted = (
        f"accounted as Poisson sampling at rate {q_acc:.4g} ({source})"
        + ("" if claimed is None else f", which claims epsilon {claimed:.4g}")
        if q_acc is not None
        else "accounted as Poisson sampling"
    )
    missing = _missing(acc, steps)
    at = f"at delta {acc.delta:g} after {steps} steps"
    if read.kind == "with_replacement":
        return [_with_replacement(name, loader, read, q_acc, accounted, claimed)]
    if read.kind == "unknown_sampler":
        return [Finding("unknown_sampler", f"{name}: not checked: {read.text}", False, claimed)]
    upper = lower = None
    if read.kind != "poisson" and acc.noise_run is not None and steps is not None:
        from accountants.samplers import account_loader

        res = account_loader(loader, acc.noise_run, acc.delta, steps=steps)
        upper, lower = res.epsilon, res.epsilon_lower
    out = []
    if read.kind in ("shuffle", "fixed_order"):
        if read.kind == "fixed_order" and upper is not None:
            exact = f"epsilon {upper:.4g}, exact: each record's batch is known (no amplification)"
            holds = f"what holds {at}: {exact}"
        else:
            holds = f"what holds {at}: {bracket(upper, lower)} (shuffle bounds; Chua et al. 2024)"
        holds = missing or holds
        message = f"{name}: {read.text} {accounted}; {holds}"
        out.append(Finding(read.kind, message, changes(claimed, upper), claimed, upper, lower))
    rate = _rate_finding(name, read, q_acc, source, acc, steps, claimed, (upper, lower), at)
    return out + ([rate] if rate is not None else [])


def _rate_finding(
    name: str,
    read: _Read,
    q_acc: float | None,
    source: str,
    acc: Accounting,
    steps: int | None,
    claimed: float | None,
    sampler_bracket: tuple[float | None, float | None],
    at: str,
) -> Finding | None:
    """The accounted rate against the loader's: for Poisson loaders, a stated or hooked rate, and
    for a DistributedSampler, the per-process rate."""
    if q_acc is None or read.rate is None:
        return None
    q = read.rate
    if read.kind == "poisson":
        if abs(q_acc - q) <= _RATE_TOLERANCE * q:
            return None
        known = acc.noise_run is not None and steps is not None
        upper = poisson_epsilon(q, acc.noise_run, steps, acc.delta) if known else None
        lower = None
    elif q_acc < q * (1 - _RATE_TOLERANCE) and (read.world_size > 1 or source != DEFAULT_RATE):
        upper, lower = sampler_bracket
    else:
        return None
    holds = _missing(acc, steps) or f"what holds {at}: {bracket(upper, lower)}"
    if read.world_size > 1 and q_acc < q:
        message = (
            f"{name}: {read.sampler} over {read.world_size} processes: each process draws its own "
            f"batch from its shard, so a record's rate per step is {q:.4g}, {q / q_acc:.3g}x the "
            f"per-process rate {q_acc:.4g} accounted ({source}); {holds}"
        )
        kind = "distributed"
    else:
        direction = "above" if q > q_acc else "below (the claim is conservative)"
        message = (
            f"{name}: the loader runs at rate {q:.4g}, {direction} the rate {q_acc:.4g} accounted "
            f"({source})"
            + ("" if claimed is None else f", which claims epsilon {claimed:.4g}")
            + f"; {holds}"
        )
        kind = "sample_rate"
    return Finding(kind, message, changes(claimed, upper), claimed, upper, lower)


def _with_replacement(
    name: str,
    loader: Any,
    read: _Read,
    q_acc: float | None,
    accounted: str,
    claimed: float | None,
) -> Finding:
    """No sound accountant: the heaviest record's per-step inclusion against the accounted rate."""
    sampler = _sampler(loader)
    weights = getattr(sampler, "weights", None)
    if weights is not None:
        share = float(weights.max()) / float(weights.double().sum())
    else:
        share = 1.0 / len(sampler.data_source)
    batch = read.batch_size or 1
    heaviest, replacement = "", bool(getattr(sampler, "replacement", True))
    if replacement:
        p = -math.expm1(batch * math.log1p(-share)) if share < 1 else 1.0
        versus = "" if q_acc is None else f", {p / q_acc:.3g}x the accounted rate {q_acc:.4g}"
        heaviest = (
            f"; its heaviest record ({share:.4g} of the total weight) is in a batch of {batch} "
            f"draws with probability {p:.4g} per step{versus} (opacus #813/#815)"
        )
    message = (
        f"{name}: {read.text} with{'' if replacement else 'out'} replacement {accounted}: no "
        f"sound accountant exists for it{heaviest}"
    )
    kind = "with_replacement" if replacement else "weighted"
    return Finding(kind, message, True, claimed, None, None)
