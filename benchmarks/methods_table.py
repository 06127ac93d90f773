"""Every registered method on the quickstart federation: wall time, test accuracy, accounted epsilon.

The README's methods table comes from this script. Each method trains once in this process, one
torch thread (``OMP_NUM_THREADS=1``), on the quickstart federation (mnist5k clients, Dirichlet
alpha=1, 20 clients, digits28 public data), with its ``quick`` configuration (what ``privkit demo``
runs) or its default configuration (``--defaults``). Epsilon is the worst client's at
delta = 1e-5 under the tightest of the RDP and PLD accountants (``inf``: a non-private release).

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
from privkit.trainers.chance import chance_level

DELTA = 1e-5


def measure(method: str, fed, quick: bool, seed: int) -> dict:
    spec = REGISTRY[method]
    cfg = spec.quick_config() if quick else spec.defaults()
    start = time.perf_counter()
    res = train(method, fed, cfg, seed=seed)
    seconds = time.perf_counter() - start
    try:
        eps = res.ledger.epsilon(DELTA, accountant="best") if res.ledger.clients else math.inf
    except ValueError:
        eps = math.nan
    return {"method": method, "config": "quick" if quick else "default", "seconds": round(seconds, 1),
            "test_accuracy": round(float(res.test_accuracy), 4),
            "epsilon": eps if math.isfinite(eps) else str(eps), "formal_dp": spec.formal_dp,
            "chance": round(chance_level(fed), 4)}


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
            print(f"{m:<14} {row['config']:<8} {row['seconds']:>7.1f} s  acc {row['test_accuracy']:.3f}  "
                  f"eps {eps if isinstance(eps, str) else f'{eps:.3g}'}", flush=True)
    out = {"schema_version": 1, "benchmark": "methods_table", "delta": DELTA,
           "conditions": {"threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                          "platform": platform.platform(), "federation": "quickstart (mnist5k, "
                          "20 clients, dirichlet alpha=1, digits28 public)", "seed": args.seed},
           "total_seconds": round(sum(r["seconds"] for r in rows), 1), "rows": rows}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"total {out['total_seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
