"""The arithmetic floor of an audit's cost: per method, how far below one training its matrix work is.

Issue 32 asks an audit with 16 reference runs to cost at most 3x one training (dpsgd, dp-fedavg,
fedkd-dp, fedkadp, fedavg, fedprox) or 6x (every method), as ``benchmarks/audit_cost.py`` measures
it. Where a method misses, this script gives the roofline arithmetic. In one process, with one torch
thread, per method:

* one training exactly as audit_cost.py's "one training" (``privkit train``'s; the method's
  ``quick`` configuration on the quickstart federation, empty h0 cache, after one untimed training as audit_cost.py's workers
  warm up), timed in process CPU seconds (``train_cpu_s``);
* the same training again under ``torch.utils.flop_counter.FlopCounterMode``: the floating-point
  operations of its matrix products and convolutions, forward and backward (``flops``, by aten op
  in ``flops_by_op``);
* a second training with seed + 1 and the h0 cache warm, counted the same way (``reference_flops``):
  what a reference run of the same recipe does in the audit's process (methods with a fixed
  ``pretrain_seed`` reuse h0, so a reference run may skip the pretraining the target paid for).

Once per run: this core's peak for such work, the float32 GFLOP/s of a large square matrix product
(``--size``, default 2048, best of ``--repeats``), one thread, process CPU time.

The reference runs' noise: an audit's reference runs draw their Gaussian noise from seeded torch
generators (docs/auditing-methods.md), so the same reference training is run once more with
``reproducible_noise`` under a dispatch mode that counts the standard normals it draws (the
elements of every ``normal_``/``randn`` output: ``reference_normals``), and the generator's own
rate is measured once per run (``ns_per_normal``: float32 ``randn`` of ``--normals`` numbers, one
thread, best of ``--repeats``). ``reference_noise_floor_s`` = reference_normals x ns_per_normal is
what drawing a reference run's noise costs at that rate, whatever else the run does; methods without
Gaussian noise draw none.

From these: ``floor_s`` = flops / peak, the time one training's products would take if they all
ran at the peak and nothing else cost anything; ``floor_share`` = floor_s / train_cpu_s; and
``audit_ratio_floor`` = 1 + shadows * (reference_floor_s + reference_noise_floor_s) / train_cpu_s:
an audit trains the target's run (a full training) plus ``shadows`` reference runs, so on one core
audit / training is at least that even if the reference runs had no overhead, ran every product at
peak and drew their normals at the generator's rate (attacks and accounting are left out: they only
raise the real ratio). ``excluded`` says whether that floor alone is above the goal; ``headroom``
is what the goal leaves, in trainings, for everything else 16 reference runs and the audit do
(goal - audit_ratio_floor). Beside it: the observed ratios of ``benchmarks/results/audit_cost_cpu.json``
(``observed_ratio`` wall, ``observed_ratio_cpu`` CPU; the floor is in CPU seconds, so compare
with the latter) and ``audit_ratio_floor_observed_train``, the floor against that file's training
CPU seconds (the trainings' time moves with the machine's load; the flops do not).

With ``--kernels``, a floor from the kernels the audit's reference runs really run: the reference
runs of ``audit_run`` at the demo's audit seed (its pool, design and recipe; the target run left
out) are trained batched, as the audit trains them, under a dispatch mode that records every
matrix product, convolution, fused optimiser pass and normal draw with its arguments' shapes,
strides and dtypes; each distinct call is then replayed on fresh tensors of those layouts and
timed on its own (``kernel_replay.py``). ``reference_kernel_s`` is what those kernels cost at the
speed torch's kernels reach on those very shapes on this core, with their inputs in cache, and
``audit_ratio_floor_kernels`` = 1 + reference_kernel_s / train_cpu_s: the audit's ratio if the
reference runs did nothing but those kernels. Unlike the floor at peak, it binds this
implementation's shapes and torch's kernels for them, not the hardware: a reformulation with
other shapes (or better kernels) could go below it; ``excluded_at_kernel_rates`` says whether it
is above the goal. The same pass counts those runs' own products and normals
(``audit_reference_flops``, ``audit_reference_normals``: all reference runs together), and
``audit_ratio_floor_at_peak`` = 1 + (their flops / peak + their normals x ns_per_normal) /
train_cpu_s is the floor at peak of the arithmetic the audit's reference runs really do, where
the count is plausible (``peak_count_plausible``: its products at peak take no longer than the
replayed kernels did; FlopCounterMode over-counts the stacked CNNs' grouped convolutions, and an
implausible count excludes nothing). It is the sound one where the two differ: a reference
client may train its first layer over the inputs its records use or over their span only (:mod:`privkit.batched.used_inputs`, the Adam methods'
``exact_mlp``), so it does less than the run alone that ``reference_flops`` and
``reference_normals`` count, and ``audit_ratio_floor`` (hence ``excluded``) can overstate the
floor for those methods.

What FlopCounterMode sees: the aten matrix and convolution ops it has formulas for (mm, addmm, bmm,
baddbmm, convolution, convolution_backward, ...), including direct calls such as
``torch.ops.aten.convolution_backward`` or ``torch.bmm`` and ops under ``torch.func``/``vmap``
(counted on their physical, batched shapes). Every aten op of the counted training is recorded;
matrix-like ops without a formula are listed per method in ``uncounted_matrix_ops`` with their call
counts. Work outside torch (numpy/scipy, e.g. the class heads' fits in privkit/trainers/heads.py)
is invisible to it. Uncounted work only makes the true floor higher: ``audit_ratio_floor_at_peak``
stays a lower bound, and ``excluded_at_peak`` stays sound.

    OMP_NUM_THREADS=1 python benchmarks/audit_roofline.py [--json] [--methods a,b] [--size 2048]
        [--normals 4000000] [--repeats 5] [--shadows 16] [--kernels]

Output (``--json``)::

    {"schema_version": 2, "peak_gflops": ..., "ns_per_normal": ..., "methods": {"dpsgd": {"flops":
     ..., "floor_s": ..., "reference_normals": ..., "reference_noise_floor_s": ..., "train_cpu_s":
     ..., "floor_share": ..., "audit_ratio_floor": ..., "headroom": ..., "observed_ratio_cpu": ...,
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

from audit_cost import _demo_settings, _federation, _one_thread, matmul_gflops
from kernel_replay import KernelRecorder, replayed

AUDIT_COST_RESULTS = Path(__file__).resolve().parent / "results" / "audit_cost_cpu.json"
GOAL_3X_METHODS = ("dpsgd", "dp-fedavg", "fedkd-dp", "fedkadp", "fedavg", "fedprox")
GOAL_3X, GOAL_ALL = 3.0, 6.0
# aten op names that do matrix or convolution arithmetic (the ones FlopCounterMode has no formula
# for are reported, not guessed)
MATRIX_LIKE = re.compile(r"mm|conv|matmul|einsum|dot|mv|linalg|cdist|linear|addr|outer|tensordot")
NOT_MATRIX = re.compile(r"norm")  # linalg_vector_norm and the like: reductions, not products
NORMAL_OPS = ("aten.normal", "aten.normal_", "aten.randn")  # Gaussian draws
# the optimisers' fused passes (Adam's moments and weights in one kernel)
OPTIMISER_OPS = ("aten._fused_adam_", "aten._fused_adam", "aten._fused_adamw_", "aten._fused_sgd_")


def _kernel_op(op: str) -> bool:
    """The ops whose kernels the reference runs' kernel floor replays: matrix products and
    convolutions, fused optimiser passes and normal draws."""
    return _matrix_like(op) or op in OPTIMISER_OPS or op in NORMAL_OPS


def audit_goal(method: str) -> float:
    """Issue 32 item 3: 3x for the named methods, 6x for every other."""
    return GOAL_3X if method in GOAL_3X_METHODS else GOAL_ALL


def audit_ratio_floor(reference_floor_s: float, train_s: float, shadows: int) -> float:
    """Audit / training at least: the target run (one full training) plus ``shadows`` reference
    runs at their floor (products at peak, plus their normals at the generator's rate), on one
    core."""
    return 1.0 + shadows * reference_floor_s / train_s


def normal_ns(count: int = 4_000_000, repeats: int = 5) -> float:
    """Nanoseconds per float32 standard normal of torch's seeded CPU generator (the reference
    runs' noise source), ``count`` at a time into one buffer, best of ``repeats`` (process CPU
    time)."""
    import torch

    gen, out = torch.Generator().manual_seed(0), torch.empty(count)
    torch.randn(count, generator=gen, out=out)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        torch.randn(count, generator=gen, out=out)
        best = min(best, time.process_time() - start)
    return best / count * 1e9


def _matrix_like(op: str) -> bool:
    name = op.removeprefix("aten.")
    return bool(MATRIX_LIKE.search(name)) and not NOT_MATRIX.search(name)


def _op_recorder():
    """A dispatch mode that counts every aten op (overload packet) called under it."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpRecorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: Counter[str] = Counter()
            self.normals = 0  # standard normals drawn (elements of normal_/randn outputs)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            self.calls[name] += 1
            out = func(*args, **(kwargs or {}))
            if name in NORMAL_OPS and isinstance(out, torch.Tensor):
                self.normals += out.numel()
            return out

    return OpRecorder()


