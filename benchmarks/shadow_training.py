"""Batched training of M models (privkit.trainers.batched_sgd.train_many) vs a loop of single models.

The loop is :func:`privkit.trainers.batched_sgd.train_one` run M times: one model at a time, DP-SGD
per-example gradients from ``torch.func.vmap(grad)`` as in privkit's DP-SGD step (the way opacus
and most DP-SGD code form them). The batched path trains the M models in lock-step with stacked
layers and per-layer clipping (no per-example weight gradients of linear layers). Same recipe, same
seeds, same batches and the same noise: both produce the same weights, which the benchmark checks
(``max_abs_weight_diff``), so the ratio is pure speed.

Timings are interleaved (loop, batched, loop, batched, ...) and the speed-up is the median of the
per-repeat ratios, so that load from other processes affects both sides alike. Run:

    python benchmarks/shadow_training.py [--json] [--models 16] [--repeats 3] [--threads 1] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

from privkit.data import load_dataset
from privkit.models import model_spec
from privkit.trainers.batched_sgd import SGDRecipe, train_many, train_one

# the quickstart's dpsgd / centralized model and batch size (privkit/trainers/dpsgd.py, quick)
ARCH = {"arch": "cnn", "width": 8, "feature_dim": 32}
RECIPES = {
    "dpsgd": SGDRecipe(epochs=1, batch_size=128, lr=0.5, clip=1.0, noise_multiplier=1.0, sampling="poisson"),
    "sgd": SGDRecipe(epochs=1, batch_size=128, lr=0.1),
}


def _time(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process)."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def bench(name: str, recipe: SGDRecipe, m: int, n_train: int, repeats: int, device: str) -> dict:
    ds = load_dataset("mnist5k")
    spec = model_spec(ARCH["arch"], ds.input_shape, ds.num_classes, width=ARCH["width"],
                      feature_dim=ARCH["feature_dim"])
    rng = np.random.default_rng(0)
    indices = [rng.choice(len(ds.y), n_train, replace=False) for _ in range(m)]
    seeds = list(range(m))
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    out: dict = {}

    def batched() -> None:
        out["many"] = train_many(spec, ds.x, ds.y, indices, recipe, seeds, device=device)
        sync()

    def loop() -> None:
        out["one"] = [train_one(spec, ds.x, ds.y, indices[j], recipe, seeds[j]) for j in range(m)]

    train_many(spec, ds.x, ds.y, indices[:2], recipe, seeds[:2], device=device)  # warm-up
    loops, vecs = [], []
    for _ in range(repeats):
        loops.append(_time(loop))
        vecs.append(_time(batched))
    err = max((out["many"][j][k] - out["one"][j][k]).abs().max().item()
              for j in range(m) for k in out["one"][j])
    wall = [a[0] / b[0] for a, b in zip(loops, vecs)]
    cpu = [a[1] / b[1] for a, b in zip(loops, vecs)]
    return {"models": m, "loop_s": statistics.median(a[0] for a in loops),
            "vectorised_s": statistics.median(b[0] for b in vecs),
            "speedup": statistics.median(wall), "speedup_min": min(wall), "speedup_max": max(wall),
            "loop_cpu_s": statistics.median(a[1] for a in loops),
            "vectorised_cpu_s": statistics.median(b[1] for b in vecs),
            "speedup_cpu": statistics.median(cpu),
            "steps_per_model": recipe.steps(n_train), "records_per_model": n_train,
            "recipe": {k: getattr(recipe, k) for k in ("epochs", "batch_size", "lr", "clip",
                                                       "noise_multiplier", "sampling", "optimizer")},
            "max_abs_weight_diff": err}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--models", type=int, default=16, help="M, models trained at once (default 16)")
    ap.add_argument("--records", type=int, default=1024, help="records per model (default 1024)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda; the loop always runs on the CPU")
    args = ap.parse_args()
    for name, v in (("models", args.models), ("records", args.records), ("repeats", args.repeats),
                    ("threads", args.threads)):
        if v < 1:
            raise SystemExit(f"--{name} must be >= 1; found {v}")
    torch.set_num_threads(args.threads)
    result = {name: bench(name, r, args.models, args.records, args.repeats, args.device)
              for name, r in RECIPES.items()}
    result["setup"] = {
        "model": f"privkit cnn width {ARCH['width']}, feature_dim {ARCH['feature_dim']} (quickstart dpsgd)",
        "data": "mnist5k (1x28x28)", "device": args.device, "torch_threads": args.threads,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()), "torch": torch.__version__,
        "loop": "train_one per model (vmap per-example gradients, CPU)",
        "vectorised": "train_many (stacked layers, per-layer clipping)",
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['setup']['model']}, {args.records} records per model, {args.models} models, "
          f"torch threads {args.threads}, load average {result['setup']['load_average'][0]:.1f}")
    for name in RECIPES:
        r = result[name]
        print(f"{name:6} loop {r['loop_s']:7.2f} s  batched {r['vectorised_s']:7.2f} s  speed-up "
              f"{r['speedup']:5.2f}x ({r['speedup_min']:.2f}-{r['speedup_max']:.2f}), by CPU time "
              f"{r['speedup_cpu']:5.2f}x  max |dw| {r['max_abs_weight_diff']:.1e}")


if __name__ == "__main__":
    main()
