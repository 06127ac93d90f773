"""What an opacus setup will account, and its findings: secure mode, the noise multiplier.

``PrivacyEngine.make_private`` attaches a step hook to the DPOptimizer that feeds its accountant
``sample_rate = 1 / len(data_loader)`` whatever the loader draws; the rate is read from that hook
(or, once steps ran, from the accountant's history).  With ``secure_mode`` off, opacus draws its
noise from torch's floating-point Gaussian sampler, which Mironov (2012, "On significance of the
least significant bits for differential privacy") shows can leak the unnoised value: fine for
experiments, not for a release.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from privkit.check.findings import Finding, changes

__all__ = ["OpacusSetup", "noise_finding", "read_opacus", "secure_mode_finding"]


@dataclass(frozen=True)
class OpacusSetup:
    """What the opacus objects of a configuration say.

    Attributes
    ----------
    sample_rate : float or None
        The rate opacus' accountant is fed (step hook, else accountant history).
    rate_source : str
        Where ``sample_rate`` was read.
    noise_multiplier : float or None
        The DPOptimizer's ``noise_multiplier`` (the noise it adds).
    insecure : tuple of str
        Names of the engines and optimizers whose ``secure_mode`` is off.
    """

    sample_rate: float | None
    rate_source: str
    noise_multiplier: float | None
    insecure: tuple[str, ...]


def _hook_rate(optimizer: Any) -> float | None:
    hook = getattr(optimizer, "step_hook", None)
    if hook is None:
        return None
    rate = inspect.getclosurevars(hook).nonlocals.get("sample_rate")
    return None if rate is None else float(rate)


def read_opacus(engines: list[tuple[str, Any]], optimizers: list[tuple[str, Any]]) -> OpacusSetup:
    """Read the accounted rate, the noise multiplier and secure mode of opacus objects.

    Parameters
    ----------
    engines : list of (str, PrivacyEngine)
        Named engines.
    optimizers : list of (str, DPOptimizer)
        Named DP optimizers.

    Returns
    -------
    OpacusSetup
    """
    rate, source = None, ""
    for name, opt in optimizers:
        if (rate := _hook_rate(opt)) is not None:
            source = f"opacus accountant hook of {name}: 1 / len(data_loader)"
            break
    if rate is None:
        for name, engine in engines:
            history = getattr(engine.accountant, "history", None) or []
            if history:
                rate, source = float(history[-1][1]), f"{name}'s accountant history"
                break
    noise = next((float(o.noise_multiplier) for _, o in optimizers), None)
    insecure = tuple(n for n, o in [*engines, *optimizers] if not getattr(o, "secure_mode", False))
    return OpacusSetup(rate, source, noise, insecure)


def secure_mode_finding(setup: OpacusSetup, release: bool) -> Finding | None:
    """A finding when some engine or optimizer runs with ``secure_mode`` off.

    Parameters
    ----------
    setup : OpacusSetup
        What :func:`read_opacus` read.
    release : bool
        Whether the model is for release: only then does the finding change the epsilon.

    Returns
    -------
    Finding or None
    """
    if not setup.insecure:
        return None
    verdict = (
        "the model is for release, so the accounted epsilon does not hold"
        if release
        else "the accounted epsilon is unchanged, but this run is not for release"
    )
    message = (
        f"{', '.join(setup.insecure)}: opacus secure_mode is off: the noise comes from torch's "
        f"floating-point Gaussian sampler, whose low-order bits can reveal the unnoised value "
        f"(Mironov 2012 floating-point attack); {verdict}"
    )
    return Finding("secure_mode", message, release)


def noise_finding(
    stated: float,
    setup: OpacusSetup,
    sample_rate: float | None,
    steps: int | None,
    delta: float,
) -> Finding | None:
    """A finding when the accountant's noise multiplier differs from the DPOptimizer's.

    Parameters
    ----------
    stated : float
        The multiplier the accountant is given.
    setup : OpacusSetup
        The DPOptimizer's multiplier.
    sample_rate : float or None
        The accounted Poisson rate, for the epsilons (None: no epsilons).
    steps : int or None
        The number of steps, for the epsilons (None: no epsilons).
    delta : float
        Delta of the epsilons.

    Returns
    -------
    Finding or None
    """
    from privkit.check.loaders import poisson_epsilon

    run = setup.noise_multiplier
    if run is None or abs(run - stated) <= 1e-12 * stated:
        return None
    claimed = upper = None
    tail = "; give steps or epochs and a sample rate for the epsilons"
    if sample_rate is not None and steps is not None:
        claimed = poisson_epsilon(sample_rate, stated, steps, delta)
        upper = poisson_epsilon(sample_rate, run, steps, delta)
        tail = (
            f"; Poisson at rate {sample_rate:.4g}, {steps} steps, delta {delta:g}: claimed epsilon "
            f"{claimed:.4g}, at the noise added {upper:.4g}"
        )
    message = f"accounted at noise_multiplier {stated:g} but the DPOptimizer adds {run:g}{tail}"
    return Finding("noise_multiplier", message, changes(claimed, upper), claimed, upper)
