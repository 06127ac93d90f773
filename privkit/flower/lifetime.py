"""Where an accounted Flower run lands, and the federation's lifetime ledger.

**Where.** A ServerApp does not run where the user typed ``flwr run``: in a deployment it runs in
the SuperLink's working directory (often on another machine), in a simulation inside or beside the
app folder, which the next ``flwr run`` packs into the app bundle (``*.json`` is among the files
Flower packs).  :func:`user_path` takes a relative path from the directory the run config names
(``privkit-dir``), moves a path that falls inside a Flower app folder next to that folder, and says
where it wrote in a deployment that named no directory.

**Lifetime ledger.** A federation trained again next month spends the same clients' privacy again.
The store is a folder of one JSON file per run (``<store>/runs/<run>.json``): the run's worst
client's ledger entries, its delta and accountant.  Node ids change between runs (a SuperNode
restarted gets a new one), so privkit cannot tell which client of one run is which of the next:
each earlier run counts with its worst client's events, composed with every client of the current
run (with client sampling every node has the same events, and this is exact).
``privkit budget lifetime <store>`` reads the total.
"""

from __future__ import annotations

import json
import os
import time
from logging import WARNING
from pathlib import Path
from typing import Any

import atomicfiles

__all__ = ["append_run", "flower_app_folder", "read_store", "store_ledger", "user_path"]

STORE_SCHEMA = 1


def flower_app_folder(path: Path) -> Path | None:
    """The Flower app folder (a ``pyproject.toml`` with ``[tool.flwr.app]``) holding ``path``."""
    for folder in [path, *path.parents]:
        project = folder / "pyproject.toml"
        if project.is_file():
            try:
                text = project.read_text()
            except OSError:
                return None
            return folder if "[tool.flwr.app" in text else None
    return None


def user_path(path: str | Path, user_dir: str | None, *, deployed: bool = False) -> Path:
    """Absolute ``path``: a relative one from ``user_dir`` (the run config's ``privkit-dir``) or the
    working directory; a path inside a Flower app folder moves next to that folder."""
    from flwr.supercore import log

    path = Path(path).expanduser()
    if not path.is_absolute():
        if user_dir:
            base = Path(str(user_dir)).expanduser()
            if not base.is_absolute():
                raise ValueError(f"privkit-dir must be an absolute path; found {user_dir!r}")
        else:
            base = Path.cwd()
            if deployed:
                log(
                    WARNING,
                    "privkit: the run config names no privkit-dir: writing under the ServerApp's "
                    "working directory %s (flwr run . --run-config \"privkit-dir='$PWD'\" writes "
                    "where you ran the federation)",
                    base,
                )
        path = base / path
    path = Path(os.path.abspath(path))
    app = flower_app_folder(path)
    if app is not None:
        moved = app.parent / f"{app.name}-privkit" / path.relative_to(app)
        log(
            WARNING,
            "privkit: %s is inside the Flower app folder %s, which flwr run packs: writing to %s",
            path,
            app,
            moved,
        )
        path = moved
    return path


def read_store(store: Path) -> list[dict]:
    """The runs recorded in ``store`` (oldest first); an absent store has none."""
    folder = Path(store) / "runs"
    if not folder.is_dir():
        return []
    runs = []
    for file in sorted(folder.glob("*.json")):
        try:  # a corrupted run is refused in one line naming it, never trusted
            data = json.loads(atomicfiles.read_verified(file, "lifetime ledger file"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"lifetime ledger file {file} must be JSON; found {exc}") from exc
        if not isinstance(data, dict) or data.get("schema_version") != STORE_SCHEMA:
            raise ValueError(
                f"lifetime ledger file {file} must have schema_version {STORE_SCHEMA}; "
                f"found {data.get('schema_version') if isinstance(data, dict) else data!r}"
            )
        runs.append(data)
    return sorted(runs, key=lambda r: (r.get("finished", 0.0), r.get("run", "")))


def append_run(store: Path, record: dict[str, Any]) -> Path:
    """Add one run to ``store`` (a new file; earlier runs are never rewritten)."""
    folder = Path(store) / "runs"
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.time()
    base = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime(stamp))}-{record.get('run', 'run')}"
    file, i = folder / f"{base}.json", 1
    while file.exists():
        i += 1
        file = folder / f"{base}-{i}.json"
    data = {"schema_version": STORE_SCHEMA, "finished": stamp, **record}
    # atomic, checksummed (atomicfiles): a lifetime budget must never read a torn run
    return atomicfiles.write_text(file, json.dumps(data, indent=2) + "\n")


def store_ledger(store: Path) -> tuple[Any, list[dict]]:
    """The store as one :class:`accountants.Ledger` of one client (every run's worst client) and the
    runs it holds."""
    from accountants import Ledger, event_from_dict

    runs = read_store(store)
    ledger = Ledger()
    for r in runs:
        for e in r["entries"]:
            ledger.add(
                "federation",
                event_from_dict(e["event"]),
                f"{r['run']}: {e['label']}",
                neighbouring=e["neighbouring"],
            )
    return ledger, runs
