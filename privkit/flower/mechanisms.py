"""Flower's DP mechanisms (flwr 1.42) as privkit privacy events.

What each of Flower's DP building blocks does to one client's data in one round, read from its source
(``flwr/serverapp/strategy/dp_fixed_clipping.py``, ``dp_adaptive_clipping.py``,
``flwr/clientapp/mod/localdp_mod.py``, ``flwr/supercore/differential_privacy.py``):

* **Fixed clipping** (``DifferentialPrivacyClientSideFixedClipping``, ``...ServerSideFixedClipping``):
  every update ``w_i - w`` is clipped to L2 norm ``C``; the inner strategy averages the replies with
  weights ``w_i`` (FedAvg: the ``num-examples`` metric, taken as public), so client ``i``'s update
  enters the mean with factor ``w_i / W``; ``N(0, (z C / m)^2)`` is added per coordinate, ``m`` = the
  wrapper's ``num_sampled_clients``.  Client ``i``'s noise multiplier is therefore
  ``(z / m) / ((w_i / W) s)`` with ``s`` the update's sensitivity in units of ``C``: ``z / s`` when
  ``m`` equal-weight clients reply, less when fewer reply than ``num_sampled_clients``.
* **Adaptive clipping** (``...ClientSideAdaptiveClipping``, ``...ServerSideAdaptiveClipping``): the
  same release at the current clip norm ``C_t``, with Flower's update multiplier
  ``z_u = (z^-2 - (2 sigma_b)^-2)^-1/2`` (Andrew et al. 2021), plus the count of clipped updates
  ``sum_i b_i + N(0, sigma_b^2)``, ``b_i`` in {0, 1}.  Both are Gaussian, so one round is one Gaussian
  with ``mult^-2 = mult_update^-2 + mult_count^-2``.  ``C_t`` depends on earlier releases but each
  round's noise *multiplier* is fixed in advance, so ordinary composition holds (no filter needed).
* **Distributed noise under SecAgg+** (privkit's :func:`privkit.flower.distributed_noise` with
  Flower's ``secaggplus_mod`` and ``SecAggPlusWorkflow``): each client clips its update to ``S`` and
  adds ``N(0, (z S)^2 / m_target)``; the server reconstructs only the weighted sum over the ``r``
  clients whose masked inputs entered the aggregate, so the noise that survives has std
  ``z S sqrt(r / m_target)`` (equal weights) and each survivor's multiplier is
  ``z sqrt(r / m_target) / s``.  Without secure aggregation the server sees each update with its own
  share only: multiplier ``z / (sqrt(m_target) s)``.
* **LocalDpMod**: the update is clipped to ``clipping_norm`` and ``N(0, s^2)`` with the classic
  formula ``s = sensitivity sqrt(2 ln(1.25/delta)) / epsilon`` is added per coordinate, on the
  client.  The noise covers the clipped update's true sensitivity only if ``sensitivity`` is at
  least that (the mod does not check).

Neighbouring relation (client-level: one client's whole data).  Flower averages a fixed number of
replies, so the relation under which its releases are well defined is ``replace_one`` (a client's
data replaced by any other's): a clipped update moves by up to ``2 C``, the clip bit by 1.
``add_remove`` here means the zero-out relation (the client's update replaced by zero: ``C`` and 1);
it is what Flower's own accountant (``flwr.supercore.privacy_accounting``) calls add-or-remove.
privkit's convention: a Gaussian's ``noise_multiplier`` is std / sensitivity *under the entry's
relation*, so ``replace_one`` halves the update's multiplier.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import dp_accounting as dpa

from accountants import NonPrivateEvent
from accountants.dpsgd import NEIGHBOURINGS

__all__ = [
    "CentralDp",
    "central_dp",
    "central_event",
    "central_multiplier",
    "distributed_event",
    "distributed_share_event",
    "local_dp_event",
    "local_dp_std",
    "update_sensitivity",
]

# sensitivity of a clipped update (in units of the clip norm) and of the clip bit, per relation
_UPDATE_SENSITIVITY = {"replace_one": 2.0, "add_remove": 1.0}
_BIT_SENSITIVITY = {"replace_one": 1.0, "add_remove": 1.0}
_CENTRAL_WRAPPERS = {
    "DifferentialPrivacyClientSideFixedClipping": ("fixed", "client"),
    "DifferentialPrivacyServerSideFixedClipping": ("fixed", "server"),
    "DifferentialPrivacyClientSideAdaptiveClipping": ("adaptive", "client"),
    "DifferentialPrivacyServerSideAdaptiveClipping": ("adaptive", "server"),
}


def _check_relation(neighbouring: str) -> str:
    if neighbouring not in NEIGHBOURINGS:
        raise ValueError(
            f"neighbouring must be one of {list(NEIGHBOURINGS)}; found {neighbouring!r}"
        )
    return neighbouring


def update_sensitivity(clip_norm: float, neighbouring: str) -> float:
    """L2 sensitivity of one client's clipped update: ``2 C`` (replace_one) or ``C`` (add_remove)."""
    return _UPDATE_SENSITIVITY[_check_relation(neighbouring)] * float(clip_norm)


