"""Deliberately broken copies of privkit's DP mechanisms, for audit controls and mutation testing.

An audit is worth what it catches. privkit checks its audits by running a method with one of the
bugs real DP code has and auditing the result exactly as a user's run is audited: the audit must
say ``violation``. The bugs (:data:`MUTATIONS`):

* ``noise x1/2``: the mechanism draws half the noise its ledger accounts for.
* ``noise x1/N``: the noise divided by the number of clients (FedAUX's official code divides by
  the number of clients twice); ``N`` is the federation's client count, set by
  :func:`for_federation`.
* ``clipping off``: per-record clipping (DP-SGD) or the sensitivity bound (output perturbation:
  the feature normalisation the bound assumes) switched off, while the noise stays calibrated to
  the claimed bound.
* ``ledger steps x1/2``: the ledger records half of the steps (or rounds) that ran.
* ``ledger rate x1/2``: the ledger's sampling rate is half of the real one.
* ``correct``: the correct twin (no bug): the audit must not flag it beyond its error rate.

Mechanism bugs act through :func:`mutated`: every privkit DP mechanism reads :func:`active` when it
draws noise or clips, so a trainer needs no change to run broken. Ledger bugs rewrite the trained
run's ledger (:func:`mutate_ledger`): what an undercounting trainer would have recorded. Never used
outside audits; a report marks every mutated run.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any

from privkit.errors import PrivkitError

__all__ = [
    "CORRECT",
    "MUTATIONS",
    "Mutation",
    "active",
    "for_federation",
    "mutate_ledger",
    "mutated",
]


@dataclass(frozen=True)
class Mutation:
    """One bug (see the module docstring). The defaults are the correct mechanism.

    Parameters
    ----------
    name : str
        The bug's name, a key of :data:`MUTATIONS` (``privkit audit --mutation NAME``).
    noise_factor : float
        The factor on every Gaussian release's noise standard deviation (the receipt keeps the
        claimed one).
    clipping : bool
        Whether per-record clipping (DP-SGD) or the sensitivity bound (output perturbation) is
        applied.
    ledger_steps_factor : float
        The factor on every self-composition count of the ledger (:func:`mutate_ledger`).
    ledger_rate_factor : float
        The factor on every Poisson sampling rate of the ledger (:func:`mutate_ledger`).
    per_client_noise : bool
        ``noise x1/N``: the noise factor is ``1 / num_clients``, set by :func:`for_federation`
        (:func:`mutated` refuses the unresolved mutation).
    """

    name: str = "correct"
    noise_factor: float = 1.0
    clipping: bool = True
    ledger_steps_factor: float = 1.0
    ledger_rate_factor: float = 1.0
    per_client_noise: bool = False

    @property
    def touches_ledger(self) -> bool:
        return self.ledger_steps_factor != 1.0 or self.ledger_rate_factor != 1.0

    def describe(self) -> str:
        return {
            "correct": "the correct mechanism",
            "noise x1/2": "half the noise the ledger accounts for",
            "noise x1/N": "the noise divided by the number of clients",
            "clipping off": "per-record clipping / the sensitivity bound switched off (noise unchanged)",
            "ledger steps x1/2": "the ledger records half of the steps or rounds",
            "ledger rate x1/2": "the ledger's sampling rate is half of the real one",
        }.get(self.name, self.name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "noise_factor": self.noise_factor,
            "clipping": self.clipping,
            "ledger_steps_factor": self.ledger_steps_factor,
            "ledger_rate_factor": self.ledger_rate_factor,
            "description": self.describe(),
        }


CORRECT = Mutation()
"""No bug: the mechanisms as implemented."""
MUTATIONS: dict[str, Mutation] = {
    m.name: m
    for m in (
        CORRECT,
        Mutation("noise x1/2", noise_factor=0.5),
        Mutation("noise x1/N", per_client_noise=True),
        Mutation("clipping off", clipping=False),
        Mutation("ledger steps x1/2", ledger_steps_factor=0.5),
        Mutation("ledger rate x1/2", ledger_rate_factor=0.5),
    )
}
"""The bugs privkit audits itself with, by name (``privkit audit --mutation NAME``)."""

_ACTIVE: ContextVar[Mutation] = ContextVar("privkit_mutation", default=CORRECT)


def active() -> Mutation:
    """The bug the DP mechanisms run with now (:data:`CORRECT` outside :func:`mutated`)."""
    return _ACTIVE.get()


def for_federation(mutation: Mutation | str, num_clients: int) -> Mutation:
    """``mutation`` (or its name) with ``noise x1/N`` resolved to ``1 / num_clients``."""
    m = MUTATIONS.get(mutation) if isinstance(mutation, str) else mutation
    if m is None:
        raise PrivkitError(f"mutation must be one of {', '.join(MUTATIONS)}; found {mutation!r}")
    if m.per_client_noise:
        if num_clients < 2:
            raise PrivkitError(f"noise x1/N needs at least 2 clients; found {num_clients}")
        m = replace(m, noise_factor=1.0 / num_clients, per_client_noise=False)
    return m


@contextmanager
def mutated(mutation: Mutation) -> Iterator[Mutation]:
    """Run the DP mechanisms inside the ``with`` block with ``mutation``'s mechanism bug."""
    if mutation.per_client_noise:
        raise PrivkitError("resolve noise x1/N with for_federation(mutation, num_clients) first")
    token = _ACTIVE.set(mutation)
    try:
        yield mutation
    finally:
        _ACTIVE.reset(token)


def mutate_ledger(ledger, mutation: Mutation):
    """A copy of ``ledger`` as a trainer with ``mutation``'s ledger bug would have recorded it:
    every self-composition count times ``ledger_steps_factor`` (at least 1), every Poisson rate
    times ``ledger_rate_factor``. Returns ``ledger`` itself when the mutation leaves it alone."""
    if not mutation.touches_ledger:
        return ledger
    from accountants import Ledger

    out = Ledger(ledger.value_discretization_interval, ledger.curve_value_discretization_interval)
    out.reproducible_noise = ledger.reproducible_noise
    out.adaptive = ledger.adaptive
    for client in ledger.clients:
        for entry in ledger.entries(client):
            out.add(
                client,
                _rewrite(entry.event, mutation),
                entry.label,
                round=entry.round,
                neighbouring=entry.neighbouring,
            )
    return out


def _rewrite(event, m: Mutation):
    import dp_accounting as dpa

    if isinstance(event, dpa.SelfComposedDpEvent):
        return dpa.SelfComposedDpEvent(
            _rewrite(event.event, m), max(1, round(event.count * m.ledger_steps_factor))
        )
    if isinstance(event, dpa.ComposedDpEvent):
        return dpa.ComposedDpEvent([_rewrite(e, m) for e in event.events])
    if isinstance(event, dpa.PoissonSampledDpEvent):
        return dpa.PoissonSampledDpEvent(
            event.sampling_probability * m.ledger_rate_factor, _rewrite(event.event, m)
        )
    return event
