"""Every registered method on the quickstart federation: wall time, test accuracy, accounted epsilon.

The methods table of docs/methods.md comes from this script. Each method trains once in this process, one
torch thread (``OMP_NUM_THREADS=1``), on the quickstart federation (mnist5k clients, Dirichlet
alpha=1, 20 clients, digits28 public data), with its ``quick`` configuration (what ``privkit demo``
runs) or its default configuration (``--defaults``), with an empty h0 cache (no method profits
from another's pretraining). ``seconds`` is wall time, ``cpu_seconds`` the process's CPU time:
with one thread, that is what the run takes on an idle core (the wall time on a shared machine
is longer). Epsilon is the worst client's at delta = 1e-5 under the tightest of the RDP and PLD
accountants (``inf``: a non-private release); for a method whose own delta is larger (FedMD-NFDP:
delta ~ k/n), ``epsilon_at_claim_delta`` is the value at the method's delta.

Usage: ``OMP_NUM_THREADS=1 python benchmarks/methods_table.py [--defaults] [--methods a,b] [--json]``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

import torch

from privkit.data import FederationConfig, build_federation
from privkit.trainers import REGISTRY, train
from privkit.trainers.pretrain import clear_cache

DELTA = 1e-5


def _epsilon(res, delta: float) -> float | str:
    try:
        eps = res.ledger.epsilon(delta, accountant="best") if res.ledger.clients else math.inf
    except ValueError:  # an event no accountant handles
        eps = math.nan
    return eps if math.isfinite(eps) else str(eps)


def measure(method: str, fed, quick: bool, seed: int) -> dict:
    spec = REGISTRY[method]
    cfg = spec.quick_config() if quick else spec.defaults()
    clear_cache()
    start, cpu = time.perf_counter(), time.process_time()
    res = train(method, fed, cfg, seed=seed)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    claim_delta = res.claims.get("delta")
    row = {
        "method": method,
        "config": "quick" if quick else "default",
        "seconds": round(seconds, 1),
        "cpu_seconds": round(cpu, 1),
        "test_accuracy": round(float(res.test_accuracy), 4),
        "chance": round(res.chance_accuracy, 4),
        "near_chance": res.near_chance,
        "epsilon": _epsilon(res, DELTA),
        "formal_dp": spec.formal_dp,
    }
    if claim_delta and 0 < claim_delta < 1 and claim_delta != DELTA:
        row["claim_delta"] = claim_delta
        row["epsilon_at_claim_delta"] = _epsilon(res, claim_delta)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--defaults", action="store_true", help="default configs instead of quick ones")
    ap.add_argument("--methods", default="", help="comma-separated subset (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    fed = build_federation(FederationConfig())  # the quickstart federation
    methods = [m for m in args.methods.split(",") if m] or sorted(REGISTRY)
    rows = []
    for m in methods:
        row = measure(m, fed, not args.defaults, args.seed)
        rows.append(row)
        if not args.json:
            eps = row["epsilon"]
            print(
                f"{m:<14} {row['config']:<8} {row['seconds']:>7.1f} s wall {row['cpu_seconds']:>7.1f} s cpu  "
                f"acc {row['test_accuracy']:.3f} (chance {row['chance']:.2f})  "
                f"eps {eps if isinstance(eps, str) else f'{eps:.3g}'}",
                flush=True,
            )
    out = {
        "schema_version": 1,
        "benchmark": "methods_table",
        "delta": DELTA,
        "conditions": {
            "threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "federation": "quickstart (mnist5k, 20 clients, dirichlet alpha=1, digits28 public)",
            "seed": args.seed,
        },
        "load_average": os.getloadavg(),
        "total_seconds": round(sum(r["seconds"] for r in rows), 1),
        "total_cpu_seconds": round(sum(r["cpu_seconds"] for r in rows), 1),
        "rows": rows,
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(
            f"total {out['total_seconds']} s wall, {out['total_cpu_seconds']} s cpu; load average "
            f"{out['load_average']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
