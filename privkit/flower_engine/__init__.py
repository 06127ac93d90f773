"""privkit's methods on Flower: each method's port (:mod:`~privkit.flower_engine.apps`), the engine
that trains a method as a Flower ServerApp/ClientApp pair (:mod:`~privkit.flower_engine.engine`),
the in-process driver (:mod:`~privkit.flower_engine.inprocess`) and the transport of an audit's
probes and mutations to the clients (:mod:`~privkit.flower_engine.audit_transport`).

This is the layer the audits and the pipeline train on; :mod:`privkit.flower` is the user's side
on top of it (accounting and auditing of a user's own Flower app). ``import privkit`` never imports
Flower; a missing Flower is one line naming the extra to install (:data:`INSTALL_HINT`).
"""

from __future__ import annotations

import importlib
from typing import Any

INSTALL_HINT = 'privkit.flower needs Flower: pip install "privkit-ml[flower]"'
"""The one-line error raised when Flower is missing (it names the extra to install)."""


def require_flwr() -> Any:
    """Import and return the ``flwr`` package, or raise one line naming the extra to install."""
    try:
        return importlib.import_module("flwr")
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc


__all__ = ["INSTALL_HINT", "require_flwr"]
