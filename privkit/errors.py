"""Errors raised by privkit.

Every error that reaches a user names the parameter and the value found, e.g.
``alpha must be > 0; found -1.0``. ``PrivkitError`` subclasses ``ValueError`` so that the
packages that must not import ``privkit`` (``accountants``) can raise plain ``ValueError`` and
still be caught by the same CLI handler.
"""

from __future__ import annotations


class PrivkitError(ValueError):
    """A user-facing error: bad input, missing files, or a failed pipeline stage."""


def check(condition: bool, message: str) -> None:
    """Raise ``PrivkitError(message)`` unless ``condition`` holds."""
    if not condition:
        raise PrivkitError(message)