@dataclass(frozen=True)
class CentralDp:
    """One of Flower's central-DP strategy wrappers, as found in a strategy chain.

    ``update_multiplier`` is the noise std on the averaged update over ``C / m`` (Flower's
    ``noise_multiplier`` attribute, which the adaptive wrappers already raised to ``z_u``);
    ``count_std`` the clip-count noise (adaptive only, else None).
    """

    wrapper: Any
    clipping: str  # "fixed" or "adaptive"
    side: str  # where clipping happens: "client" or "server"
    update_multiplier: float
    num_sampled_clients: int
    count_std: float | None
    aggregator: Any  # the innermost strategy (the one that averages)

    @property
    def name(self) -> str:
        return type(self.wrapper).__name__

    @property
    def clip_norm(self) -> float:
        """The clip norm of the coming round (adaptive wrappers change it after each round)."""
        return float(self.wrapper.clipping_norm)


def _chain(strategy: Any) -> list[Any]:
    chain, seen = [strategy], {id(strategy)}
    while (inner := getattr(chain[-1], "strategy", None)) is not None and id(inner) not in seen:
        chain.append(inner)
        seen.add(id(inner))
    return chain


def central_dp(strategy: Any) -> CentralDp | None:
    """The central-DP wrapper in ``strategy``'s chain of ``.strategy`` attributes, or None.

    Raises ``ValueError`` for two wrappers in one chain (privkit would not know which noise the
    release carries) and for an averaging strategy whose ``aggregate_train`` is not FedAvg's (a
    server optimiser such as FedAdam changes the sensitivity the noise was calibrated for).
    """
    from flwr.serverapp.strategy import FedAvg

    chain = _chain(strategy)
    found = [
        s
        for s in chain
        if type(s).__name__ in _CENTRAL_WRAPPERS
        and type(s).__module__.startswith("flwr.serverapp.strategy")
    ]
    if not found:
        return None
    if len(found) > 1:
        raise ValueError(
            f"strategy must hold one Flower DP wrapper; found {[type(s).__name__ for s in found]}"
        )
    wrapper, aggregator = found[0], chain[-1]
    if (
        not isinstance(aggregator, FedAvg)
        or type(aggregator).aggregate_train is not FedAvg.aggregate_train
    ):
        raise ValueError(
            f"strategy inside {type(wrapper).__name__} must aggregate as FedAvg.aggregate_train (the noise "
            f"is calibrated to a weighted mean of clipped updates); found {type(aggregator).__name__}"
        )
    clipping, side = _CENTRAL_WRAPPERS[type(wrapper).__name__]
    count_std = float(wrapper.clipped_count_stddev) if clipping == "adaptive" else None
    return CentralDp(
        wrapper=wrapper,
        clipping=clipping,
        side=side,
        update_multiplier=float(wrapper.noise_multiplier),
        num_sampled_clients=int(wrapper.num_sampled_clients),
        count_std=count_std,
        aggregator=aggregator,
    )


def central_multiplier(dp: CentralDp, weight_share: float, neighbouring: str) -> float:
    """Client's Gaussian noise multiplier for one round (``inf``-free; 0 means no noise).

    ``weight_share`` = ``w_i / W``, the client's weight in the mean (``1/m`` for equal weights).
    """
    rel = _check_relation(neighbouring)
    noise_on_mean = dp.update_multiplier / dp.num_sampled_clients  # in units of C
    update = noise_on_mean / (weight_share * _UPDATE_SENSITIVITY[rel])
    if dp.count_std is None:
        return update
    count = dp.count_std / _BIT_SENSITIVITY[rel]
    if update == 0.0 or count == 0.0:
        return 0.0
    return (update**-2 + count**-2) ** -0.5


