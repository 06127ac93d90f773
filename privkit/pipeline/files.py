"""Files of a run directory: atomic JSON writes, reads, timestamps, one-line error text."""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
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
    """Parse a run file; a corrupted one is a one-line error naming it."""
    from privkit.jsonutil import read_json as _read

    return _read(path, "run file")


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def staging_dir(target: Path) -> Path:
    """Where :func:`staged_dir` writes ``target`` before swapping it into place."""
    return target.parent / f".staging-{target.name}"


@contextmanager
def staged_dir(target: Path):
    """Yield an empty sibling folder to write ``target``'s new content into; on success it replaces
    ``target`` (the old content is removed last), on any error or Ctrl-C it is deleted and
    ``target`` stays as it was. Nothing half-written is ever found at ``target``."""
    staging = staging_dir(target)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    old = target.parent / f".old-{target.name}"
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        target.rename(old)
    staging.rename(target)
    shutil.rmtree(old, ignore_errors=True)
