"""Mutation suite: the bugs real DP code has, injected into privkit's methods and audited as a user's
run is audited; how often each is caught, and the correct twins' false-violation rate.

Setting: the demo's federation (``privkit demo``: mnist5k over 20 clients, digits28 public data)
and every method's quick config. Each (method, mutation, seed) trains the method once with the
bug (:mod:`privkit.mechanisms.mutations`) and white-box probes at its DP mechanisms for client 0
(:mod:`privkit.mechanisms.probes`, 1000 Dirac canaries per mechanism, capped at its dimension), then audits
each probe set against the run's (possibly mutated) ledger
(:func:`privkit.audit.mechanism_audit.audit_mechanisms`: conformance test + one-run bound at 95%).

Mutations: ``correct`` (the twin without a bug: flagged at most at the nominal 5%), ``noise x1/2``,
``noise x1/N`` (N = 20 clients), ``clipping off`` (DP-SGD: no per-record clipping; output
perturbation: features not normalised), ``ledger steps x1/2``, ``ledger rate x1/2``. A ledger
mutation that changes nothing in a method's ledger is ``n/a``.

The table: catch rate over the seeds, median of the one-run bound (model-free) and of the measured
epsilon (the claim's epsilon at the measured noise), and per method the smallest noise reduction
caught at least half the time, scanned over noise factors ``--factors``.

Usage: ``python benchmarks/audit_mutations.py [--seeds 10] [--methods ...] [--workers 2] [--json]``;
writes benchmarks/results/audit_mutations.json and prints the Markdown table of
benchmarks/audit_mutations.md. ``--quick``: 2 seeds, two methods, no factor scan.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

DELTA = 1e-5
METHODS = (
    "dpsgd",
    "dp-fedavg",
    "fedkd-dp",
    "fedkadp",
    "fedauxfdp",
    "fedavg-dphead",
    "fedd-dphead",
    "fedaux",
)
MUTATIONS = (
    "correct",
    "noise x1/2",
    "noise x1/N",
    "clipping off",
    "ledger steps x1/2",
    "ledger rate x1/2",
)
FACTORS = (0.95, 0.9, 0.8, 0.7)
RESULTS = Path(__file__).resolve().parent / "results" / "audit_mutations.json"

_FED = None


def _federation():
    global _FED
    if _FED is None:
        from privkit.data import build_federation
        from privkit.pipeline import bundled_config, load_run_config

        _FED = build_federation(load_run_config(bundled_config("quickstart")).config.federation)
    return _FED


def one(task: tuple[str, str | float, int, int]) -> dict:
    """Train and audit one (method, mutation or noise factor, seed)."""
    import torch

    from privkit.mechanisms.mutations import Mutation
    from privkit.methods import get_trainer

    torch.set_num_threads(1)
    method, mutation, seed, canaries = task
    mut = (
        Mutation(f"noise x{mutation:g}", noise_factor=float(mutation))
        if isinstance(mutation, float)
        else mutation
    )
    t0 = time.perf_counter()
    try:
        r = __import__(
            "privkit.audit.mechanism_audit", fromlist=["audit_mechanisms"]
        ).audit_mechanisms(
            method,
            _federation(),
            get_trainer(method).quick_config(),
            delta=DELTA,
            seed=seed,
            mutation=mut,
            canaries=canaries,
        )
    except Exception as exc:
        return {
            "method": method,
            "mutation": str(mutation),
            "seed": seed,
            "status": "error",
            "error": f"{type(exc).__name__}: {exc}",
            "seconds": time.perf_counter() - t0,
        }
    return {
        "method": method,
        "mutation": str(mutation) if not isinstance(mutation, float) else mutation,
        "seed": seed,
        "status": r["status"],
        "epsilon_lower_bound": r.get("epsilon_lower_bound"),
        "measured_epsilon": r.get("measured_epsilon"),
        "accounted_epsilon": r.get("accounted_epsilon"),
        "rejected": sorted({t for p in r["probes"] for t in p["rejected"]}),
        "probe_sets": [f"client {p['client']} {p['mechanism']}" for p in r["probes"]],
        "seconds": time.perf_counter() - t0,
    }


def _median(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return statistics.median(xs) if xs else None


def summarise(rows: list[dict]) -> dict:
    """Per (method, mutation): catch rate, medians; per method: the smallest noise factor caught."""
    table: dict[str, dict] = {}
    for r in rows:
        cell = table.setdefault(r["method"], {}).setdefault(str(r["mutation"]), [])
        cell.append(r)
    out: dict[str, dict] = {}
    for method, cells in table.items():
        out[method] = {}
        for mutation, rs in cells.items():
            applicable = [r for r in rs if r["status"] in ("violation", "consistent")]
            out[method][mutation] = {
                "seeds": len(rs),
                "applicable": len(applicable),
                "caught": sum(r["status"] == "violation" for r in applicable),
                "catch_rate": (
                    sum(r["status"] == "violation" for r in applicable) / len(applicable)
                    if applicable
                    else None
                ),
                "status": (
                    "n/a"
                    if not applicable and all(r["status"] == "not-applicable" for r in rs)
                    else "error"
                    if not applicable
                    else "ok"
                ),
                "errors": sorted({r["error"] for r in rs if r["status"] == "error"}),
                "median_bound": _median([r.get("epsilon_lower_bound") for r in applicable]),
                "median_measured": _median([r.get("measured_epsilon") for r in applicable]),
                "median_accounted": _median([r.get("accounted_epsilon") for r in applicable]),
                "rejected": sorted({t for r in applicable for t in r["rejected"]}),
                "median_seconds": _median([r["seconds"] for r in rs]),
            }
        caught = [
            float(m)
            for m, c in out[method].items()
            if _is_factor(m) and (c["catch_rate"] or 0) >= 0.5
        ]
        halved = out[method].get("noise x1/2", {}).get("catch_rate") or 0
        out[method]["smallest_noise_reduction_caught"] = max(
            caught + ([0.5] if halved >= 0.5 else []), default=None
        )
    return out


def _is_factor(name: str) -> bool:
    try:
        float(name)
        return True
    except ValueError:
        return False


def _fmt(x, digits=2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:.{digits}f}"


def markdown(summary: dict, seeds: int) -> str:
    head = (
        "| method | "
        + " | ".join(MUTATIONS)
        + " | largest noise factor caught >= 1/2 |\n|---|"
        + "---|" * (len(MUTATIONS) + 1)
        + "\n"
    )
    lines = []
    for method, cells in summary.items():
        row = []
        for m in MUTATIONS:
            c = cells.get(m)
            if c is None:
                row.append("-")
            elif c["status"] == "n/a":
                row.append("n/a")
            elif c["status"] == "error":
                row.append("error")
            else:
                row.append(
                    f"{c['caught']}/{c['applicable']} (bound {_fmt(c['median_bound'])}, "
                    f"measured {_fmt(c['median_measured'])})"
                )
        lines.append(
            f"| {method} | "
            + " | ".join(row)
            + f" | {_fmt(cells.get('smallest_noise_reduction_caught'))} |"
        )
    return (
        f"Caught / seeds ({seeds} seeds each; median one-run bound and median measured epsilon)\n\n"
        + head
        + "\n".join(lines)
        + "\n"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--methods", nargs="*", default=list(METHODS))
    ap.add_argument("--mutations", nargs="*", default=list(MUTATIONS))
    ap.add_argument("--factors", nargs="*", type=float, default=list(FACTORS))
    ap.add_argument("--canaries", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.seeds < 1:
        print(f"--seeds must be >= 1; found {args.seeds}", file=sys.stderr)
        return 2
    if args.quick:
        args.seeds, args.methods, args.factors = 2, ["dp-fedavg", "fedavg-dphead"], []
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    tasks = [
        (m, mut, s, args.canaries)
        for m in args.methods
        for mut in args.mutations
        for s in range(args.seeds)
    ]
    tasks += [
        (m, f, s, args.canaries)
        for m in args.methods
        for f in args.factors
        for s in range(args.seeds)
    ]
    t0 = time.perf_counter()
    rows = []
    partial = args.out.with_suffix(
        ".partial.jsonl"
    )  # every finished row, kept if the run is cut short
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_text("")
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        for i, row in enumerate(pool.map(one, tasks), 1):
            rows.append(row)
            with partial.open("a") as fh:
                fh.write(json.dumps(row, default=float) + "\n")
            print(
                f"[{i}/{len(tasks)}] {row['method']} {row['mutation']} seed {row['seed']}: {row['status']} "
                f"({row['seconds']:.1f} s)",
                file=sys.stderr,
                flush=True,
            )
    summary = summarise(rows)
    result = {
        "schema_version": 1,
        "benchmark": "audit_mutations",
        "delta": DELTA,
        "seeds": args.seeds,
        "canaries": args.canaries,
        "confidence": 0.95,
        "federation": "quickstart (mnist5k, 20 clients)",
        "wall_seconds": time.perf_counter() - t0,
        "summary": summary,
        "rows": rows,
    }
    args.out.write_text(json.dumps(result, indent=1, default=float))
    partial.unlink()
    print(
        json.dumps(result if args.json else {"summary": summary}, default=float)
        if args.json
        else markdown(summary, args.seeds)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
