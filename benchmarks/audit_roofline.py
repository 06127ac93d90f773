"""The arithmetic floor of an audit's cost: per method, how far below one training its matrix work is.

Issue 32 asks an audit with 16 reference runs to cost at most 3x one training (dpsgd, dp-fedavg,
fedkd-dp, fedkadp, fedavg, fedprox) or 6x (every method), as ``benchmarks/audit_cost.py`` measures
it. Where a method misses, this script gives the roofline arithmetic. In one process, with one torch
thread, per method:

* one training exactly as audit_cost.py's "one training" (the method's ``quick`` configuration on the
  quickstart federation, empty h0 cache), timed in process CPU seconds (``train_cpu_s``);
* the same training again under ``torch.utils.flop_counter.FlopCounterMode``: the floating-point
  operations of its matrix products and convolutions, forward and backward (``flops``, by aten op
  in ``flops_by_op``);
* a second training with seed + 1 and the h0 cache warm, counted the same way (``reference_flops``):
  what a reference run of the same recipe does in the audit's process (methods with a fixed
  ``pretrain_seed`` reuse h0, so a reference run may skip the pretraining the target paid for).

Once per run: this core's peak for such work, the float32 GFLOP/s of a large square matrix product
(``--size``, default 2048, best of ``--repeats``), one thread, process CPU time.

From these: ``floor_s`` = flops / peak, the time one training's products would take if they all
ran at the peak and nothing else cost anything; ``floor_share`` = floor_s / train_cpu_s; and
``audit_ratio_floor`` = 1 + shadows * reference_floor_s / train_cpu_s: an audit trains the target's
run (a full training) plus ``shadows`` reference runs, so on one core audit / training is at least
that even if the reference runs had no overhead and ran every product at peak (attacks and
accounting are left out: they only raise the real ratio). ``excluded`` says whether that floor
alone is above the goal. Beside it: the observed ratios of ``benchmarks/results/audit_cost_cpu.json``
(``observed_ratio`` wall, ``observed_ratio_cpu`` CPU; the floor is in CPU seconds, so compare
with the latter) and ``audit_ratio_floor_observed_train``, the floor against that file's training
CPU seconds (the trainings' time moves with the machine's load; the flops do not).

What FlopCounterMode sees: the aten matrix and convolution ops it has formulas for (mm, addmm, bmm,
baddbmm, convolution, convolution_backward, ...), including direct calls such as
``torch.ops.aten.convolution_backward`` or ``torch.bmm`` and ops under ``torch.func``/``vmap``
(counted on their physical, batched shapes). Every aten op of the counted training is recorded;
matrix-like ops without a formula are listed per method in ``uncounted_matrix_ops`` with their call
counts. Work outside torch (numpy/scipy, e.g. the class heads' fits in privkit/trainers/heads.py)
is invisible to it. Uncounted work only makes the true floor higher: the floor stays a lower
bound, and ``excluded`` stays sound.

    OMP_NUM_THREADS=1 python benchmarks/audit_roofline.py [--json] [--methods a,b] [--size 2048]
        [--repeats 5] [--shadows 16]

Output (``--json``)::

    {"schema_version": 1, "peak_gflops": ..., "methods": {"dpsgd": {"flops": ..., "floor_s": ...,
     "train_cpu_s": ..., "floor_share": ..., "audit_ratio_floor": ..., "observed_ratio_cpu": ...,
     "goal": 3.0, "excluded": false, ...}, ...}, "conditions": {...}}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # audit_cost, when imported from elsewhere

from audit_cost import _demo_settings, _federation, _one_thread

AUDIT_COST_RESULTS = Path(__file__).resolve().parent / "results" / "audit_cost_cpu.json"
GOAL_3X_METHODS = ("dpsgd", "dp-fedavg", "fedkd-dp", "fedkadp", "fedavg", "fedprox")
GOAL_3X, GOAL_ALL = 3.0, 6.0
# aten op names that do matrix or convolution arithmetic (the ones FlopCounterMode has no formula
# for are reported, not guessed)
MATRIX_LIKE = re.compile(r"mm|conv|matmul|einsum|dot|mv|linalg|cdist|linear|addr|outer|tensordot")
NOT_MATRIX = re.compile(r"norm")  # linalg_vector_norm and the like: reductions, not products


def audit_goal(method: str) -> float:
    """Issue 32 item 3: 3x for the named methods, 6x for every other."""
    return GOAL_3X if method in GOAL_3X_METHODS else GOAL_ALL


def audit_ratio_floor(reference_floor_s: float, train_s: float, shadows: int) -> float:
    """Audit / training at least: the target run (one full training) plus ``shadows`` reference
    runs at their arithmetic floor, on one core."""
    return 1.0 + shadows * reference_floor_s / train_s


def matmul_gflops(size: int = 2048, repeats: int = 5) -> float:
    """Float32 GFLOP/s of a ``size x size`` matrix product, best of ``repeats`` (process CPU time)."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        torch.mm(a, b)
        best = min(best, time.process_time() - start)
    return 2 * size**3 / best / 1e9