def central_event(
    dp: CentralDp, weight_share: float, neighbouring: str, sampling: tuple[int, int] | None = None
) -> dpa.DpEvent:
    """The privacy event of one round's central-DP release for one client.

    ``sampling = (n, m)``: the round's clients were ``m`` of ``n`` drawn uniformly without
    replacement (as ``flwr.serverapp.strategy.strategy_utils.sample_nodes`` does) and the draw stays
    hidden from whoever sees the released model; accounted as dp-accounting's
    ``SampledWithoutReplacementDpEvent`` (RDP, replace-one only).  None: no amplification.
    """
    mult = central_multiplier(dp, weight_share, neighbouring)
    if mult == 0.0:
        return NonPrivateEvent(f"{dp.name} with noise multiplier 0 adds no noise")
    gauss = dpa.GaussianDpEvent(mult)
    if sampling is None:
        return gauss
    n, m = sampling
    if neighbouring != "replace_one":
        raise ValueError(
            "client_sampling 'without_replacement' is accounted under neighbouring 'replace_one' "
            f"only (dp-accounting's RDP); found neighbouring {neighbouring!r}"
        )
    return dpa.SampledWithoutReplacementDpEvent(int(n), int(m), gauss) if m < n else gauss


def local_dp_std(mod: Any) -> float:
    """Noise std LocalDpMod adds per coordinate: ``sensitivity sqrt(2 ln(1.25/delta)) / epsilon``."""
    eps, delta, sens = float(mod.epsilon), float(mod.delta), float(mod.sensitivity)
    if not eps > 0:
        raise ValueError(f"LocalDpMod epsilon must be > 0 to add finite noise; found {eps!r}")
    if not 0 < delta < 1.25:
        raise ValueError(f"LocalDpMod delta must be in (0, 1.25) for its formula; found {delta!r}")
    return sens * math.sqrt(2.0 * math.log(1.25 / delta)) / eps


def local_dp_event(mod: Any, neighbouring: str) -> dpa.DpEvent:
    """One round of a LocalDpMod for the client that ran it: the Gaussian with its real std over the
    clipped update's real sensitivity (``2 clipping_norm`` or ``clipping_norm``), whatever the
    ``sensitivity`` the mod was given."""
    std = local_dp_std(mod)
    if std == 0.0:
        return NonPrivateEvent("LocalDpMod with sensitivity 0 adds no noise")
    return dpa.GaussianDpEvent(std / update_sensitivity(mod.clipping_norm, neighbouring))


def distributed_event(
    clip_norm: float, weight: float, noise: list[tuple[float, float]], neighbouring: str
) -> dpa.DpEvent:
    """One survivor's event of a secure aggregation with distributed noise.

    The server sees ``sum_j w_j (u_j + n_j) / sum_j w_j`` over the survivors ``j`` (SecAgg+ scales
    each client's input by its weight ``w_j`` before masking); ``noise`` lists each survivor's
    ``(w_j, std_j)``.  The noise on the weighted sum has std ``sqrt(sum_j w_j^2 std_j^2)``; this
    client (weight ``weight``, clip norm ``clip_norm``) moves it by ``weight`` times its update's
    sensitivity.  Equal weights and equal shares ``z S / sqrt(m)`` over ``r`` survivors give
    ``z sqrt(r / m) / s`` (``s`` = 2 replace-one, 1 zero-out add/remove).

    Parameters
    ----------
    clip_norm : float
        The clip norm ``S`` of this client's update.
    weight : float
        This client's weight ``w_i`` in the aggregate.
    noise : list of (float, float)
        ``(w_j, std_j)`` of every survivor that added a share.
    neighbouring : {"replace_one", "add_remove"}
        The client-level relation.
    """
    total = math.sqrt(math.fsum((w * std) ** 2 for w, std in noise))
    if total == 0.0:
        return NonPrivateEvent("distributed noise of std 0 on the secure aggregate")
    return dpa.GaussianDpEvent(total / (weight * update_sensitivity(clip_norm, neighbouring)))


def distributed_share_event(clip_norm: float, std: float, neighbouring: str) -> dpa.DpEvent:
    """A distributed-noise share seen on its own (no secure aggregation: the server reads the
    client's update with only its share ``std`` of the noise)."""
    if std == 0.0:
        return NonPrivateEvent("distributed noise share of std 0, aggregated in the clear")
    return dpa.GaussianDpEvent(std / update_sensitivity(clip_norm, neighbouring))
