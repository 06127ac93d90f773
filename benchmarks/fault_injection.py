"""Kill ``privkit run``, ``privkit train`` and ``privkit audit`` with SIGKILL, re-run, compare.

Each command first runs uninterrupted (the reference) with ``PRIVKIT_FAULT_TRACE``, which lists
every artefact write. Each kill point then runs the same command in a fresh directory with
``PRIVKIT_FAULT_KILL=N:PHASE`` (the process SIGKILLs itself at its N-th artefact write: before
it, with the new checksum listed, midway through the bytes, or just after the rename; see
:mod:`privkit.files`) or kills it from outside at a random time, records which stages
had finished (``status.json`` entries, the mtimes of their files), re-runs the same command once
and checks

* resumed: the re-run exits 0;
* identical: every number of every JSON file it leaves (report, privacy, audit, metrics, ledger,
  controls...; timings and timestamps aside) equals the reference's, in reproducible-noise mode;
* recomputed: finished stages whose record or files changed (must be none); for ``privkit
  audit`` every audited run whose model checkpoint (``audit-models/model-NNN.pkl``) was stored
  before the kill counts as a finished stage: a re-run that trained it again would rewrite it.

Run (the long form: every file write, four phases, random-time kills; about 30-40 min on a
loaded 2-core machine):

    PYTHONPATH=$PWD .venv/bin/python benchmarks/fault_injection.py --json

``--commands audit`` kills one command alone (results of the audit's own kill points:
benchmarks/results/fault_injection_audit_cpu.json). ``--quick`` runs a handful of points (the test tests/privkit/test_fault_injection.py does).
Results: benchmarks/results/fault_injection_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from privkit.files import FAULT_ENV, FAULT_PHASES, read_json  # noqa: E402

RUN_TOML = """
name = "fi"
seed = 0
delta = 1e-5
accountants = ["rdp", "pld"]
pld_grid = 1e-3
workers = 1
reproducible_noise = true

[federation]
dataset = "digits"
public_dataset = "none"
clients = 2
partition = "iid"

[audit]
shadows = 2
attacks = ["threshold"]
controls = {{ enabled = {controls}, black_box_epochs = 1, canaries = 10 }}
mechanism_controls = {{ enabled = {controls}, canaries = 10 }}

[[methods]]
name = "dpsgd"
quick = true
overrides = {{ epochs = 1, feature_dim = 16 }}
"""
TRAIN = [
    "train",
    "dpsgd",
    "--quick",
    "--set",
    "epochs=1",
    "--set",
    "feature_dim=16",
    "--federation-set",
    "dataset=digits",
    "--federation-set",
    "public_dataset=none",
    "--federation-set",
    "clients=2",
    "--federation-set",
    "partition=iid",
    "--reproducible-noise",
    "--json",
]
AUDIT = ["--attacks", "threshold", "--shadows", "2", "--seed", "0", "--json"]
# what differs between two runs of the same config: clocks and where the run lives
VOLATILE = {"seconds", "wall_seconds", "created", "updated", "run_dir"}


def numbers(obj, path: str = "") -> dict[str, float]:
    """Every number of a JSON value by its path (booleans and strings aside, volatile keys out)."""
    out: dict[str, float] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k not in VOLATILE:
                out.update(numbers(v, f"{path}/{k}"))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.update(numbers(v, f"{path}[{i}]"))
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        out[path] = obj
    return out


def results(out_dir: Path) -> dict[str, dict[str, float]]:
    """The numbers of every JSON file under ``out_dir`` (status.json aside: it holds timings)."""
    return {
        str(p.relative_to(out_dir)): numbers(json.loads(p.read_text()))
        for p in sorted(out_dir.rglob("*.json"))
        if p.name != "status.json"
        and not any(part.startswith(".") for part in p.relative_to(out_dir).parts)
    }


def _mtime(path: Path) -> int | None:
    return path.stat().st_mtime_ns if path.is_file() else None


def run_stages(root: Path) -> dict[str, str]:
    """Finished stages of a ``privkit run`` directory: their status entry and their file's mtime."""
    try:
        status = read_json(root / "status.json")
    except ValueError:  # missing or failing its checksum: nothing counts as finished
        return {}
    out = {}
    outputs = {"train": "train.json", "account": "privacy.json", "audit": "audit.json"}
    for key, m in status.get("methods", {}).items():
        for stage, entry in m.get("stages", {}).items():
            if entry.get("state") == "done":
                out[f"{key}/{stage}"] = json.dumps([entry, _mtime(root / key / outputs[stage])])
    controls = status.get("controls") or {}
    if controls.get("state") == "done":
        out["controls"] = json.dumps([controls, _mtime(root / "audit-controls" / "controls.json")])
    for key, entry in (status.get("mechanism_controls") or {}).items():
        if isinstance(entry, dict) and entry.get("state") == "done":
            out[f"{key}/mechanism-controls"] = json.dumps(
                [entry, _mtime(root / "mechanism-controls" / f"{key}.json")]
            )
    return out


