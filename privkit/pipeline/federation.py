"""The run's federation (``<root>/federation.json``), loaded once per process and shared by every
step that trains in that process: the method stages (:mod:`privkit.pipeline.stages`), the audit
controls (:mod:`privkit.pipeline.controls`) and the mechanism controls
(:mod:`privkit.pipeline.mechanism_controls`). The runner seeds the cache with the federation it
has just built."""

from __future__ import annotations

from pathlib import Path
from typing import Any

FEDERATIONS: dict[str, Any] = {}  # per process: the run's federation, loaded once


def run_federation(root: str | Path):
    """The run's federation (``<root>/federation.json``), loaded once per process."""
    from privkit.data import Federation

    path = str(Path(root) / "federation.json")
    if path not in FEDERATIONS:
        FEDERATIONS[path] = Federation.load(path)
    return FEDERATIONS[path]
