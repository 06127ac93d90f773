"""The ``privkit`` command line.

Each command group lives in its own module and registers itself on :data:`app` when imported.
"""

from privkit.cli import audit as _audit  # noqa: F401  (registers `privkit audit`)
from privkit.cli import budget as _budget  # noqa: F401
from privkit.cli import check as _check  # noqa: F401  (registers `privkit check`)
from privkit.cli import data as _data  # noqa: F401  (registers `privkit data`)
from privkit.cli import run as _run  # noqa: F401  (registers `privkit run`, `report`, `demo`)
from privkit.cli import train as _train  # noqa: F401  (registers `privkit train`)
from privkit.cli.app import app, main

__all__ = ["app", "main"]
