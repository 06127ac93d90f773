"""privkit's DP mechanisms: everything that spends randomness or bounds a sensitivity.

One module per part: the Gaussian release every mechanism draws its noise through and the receipt
it returns (:mod:`~privkit.mechanisms.gaussian`), the random bits (:mod:`~privkit.mechanisms.
dp_random`, :mod:`~privkit.mechanisms.device_random`), the floating-point defence
(:mod:`~privkit.mechanisms.grid_noise`), per-example clipping (:mod:`~privkit.mechanisms.stacked`,
:mod:`~privkit.mechanisms.stacked_pairs`, :mod:`~privkit.mechanisms.ghost_clipping`), one DP-SGD
step (:mod:`~privkit.mechanisms.dp_sgd_step`) and its clipped sum replayed by batch size
(:mod:`~privkit.mechanisms.step_replay`), output perturbation
(:mod:`~privkit.mechanisms.output_perturbation`), opacus drawing privkit's randomness
(:mod:`~privkit.mechanisms.opacus_streams`), and what audits plant in them: probes
(:mod:`~privkit.mechanisms.probes`) and mutations (:mod:`~privkit.mechanisms.mutations`).

Importing the package imports no torch: the names below load their module on first use, so that
the torch-free parts (``mutations``, ``probes``) stay cheap to import for the CLI.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> the submodule defining it (loaded on first access)
_LAZY: dict[str, str] = {
    "ModelRows": "privkit.mechanisms.gaussian",
    "NormalRows": "privkit.mechanisms.gaussian",
    "Receipt": "privkit.mechanisms.gaussian",
    "compose_receipts": "privkit.mechanisms.gaussian",
    "gaussian_release": "privkit.mechanisms.gaussian",
    "gaussian_release_rows": "privkit.mechanisms.gaussian",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'privkit.mechanisms' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = list(_LAZY)
