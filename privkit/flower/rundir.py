"""A Flower app's ledger written as a privkit run directory.

``<out>/<name>/ledger.json`` and ``privacy.json`` are the files a privkit run writes for a method
(``privacy.json`` by the same :func:`privkit.pipeline.stages.account_method`); ``train.json`` and
``metrics.json`` hold the rounds and the accounting assumptions; ``<out>/config.resolved.json`` names
the run so that ``privkit report <out> --rebuild`` renders it like any privkit run (no audit).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from privkit.files import write_json, write_text
from privkit.pipeline.config import ACCOUNTANTS, SCHEMA_VERSION

__all__ = ["RunWriter", "write_run"]


class RunWriter(ABC):
    """What :class:`~privkit.flower.Accounted` and :class:`~privkit.flower.SecAggPlusAccounted`
    share: the worst client's epsilon so far and the run directory they write."""

    name: str
    ledger: Any
    delta: float
    rounds: list[dict]
    stopped: str | None
    written: Path | None
    _worst: float

    @abstractmethod
    def describe(self) -> list[str]:
        """The accounting assumptions, as the run's warnings."""

    @abstractmethod
    def convention(self) -> dict:
        """What ``ledger.json``'s events mean, and how to replay them in dp-accounting."""

    def _with(self, client: str, extra: list[tuple[Any, str, str]], scratch: Any = None) -> Any:
        """A ledger (``scratch``, else a new one) holding ``client``'s entries so far and ``extra``
        ((event, label, relation) each): what the budget checks account."""
        from accountants import Ledger

        scratch = Ledger() if scratch is None else scratch
        for e in self.ledger.entries(client) if client in self.ledger.clients else []:
            scratch.add(client, e.event, e.label, round=e.round, neighbouring=e.neighbouring)
        for event, label, relation in extra:
            scratch.add(client, event, label, neighbouring=relation)
        return scratch

    @property
    def epsilon(self) -> float:
        """The worst client's epsilon at ``delta`` after the rounds released so far."""
        return self._worst

    def save(self, out: str | Path) -> Path:
        """Write ``<out>/<name>/`` (``ledger.json``, ``privacy.json``, ``metrics.json``,
        ``train.json``) and ``<out>/config.resolved.json``: what ``privkit budget ledger`` and
        ``privkit report`` read."""
        self.written = write_run(
            Path(out),
            self.name,
            self.ledger,
            self.delta,
            rounds=self.rounds,
            description=self.describe(),
            stop=self.stopped,
            convention=self.convention(),
        )
        return self.written


def write_run(
    out: Path,
    name: str,
    ledger: Any,
    delta: float,
    *,
    rounds: list[dict],
    description: list[str],
    stop: str | None,
    convention: dict | None = None,
) -> Path:
    """Write the run; returns ``<out>/<name>`` (``<name>-2``, ... when a run already has the name:
    several runs in one folder never overwrite each other)."""
    import json

    from privkit.pipeline.stages import account_method

    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"name must be a plain folder name; found {name!r}")
    base, i = name, 1
    while (out / name / "ledger.json").exists():
        i += 1
        name = f"{base}-{i}"
    mdir = out / name
    mdir.mkdir(parents=True, exist_ok=True)
    data = ledger.to_dict()
    if convention is not None:
        data["convention"] = convention
    write_text(mdir / "ledger.json", json.dumps(data, indent=2) + "\n")
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
    if len(ledger):  # a run refused or failed before any release has nothing to account
        write_json(mdir / "privacy.json", account_method(mdir, delta))
    entry = {
        "key": name,
        "method": "flower",
        "seed": 0,
        "trainer": {},
        "summary": "a Flower app accounted by privkit.flower.Accounted",
        "formal_dp": True,
    }
    config = out / "config.resolved.json"
    earlier: list[dict] = []
    if config.is_file():  # the runs already in this folder stay listed
        try:
            earlier = [
                m
                for m in json.loads(config.read_text()).get("resolved_methods", [])
                if m.get("method") == "flower" and m.get("key") != name
            ]
        except (OSError, ValueError, AttributeError):
            earlier = []
    write_json(
        config,
        {
            "schema_version": SCHEMA_VERSION,
            "name": out.name or name,
            "delta": delta,
            "seed": 0,
            "accountant": "best",
            "accountants": list(ACCOUNTANTS),
            "audit": {"enabled": False},
            "report": {"title": f"privkit privacy report: Flower app {out.name or name}"},
            "resolved_methods": [*earlier, entry],
        },
    )
    status_file = out / "status.json"
    try:
        status = json.loads(status_file.read_text()) if status_file.is_file() else {}
    except (OSError, ValueError):
        status = {}
    done = {"state": "done", "error": None, "seconds": None}
    stages = {"train": done, "account": done if len(ledger) else {"state": "failed", "error": stop}}
    stages["audit"] = {"state": "skipped", "error": None, "seconds": None}
    status.setdefault("methods", {})[name] = {"stages": stages}
    write_json(status_file, status)
    return mdir