def file_stage(path: Path, name: str) -> Callable[[Path], dict[str, str]]:
    """A one-stage command is finished when its last file is in place (its mtime the witness)."""

    def stages(out: Path) -> dict[str, str]:
        t = _mtime(out / path)
        return {} if t is None else {name: str(t)}

    return stages


def audit_stages(out: Path) -> dict[str, str]:
    """A ``privkit audit``'s finished parts: each audited run whose model checkpoint verifies
    (``audit-models/model-NNN.pkl``) and ``audit.json``, each with its file's mtime."""
    from atomicfiles import verify

    done = {
        f"audit/{p.stem}": str(_mtime(p))
        for p in sorted((out / "audit-models").glob("model-*.pkl"))
        if verify(p, required=True) is None
    }
    return {**done, **file_stage(Path("audit.json"), "audit")(out)}


@dataclass
class Scenario:
    name: str
    argv: Callable[[Path], list[str]]  # work folder -> arguments of the command
    out: Callable[[Path], Path]  # work folder -> the directory the command writes
    stages: Callable[[Path], dict[str, str]]  # out -> finished stage -> fingerprint
    prepare: Callable[[Path], None] = lambda work: None


def scenarios(trained: Path | None, controls: bool) -> list[Scenario]:
    def run_argv(work: Path) -> list[str]:
        toml = work / "fi.toml"
        toml.write_text(RUN_TOML.format(controls=str(controls).lower()))
        return ["run", str(toml), "--out", str(work / "runs"), "--quiet"]

    def copy_trained(work: Path) -> None:
        shutil.copytree(trained, work / "trained")

    out = [
        Scenario("run", run_argv, lambda w: w / "runs" / "fi", run_stages),
        Scenario(
            "train",
            lambda w: [*TRAIN, "--out", str(w / "train")],
            lambda w: w / "train",
            file_stage(Path("train.json"), "train"),
        ),
    ]
    if trained is not None:
        out.append(
            Scenario(
                "audit",
                lambda w: ["audit", str(w / "trained"), *AUDIT],
                lambda w: w / "trained",
                audit_stages,
                copy_trained,
            )
        )
    return out


def child_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **extra}
    for key in (FAULT_ENV, "PRIVKIT_FAULT_TRACE"):
        if key not in extra:
            env.pop(key, None)
    return env


def command(argv: list[str]) -> list[str]:
    return [sys.executable, "-c", "from privkit.cli import main; main()", *argv]


def start(argv: list[str], **popen: object) -> subprocess.Popen:
    """Start ``argv`` in a session (and process group) of its own, from the repository root, so
    that :func:`kill_group` reaches it and every worker it started."""
    popen.setdefault("env", child_env())
    return subprocess.Popen(argv, cwd=REPO, start_new_session=True, **popen)