def _matrix_like(op: str) -> bool:
    name = op.removeprefix("aten.")
    return bool(MATRIX_LIKE.search(name)) and not NOT_MATRIX.search(name)


def _op_recorder():
    """A dispatch mode that counts every aten op (overload packet) called under it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpRecorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: Counter[str] = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    return OpRecorder()


def _train(method: str, seed: int):
    from privkit.trainers import REGISTRY, train

    return train(method, _federation(), REGISTRY[method].quick_config(), seed=seed)


def counted_training(method: str, seed: int) -> dict[str, Any]:
    """One training under FlopCounterMode: total flops, flops by op, uncounted matrix-like ops."""
    from torch.utils.flop_counter import FlopCounterMode, flop_registry

    counter, recorder = FlopCounterMode(display=False), _op_recorder()
    with counter, recorder:
        _train(method, seed)
    counted = {str(op) for op in flop_registry}
    by_op = counter.get_flop_counts().get("Global", {})
    return {
        "flops": int(counter.get_total_flops()),
        "flops_by_op": {str(op): int(n) for op, n in sorted(by_op.items(), key=lambda kv: -kv[1])},
        "uncounted_matrix_ops": {
            op: n
            for op, n in sorted(recorder.calls.items())
            if _matrix_like(op) and op not in counted
        },
    }


def measure(method: str, seed: int, peak_gflops: float, shadows: int) -> dict[str, Any]:
    """Time one training, count its flops and a reference run's, and derive the floors."""
    from privkit.trainers.pretrain import clear_cache

    clear_cache()
    start = time.process_time()
    _train(method, seed)
    train_cpu_s = time.process_time() - start
    clear_cache()
    target = counted_training(method, seed)  # the timed training, counted (cold h0 cache)
    reference = counted_training(method, seed + 1)  # h0 cache warm, as in the audit's process
    peak = peak_gflops * 1e9
    floor_s, reference_floor_s = target["flops"] / peak, reference["flops"] / peak
    ratio_floor = audit_ratio_floor(reference_floor_s, train_cpu_s, shadows)
    goal = audit_goal(method)
    return {
        "flops": target["flops"],
        "reference_flops": reference["flops"],
        "floor_s": round(floor_s, 4),
        "reference_floor_s": round(reference_floor_s, 4),
        "train_cpu_s": round(train_cpu_s, 2),
        "floor_share": round(floor_s / train_cpu_s, 4),
        "audit_ratio_floor": round(ratio_floor, 3),
        "goal": goal,
        "excluded": ratio_floor > goal,
        "flops_by_op": target["flops_by_op"],
        "uncounted_matrix_ops": dict(
            Counter(target["uncounted_matrix_ops"]) + Counter(reference["uncounted_matrix_ops"])
        ),
        "load_average": os.getloadavg(),
    }


