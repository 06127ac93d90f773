"""Auditing privkit's own runs: the application side of the audit layer.

:func:`audit_run` audits a run directory (``privkit audit RUN_DIR``, the pipeline's audit stage)
and writes ``audit.json``; :mod:`~privkit.audit.recipes` re-runs a method's federation as shadow
runs; :mod:`~privkit.audit.instantiations` holds the attribute attacks on what the seed methods
share (FLiP's Table II protocol among them). :mod:`~privkit.audit.controls` trains and audits the
broken twins of a DP-SGD method that every report carries; :mod:`~privkit.audit.federated_canaries`
audits one client's record-level guarantee with canary records. The attacks and the bounds come
from the ``attacks`` library, which never imports privkit.
"""

from __future__ import annotations

from typing import Any

from privkit.audit.names import ATTACKS, ATTRIBUTE_ATTACKS, MEMBERSHIP_ATTACKS

__all__ = ["ATTACKS", "ATTRIBUTE_ATTACKS", "MEMBERSHIP_ATTACKS", "audit_run"]


def __getattr__(name: str) -> Any:
    # audit_run pulls in the attacks library (scikit-learn, CatBoost, dp-accounting): loaded on
    # first use, so that checking a config's attack names stays fast
    if name == "audit_run":
        from privkit.audit.run import audit_run

        return audit_run
    raise AttributeError(f"module 'privkit.audit' has no attribute {name!r}")