def kill_group(proc: subprocess.Popen) -> tuple[object, object]:
    """SIGKILL ``proc``'s process group (it and its workers, alive or orphaned), reap ``proc`` and
    return what it printed (``communicate``'s pair; None where nothing was left to read).

    The group id outlives its leader while a member lives, so workers that a killed or finished
    command left behind are reached too; a group already gone is fine."""
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        return proc.communicate(timeout=30)
    except (subprocess.TimeoutExpired, ValueError, OSError):
        proc.wait()
        return None, None


@contextmanager
def owned(argv: list[str], **popen: object) -> Iterator[subprocess.Popen]:
    """:func:`start` ``argv`` for the block; whatever ends the block (its end, a failed assertion,
    a timeout, Ctrl-C), the process and its workers are killed on the way out: a failing test
    never leaves a privkit process running."""
    proc = start(argv, **popen)
    try:
        yield proc
    finally:
        kill_group(proc)


def invoke(argv: list[str], timeout: float = 900, **env: str) -> subprocess.CompletedProcess:
    """Run a privkit command to its end (or ``timeout``), its process group killed after it."""
    args = command(argv)
    with owned(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(**env)
    ) as proc:
        out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


@dataclass
class Reference:
    results: dict
    writes: list[str]  # the path of every artefact write of the main process, in order
    seconds: float


def reference(sc: Scenario, work: Path) -> Reference:
    work.mkdir(parents=True)
    sc.prepare(work)
    trace = work / "trace.txt"
    t0 = time.perf_counter()
    proc = invoke(sc.argv(work), PRIVKIT_FAULT_TRACE=str(trace))
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{sc.name} reference failed: {proc.stderr[-2000:]}")
    lines = [ln.split(" ", 2) for ln in trace.read_text().splitlines()]
    main_pid = lines[0][0]
    return Reference(results(sc.out(work)), [p for pid, _, p in lines if pid == main_pid], seconds)


# --quick: one kill per command, midway through the first write of this file (stages finished
# before it: train and account for `run`; for `audit`, the target and the first reference run,
# whose model checkpoints are stored, the second reference run's being written; checkpoints for
# `train`)
QUICK = {"run": "audit.json", "train": "ledger.json", "audit": "model-002.pkl"}


def quick_point(ref: Reference, name: str) -> list[tuple[int, str]]:
    n = next(i for i, p in enumerate(ref.writes, 1) if Path(p).name == QUICK[name])
    return [(n, "mid")]


def kill_points(ref: Reference, limit: int | None) -> list[tuple[int, str]]:
    """The first write of every file midway (every stage writes a file of its own), then other
    writes at every phase, spread evenly over the run up to ``limit`` points in all (the first
    writes are always kept)."""
    first: dict[str, int] = {}
    for n, path in enumerate(ref.writes, 1):
        first.setdefault(path, n)
    points = [(n, "mid") for n in sorted(first.values())]
    others = [n for n in range(1, len(ref.writes) + 1) if n not in first.values()]
    room = len(others) if limit is None else max(0, limit - len(points))
    if room < len(others):
        step = len(others) / max(room, 1)
        others = [others[int((i + 0.5) * step)] for i in range(room)]
    points += [(n, FAULT_PHASES[i % len(FAULT_PHASES)]) for i, n in enumerate(others)]
    return sorted(points)


