"""What a Flower DP configuration guarantees, read from its parameters, and when it guarantees nothing.

:func:`check_flower_dp` states the exact (epsilon, delta) of one round for one client (no client
sampling amplification) of a ``LocalDpMod`` or of a strategy holding one of Flower's central-DP
wrappers, computed by privkit's accountants from the noise the configuration really adds
(:mod:`privkit.flower.mechanisms`), and warns, with the numbers, where:

* the epsilon of one round is above :data:`MEANINGLESS_EPSILON` (100): the noise hides nothing;
* ``LocalDpMod`` calibrates its noise with the classic Gaussian formula
  ``sigma = sensitivity sqrt(2 ln(1.25/delta)) / epsilon`` (``flwr/supercore/differential_privacy.py``,
  ``add_localdp_gaussian_noise_to_params``) at ``epsilon >= 1``, where that formula is not a theorem
  (Dwork & Roth 2014, Thm A.1 holds for epsilon < 1);  the exact epsilon of its noise is given;
* ``LocalDpMod``'s ``sensitivity`` is below the sensitivity of the update it clips (``2 clipping_norm``
  under replace-one, ``clipping_norm`` under zero-out): the noise is calibrated to the wrong scale;
* an adaptive-clipping wrapper under zero-out: Flower sizes its noise for a clip count of
  sensitivity 1/2, but counts uncentred bits (sensitivity 1);
* a strategy holds no DP wrapper at all: its rounds add no noise (epsilon infinite per round, unless
  the clients add it, e.g. with ``LocalDpMod``).

Each warning has a kind in :attr:`DpCheck.kinds` (one of :data:`WARNING_KINDS`), so that
:func:`privkit.check.check_training` can tell which of them change the epsilon.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from accountants import gaussian_epsilon
from privkit.flower.mechanisms import (
    central_dp,
    central_multiplier,
    local_dp_std,
    update_sensitivity,
)

__all__ = ["MEANINGLESS_EPSILON", "WARNING_KINDS", "DpCheck", "check_flower_dp"]

MEANINGLESS_EPSILON = 100.0
WARNING_KINDS = {
    "sensitivity": "LocalDpMod's sensitivity is below the clipped update's",
    "classic_formula": "LocalDpMod's classic Gaussian formula at epsilon >= 1",
    "stated_epsilon": "LocalDpMod's noise gives more than its stated epsilon",
    "adaptive_count": "adaptive clipping's clip count under zero-out",
    "no_noise": "a strategy without a DP wrapper",
    "meaningless": "an epsilon above MEANINGLESS_EPSILON per round",
}
"""The kinds of :attr:`DpCheck.warnings`, each with what it is about."""


@dataclass(frozen=True)
class DpCheck:
    """One round's guarantee for one client under a Flower DP configuration.

    ``epsilon`` is exact (the Gaussian's privacy curve, rounded up) at ``delta``; ``stated`` is the
    (epsilon, delta) the configuration claims, where it claims one (LocalDpMod). ``claimed_epsilon``
    is the epsilon at ``delta`` that the configuration's own numbers claim (LocalDpMod's ``epsilon``;
    for adaptive clipping, the Gaussian at Flower's nominal ``noise_multiplier``), None where it
    claims nothing else than ``epsilon``; ``kinds[i]`` is the kind of ``warnings[i]``
    (:data:`WARNING_KINDS`).
    """

    mechanism: str
    neighbouring: str
    noise_multiplier: float
    epsilon: float
    delta: float
    stated: tuple[float, float] | None = None
    warnings: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    claimed_epsilon: float | None = None

    def __str__(self) -> str:
        head = (
            f"{self.mechanism}: one round is ({self.epsilon:.4g}, {self.delta:g})-DP per client "
            f"({self.neighbouring}, noise multiplier {self.noise_multiplier:.4g})"
        )
        return "\n".join([head, *(f"warning: {w}" for w in self.warnings)])


def _epsilon(multiplier: float, delta: float) -> float:
    return float("inf") if multiplier == 0 else gaussian_epsilon(multiplier, delta)


def _local_dp(mod: Any, neighbouring: str) -> DpCheck:
    std = local_dp_std(mod)
    true_sens = update_sensitivity(mod.clipping_norm, neighbouring)
    mult = std / true_sens
    eps, delta = _epsilon(mult, mod.delta), float(mod.delta)
    out, kinds = [], []
    if mod.sensitivity < true_sens:
        kinds.append("sensitivity")
        out.append(
            f"LocalDpMod sensitivity {mod.sensitivity:g} is below the clipped update's sensitivity "
            f"{true_sens:g} ({neighbouring}, clipping_norm {mod.clipping_norm:g}): its noise std {std:.4g} "
            f"is calibrated to the wrong scale"
        )
    if mod.epsilon >= 1:
        kinds.append("classic_formula")
        own = _epsilon(std / mod.sensitivity, delta) if mod.sensitivity > 0 else float("inf")
        out.append(
            f"LocalDpMod uses the classic Gaussian formula sigma = sensitivity*sqrt(2 ln(1.25/delta))/epsilon "
            f"at epsilon = {mod.epsilon:g} >= 1, where it is not a proof: the exact epsilon of its noise "
            f"(std {std:.4g}) at delta = {delta:g} is {eps:.4g}, not {mod.epsilon:g} ({own:.4g} at its "
            f"stated sensitivity {mod.sensitivity:g})"
        )
    elif eps > mod.epsilon * (1 + 1e-9):
        kinds.append("stated_epsilon")
        out.append(
            f"LocalDpMod states epsilon {mod.epsilon:g} but its noise gives {eps:.4g} at delta {delta:g}"
        )
    if eps > MEANINGLESS_EPSILON:
        kinds.append("meaningless")
        out.append(_meaningless("LocalDpMod", eps, delta))
    stated = (float(mod.epsilon), float(mod.delta))
    return DpCheck("LocalDpMod", neighbouring, mult, eps, delta, stated, out, kinds, stated[0])


def _meaningless(name: str, eps: float, delta: float) -> str:
    return (
        f"{name}: epsilon {eps:.4g} per round at delta {delta:g} (> {MEANINGLESS_EPSILON:g}) is no "
        "meaningful guarantee"
    )


def _central(strategy: Any, delta: float, neighbouring: str) -> DpCheck:
    dp = central_dp(strategy)
    if dp is None:
        name = type(strategy).__name__
        return DpCheck(
            name,
            neighbouring,
            0.0,
            float("inf"),
            delta,
            warnings=[
                f"{name} holds no Flower DP wrapper (DifferentialPrivacy{{Client,Server}}Side"
                "{Fixed,Adaptive}Clipping): its rounds add no noise, epsilon inf per round, unless "
                "the clients add noise themselves (LocalDpMod)"
            ],
            kinds=["no_noise"],
        )
    mult = central_multiplier(dp, 1.0 / dp.num_sampled_clients, neighbouring)
    eps = _epsilon(mult, delta)
    out, kinds, claimed = [], [], None
    if dp.clipping == "adaptive" and neighbouring == "add_remove" and dp.count_std:
        z = (dp.update_multiplier**-2 + (2 * dp.count_std) ** -2) ** -0.5
        kinds.append("adaptive_count")
        claimed = _epsilon(z, delta)
        out.append(
            f"{dp.name} sets the update noise so that the round's multiplier is {z:.4g} when the clip "
            f"count has sensitivity 1/2 (Andrew et al. 2021 count bits centred at 1/2); Flower counts uncentred "
            f"bits (sensitivity 1 under zero-out), so the round's multiplier is {mult:.4g}"
        )
    if eps > MEANINGLESS_EPSILON:
        kinds.append("meaningless")
        out.append(_meaningless(dp.name, eps, delta))
    return DpCheck(dp.name, neighbouring, mult, eps, delta, None, out, kinds, claimed)


def check_flower_dp(
    config: Any, *, delta: float | None = None, neighbouring: str = "replace_one"
) -> DpCheck:
    """The exact one-round guarantee of a Flower DP configuration, with warnings.

    Parameters
    ----------
    config : LocalDpMod, a :func:`privkit.flower.recorded` mod, or a strategy
        A strategy with a central-DP wrapper is checked at its wrapper's noise; a strategy without
        one is reported as adding no noise (epsilon inf, a ``"no_noise"`` warning).
    delta : float, optional
        Delta of the statement; LocalDpMod's own delta by default, required for a strategy.
    neighbouring : {"replace_one", "add_remove"}
        Client-level relation (:mod:`privkit.flower.mechanisms`).

    Returns
    -------
    DpCheck
        One round's epsilon for one client, the warnings and their kinds.
    """
    from flwr.clientapp.mod import LocalDpMod

    mod = getattr(config, "dp_mod", config)
    if isinstance(mod, LocalDpMod):
        if delta is not None and delta != mod.delta:
            raise ValueError(
                f"delta must be the LocalDpMod's own delta {mod.delta:g}; found {delta!r}"
            )
        return _local_dp(mod, neighbouring)
    if delta is None or not 0 < delta < 1:
        raise ValueError(
            f"delta must be in (0, 1) to state a strategy's guarantee; found {delta!r}"
        )
    return _central(config, float(delta), neighbouring)
