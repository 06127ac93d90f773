"""Resume state of a run: what each stage depends on (hashes) and ``status.json``.

Re-running a config skips every stage whose hash matches a completed entry, so an interrupted run
resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from privkit.files import atomic_write_json
from privkit.files import now as _now
from privkit.files import read_json as _read_json
from privkit.pipeline.config import SCHEMA_VERSION, ResolvedMethod, ResolvedRun


def _hash(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def stage_hashes(run: ResolvedRun, m: ResolvedMethod) -> dict[str, str]:
    """What each stage of ``m`` depends on; a changed hash re-runs that stage (and later ones)."""
    cfg = run.config
    train = _hash(
        {
            "method": m.method,
            "trainer": m.trainer,
            "seed": m.seed,
            "federation": cfg.federation.model_dump(mode="json"),
        }
    )
    account = _hash(
        {
            "train": train,
            "delta": cfg.delta,
            "accountant": cfg.accountant,
            "accountants": cfg.accountants,
            "pld_grid": cfg.pld_grid,
            "curve": cfg.curve_accountant,
        }
    )
    audit = _hash(
        {
            "train": train,
            "delta": cfg.delta,
            "attacks": cfg.audit.attacks,
            "shadows": cfg.audit.shadows,
            "options": {k: v for k, v in cfg.audit.options().items() if k != "workers"},
            "seed": cfg.seed if cfg.audit.seed is None else cfg.audit.seed,
            "enabled": cfg.audit.enabled,
        }
    )
    return {"train": train, "account": account, "audit": audit}


class Status:
    """``status.json``: per method and stage, state + hash + error + seconds (written atomically)."""

    def __init__(self, path: Path, name: str):
        self.path = path
        self.unreadable: str | None = None
        self.data: dict = {"schema_version": SCHEMA_VERSION, "name": name, "methods": {}}
        if path.is_file():
            try:
                old = _read_json(path)
                if isinstance(old, dict) and old.get("schema_version") == SCHEMA_VERSION:
                    self.data["methods"] = old.get("methods", {})
                    self.data["report"] = old.get("report")
                    for step in ("controls", "mechanism_controls"):  # steps beside the methods
                        if old.get(step):
                            self.data[step] = old[step]
            except (ValueError, OSError) as exc:  # corrupted JSON (a ValueError) or unreadable
                # unreadable: every stage is re-run (earlier files stay on disk); the run says so
                self.unreadable = (
                    f"{path} unreadable ({type(exc).__name__}); re-running every stage"
                )

    def stage(self, key: str, stage: str) -> dict:
        return self.data["methods"].get(key, {}).get("stages", {}).get(stage, {})

    def is_done(self, key: str, stage: str, digest: str) -> bool:
        """Whether ``stage`` of method ``key`` is done for the same inputs.

        Parameters
        ----------
        key : str
            The method's key in the run.
        stage : str
            ``train``, ``account`` or ``audit``.
        digest : str
            Hash of the stage's inputs (config and upstream files) now; a stage done with other
            inputs is not done.
        """
        s = self.stage(key, stage)
        return s.get("state") == "done" and s.get("hash") == digest

    def set(
        self,
        key: str,
        method: str,
        stage: str,
        state: str,
        digest: str | None,
        error: str | None = None,
        seconds: float | None = None,
    ) -> None:
        """Record the state of one stage of one method and save ``status.json``.

        Parameters
        ----------
        key : str
            The method's key in the run.
        method : str
            The registered method it runs.
        stage : str
            ``train``, ``account`` or ``audit``.
        state : str
            ``done``, ``failed`` or ``skipped``.
        digest : str or None
            Hash of the stage's inputs.
        error : str, optional
            Why the stage failed or was skipped.
        seconds : float, optional
            How long the stage ran.
        """
        entry = self.data["methods"].setdefault(key, {"method": method, "stages": {}})
        entry["method"] = method
        entry["stages"][stage] = {
            "state": state,
            "hash": digest,
            "error": error,
            "seconds": None if seconds is None else round(seconds, 3),
            "updated": _now(),
        }
        self.save()

    def save(self) -> None:
        self.data["updated"] = _now()
        atomic_write_json(self.path, self.data)
