"""JSON encoding of the numpy values that results carry (one ``default=`` hook for every writer)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np


def json_default(obj: Any) -> Any:
    """``json.dumps(..., default=json_default)``: numpy scalars and arrays as Python values,
    anything else (paths, enums) as its string form."""
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return str(obj)


def strict(obj: Any) -> Any:
    """A copy of ``obj`` that strict JSON parsers accept: non-finite floats become the strings
    ``"Infinity"``, ``"-Infinity"`` and ``"NaN"`` (as in report.json), which ``float()`` reads back."""
    if isinstance(obj, dict):
        return {k: strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, np.ndarray)):
        return [strict(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not np.isfinite(obj):
        return "NaN" if np.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")
    return obj


def read_json(path: str | Path, what: str = "file") -> Any:
    """Parse a JSON file; a missing, unreadable or corrupted file is one error naming it."""
    from privkit.errors import PrivkitError

    p = Path(path)
    if not p.is_file():
        raise PrivkitError(f"{what} not found: {p}")
    try:
        return json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PrivkitError(
            f"{what} {p} is unreadable or corrupted: {' '.join(str(exc).split())}"
        ) from None
