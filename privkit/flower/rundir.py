"""A Flower app's ledger written as a privkit run directory.

``<out>/<name>/ledger.json`` and ``privacy.json`` are the files a privkit run writes for a method
(``privacy.json`` by the same :func:`privkit.pipeline.stages.account_method`); ``train.json`` and
``metrics.json`` hold the rounds and the accounting assumptions; ``<out>/config.resolved.json`` names
the run so that ``privkit report <out> --rebuild`` renders it like any privkit run (no audit).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from privkit.pipeline.config import ACCOUNTANTS, SCHEMA_VERSION
from privkit.pipeline.files import write_json, write_text

__all__ = ["write_run"]


def write_run(
    out: Path,
    name: str,
    ledger: Any,
    delta: float,
    *,
    rounds: list[dict],
    description: list[str],
    stop: str | None,
) -> Path:
    """Write the run; returns ``<out>/<name>``."""
    import json

    from privkit.pipeline.stages import account_method

    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"name must be a plain folder name; found {name!r}")
    mdir = out / name
    mdir.mkdir(parents=True, exist_ok=True)
    write_text(mdir / "ledger.json", json.dumps(ledger.to_dict(), indent=2) + "\n")
    notes = [*description, *([stop] if stop else [])]
    write_json(
        mdir / "train.json",
        {
            "schema_version": SCHEMA_VERSION,
            "method": "flower",
            "engine": "flower",
            "rounds_run": len(rounds),
            "stop": stop,
            "warnings": notes,
            "claims": {},
        },
    )
    write_json(mdir / "metrics.json", {"rounds": rounds})
    write_json(mdir / "privacy.json", account_method(mdir, delta))
    write_json(
        out / "config.resolved.json",
        {
            "schema_version": SCHEMA_VERSION,
            "name": name,
            "delta": delta,
            "seed": 0,
            "accountant": "best",
            "accountants": list(ACCOUNTANTS),
            "audit": {"enabled": False},
            "report": {"title": f"privkit privacy report: Flower app {name}"},
            "resolved_methods": [
                {
                    "key": name,
                    "method": "flower",
                    "seed": 0,
                    "trainer": {},
                    "summary": "a Flower app accounted by privkit.flower.Accounted",
                    "formal_dp": True,
                }
            ],
        },
    )
    return mdir
