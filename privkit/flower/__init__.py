"""privkit on Flower (optional extra: ``pip install "privkit-ml[flower]"``).

Accounting of a Flower app's DP mechanisms as privkit ledger events, privkit's methods as Flower apps,
and audits of Flower simulations. ``import privkit`` never imports Flower: the names below are loaded
on first use, and a missing Flower is one line naming the extra to install.
"""

from __future__ import annotations

import importlib
from typing import Any

INSTALL_HINT = 'privkit.flower needs Flower: pip install "privkit-ml[flower]"'
"""The one-line error raised when Flower is missing (it names the extra to install)."""

# public name -> submodule of privkit.flower that defines it (loaded on first access)
_LAZY: dict[str, str] = {
    "Accounted": "privkit.flower.accounting",
    "ledger_mod": "privkit.flower.client",
    "record": "privkit.flower.client",
    "record_dpsgd": "privkit.flower.client",
    "recorded": "privkit.flower.client",
    "check_flower_dp": "privkit.flower.checks",
    "run_inprocess": "privkit.flower.inprocess",
    "train_on_flower": "privkit.flower.engine",
    "method_app": "privkit.flower.engine",
    "FlowerApp": "privkit.flower.apps",
    "audit_app": "privkit.flower.audit",
    "audit_app_mechanisms": "privkit.flower.audit",
    "FlowerAppRecipe": "privkit.flower.audit",
    "audit_mod": "privkit.flower.audit_transport",
    "CanaryClients": "privkit.flower.canary_clients",
    "write_audit": "privkit.flower.rundir",
    "distributed_noise": "privkit.flower.secagg",
    "SecAggPlusAccounted": "privkit.flower.secagg",
}


def require_flwr() -> Any:
    """Import and return the ``flwr`` package, or raise one line naming the extra to install."""
    try:
        return importlib.import_module("flwr")
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'privkit.flower' has no attribute {name!r}")
    require_flwr()
    return getattr(importlib.import_module(module), name)


__all__ = ["INSTALL_HINT", "require_flwr"] + list(_LAZY)
