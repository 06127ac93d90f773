"""What an audit costs: per method, one training's time, the audit's time, and their ratio.

Each method trains once with its ``quick`` configuration (what ``privkit demo`` runs; ``--config
default``: its default configuration, the paper's setting where privkit has one) on the
quickstart federation (mnist5k, 20 clients, Dirichlet alpha=1, digits28 public data), with an empty
h0 cache (a worker process's first task trains once untimed before: the process's own start-up
is not a training's), as ``privkit train`` trains it (:func:`privkit.flower_engine.engine.train`:
the batched engine's single run where the method has a batched form, schema 2); it also trains
once by the loop (:func:`privkit.trainers.train`, ``train_loop_s``), the training schema 1's
files measured, and ``ratio_to_loop`` is the audit's ratio to that one. Its run directory gets the demo's account stage (``privacy.json``, not timed: the audit
accounts the audited runs on its PLD grid, 1e-3 in the demo) and is then audited as the demo audits
it (:func:`privkit.audit.audit_run`: 16 reference runs, every attack, the demo's delta and seed). The
audit trains the target's fair-coin run and the reference runs: on the batched path where the
method's recipe has one (serial executor), else one run after the other. ``--loop`` forces the
one-at-a-time path (an executor object, so the batched form is not taken): the "before" of a
before/after comparison, run in the same invocation with ``--compare``.

``--rounds N`` sets every method's ``rounds`` (a default configuration cut short: FedMD's or
FedDF's default training takes minutes a run; federated methods only).

Conditions: the demo's. Methods run in ``--workers`` (default 2) spawned processes, one torch
thread each, so both cores are busy as in ``privkit demo``; each (method, repeat) is one task and
the repeats of a method are spread over the run. ``train_s`` and ``audit_s`` are medians over
``--repeats`` (default 3) of wall seconds, ``ratio`` their quotient; ``*_cpu_s`` are the worker's
CPU seconds (one thread: the work done, less disturbed by other processes on a shared machine), and
``ratio_cpu`` their quotient. ``load_average`` says how busy the machine was, and
``matmul_gflops_start``/``_end`` its rate for a float32 matrix product on one thread before and
after: on a shared machine that rate differs between days (88-173 GFLOP/s measured), and the
reference runs' batched products with it, so the ratios of two files compare only at similar
rates. Each (method,
repeat) is also printed to stderr as one JSON line when it ends.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/audit_cost.py [--json] [--methods a,b] [--repeats 3]
        [--shadows 16] [--workers 2] [--config quick|default] [--rounds N] [--loop | --compare]

Output (``--json``)::

    {"methods": {"dpsgd": {"train_s": ..., "audit_s": ..., "ratio": ..., ...}, ...}, ...}

With ``--compare`` each method also carries ``loop_audit_s`` and ``speedup`` (loop audit over
batched audit, medians of the per-repeat ratios: the two audits of a repeat run back to back).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from typing import Any, NoReturn

QUICKSTART = Path(__file__).resolve().parents[1] / "privkit" / "configs" / "quickstart.toml"


def _one_thread() -> None:
    """One torch thread, and the allocator policy ``privkit``'s command line runs under (a tree
    from before :mod:`privkit.memory`, measured by ``audit_cost_paired.py``, runs without it)."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = "1"
    import torch

    torch.set_num_threads(1)
    try:
        from privkit.memory import keep_freed_memory
    except ImportError:
        return
    keep_freed_memory()