def _train(method: str, seed: int, seeded_noise: bool = False):
    """One training as ``privkit train`` trains it (the batched engine's single run where the
    method has a batched form: :func:`privkit.batched.many.trains_batched_alone`)."""
    from privkit.flower_engine.engine import train
    from privkit.trainers import REGISTRY

    cfg = REGISTRY[method].quick_config()
    if seeded_noise:  # as an audit's reference runs draw it
        cfg = {**cfg, "reproducible_noise": True}
    return train(method, _federation(), cfg, seed=seed)


def reference_normals(method: str, seed: int) -> int:
    """The standard normals a reference run of ``method`` draws (seeded noise, as an audit's
    reference runs draw it)."""
    recorder = _op_recorder()
    with recorder:
        _train(method, seed, seeded_noise=True)
    return recorder.normals


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


def audit_reference_runs(method: str, audit_seed: int, shadows: int):
    """The reference runs an audit of the method's quick run trains (the experiment of
    :func:`privkit.audit.run.audit_run` at ``audit_seed``: its pool, design and recipe), as a
    callable that trains them batched, as the audit does (the target run left out)."""
    from privkit.audit.run import audit_experiment
    from privkit.trainers import REGISTRY

    fed = _federation()
    pool, _, _, design, recipe = audit_experiment(
        fed, method, REGISTRY[method].quick_config(), seed=audit_seed, shadows=shadows
    )
    runs = [
        (ix, s) for ix, s in zip(design.index_sets(), design.seeds()) if s != design.target_seed
    ]
    x, y = fed.private.x[pool], fed.private.y[pool]
    return lambda: recipe.fit_many(x, y, [ix for ix, _ in runs], [s for _, s in runs])


