"""Quiet one known, harmless dp-accounting warning.

dp-accounting's RDP accountant logs a warning for every fractional Renyi order whose series fails
to converge (common at noise multipliers below 1) and then leaves that order out of the minimum.
The bound stays valid: epsilon is the minimum over the orders that did converge. On a federated
ledger this repeats thousands of times and buries real messages, so privkit drops exactly this
message from the ``absl`` logger and nothing else.
"""

from __future__ import annotations

import logging

_MESSAGE = "failed to converge after"


class _DropNonConvergedOrders(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.getMessage().startswith("_compute_log_a_frac")
            and _MESSAGE in record.getMessage()
        )


def install() -> None:
    logger = logging.getLogger("absl")
    if not any(isinstance(f, _DropNonConvergedOrders) for f in logger.filters):
        logger.addFilter(_DropNonConvergedOrders())
