"""Each formal-DP method's mechanism controls as a pipeline step: ``mechanism-controls/<method>.json``.

For every method of the run with a formal guarantee (``formal_dp`` in its registration) the step
trains the method twice more with white-box probes at its DP mechanisms
(:func:`privkit.audit.mechanism_audit.audit_mechanisms`): the *correct twin*, exactly as the method
is accounted, and the *noise-halved twin*, with half the noise its ledger accounts for. Both use
the method's trainer config, reproducible noise (controls are never releases), the run's delta and
its audit seed. The correct twin's verdict is the one the report's summary row rests on
(:mod:`privkit.pipeline.mechanism_report`); the noise-halved twin must come out ``violation``, or
the audit lacked the power to see a bug of that size.

A method whose mechanisms take no probes (no Gaussian mechanism, as FedMD-NFDP's noise-free
subsampling, or one not wired to :mod:`privkit.mechanisms.probes` yet) gets an ``unprobed`` record that says
so; its verdict stays the black-box audit's.

The step is keyed by a hash (method, trainer config, federation, delta, audit seed, settings) and
recorded under ``mechanism_controls.<method>`` in ``status.json``. Each twin's audit (one training
with its probe sets) is a checkpoint of its own, ``mechanism-controls/<method>.twins/<twin>.json``
(atomic, checksummed, under the same hash): a step killed after the correct twin, re-run, trains
the noise-halved twin alone. Records live in the run
directory's ``mechanism-controls/`` folder, not in the method's own: a method's training replaces
its folder whole, and this step runs beside it (in the worker pool when ``workers > 1``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path

from privkit.errors import PrivkitError
from privkit.files import atomic_write_json, intact, read_json
from privkit.pipeline.config import ResolvedMethod, ResolvedRun
from privkit.pipeline.controls import audit_seed
from privkit.pipeline.federation import run_federation
from privkit.pipeline.state import Status, _hash
from privkit.pipeline.steps import StepPlan

SCHEMA_VERSION = 1
MECH_DIR = "mechanism-controls"
STAGE = "mechanism-controls"
#: the twins: (mutation of :mod:`privkit.mechanisms.mutations`, the verdict its audit must give)
TWINS = (("correct", "consistent"), ("noise x1/2", "violation"))
#: the words of audit_mechanisms' error for a method none of whose mechanisms took probes
UNPROBED = "ran no probed DP mechanism"


def mechanism_controls_enabled(run: ResolvedRun) -> bool:
    audit = run.config.audit
    return audit.enabled and audit.mechanism_controls.enabled


def record_path(root: Path, key: str) -> Path:
    """Where the mechanism controls of method ``key`` are written."""
    return Path(root) / MECH_DIR / f"{key}.json"


def mechanism_hash(run: ResolvedRun, m: ResolvedMethod) -> str:
    cfg = run.config
    return _hash(
        {
            "method": m.method,
            "trainer": m.trainer,
            "federation": cfg.federation.model_dump(mode="json"),
            "delta": cfg.delta,
            "pld_grid": cfg.pld_grid,
            "seed": audit_seed(run),
            "settings": cfg.audit.mechanism_controls.model_dump(mode="json"),
            "twins": TWINS,
        }
    )


def mechanism_controls_stage(
    run: ResolvedRun, m: ResolvedMethod, root: Path, progress: bool
) -> None:
    """Train and audit method ``m``'s two twins; write ``mechanism-controls/<m.key>.json``."""

    settings = run.config.audit.mechanism_controls
    base = {
        "schema_version": SCHEMA_VERSION,
        "method": m.key,
        "trainer": m.method,
        "delta": run.config.delta,
        "seed": audit_seed(run),
        "canaries": settings.canaries,
        "clients": list(settings.clients),
        "confidence": settings.confidence,
    }
    twins = []
    key_hash = mechanism_hash(run, m)
    for mutation, expected in TWINS:
        try:
            rec = stored_twin(root, m.key, mutation, key_hash)
            if rec is None:
                rec = _audit_twin(run, m, run_federation(root), mutation, progress)
                atomic_write_json(
                    twin_path(root, m.key, mutation), {"hash": key_hash, "record": rec}
                )
        except PrivkitError as exc:
            if UNPROBED not in str(exc):
                raise
            # the same holds for every twin: one training says it, the other is not run
            atomic_write_json(
                record_path(root, m.key),
                {**base, "state": "unprobed", "twins": [], "message": str(exc), "catchable": None},
            )
            return
        twins.append(
            {
                **rec,
                "twin": mutation,
                "expected": expected,
                "as_expected": rec["status"] == expected,
            }
        )
    atomic_write_json(
        record_path(root, m.key),
        {
            **base,
            "state": "done",
            "twins": twins,
            "message": _summary(twins),
            "catchable": catchable(m.key, twins[0]),
        },
    )


