"""The ``privkit`` command line.

Each command group lives in its own module and registers itself on :data:`app` when imported.
"""

from privkit.cli.app import app, main
from privkit.cli import data as _data  # noqa: F401  (registers `privkit data`)
from privkit.cli import budget as _budget  # noqa: F401

__all__ = ["app", "main"]