def reference_kernels(method: str, audit_seed: int, shadows: int, repeats: int) -> dict[str, Any]:
    """The audit's reference runs trained batched under a :class:`~kernel_replay.KernelRecorder`
    (matrix products, convolutions, fused optimiser passes, normal draws), each distinct call then
    replayed on its own (:func:`~kernel_replay.replayed`): what those kernels cost at the speed
    torch reaches on their shapes on this core, for all the reference runs together."""
    from torch.utils.flop_counter import FlopCounterMode

    train_references = audit_reference_runs(method, audit_seed, shadows)
    recorder = KernelRecorder(_kernel_op)
    # the same runs' products and normals counted: their arithmetic as the audit does it (a
    # reference client may train over its records' inputs or span only: fewer than a run alone)
    counter, normals = FlopCounterMode(display=False), _op_recorder()
    start = time.process_time()
    with counter, normals, recorder:
        train_references()
    recorded_s = time.process_time() - start
    out = replayed(recorder.calls, repeats=repeats)
    by_op = out["by_op"]
    return {
        "audit_reference_flops": int(counter.get_total_flops()),
        "audit_reference_normals": normals.normals,
        "reference_kernel_s": round(out["seconds"], 3),
        "reference_kernel_by_op": dict(list(by_op.items())[:8]),
        "reference_kernel_calls": out["calls"],
        "reference_kernel_signatures": out["signatures"],
        "reference_runs_recorded_s": round(recorded_s, 2),
    }


