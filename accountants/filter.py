"""Rényi privacy filter: a sound guarantee when the noise and the stopping time are chosen adaptively.

Composition theorems (RDP, PLD) assume every mechanism's parameters are fixed in advance.  A method
that picks its next noise multiplier, or decides to stop, from released outputs (FedKADP's feedback
Metric, Eq. 20) composes mechanisms whose privacy parameters are themselves random.  Feldman & Zrnic
(2021, "Individual privacy accounting via a Rényi filter", Thm. 3.1) show: fix an order ``alpha > 1``
and a budget ``B`` *before* the run; let each step's RDP at ``alpha``, ``rho_t``, depend on everything
released so far; stop before ``sum_t rho_t`` would exceed ``B``.  Then the whole interaction is
``(alpha, B)``-RDP, for every client separately (a client not selected in a step spends ``rho_t = 0``).
Whitehouse et al. (2023, "Fully adaptive composition in differential privacy") re-derive the filter
and show that the order must indeed be fixed in advance: the minimum over orders that a fixed-parameter
RDP accountant reports does not hold under adaptivity.

The filter's guarantee is ``(alpha, B)``-RDP, converted to ``(epsilon, delta)`` by dp-accounting's
conversion (Canonne, Kamath & Steinke 2020, Prop. 12), which holds for any mechanism with that RDP.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from accountants._validate import check_open_unit, check_positive

__all__ = ["RenyiFilter", "conversion_offset", "plan_order"]


def conversion_offset(order: float, delta: float) -> float:
    """``epsilon - rho`` of dp-accounting's RDP -> (epsilon, delta) conversion at one order:
    ``log(1 - 1/alpha) - log(delta alpha) / (alpha - 1)`` (Canonne, Kamath & Steinke 2020, Prop. 12)."""
    if not order > 1:
        raise ValueError(f"order must be > 1; found {order!r}")
    return math.log1p(-1.0 / order) - math.log(delta * order) / (order - 1)


def plan_order(
    epsilon: float,
    delta: float,
    rdp_of_step: Callable[[np.ndarray], np.ndarray],
    orders: Sequence[float],
) -> tuple[float, float]:
    """The order (and its budget) that affords the most steps of ``rdp_of_step`` within ``epsilon``.

    ``rdp_of_step(orders)`` must use only parameters fixed before the run (e.g. the initial noise
    multiplier): the order is part of the filter and may not depend on the run's outputs.
    """
    grid = np.asarray(orders, dtype=float)
    budgets = np.array([epsilon - conversion_offset(a, delta) for a in grid])
    per_step = np.asarray(rdp_of_step(grid), dtype=float)
    steps = np.where(budgets > 0, budgets / np.maximum(per_step, 1e-300), -np.inf)
    best = int(np.argmax(steps))
    if not budgets[best] > 0:
        raise ValueError(
            f"target epsilon {epsilon:g} is below the RDP conversion cost at every order; found none "
            f"with a positive budget at delta={delta:g}"
        )
    return float(grid[best]), float(budgets[best])


@dataclass
class RenyiFilter:
    """A Rényi filter per client at one order fixed in advance (Feldman & Zrnic 2021).

    Call :meth:`admits` before a step with the step's RDP at :attr:`order` for each client it
    touches; run the step only if every one is admitted, then :meth:`spend`.
    """

    order: float
    budget: float
    spent: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.order > 1:
            raise ValueError(f"order must be > 1; found {self.order!r}")
        check_positive(self.budget, "budget")

    @classmethod
    def for_epsilon(cls, epsilon: float, delta: float, order: float) -> RenyiFilter:
        """The filter whose guarantee converts to exactly ``(epsilon, delta)``."""
        check_positive(epsilon, "epsilon")
        check_open_unit(delta, "delta")
        return cls(float(order), epsilon - conversion_offset(order, delta))

    def admits(self, client: str | int, rdp: float) -> bool:
        """True if ``client`` can spend ``rdp`` more at :attr:`order` without passing the budget."""
        return self.spent.get(str(client), 0.0) + rdp <= self.budget

    def spend(self, client: str | int, rdp: float) -> None:
        if not self.admits(client, rdp):
            raise ValueError(
                f"client {client!r} would pass the filter's budget {self.budget:.6g} at order "
                f"{self.order:g}; found {self.spent.get(str(client), 0.0) + rdp:.6g}"
            )
        self.spent[str(client)] = self.spent.get(str(client), 0.0) + rdp

    def epsilon(self, delta: float) -> float:
        """The guarantee every client has, whatever the adaptive choices: ``(alpha, B)``-RDP converted."""
        check_open_unit(delta, "delta")
        return self.budget + conversion_offset(self.order, delta)

    def to_dict(self, delta: float) -> dict:
        return {
            "kind": "renyi_filter",
            "source": "Feldman & Zrnic 2021, Thm. 3.1",
            "order": self.order,
            "rdp_budget": self.budget,
            "delta": delta,
            "epsilon": self.epsilon(delta),
            "spent": dict(self.spent),
            "max_spent": max(self.spent.values(), default=0.0),
        }
