"""One part of a conformance test: its outcome, and the formatting every part shares.

Each part of :func:`attacks.conformance.conformance_test` (releases, noise scale, influence,
sensitivity, sampling law, independence, distribution, normalisation) returns a
:class:`ConformanceTest`. A part that the evidence cannot measure (no probe-free coordinate, no
record of what the sampler drew) is returned by :func:`not_measured`: never rejected, and it takes
no share of the family's error rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ConformanceTest", "finite", "not_measured", "pct"]


@dataclass
class ConformanceTest:
    """One part of the conformance test (see :mod:`attacks.conformance`).

    Attributes
    ----------
    name : the part ("releases", "noise", "influence", "sensitivity", "sampling", "independence",
        "distribution", "normalisation").
    rejected : whether this part rejects the claim at ``level``.
    p_value : its p-value (0 or 1 for the exact parts).
    level : the error rate this part was given (its share of the family's).
    measured, confidence_limit, claimed : the measured quantity, its confidence limit on the side
        of less privacy, and the claimed value (NaN where the part measures no single quantity).
    detail : one sentence saying what was measured.
    detectable : the smallest departure from the claim this part flags at least half the time
        (a noise factor at or below it, an influence factor at or above it); ``None`` where no
        single factor describes the departures it sees.
    measured_part : whether the evidence allowed this part at all.
    failed : the subtests that rejected (e.g. ``("regularity",)`` of the sampling part).
    """

    name: str
    rejected: bool
    p_value: float
    level: float
    measured: float
    confidence_limit: float
    claimed: float
    detail: str
    detectable: float | None = None
    measured_part: bool = True
    failed: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        out = {k: finite(v) for k, v in self.__dict__.items()}
        out["failed"] = list(self.failed)
        return out


def finite(v):
    """JSON-safe float: non-finite values as the strings JSON readers accept."""
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    return v


def pct(p: float) -> str:
    return f"{100 * p:.4g}%"


def not_measured(name: str, why: str) -> ConformanceTest:
    """A part the evidence does not allow: never rejected, no share of the error rate."""
    return ConformanceTest(
        name,
        False,
        1.0,
        0.0,
        math.nan,
        math.nan,
        math.nan,
        f"{name} not measured: {why}",
        None,
        False,
    )