def measure(
    method: str,
    seed: int,
    peak_gflops: float,
    ns_per_normal: float,
    shadows: int,
    audit_seed: int | None = None,
    repeats: int = 3,
) -> dict[str, Any]:
    """Time one training, count its flops and a reference run's (and that run's normals), and
    derive the floors; with ``audit_seed``, also the audit's batched reference runs' kernels
    replayed (:func:`reference_kernels`) and the ratio floor they set."""
    from privkit.trainers.pretrain import clear_cache

    _train(method, seed)  # untimed: the process's first training pays its one-time set-up
    clear_cache()
    start = time.process_time()
    _train(method, seed)
    train_cpu_s = time.process_time() - start
    clear_cache()
    target = counted_training(method, seed)  # the timed training, counted (cold h0 cache)
    reference = counted_training(method, seed + 1)  # h0 cache warm, as in the audit's process
    normals = reference_normals(method, seed + 1)
    peak = peak_gflops * 1e9
    floor_s, reference_floor_s = target["flops"] / peak, reference["flops"] / peak
    noise_floor_s = normals * ns_per_normal / 1e9
    ratio_floor = audit_ratio_floor(reference_floor_s + noise_floor_s, train_cpu_s, shadows)
    goal = audit_goal(method)
    return {
        "flops": target["flops"],
        "reference_flops": reference["flops"],
        "floor_s": round(floor_s, 4),
        "reference_floor_s": round(reference_floor_s, 4),
        "reference_normals": normals,
        "reference_noise_floor_s": round(noise_floor_s, 4),
        "train_cpu_s": round(train_cpu_s, 2),
        "floor_share": round(floor_s / train_cpu_s, 4),
        "audit_ratio_floor": round(ratio_floor, 3),
        "headroom": round(goal - ratio_floor, 3),
        "goal": goal,
        "excluded": ratio_floor > goal,
        **_kernel_floor(
            method, audit_seed, shadows, repeats, train_cpu_s, goal, peak, ns_per_normal
        ),
        "flops_by_op": target["flops_by_op"],
        "uncounted_matrix_ops": dict(
            Counter(target["uncounted_matrix_ops"]) + Counter(reference["uncounted_matrix_ops"])
        ),
        "load_average": os.getloadavg(),
    }


def _kernel_floor(
    method: str,
    audit_seed: int | None,
    shadows: int,
    repeats: int,
    train_cpu_s: float,
    goal: float,
    peak: float,
    ns_per_normal: float,
) -> dict[str, Any]:
    """The kernel floor's fields (none without ``audit_seed``): the reference runs' replayed
    kernels, and ``audit_ratio_floor_kernels`` = 1 + their seconds / one training's (the target
    run a full training, the reference runs no more than their kernels); and the peak floor of
    the same runs' own arithmetic, ``audit_ratio_floor_at_peak`` = 1 + (their flops / ``peak``
    (flop/s) + their normals x ``ns_per_normal``) / one training's."""
    if audit_seed is None:
        return {}
    kernels = reference_kernels(method, audit_seed, shadows, repeats)
    floor = 1.0 + kernels["reference_kernel_s"] / train_cpu_s
    products_at_peak = kernels["audit_reference_flops"] / peak
    at_peak = products_at_peak + kernels["audit_reference_normals"] * ns_per_normal / 1e9
    peak_floor = 1.0 + at_peak / train_cpu_s
    # a count whose products would take longer at peak than their kernels took is not a floor
    # (FlopCounterMode over-counts some batched forms, e.g. the stacked CNNs' grouped
    # convolutions): it is reported, not used to exclude
    plausible = products_at_peak <= kernels["reference_kernel_s"]
    return {
        **kernels,
        "audit_ratio_floor_kernels": round(floor, 3),
        "excluded_at_kernel_rates": floor > goal,
        "audit_ratio_floor_at_peak": round(peak_floor, 3),
        "peak_count_plausible": plausible,
        "excluded_at_peak": plausible and peak_floor > goal,
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
                entry["reference_floor_s"] + entry.get("reference_noise_floor_s", 0.0),
                observed["observed_train_cpu_s"],
                shadows,
            ),
            3,
        )
    return out