def twin_path(root: Path, key: str, mutation: str) -> Path:
    """Where one twin's audit (its training's probe sets, audited) is kept until the step ends:
    a step killed after the first twin, re-run, trains the second one alone."""
    slug = re.sub(r"[^a-z0-9]+", "-", mutation.lower()).strip("-")
    return Path(root) / MECH_DIR / f"{key}.twins" / f"{slug}.json"


def stored_twin(root: Path, key: str, mutation: str, key_hash: str) -> dict | None:
    """The twin's stored audit when it verifies and was made for the same step (``key_hash``:
    :func:`mechanism_hash`), else None (a corrupted one is named in a warning)."""
    path = twin_path(root, key, mutation)
    if not intact(path):
        return None
    stored = read_json(path, "mechanism-control twin")
    if not isinstance(stored, dict) or stored.get("hash") != key_hash:
        return None
    return stored.get("record")


def _audit_twin(
    run: ResolvedRun, m: ResolvedMethod, federation, mutation: str, progress: bool
) -> dict:
    from privkit.audit.mechanism_audit import audit_mechanisms

    settings = run.config.audit.mechanism_controls
    return audit_mechanisms(
        m.method,
        federation,
        m.trainer,
        delta=run.config.delta,
        seed=audit_seed(run),
        mutation=mutation,
        canaries=settings.canaries,
        clients=tuple(settings.clients),
        confidence=settings.confidence,
        reproducible_noise=True,
        progress=progress,
        engine=m.engine,
        pld_grid=run.config.pld_grid,
    )


def _summary(twins: list[dict]) -> str:
    missed = [t["twin"] for t in twins if not t["as_expected"]]
    if not missed:
        return "every twin came out as expected (the correct twin consistent, the noise-halved twin a violation)"
    return "not as expected: " + "; ".join(
        f"the {t['twin']} twin came out {t['status']} (expected {t['expected']})"
        for t in twins
        if t["twin"] in missed
    )


def catchable(key: str, correct: dict) -> str:
    """:func:`~privkit.audit.mechanism_audit.catchable_sentence` from the correct twin's conformance
    tests: the least sensitive probe set sets each size (the smallest noise factor, the largest
    influence factor any of them flags half the time)."""
    from privkit.audit.mechanism_audit import catchable_sentence

    def detectable(test: str) -> list[float]:
        out = []
        for p in correct.get("probes", []):
            v = p["audit"]["conformance"]["tests"].get(test, {}).get("detectable")
            if isinstance(v, (int, float)) and math.isfinite(v):
                out.append(float(v))
        return out

    noise, influence = detectable("noise"), detectable("influence")
    return catchable_sentence(
        key, min(noise) if noise else None, max(influence) if influence else None
    )


class MechanismControlsPlan(StepPlan):
    """Method ``m``'s mechanism-controls step (``status.json``: ``mechanism_controls.<m.key>``)."""

    def __init__(
        self,
        run: ResolvedRun,
        m: ResolvedMethod,
        root: Path,
        status: Status,
        say: Callable[[str], None],
    ):
        mdir = root / MECH_DIR
        super().__init__(
            run,
            m,
            mdir=mdir,
            status=status,
            slot=("mechanism_controls", m.key),
            digest=mechanism_hash(run, m),
            stage=STAGE,
            output=record_path(root, m.key),
            title=f"{m.key}: mechanism controls",
            name=f"{m.key}/{STAGE}",
            log=mdir / f"{m.key}.errors.log",
            say=say,
            disabled=None
            if mechanism_controls_enabled(run)
            else "mechanism controls disabled in config",
        )