AUDIT_KINDS = {"client": "canary-clients", "record": "canary-records"}
"""``audit.json``'s ``audit_kind`` for each claim level a Flower run's white-box audit tests."""


def write_audit(
    run: Path, audit: Any, delta: float, what: str, *, level: str | None = None
) -> Path:
    """Write an audit of a run written by :func:`write_run` (an ``attacks`` ``MechanismAudit``: canary
    records' or canary clients' ``audit()``) as ``<run>/audit.json``, and mark the run's audit
    stage done, so that ``privkit report <out> --rebuild`` shows its verdict.

    Parameters
    ----------
    run : path
        The run's folder (``<out>/<name>``, where ``ledger.json`` is).
    audit : attacks.whitebox.MechanismAudit
        The audit's result.
    delta : float
        The delta of the audit's epsilons.
    what : str
        What was audited (the claim tested), one line for the report.
    level : {"client", "record"}, optional
        The claim's level: ``"client"`` for canary clients (:class:`privkit.flower.CanaryClients`:
        one client's whole data), ``"record"`` for canary records in a client's data. Default: read
        from ``what`` where it says "client-level" or "record-level". ``audit.json`` records it as
        ``audit_kind`` (``canary-clients`` or ``canary-records``), the label of the report's row.
    """
    import json

    run = Path(run)
    if not (run / "ledger.json").is_file():
        raise ValueError(
            f"run must be a folder written by privkit.flower (with ledger.json); found {run}"
        )
    if level is None:
        said = [lv for lv in AUDIT_KINDS if f"{lv}-level" in what.lower()]
        level = said[0] if len(said) == 1 else None
    if level is not None and level not in AUDIT_KINDS:
        raise ValueError(f"level must be one of {', '.join(AUDIT_KINDS)}; found {level!r}")
    verdict = audit.to_dict()
    write_json(
        run / "audit.json",
        {
            "schema_version": SCHEMA_VERSION,
            "method": "flower",
            "verdict": verdict,
            "accounted_epsilon": verdict.get("accounted_epsilon"),
            "delta": float(delta),
            "claims": {},
            "audited": what,
            # white-box canaries (no black-box membership attack): the report labels the row so
            "audit_kind": AUDIT_KINDS[level] if level is not None else "canaries",
        },
    )
    status_file = run.parent / "status.json"
    status = json.loads(status_file.read_text()) if status_file.is_file() else {}
    stages = status.setdefault("methods", {}).setdefault(run.name, {"stages": {}})["stages"]
    stages["audit"] = {"state": "done", "error": None, "seconds": None}
    write_json(status_file, status)
    return run / "audit.json"


def convention(neighbouring: str, client_sampling: str) -> dict:
    """``ledger.json``'s convention: what its events mean and how dp-accounting replays them to
    privkit's number (tested: ``tests/privkit/test_flower_deployed.py``)."""
    return {
        "unit": "client-level: one client's whole data (a Flower node id)",
        "neighbouring": neighbouring,
        "noise_multiplier": (
            "a GaussianDpEvent's noise_multiplier is the noise std over the sensitivity under the "
            "entry's relation (a clipped update: 2 C under replace_one, C under add_remove)"
        ),
        "client_sampling": client_sampling,
        "replay_rdp": (
            "per client, compose every event in dp_accounting.rdp.RdpAccountant("
            "neighboring_relation=REPLACE_ONE for replace_one entries, ADD_OR_REMOVE_ONE for "
            "add_remove) and take get_epsilon(delta): privacy.json's rdp"
        ),
        "replay_pld": (
            "per client, compose every event in dp_accounting.pld.PLDAccountant("
            "ADD_OR_REMOVE_ONE, value_discretization_interval=1e-4) whatever the entry's relation: "
            "dp-accounting's REPLACE_ONE doubles a Gaussian's sensitivity, already inside the "
            "multiplier here; SampledWithoutReplacementDpEvent has no PLD (client_sampling 'none')"
        ),
    }