def observed_ratios(path: Path = AUDIT_COST_RESULTS) -> dict[str, dict[str, float]]:
    """Per method, audit_cost.py's recorded ratios (wall and CPU) and training CPU seconds, if the
    results file exists."""
    if not path.exists():
        return {}
    methods = json.loads(path.read_text())["methods"]
    return {
        m: {
            "observed_ratio": e["ratio"],
            "observed_ratio_cpu": e["ratio_cpu"],
            "observed_train_cpu_s": e["train_cpu_s"],
        }
        for m, e in methods.items()
    }


def with_observed(entry: dict, observed: dict, shadows: int) -> dict:
    """The entry, audit_cost.py's figures beside it, and the ratio floor against its training
    time (that run's conditions: its ratios are measured against that time)."""
    out = {**entry, **observed}
    if "observed_train_cpu_s" in observed:
        out["audit_ratio_floor_observed_train"] = round(
            audit_ratio_floor(
                entry["reference_floor_s"], observed["observed_train_cpu_s"], shadows
            ),
            3,
        )
    return out


def _print_table(out: dict) -> None:
    print(f"peak {out['peak_gflops']:.1f} GFLOP/s (float32 matrix product, one thread)")
    print(
        f"{'method':<14} {'GFLOP':>7} {'floor s':>8} {'train s':>8} {'share':>7} "
        f"{'ratio floor':>11} {'observed':>8} {'goal':>5}"
    )
    for m, e in out["methods"].items():
        print(
            f"{m:<14} {e['flops'] / 1e9:>7.2f} {e['floor_s']:>8.3f} {e['train_cpu_s']:>8.2f} "
            f"{e['floor_share']:>7.2%} {e['audit_ratio_floor']:>11.2f} "
            f"{e.get('observed_ratio_cpu', float('nan')):>8.2f} {e['goal']:>5.0f}"
            + ("  excluded" if e["excluded"] else "")
        )
        if e["uncounted_matrix_ops"]:
            print(f"{'':<14} not counted: {e['uncounted_matrix_ops']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", default="", help="comma-separated subset (default: the demo's 16)")
    ap.add_argument("--size", type=int, default=2048, help="side of the peak's square matmul")
    ap.add_argument("--repeats", type=int, default=5, help="peak: best of this many products")
    ap.add_argument(
        "--shadows", type=int, default=None, help="reference runs (default: the demo's 16)"
    )
    ap.add_argument("--seed", type=int, default=None, help="training seed (default: the demo's)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    _one_thread()
    demo_methods, audit, demo_seed = _demo_settings()
    methods = [m for m in args.methods.split(",") if m] or demo_methods
    shadows = args.shadows or audit["shadows"]
    seed = demo_seed if args.seed is None else args.seed
    load_start = os.getloadavg()
    t0 = time.perf_counter()
    _federation()  # built once, not timed
    peak = matmul_gflops(args.size, args.repeats)
    observed = observed_ratios()
    results = {}
    for method in methods:
        entry = measure(method, seed, peak, shadows)
        results[method] = with_observed(entry, observed.get(method, {}), shadows)
        print(json.dumps({"method": method, **results[method]}), file=sys.stderr, flush=True)
    out: dict[str, Any] = {
        "schema_version": 1,
        "benchmark": "audit_roofline",
        "peak_gflops": round(peak, 2),
        "methods": results,
        "conditions": {
            "torch_threads": 1,
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "config": "quick",
            "federation": "quickstart (mnist5k, 20 clients, dirichlet alpha=1, digits28 public)",
            "shadows": shadows,
            "seed": seed,
            "peak_matmul_size": args.size,
            "observed_from": str(AUDIT_COST_RESULTS.relative_to(AUDIT_COST_RESULTS.parents[2])),
            "load_average_start": load_start,
            "load_average_end": os.getloadavg(),
        },
        "total_seconds": round(time.perf_counter() - t0, 1),
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        _print_table(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