def matmul_gflops(size: int = 2048, repeats: int = 5) -> float:
    """Float32 GFLOP/s of a ``size x size`` matrix product on one thread, best of ``repeats``
    (process CPU time): this machine's rate for the work the reference runs' batched products
    do, which differs between days on a shared machine (88-173 GFLOP/s measured), and with it
    the audit's ratio to a training of small operations."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        torch.mm(a, b)  # warm-up
        best = float("inf")
        for _ in range(repeats):
            start = time.process_time()
            torch.mm(a, b)
            best = min(best, time.process_time() - start)
    finally:
        torch.set_num_threads(threads)
    return 2 * size**3 / best / 1e9


def _demo_settings() -> tuple[list[str], dict, int]:
    """The demo's methods, audit and accounting settings and seed (privkit/configs/quickstart.toml)."""
    import tomllib

    cfg = tomllib.loads(QUICKSTART.read_text())
    methods = [m["name"] for m in cfg["methods"]]
    audit = cfg.get("audit", {})
    return (
        methods,
        {
            "shadows": int(audit.get("shadows", 16)),
            "delta": float(cfg.get("delta", 1e-5)),
            # the account stage's settings: privacy.json's PLD grid is the audit's
            "accountant": cfg.get("accountant", "best"),
            "accountants": cfg.get("accountants"),
            "pld_grid": cfg.get("pld_grid"),
            "curve_accountant": cfg.get("curve_accountant", "rdp"),
        },
        int(cfg.get("seed", 0)),
    )


def _account(run: Path, task: dict) -> None:
    """The demo's account stage on the run directory (``privacy.json``; not timed): the audit
    accounts the audited runs on its PLD grid (:func:`privkit.audit.run._headline_grid`)."""
    from privkit.files import atomic_write_json
    from privkit.pipeline.stages import account_method

    atomic_write_json(
        run / "privacy.json",
        account_method(
            run,
            task["delta"],
            task["accountant"],
            accountants=task["accountants"],
            pld_grid=task["pld_grid"],
            curve_accountant=task["curve_accountant"],
        ),
    )


def run_directory(run: Path, method: str, seed: int, cfg, fed, result, task: dict) -> None:
    """``run`` made the run directory ``privkit train`` writes for ``result`` (the method's
    config, the federation, the trained run), with the demo's account stage."""
    (run / "config.json").write_text(json.dumps({"method": method, "seed": seed, "trainer": cfg}))
    fed.save(run / "federation.json")
    result.save(run)
    _account(run, task)


def emit(result: dict, out: Path | None, as_json: bool, skip: tuple[str, ...] = ()) -> None:
    """Write a one-process benchmark's ``result`` to ``out`` (where given) and print it: the JSON
    with ``as_json``, else a line per method (without the ``skip`` entries)."""
    text = json.dumps(result, indent=1)
    if out:
        out.write_text(text + "\n")
    if as_json:
        print(text)
        return
    for method, row in result["methods"].items():
        print(method, {k: v for k, v in row.items() if k not in skip})


_FEDERATION: dict[str, Any] = {}
_WARM: list[str] = []  # the method this worker process warmed up with (untimed), once


def _check_rounds(rounds: int, methods: list[str]) -> None:
    """``--rounds`` applies to methods whose configuration has rounds: a bad value or such a
    method is one line naming it (exit code 2)."""
    from privkit.trainers import REGISTRY

    if rounds < 0:
        fail(f"--rounds must be an integer >= 0; found {rounds}")
    for m in methods:
        if m in REGISTRY and "rounds" not in REGISTRY[m].defaults():
            fail(f"--rounds applies to federated methods; found {m}, which has no rounds")


def fail(message: str) -> NoReturn:
    """Bad input: one line naming the parameter and the value found, exit code 2 (the benchmarks
    that take their measurement from here say it the same way)."""
    print(message, file=sys.stderr)
    raise SystemExit(2)


def _federation():
    from privkit.data import FederationConfig, build_federation

    if "fed" not in _FEDERATION:
        _FEDERATION["fed"] = build_federation(FederationConfig())  # the quickstart federation
    return _FEDERATION["fed"]


