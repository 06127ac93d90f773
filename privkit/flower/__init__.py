"""privkit on Flower (optional extra: ``pip install "privkit-ml[flower]"``).

Accounting of a Flower app's DP mechanisms as privkit ledger events, privkit's methods as Flower apps,
and audits of Flower simulations. ``import privkit`` never imports Flower: the names below are loaded
on first use, and a missing Flower is one line naming the extra to install.
"""

from __future__ import annotations

import importlib
from typing import Any

from privkit.flower_engine import INSTALL_HINT, require_flwr

# public name -> submodule of privkit.flower that defines it (loaded on first access)
_LAZY: dict[str, str] = {
    "Accounted": "privkit.flower.accounting",
    "ledger_mod": "privkit.flower.client",
    "record": "privkit.flower.client",
    "record_dpsgd": "privkit.flower.client",
    "recorded": "privkit.flower.client",
    "check_flower_dp": "privkit.flower.checks",
    "run_inprocess": "privkit.flower_engine.inprocess",
    "train_on_flower": "privkit.flower_engine.engine",
    "method_app": "privkit.flower_engine.engine",
    "FlowerApp": "privkit.flower_engine.apps",
    "audit_app": "privkit.flower.audit",
    "audit_app_mechanisms": "privkit.flower.audit",
    "FlowerAppRecipe": "privkit.flower.audit",
    "audit_mod": "privkit.flower_engine.audit_transport",
    "CanaryClients": "privkit.flower.canary_clients",
    "write_audit": "privkit.flower.rundir",
    "distributed_noise": "privkit.flower.secagg",
    "SecAggPlusAccounted": "privkit.flower.secagg",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'privkit.flower' has no attribute {name!r}")
    require_flwr()
    return getattr(importlib.import_module(module), name)


__all__ = ["INSTALL_HINT", "require_flwr"] + list(_LAZY)
