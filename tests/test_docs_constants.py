"""A module constant the docs quote with its value (```attacks.whitebox.NOISE_READ` = 262,144``,
or ``..., 262,144``) holds that value in the code: a constant changed without its page fails here.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
_QUOTED = re.compile(
    r"`((?:accountants|attacks|privkit|reports)(?:\.[a-z_0-9]+)+)\.([A-Z][A-Z0-9_]+)`"
    r"(?: =|,) (\d[\d,]*(?:\.\d+)?)"
)


def _quotes() -> list[tuple[str, str, str, str]]:
    found = []
    for page in PAGES:
        for module, name, value in _QUOTED.findall(page.read_text()):
            found.append((page.relative_to(ROOT).as_posix(), module, name, value))
    return found


def test_the_docs_quote_constants():
    """The pattern still finds the quotes it was written for (a test that finds none tests
    nothing)."""
    assert any(name == "NOISE_READ" for _, _, name, _ in _quotes())


@pytest.mark.parametrize("page, module, name, value", _quotes())
def test_a_quoted_constant_holds_its_value(page, module, name, value):
    held = getattr(importlib.import_module(module), name)
    assert float(held) == float(value.replace(",", "")), f"{page}: {module}.{name} is {held}"