def _timed(fn):
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def measure(task: dict) -> dict:
    """One (method, repeat): train once (cold h0 cache), then audit the run directory (batched
    and/or loop path). A worker process's first task first trains its method once untimed: the
    process's one-time costs (lazy imports, first calls into torch) are not one training's."""
    _one_thread()
    from attacks.executor import SerialExecutor
    from privkit.audit import audit_run
    from privkit.flower_engine.engine import train
    from privkit.trainers import REGISTRY
    from privkit.trainers import train as train_loop
    from privkit.trainers.pretrain import clear_cache

    method, seed, shadows, delta = task["method"], task["seed"], task["shadows"], task["delta"]
    fed = _federation()
    spec = REGISTRY[method]
    cfg = spec.quick_config() if task["config"] == "quick" else spec.defaults()
    if task.get("rounds") is not None:  # the configuration cut (or grown) to this many rounds
        cfg = {**cfg, "rounds": task["rounds"]}
    if not _WARM:  # a worker's first training also pays the process's lazy imports and set-up
        train(method, fed, cfg, seed=seed)
        train_loop(method, fed, cfg, seed=seed)
        _WARM.append(method)
    clear_cache()
    result, train_s, train_cpu = _timed(lambda: train(method, fed, cfg, seed=seed))
    clear_cache()
    _, loop_s, loop_cpu = _timed(lambda: train_loop(method, fed, cfg, seed=seed))
    out = {
        "method": method,
        "repeat": task["repeat"],
        "train_s": train_s,
        "train_cpu_s": train_cpu,
        "train_loop_s": loop_s,
        "train_loop_cpu_s": loop_cpu,
        "test_accuracy": float(result.test_accuracy),
    }
    with tempfile.TemporaryDirectory(prefix="audit-cost-") as tmp:
        run = Path(tmp)
        run_directory(run, method, seed, cfg, fed, result, task)
        for path in task["paths"]:  # "batched" (the serial executor: batched form if any) or "loop"
            executor = "serial" if path == "batched" else SerialExecutor()
            audit, secs, cpu = _timed(
                lambda ex=executor: audit_run(
                    run,
                    shadows=shadows,
                    executor=ex,
                    seed=task["audit_seed"],
                    delta=delta,
                    write=False,
                )
            )
            key = "audit" if path == "batched" else "loop_audit"
            out[f"{key}_s"], out[f"{key}_cpu_s"] = secs, cpu
            out[f"{key}_error"] = audit.get("shadow_error")
    return out