def trial(
    sc: Scenario,
    ref: Reference,
    work: Path,
    *,
    point: tuple[int, str] | None = None,
    at: float | None = None,
) -> dict:
    """Kill once (at a write ``point`` or after ``at`` seconds), re-run, compare with ``ref``."""
    work.mkdir(parents=True)
    sc.prepare(work)
    argv = sc.argv(work)
    if point is not None:
        first = invoke(argv, **{FAULT_ENV: f"{point[0]}:{point[1]}"})
        killed = first.returncode == -signal.SIGKILL
        where = f"write {point[0]} ({Path(ref.writes[point[0] - 1]).name}) {point[1]}"
    else:
        with (
            owned(command(argv), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc,
            suppress(subprocess.TimeoutExpired),  # still running at `at`: killed on the way out
        ):
            proc.wait(timeout=at)
        killed = proc.returncode == -signal.SIGKILL
        where = f"random time {at:.1f} s"
    out = sc.out(work)
    finished = sc.stages(out)
    trace = work / "rerun-trace.txt"
    again = invoke(argv, PRIVKIT_FAULT_TRACE=str(trace))
    after = sc.stages(out)
    written = trace.read_text().splitlines() if trace.is_file() else []
    recomputed = sorted(s for s, fp in finished.items() if after.get(s) != fp)
    same = again.returncode == 0 and results(out) == ref.results
    return {
        "command": sc.name,
        "kill": where,
        "killed": killed,
        "finished_at_kill": len(finished),
        "resumed": again.returncode == 0,
        "identical": same,
        "stages_recomputed": recomputed,
        # the files the re-run wrote (a model checkpoint among them: that model was trained)
        "rerun_writes": sorted({Path(ln.split(" ", 2)[2]).name for ln in written}),
        "error": None if again.returncode == 0 else again.stderr.strip()[-300:],
    }


def random_kill(sc: Scenario, ref: Reference, work: Path, rng: random.Random) -> dict:
    """A kill at a random time of the run; a command that finished first (the machine's load
    varies) is tried again at half that time, up to three times."""
    at = rng.uniform(0.3, ref.seconds)
    for attempt in range(3):
        row = trial(sc, ref, work / str(attempt), at=at)
        if row["killed"]:
            break
        at /= 2
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="a handful of kill points (CI)")
    ap.add_argument("--points", type=int, default=None, help="write kill points per command")
    ap.add_argument("--random", type=int, default=4, help="random-time kills per command")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    ap.add_argument(
        "--commands",
        default="run,train,audit",
        help="the commands to kill, comma-separated (default: run,train,audit)",
    )
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    n_random = 0 if args.quick else args.random
    base = Path(tempfile.mkdtemp(prefix="privkit-faults-"))
    rows, refs = [], {}
    wanted = {c.strip() for c in args.commands.split(",") if c.strip()}
    try:
        train_sc = scenarios(None, controls=not args.quick)[1]
        refs["train"] = reference(train_sc, base / "ref-train")
        for sc in scenarios(base / "ref-train" / "train", controls=not args.quick):
            if sc.name not in wanted:
                continue
            if sc.name not in refs:
                refs[sc.name] = reference(sc, base / f"ref-{sc.name}")
            ref = refs[sc.name]
            points = quick_point(ref, sc.name) if args.quick else kill_points(ref, args.points)
            for i, point in enumerate(points):
                rows.append(trial(sc, ref, base / f"{sc.name}-w{i}", point=point))
                _progress(rows[-1], args.json)
            for i in range(n_random):
                rows.append(random_kill(sc, ref, base / f"{sc.name}-r{i}", rng))
                _progress(rows[-1], args.json)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    summary = {
        name: {
            "kill_points": sum(r["command"] == name for r in rows),
            "killed": sum(r["killed"] for r in rows if r["command"] == name),
            "resumed": sum(r["resumed"] for r in rows if r["command"] == name),
            "identical": sum(r["identical"] for r in rows if r["command"] == name),
            "stages_recomputed": sum(
                len(r["stages_recomputed"]) for r in rows if r["command"] == name
            ),
            "artefact_writes": len(refs[name].writes),
            "reference_seconds": round(refs[name].seconds, 1),
        }
        for name in refs
        if name in wanted
    }
    record = {
        "machine": "cpu",
        "cpus": os.cpu_count(),
        "quick": args.quick,
        "table": summary,
        "rows": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        print(
            f"{'command':8} {'kill points':>11} {'resumed':>8} {'identical':>9} {'recomputed':>10}"
        )
        for name, s in summary.items():
            print(
                f"{name:8} {s['kill_points']:>11} {s['resumed']:>8} {s['identical']:>9} "
                f"{s['stages_recomputed']:>10}"
            )
    return record


def _progress(row: dict, quiet: bool) -> None:
    print(json.dumps(row), file=sys.stderr if quiet else sys.stdout, flush=True)


if __name__ == "__main__":
    main()
