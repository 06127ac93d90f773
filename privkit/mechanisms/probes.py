"""Audit probes at privkit's DP mechanisms: which mechanism of which client takes canaries.

A white-box audit tests what the ledger claims for a mechanism where the mechanism runs: canaries
(:class:`attacks.whitebox.GradientCanaries`) enter the mechanism as records, are sampled and clipped
by it, and see each noisy release. A trainer does not know it is audited: every privkit DP
mechanism asks :func:`canaries_for` for its probes, which answers ``None`` outside a
:func:`probing` block. Inside one, the :class:`ProbeSession` creates the canaries of a (client,
mechanism) pair on first use, with the mechanism's *claimed* parameters, and keeps them across
rounds, so each probe set observes every release of its mechanism for its client.

Mechanism labels are the words the ledger's entries carry for the same mechanism (``dp-sgd``,
``class-head``, ``scores``, ...): :func:`privkit.audit.mechanism_audit.audit_mechanisms` reads the
claim of each probe set from the ledger entries of its client whose label contains its label.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from privkit.errors import PrivkitError

__all__ = ["ProbePlan", "ProbeSession", "active", "canaries_for", "current", "probing"]


@dataclass(frozen=True)
class ProbePlan:
    """Which mechanisms take canaries, and how many.

    Attributes
    ----------
    canaries : canaries per (client, mechanism) probe set (capped at the mechanism's dimension).
    clients : the clients whose mechanisms are probed (``None``: every client).
    seed : audit seed; each probe set's canaries derive from it and their (client, mechanism).
    kind : ``dirac`` (one coordinate each) or ``random`` directions.
    """

    canaries: int = 1000
    clients: tuple[int, ...] | None = (0,)
    seed: int = 0
    kind: str = "dirac"

    def __post_init__(self) -> None:
        if self.canaries < 2:
            raise PrivkitError(f"canaries must be >= 2; found {self.canaries}")


@dataclass
class ProbeSession:
    """The canaries of one probed run, keyed by (client, mechanism label)."""

    plan: ProbePlan
    probes: dict[tuple[int, str], Any] = field(default_factory=dict)

    def canaries(
        self,
        client: int,
        label: str,
        *,
        dim: int,
        clip_norm: float,
        sample_rate: float,
        noise_multiplier: float,
    ):
        """The canaries of ``client``'s mechanism ``label`` (created on first call with these
        claimed parameters), or ``None`` when the plan does not probe this client.

        Parameters
        ----------
        client : int
            The client whose mechanism runs.
        label : str
            The mechanism's label, the word its ledger entries carry (``dp-sgd``, ``scores``, ...).
        dim : int
            The number of coordinates the mechanism releases (its trainable parameters for
            DP-SGD); ``dirac`` canaries are capped at it, and fewer than 2 means no probes.
        clip_norm : float
            The claimed clipping norm (or sensitivity): the L2 norm of an injected canary.
        sample_rate : float
            The claimed Poisson rate at which the mechanism samples its records (1 if none).
        noise_multiplier : float
            The claimed noise multiplier the audit tests against.
        """
        from attacks.experiment import stream_seeds
        from attacks.whitebox import GradientCanaries

        if self.plan.clients is not None and int(client) not in self.plan.clients:
            return None
        key = (int(client), str(label))
        if key not in self.probes:
            n = min(self.plan.canaries, dim if self.plan.kind == "dirac" else self.plan.canaries)
            if n < 2:
                return None
            seed = int(stream_seeds(self.plan.seed, 1, f"probes/{key[0]}/{key[1]}")[0])
            self.probes[key] = GradientCanaries(
                dim,
                n,
                clip_norm=clip_norm,
                sample_rate=sample_rate,
                noise_multiplier=noise_multiplier,
                kind=self.plan.kind,
                seed=seed,
            )
        return self.probes[key]


_SESSION: ContextVar[ProbeSession | None] = ContextVar("privkit_probes", default=None)


def active() -> bool:
    """Whether an audit is probing now (inside :func:`probing`)."""
    return _SESSION.get() is not None


def current() -> ProbeSession | None:
    """The probe session of the enclosing :func:`probing` block (``None`` outside one): an engine
    that runs mechanisms in other processes carries it there (:mod:`privkit.flower.audit`)."""
    return _SESSION.get()


def canaries_for(
    client: int,
    label: str,
    *,
    dim: int,
    clip_norm: float,
    sample_rate: float,
    noise_multiplier: float,
):
    """The canaries a DP mechanism of ``client`` labelled ``label`` must take now (``None``
    outside :func:`probing`, or for a client the plan does not probe).

    Parameters
    ----------
    client : int
        The client whose mechanism runs.
    label : str
        The mechanism's label, the word its ledger entries carry (``dp-sgd``, ``scores``, ...).
    dim : int
        The number of coordinates the mechanism releases (its trainable parameters for
        DP-SGD); ``dirac`` canaries are capped at it, and fewer than 2 means no probes.
    clip_norm : float
        The claimed clipping norm (or sensitivity): the L2 norm of an injected canary.
    sample_rate : float
        The claimed Poisson rate at which the mechanism samples its records (1 if none).
    noise_multiplier : float
        The claimed noise multiplier the audit tests against.
    """
    session = _SESSION.get()
    if session is None:
        return None
    return session.canaries(
        client,
        label,
        dim=dim,
        clip_norm=clip_norm,
        sample_rate=sample_rate,
        noise_multiplier=noise_multiplier,
    )


@contextmanager
def probing(plan: ProbePlan, session: ProbeSession | None = None) -> Iterator[ProbeSession]:
    """Probe the DP mechanisms that run inside the ``with`` block (see the module docstring);
    ``session``: go on with the probes of an earlier block (same plan)."""
    session = ProbeSession(plan) if session is None else session
    token = _SESSION.set(session)
    try:
        yield session
    finally:
        _SESSION.reset(token)