def _median(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def summarise(rows: list[dict]) -> dict:
    """Per method: medians and ratios (see the module docstring)."""
    out: dict = {}
    for method in dict.fromkeys(r["method"] for r in rows):
        rs = [r for r in rows if r["method"] == method]
        entry: dict[str, Any] = {"repeats": len(rs)}
        for key in (
            "train_s",
            "train_cpu_s",
            "train_loop_s",
            "train_loop_cpu_s",
            "audit_s",
            "audit_cpu_s",
            "loop_audit_s",
            "loop_audit_cpu_s",
        ):
            v = _median(rs, key)
            if v is not None:
                entry[key] = round(v, 2)
        # the audit of the default path: batched where the recipe allows, else the loop
        audit, audit_cpu = (
            entry.get("audit_s", entry.get("loop_audit_s")),
            entry.get("audit_cpu_s", entry.get("loop_audit_cpu_s")),
        )
        entry["audit_s"], entry["audit_cpu_s"] = audit, audit_cpu
        entry["ratio"] = round(audit / entry["train_s"], 2)
        entry["ratio_cpu"] = round(audit_cpu / entry["train_cpu_s"], 2)
        if "train_loop_s" in entry:  # against the loop's training: the earlier files' ratio
            entry["ratio_to_loop"] = round(audit / entry["train_loop_s"], 2)
            entry["ratio_cpu_to_loop"] = round(audit_cpu / entry["train_loop_cpu_s"], 2)
        if all("loop_audit_s" in r and "audit_s" in r for r in rs):
            entry["loop_ratio"] = round(entry["loop_audit_s"] / entry["train_s"], 2)
            entry["speedup"] = round(
                statistics.median(r["loop_audit_s"] / r["audit_s"] for r in rs), 2
            )
            entry["speedup_cpu"] = round(
                statistics.median(r["loop_audit_cpu_s"] / r["audit_cpu_s"] for r in rs), 2
            )
        errors = sorted(
            {e for r in rs for k in ("audit_error", "loop_audit_error") if (e := r.get(k))}
        )
        if errors:
            entry["errors"] = errors
        entry["test_accuracy"] = round(statistics.median(r["test_accuracy"] for r in rs), 4)
        out[method] = entry
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", default="", help="comma-separated subset (default: the demo's 16)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--shadows", type=int, default=None, help="reference runs (default: the demo's 16)"
    )
    ap.add_argument(
        "--workers", type=int, default=2, help="parallel worker processes (one thread each)"
    )
    ap.add_argument("--seed", type=int, default=None, help="training seed (default: the demo's)")
    ap.add_argument(
        "--config",
        choices=["quick", "default"],
        default="quick",
        help="each method's quick configuration (the demo's) or its default one",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="set the configuration's rounds (federated methods): a default one cut short",
    )
    path = ap.add_mutually_exclusive_group()
    path.add_argument(
        "--loop", action="store_true", help="audit one run after the other (no batched form)"
    )
    path.add_argument("--compare", action="store_true", help="audit both ways, back to back")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.workers < 1:
        ap.error(f"repeats and workers must be >= 1; found {args.repeats}, {args.workers}")
    demo_methods, audit, demo_seed = _demo_settings()
    methods = [m for m in args.methods.split(",") if m] or demo_methods
    if args.rounds is not None:
        _check_rounds(args.rounds, methods)
    shadows = args.shadows or audit["shadows"]
    seed = demo_seed if args.seed is None else args.seed
    paths = ["loop"] if args.loop else ["batched", "loop"] if args.compare else ["batched"]
    tasks = [
        {
            "method": m,
            "repeat": r,
            "seed": seed,
            "audit_seed": seed + r,
            "shadows": shadows,
            "delta": audit["delta"],
            **{k: audit[k] for k in ("accountant", "accountants", "pld_grid", "curve_accountant")},
            "paths": paths,
            "config": args.config,
            "rounds": args.rounds,
        }
        for r in range(args.repeats)
        for m in methods
    ]  # repeats spread over the run
    load_start = os.getloadavg()
    gflops_start = matmul_gflops(repeats=3)
    t0 = time.perf_counter()
    rows = []
    with ProcessPoolExecutor(
        args.workers, mp_context=get_context("spawn"), initializer=_one_thread
    ) as pool:
        futures = [pool.submit(measure, t) for t in tasks]
        for fut in as_completed(futures):
            row = fut.result()
            rows.append(row)
            print(
                json.dumps(row), file=sys.stderr, flush=True
            )  # each repeat as it ends (a long run's log)
    summary = summarise(sorted(rows, key=lambda r: (methods.index(r["method"]), r["repeat"])))
    out: dict[str, Any] = {
        "schema_version": 2,
        "benchmark": "audit_cost",
        "methods": summary,
        "conditions": {
            "workers": args.workers,
            "torch_threads": 1,
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "config": args.config,
            "rounds": args.rounds,  # None: the configuration's own
            "federation": "quickstart (mnist5k, 20 clients, dirichlet alpha=1, digits28 public)",
            "shadows": shadows,
            "pld_grid": audit["pld_grid"],
            "repeats": args.repeats,
            "paths": paths,
            "seed": seed,
            "load_average_start": load_start,
            "load_average_end": os.getloadavg(),
            # the machine's matrix-product rate before and after (one thread): ratios of files
            # measured on days of different rates are not comparable
            "matmul_gflops_start": round(gflops_start, 1),
            "matmul_gflops_end": round(matmul_gflops(repeats=3), 1),
        },
        "total_seconds": round(time.perf_counter() - t0, 1),
        "totals": {
            k: round(sum(e.get(k) or 0.0 for e in summary.values()), 1)
            for k in ("train_s", "train_loop_s", "audit_s", "loop_audit_s")
        },
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(
            f"{'method':<14} {'train s':>8} {'audit s':>8} {'ratio':>6} {'cpu ratio':>9}"
            + ("  loop audit s  speed-up" if args.compare else "")
        )
        for m, e in summary.items():
            line = f"{m:<14} {e['train_s']:>8.1f} {e['audit_s']:>8.1f} {e['ratio']:>6.1f} {e['ratio_cpu']:>9.1f}"
            if "speedup" in e:
                line += f"  {e['loop_audit_s']:>12.1f}  {e['speedup']:>7.2f}x"
            print(line)
        c = out["conditions"]
        print(
            f"load average {c['load_average_start']} -> {c['load_average_end']}; matrix product "
            f"{c['matmul_gflops_start']} -> {c['matmul_gflops_end']} GFLOP/s (one thread)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
