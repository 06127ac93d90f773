"""The Rényi filter for a Flower app whose noise adapts from round to round.

RDP and PLD composition assume that every round's mechanism was fixed before the run.  A ClientApp
that picks its next noise multiplier from what earlier rounds released (as FedKADP does) breaks that
assumption; Feldman & Zrnic (2021, Thm 3.1) restore a guarantee with a filter: fix an RDP order and
a budget before the run, charge each client its round's RDP at that order, and stop before any
client would pass the budget (:class:`accountants.RenyiFilter`).  :class:`RoundFilter` does that for
:class:`privkit.flower.Accounted`: the order is given, or planned from the first round's mechanisms
(known before that round is sent), and the budget converts to exactly the run's epsilon budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import dp_accounting as dpa
import numpy as np

from accountants import NonPrivateEvent, RenyiFilter, neighbouring_relation, plan_order
from accountants.fast import RdpAccountant

__all__ = ["RoundFilter", "round_rdp"]

ORDERS = tuple(a for a in dpa.rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS if a >= 1.1)

# (event, label, relation) triples of one client in one round, as Accounted records them
Pending = dict[str, list[tuple[Any, str, str]]]


def round_rdp(events: Sequence[tuple[Any, str, str]], orders: Sequence[float]) -> np.ndarray:
    """The RDP curve at ``orders`` of one client's events of one round (``inf`` for a non-private one)."""
    total = np.zeros(len(orders))
    for event, label, relation in events:
        acc = RdpAccountant(
            orders=list(orders), neighboring_relation=neighbouring_relation(relation)
        )
        if isinstance(event, NonPrivateEvent):
            return np.full(len(orders), math.inf)
        if not acc.supports(event):
            raise ValueError(
                f"the Renyi filter needs the RDP of every event; found {event!r} ({label!r})"
            )
        acc.compose(event)
        total = total + acc.rdp_curve()[1]
    return total


class RoundFilter:
    """A :class:`~accountants.RenyiFilter` charged round by round, per client."""

    def __init__(self, epsilon: float, delta: float, order: float | None = None) -> None:
        self.epsilon, self.delta = epsilon, delta
        self.filter = None if order is None else RenyiFilter.for_epsilon(epsilon, delta, order)
        self.passed: str | None = None  # set when a round charged more than the filter admitted

    def plan(self, pending: Pending) -> None:
        """Fix the order from the first round's mechanisms: the one that affords most such rounds to
        the client they cost most."""
        if self.filter is not None:
            return
        curves = [round_rdp(evs, ORDERS) for evs in pending.values() if evs]
        if not curves:
            raise ValueError(
                "order must be given for adaptive accounting when the first round's mechanisms "
                "are not known before it runs (client-side mechanisms only); found order=None"
            )
        worst = np.max(np.vstack(curves), axis=0)
        order, _ = plan_order(self.epsilon, self.delta, lambda a: worst, ORDERS)
        self.filter = RenyiFilter.for_epsilon(self.epsilon, self.delta, order)

    def charges(self, pending: Pending) -> dict[str, float]:
        assert self.filter is not None
        return {
            c: float(round_rdp(evs, [self.filter.order])[0]) for c, evs in pending.items() if evs
        }

    def refused(self, pending: Pending) -> str | None:
        """The first client the filter would not admit this round, or None."""
        assert self.filter is not None
        return next(
            (c for c, r in self.charges(pending).items() if not self.filter.admits(c, r)), None
        )

    def spend(self, pending: Pending, round_number: int) -> None:
        """Charge the round as it ran; a charge past the budget voids the filter's guarantee."""
        assert self.filter is not None
        for client, rdp in self.charges(pending).items():
            if self.filter.admits(client, rdp):
                self.filter.spend(client, rdp)
            else:
                self.filter.spent[client] = self.filter.spent.get(client, 0.0) + rdp
                self.passed = self.passed or (
                    f"round {round_number} charged client {client} past the Renyi "
                    "filter's budget (its mechanism differed from the prediction): "
                    "the filter's guarantee does not hold"
                )

    def to_dict(self) -> dict | None:
        """The filter's guarantee for the ledger, or None when it was passed or never planned."""
        if self.filter is None or self.passed:
            return None
        return self.filter.to_dict(self.delta)
