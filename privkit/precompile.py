"""Byte-compile what a pipeline run imports: ``python -m privkit.precompile`` (``make demo`` runs it
once, after installing).

pip byte-compiles every file of every package it installs (20 s of the demo's install, most of
it for torch modules no run imports); ``make`` installs with ``--no-compile`` and this imports the
modules ``privkit run`` and its worker processes load (about 2800), writing their ``.pyc`` files,
in 10 s. Later processes read them even where ``PYTHONDONTWRITEBYTECODE`` is set; a module missed
here is compiled on first use, as without ``.pyc`` files.
"""

from __future__ import annotations

import importlib
import sys
import time

MODULES = (
    "privkit.cli.app",
    "privkit.pipeline.runner",
    "privkit.pipeline.controls",
    "privkit.pipeline.mechanism_controls",
    "privkit.audit",
    "attacks.mia",
    "reports.plots",
    "reports.render",
    # libraries privkit imports lazily, inside the functions that use them
    "catboost",
    "dp_accounting",
    "mpmath",
    "opacus",
    "randomgen",
    "sklearn.linear_model",
    "sklearn.metrics",
    "scipy.stats",
)


def main() -> int:
    sys.dont_write_bytecode = False  # this process writes .pyc files whatever the environment says
    start = time.perf_counter()
    for name in MODULES:
        importlib.import_module(name)
    from privkit.trainers import REGISTRY

    for spec in REGISTRY.values():  # every method's trainer module
        _ = spec.fn
    print(
        f"privkit: {len(sys.modules)} modules imported and byte-compiled in "
        f"{time.perf_counter() - start:.1f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
