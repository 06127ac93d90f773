"""One rule for "formal DP": does a method's ledger give a meaningful guarantee at the report's delta?

Every place that says whether a method is formally private (the report's tables and charts, the
verdict of a report row, the ``privkit train`` headline) asks :func:`formal_dp_status`, so they
cannot disagree. The rule, in order:

1. a release without noise in the ledger: no epsilon at any delta ("no");
2. the method claims no formal guarantee ("no");
3. no accounted epsilon (accounting failed or did not run): "not accounted";
4. no finite epsilon at the report's delta because mechanisms known only by their (epsilon, delta)
   already spend ``fixed_delta`` >= delta: if ``fixed_delta >= 1/n`` (n: the smallest client) the
   guarantee permits publishing records in the clear ("delta >= 1/n"), else it holds only at a
   larger delta ("not at this delta"); a (0, delta) guarantee is never shown as epsilon 0;
5. a finite epsilon at a delta >= 1/n: "delta >= 1/n" as in 4;
6. otherwise a finite epsilon at the report's delta: "yes".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class FormalDP:
    """The rule's answer: ``formal`` (bool), a short ``label`` for tables, the ``reason`` in words."""

    formal: bool
    label: str
    reason: str


def delta_ge_one_over_n(delta: float | None, n: int | None) -> bool:
    """True when ``delta >= 1/n``: a mechanism may then publish a record outright."""
    return delta is not None and n is not None and n != 0 and delta >= 1.0 / n


def formal_dp_status(
    *,
    claims_dp: bool,
    epsilon: float | None,
    delta: float,
    fixed_delta: float | None = None,
    non_private: Sequence[str] = (),
    n_min: int | None = None,
    error: str | None = None,
) -> FormalDP:
    """Apply the rule above.

    Parameters
    ----------
    claims_dp : the method claims a formal DP guarantee (its trainer's registration).
    epsilon : worst-client accounted epsilon at ``delta`` (None: not accounted; inf: none).
    delta : the report's delta.
    fixed_delta : worst-client sum of the deltas of mechanisms known only by (epsilon, delta),
        e.g. FedMD-NFDP's (0, k/n) subsample release: no finite epsilon below it.
    non_private : labels of releases recorded without noise.
    n_min : records of the smallest client (for the delta >= 1/n test).
    error : why the accounting failed, if it did.
    """
    if non_private:
        labels = ", ".join(sorted(set(non_private)))
        return FormalDP(
            False,
            "no",
            f"a release without noise is recorded ({labels}): no finite epsilon at any delta",
        )
    if not claims_dp:
        return FormalDP(False, "no", "the method makes no formal DP claim")
    if epsilon is None or math.isnan(epsilon):
        return FormalDP(
            False, "not accounted", f"no accounted epsilon{': ' + error if error else ''}"
        )
    if math.isinf(epsilon):
        if fixed_delta is not None and fixed_delta >= delta:
            if n_min and delta_ge_one_over_n(fixed_delta, n_min):
                return FormalDP(
                    False,
                    "δ ≥ 1/n",
                    (
                        f"the ledger's guarantee needs delta >= {fixed_delta:.3g}, and delta >= 1/n = "
                        f"{1.0 / n_min:.3g} (smallest client, n = {n_min}) permits publishing records "
                        "in the clear: not a meaningful guarantee"
                    ),
                )
            return FormalDP(
                False,
                "not at this δ",
                (
                    f"finite epsilon only at delta >= {fixed_delta:.3g}, above the report's delta "
                    f"{delta:g}"
                ),
            )
        return FormalDP(False, "no", f"no finite epsilon at delta {delta:g}")
    if n_min and delta_ge_one_over_n(delta, n_min):
        return FormalDP(
            False,
            "δ ≥ 1/n",
            (
                f"epsilon is finite only because delta = {delta:g} >= 1/n = {1.0 / n_min:.3g} (smallest "
                f"client, n = {n_min}), which permits publishing records in the clear: not a "
                "meaningful guarantee"
            ),
        )
    return FormalDP(True, "yes", "")
