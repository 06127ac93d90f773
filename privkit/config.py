"""Configuration: pydantic models loaded from TOML, with ``--set key=value`` overrides.

A config is validated before any work starts; a bad value is a pydantic ``ValidationError`` (the CLI
prints it as one line naming the field and the value found).
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from privkit.errors import PrivkitError

#: where a federated method runs: privkit's own in-process federation (default) or Flower's
#: simulation engine (:mod:`privkit.flower_engine.engine`)
ENGINES = ("inprocess", "flower")
Engine = Literal["inprocess", "flower"]


class StrictModel(BaseModel):
    """Base for every privkit config: unknown keys are errors, values validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


def parse_value(text: str) -> Any:
    """Parse the right-hand side of ``key=value`` as TOML (numbers, booleans, lists, strings)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word: treat as a string (e.g. method=fedavg)


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with dotted ``key=value`` overrides applied.

    ``federation.alpha=0.1`` sets ``data["federation"]["alpha"] = 0.1``; values parse as TOML.
    """
    out = json.loads(json.dumps(data))
    for item in overrides:
        if "=" not in item:
            raise PrivkitError(f"--set expects key=value; found {item!r}")
        key, _, raw = item.partition("=")
        parts = [p for p in key.strip().split(".") if p]
        if not parts:
            raise PrivkitError(f"--set expects key=value; found {item!r}")
        node = out
        for p in parts[:-1]:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise PrivkitError(f"--set {key}: {p} is not a table; found {child!r}")
            node = child
        node[parts[-1]] = parse_value(raw.strip())
    return out


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file; a missing or malformed file is a one-line error naming the path."""
    p = Path(path)
    if not p.is_file():
        raise PrivkitError(f"config file not found: {p}")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise PrivkitError(f"malformed config {p}: {exc}") from exc
