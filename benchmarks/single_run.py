"""One training on the CPU: the batched engine's single run against the loop, side by side.

``privkit train`` and ``privkit run`` train a single run of a method with a batched form
through the batched engine (:func:`privkit.batched.many.train_one`: the round's clients step
together, with the kernels an audit's target run takes); :func:`privkit.trainers.train` is the
loop (one client after the other, autograd and ``torch.optim``) the engine is tested against.
This script times both, per method, on the quickstart federation with the method's ``quick``
configuration (the demo's), one torch thread, in one process, the two paths interleaved
within each repeat:

* ``loop_cpu_s`` / ``batched_cpu_s``: CPU seconds of one training (median over ``--repeats``)
  in release mode (the default: the DP noise from secret streams, as a user's run draws it);
  ``speedup``: their quotient;
* ``seeded_loop_cpu_s`` / ``seeded_batched_cpu_s`` / ``seeded_speedup``: the same in
  reproducible-noise mode, where both paths draw the same noise;
* ``bit_equal`` and ``max_abs_diff``: whether the two paths' final global models are equal bit
  for bit in reproducible-noise mode, and else by how much they differ (float rounding of
  other kernels: the batched engine's contract is 1e-5, bit for bit for the Adam methods).

Each training starts with an empty h0 cache (``clear_cache``); each path trains once untimed
before (a process's first call pays lazy imports and set-up).

Usage::

    OMP_NUM_THREADS=1 python benchmarks/single_run.py [--methods fedavg,dpsgd] [--repeats 3]
        [--json] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import audit_cost


def _cpu_seconds(fn) -> tuple[object, float]:
    start = time.process_time()
    out = fn()
    return out, time.process_time() - start


def max_abs_diff(a: dict, b: dict) -> float:
    """The largest absolute difference between two state dicts' entries (same keys)."""
    return max(
        (float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].numel()),
        default=0.0,
    )


def measure(method: str, repeats: int) -> dict:
    from privkit.batched.many import train_one
    from privkit.trainers import REGISTRY, train
    from privkit.trainers.pretrain import clear_cache

    fed = audit_cost._federation()
    release = REGISTRY[method].quick_config()
    seeded = {**release, "reproducible_noise": True}
    paths = {
        "loop": lambda cfg: train(method, fed, cfg, seed=0),
        "batched": lambda cfg: train_one(method, fed, cfg, 0),
    }
    for run in paths.values():  # untimed: lazy imports and first calls
        run(release)
    times: dict[str, list[float]] = {}
    models = {}
    for _ in range(repeats):
        for mode, cfg in (("", release), ("seeded_", seeded)):
            for path, run in paths.items():
                clear_cache()
                result, secs = _cpu_seconds(lambda r=run, c=cfg: r(c))
                times.setdefault(f"{mode}{path}", []).append(secs)
                if mode:
                    models[path] = {
                        k: v.detach().cpu() for k, v in result.model.state_dict().items()
                    }
    row: dict = {f"{k}_cpu_s": round(statistics.median(v), 3) for k, v in times.items()}
    row["speedup"] = round(row["loop_cpu_s"] / row["batched_cpu_s"], 2)
    row["seeded_speedup"] = round(row["seeded_loop_cpu_s"] / row["seeded_batched_cpu_s"], 2)
    diff = max_abs_diff(models["loop"], models["batched"])
    row["bit_equal"] = diff == 0.0
    row["max_abs_diff"] = diff
    return row


def main(argv: list[str] | None = None) -> int:
    from privkit.methods import REGISTRY

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", default="", help="comma-separated (default: every batched one)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path, help="write the JSON here too")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        print(f"error: --repeats must be >= 1; found {args.repeats}", file=sys.stderr)
        return 2
    batched = [m for m, spec in REGISTRY.items() if spec.batched is not None]
    methods = [m for m in args.methods.split(",") if m] or batched
    unknown = [m for m in methods if m not in batched]
    if unknown:
        print(
            f"error: --methods must name methods with a batched form ({', '.join(batched)}); "
            f"found {', '.join(unknown)}",
            file=sys.stderr,
        )
        return 2
    audit_cost._one_thread()
    gflops_start = audit_cost.matmul_gflops()
    rows = {}
    for method in methods:
        rows[method] = measure(method, args.repeats)
        print(json.dumps({method: rows[method]}), file=sys.stderr, flush=True)
    out = {
        "schema_version": 1,
        "benchmark": "single_run",
        "methods": rows,
        "conditions": {
            "torch_threads": 1,
            "platform": platform.platform(),
            "config": "quick",
            "federation": "quickstart (mnist5k, 20 clients, dirichlet alpha=1, digits28 public)",
            "repeats": args.repeats,
            "matmul_gflops_start": round(gflops_start, 1),
            "matmul_gflops_end": round(audit_cost.matmul_gflops(), 1),
        },
    }
    audit_cost.emit(out, args.out, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
