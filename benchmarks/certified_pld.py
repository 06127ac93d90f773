"""The full form of tests/accountants/test_certified.py: no epsilon privkit prints (PLD, or RDP
where the PLD cannot certify) falls below the exact one (mpmath), nor below the printed bracket's
lower end, over random (q, sigma, steps, delta) with delta down to 1e-300, and over random
two-step compositions of a subsampled Gaussian (q < 1; an mpmath quadrature of the one-step closed
form, delta down to 1e-30; a case whose quadrature cannot reach 1e-11 relative error is listed
as skipped, not counted).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/certified_pld.py --cases 60 --json

Results: benchmarks/results/certified_pld.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "accountants"))

from certified_cases import check, draw_cases, two_step_check  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=60)
    parser.add_argument("--two-step-cases", type=int, default=12)
    parser.add_argument("--seed", type=int, default=2033)
    parser.add_argument(
        "--json", action="store_true", help="write benchmarks/results/certified_pld.json"
    )
    args = parser.parse_args()
    rows = []
    start = time.perf_counter()
    for case in draw_cases(args.cases, args.seed):
        t0 = time.perf_counter()
        row = check(case)
        row["seconds"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    rng = np.random.default_rng(args.seed + 1)
    for _ in range(args.two_step_cases):
        q, sigma = (
            float(rng.uniform(0.01, 0.99)),
            float(np.exp(rng.uniform(np.log(0.5), np.log(8)))),
        )
        delta = float(10.0 ** -rng.uniform(3, 30))
        t0 = time.perf_counter()
        try:
            row = two_step_check(q, sigma, delta)
        except ArithmeticError as exc:  # the quadrature's own error estimate is too large
            row = {"q": q, "sigma": sigma, "steps": 2, "delta": delta, "skipped": str(exc)}
        row["seconds"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    checked = [r for r in rows if "skipped" not in r]
    summary = {
        "cases": len(checked),
        "two_step_cases": sum(r["steps"] == 2 and r["q"] < 1 for r in checked),
        "skipped_quadrature": len(rows) - len(checked),
        "violations": sum(not r["ok"] for r in checked),
        "printed_by_pld": sum(r["accountant"] == "pld" for r in checked),
        "printed_by_rdp": sum(r["accountant"] == "rdp" for r in checked),
        "smallest_delta": min(r["delta"] for r in rows),
        "seconds": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(summary))
    if args.json:
        out = REPO / "benchmarks" / "results" / "certified_pld.json"
        out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=2) + "\n")
    return 1 if summary["violations"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
