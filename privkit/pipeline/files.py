"""Files of a run directory: atomic JSON writes, reads, timestamps, one-line error text."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from privkit.jsonutil import json_default


def one_line(exc: BaseException) -> str:
    if isinstance(exc, ValidationError):
        parts = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "config"
            parts.append(f"{loc}: {err['msg']} (found {err.get('input')!r})")
        return "; ".join(parts)
    return " ".join(str(exc).split()) or type(exc).__name__


def atomic_write_json(path: Path, obj: Any) -> Path:
    """Write JSON through a temporary file and a rename (never a half-written file)."""
    from reports import atomic_write_text

    return atomic_write_text(path, json.dumps(obj, indent=2, default=json_default))


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