def _print_table(out: dict) -> None:
    print(
        f"peak {out['peak_gflops']:.1f} GFLOP/s (float32 matrix product, one thread); "
        f"{out['ns_per_normal']:.2f} ns per seeded normal"
    )
    print(
        f"{'method':<14} {'GFLOP':>7} {'floor s':>8} {'noise s':>8} {'train s':>8} {'share':>7} "
        f"{'ratio floor':>11} {'observed':>8} {'goal':>5}"
    )
    for m, e in out["methods"].items():
        print(
            f"{m:<14} {e['flops'] / 1e9:>7.2f} {e['floor_s']:>8.3f} "
            f"{e['reference_noise_floor_s']:>8.3f} {e['train_cpu_s']:>8.2f} "
            f"{e['floor_share']:>7.2%} {e['audit_ratio_floor']:>11.2f} "
            f"{e.get('observed_ratio_cpu', float('nan')):>8.2f} {e['goal']:>5.0f}"
            + ("  excluded" if e["excluded"] else "")
        )
        if "audit_ratio_floor_kernels" in e:
            print(
                f"{'':<14} reference runs' kernels {e['reference_kernel_s']:.2f} s: kernel floor "
                f"{e['audit_ratio_floor_kernels']:.2f}x"
                + ("  excluded at these kernels' rates" if e["excluded_at_kernel_rates"] else "")
            )
        if "audit_ratio_floor_at_peak" in e:
            print(
                f"{'':<14} the audit's reference runs' own arithmetic at peak: floor "
                f"{e['audit_ratio_floor_at_peak']:.2f}x"
                + ("  excluded at peak" if e["excluded_at_peak"] else "")
                + ("" if e["peak_count_plausible"] else "  (over-counted: not a floor)")
            )
        if e["uncounted_matrix_ops"]:
            print(f"{'':<14} not counted: {e['uncounted_matrix_ops']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", default="", help="comma-separated subset (default: the demo's 16)")
    ap.add_argument("--size", type=int, default=2048, help="side of the peak's square matmul")
    ap.add_argument(
        "--normals", type=int, default=4_000_000, help="normals per timed draw of the generator"
    )
    ap.add_argument(
        "--repeats", type=int, default=5, help="peak and generator: best of this many timings"
    )
    ap.add_argument(
        "--shadows", type=int, default=None, help="reference runs (default: the demo's 16)"
    )
    ap.add_argument("--seed", type=int, default=None, help="training seed (default: the demo's)")
    ap.add_argument(
        "--kernels",
        action="store_true",
        help="also replay the audit's batched reference runs' kernels (the kernel floor; slower)",
    )
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
    if min(args.size, args.normals, args.repeats) < 1:
        ap.error(
            f"size, normals and repeats must be >= 1; found {args.size}, {args.normals}, "
            f"{args.repeats}"
        )
    peak = matmul_gflops(args.size, args.repeats)
    ns = normal_ns(args.normals, args.repeats)
    observed = observed_ratios()
    results = {}
    for method in methods:
        entry = measure(
            method, seed, peak, ns, shadows, seed if args.kernels else None, args.repeats
        )
        results[method] = with_observed(entry, observed.get(method, {}), shadows)
        print(json.dumps({"method": method, **results[method]}), file=sys.stderr, flush=True)
    out: dict[str, Any] = {
        "schema_version": 2,
        "benchmark": "audit_roofline",
        "peak_gflops": round(peak, 2),
        "ns_per_normal": round(ns, 3),
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
