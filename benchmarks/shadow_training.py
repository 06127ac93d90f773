"""Batched training of M models (privkit.batched.batched_sgd.train_many) vs a loop of single models.

The loop is :func:`privkit.batched.batched_sgd.train_one` run M times: one model at a time, DP-SGD
per-example gradients from ``torch.func.vmap(grad)`` as in privkit's DP-SGD step. The batched path
trains the M models in lock-step on stacked layers with per-layer clipping (no per-example weight
gradients of linear layers). Same recipe, same seeds, same batches and the same noise: both give
the same weights, which the benchmark checks (``max_abs_weight_diff``), so the ratio is pure
speed. For DP-SGD two more loops run the same mechanism with their own random streams: privkit's
single-model step (:class:`~privkit.mechanisms.dp_sgd_step.DpSgdStep`, what privkit's federated
DP-SGD methods run per model: per-layer clipping by the batched path's own code with M = 1) and
opacus (``PrivacyEngine``, the peer).

Two models: ``mlp`` (784-128-10, batch 32, 256 records per model: the configuration of the
measurement that found the old batched DP-SGD slower than the loop) and ``cnn`` (the quickstart's
dpsgd model, batch 128, 1024 records per model). The top-level ``dpsgd`` and ``sgd`` entries are the
mlp's; ``cnn`` holds the same entries for the CNN.

Timings are interleaved (loop, batched, opacus, DpSgdStep loop, loop, ...); speed-ups are medians of the
per-repeat ratios, by wall clock and by this process's CPU time (one torch thread: CPU time is the
work done, and is less disturbed by other processes on a shared machine). Run:

    python benchmarks/shadow_training.py [--json] [--models 16] [--repeats 3] [--threads 1] [--device cpu]
        [--loop-device DEVICE] [--no-peers]

On a GPU (``--device cuda``) both the batched path and the loop run there (the loop's per-model
kernel launches are what batching removes); ``--loop-device cpu`` compares with the CPU loop.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings

import numpy as np
import torch
import torch.nn.functional as F

from privkit.batched.batched_sgd import SGDRecipe, _init, train_many, train_one
from privkit.data import load_dataset
from privkit.mechanisms.dp_sgd_step import DpSgdStep
from privkit.models import model_spec

CASES = {
    "mlp": ({"arch": "mlp", "feature_dim": 128}, 32, 256),
    "cnn": ({"arch": "cnn", "width": 8, "feature_dim": 32}, 128, 1024),  # quickstart dpsgd (quick)
}


def _recipes(batch_size: int) -> dict[str, SGDRecipe]:
    return {
        "dpsgd": SGDRecipe(
            epochs=1,
            batch_size=batch_size,
            lr=0.5,
            clip=1.0,
            noise_multiplier=1.0,
            sampling="poisson",
        ),
        "sgd": SGDRecipe(epochs=1, batch_size=batch_size, lr=0.1),
    }


def _time(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process)."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def _opacus_one(spec: dict, x: np.ndarray, y: np.ndarray, recipe: SGDRecipe, seed: int) -> None:
    """One model trained by opacus with the recipe's mechanism (Poisson rate 1 / batches per epoch)."""
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    model = _init(spec, seed)
    loader = DataLoader(
        TensorDataset(torch.as_tensor(x), torch.as_tensor(y)), batch_size=recipe.batch_size
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        private, opt, dp_loader = PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=recipe.lr),
            data_loader=loader,
            noise_multiplier=recipe.noise_multiplier,
            max_grad_norm=recipe.clip,
            poisson_sampling=True,
        )
        for _ in range(recipe.epochs):
            for xb, yb in dp_loader:
                opt.zero_grad()
                if len(yb):
                    F.cross_entropy(private(xb), yb).backward()
                opt.step()


def _dpsgd_step_one(spec: dict, x: np.ndarray, y: np.ndarray, recipe: SGDRecipe, seed: int) -> None:
    """One model trained with privkit's single-model DP-SGD step and the recipe's mechanism."""
    model = _init(spec, seed)
    n = len(y)
    step = DpSgdStep(recipe.clip, recipe.noise_multiplier, recipe.sample_rate(n), n)
    opt = torch.optim.SGD(model.parameters(), lr=recipe.lr)
    xt, yt = torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y, dtype=torch.long)
    batches, noise = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
    for _ in range(recipe.steps(n)):
        b = step.sample(batches)
        step.apply(model, opt, xt[b], yt[b], lambda lo, t, _a: F.cross_entropy(lo, t), noise)


def _median_ratio(a: list, b: list, i: int) -> float:
    return statistics.median(u[i] / v[i] for u, v in zip(a, b))


def bench(
    case: str,
    recipe: SGDRecipe,
    m: int,
    repeats: int,
    device: str,
    loop_device: str,
    peers: bool = True,
) -> dict:
    arch, _, n_train = CASES[case]
    ds = load_dataset("mnist5k")
    spec = model_spec(
        arch["arch"],
        ds.input_shape,
        ds.num_classes,
        **{k: v for k, v in arch.items() if k != "arch"},
    )
    rng = np.random.default_rng(0)
    indices = [rng.choice(len(ds.y), n_train, replace=False) for _ in range(m)]
    seeds = list(range(m))
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    out: dict = {}

    def batched() -> None:
        out["many"] = train_many(spec, ds.x, ds.y, indices, recipe, seeds, device=device)
        sync()

    loop_sync = torch.cuda.synchronize if loop_device.startswith("cuda") else (lambda: None)

    def loop() -> None:
        out["one"] = [
            train_one(spec, ds.x, ds.y, indices[j], recipe, seeds[j], device=loop_device)
            for j in range(m)
        ]
        loop_sync()

    def opacus() -> None:
        for j in range(m):
            _opacus_one(spec, ds.x[indices[j]], ds.y[indices[j]], recipe, seeds[j])

    def step_loop() -> None:
        for j in range(m):
            _dpsgd_step_one(spec, ds.x[indices[j]], ds.y[indices[j]], recipe, seeds[j])

    train_many(spec, ds.x, ds.y, indices[:2], recipe, seeds[:2], device=device)  # warm-up
    train_one(spec, ds.x, ds.y, indices[0], recipe, seeds[0], device=loop_device)
    dp = recipe.clip is not None and peers
    loops, vecs, peers, steps = [], [], [], []
    for _ in range(repeats):
        loops.append(_time(loop))
        vecs.append(_time(batched))
        if dp:
            peers.append(_time(opacus))
            steps.append(_time(step_loop))
    err = max(
        (out["many"][j][k] - out["one"][j][k]).abs().max().item()
        for j in range(m)
        for k in out["one"][j]
    )
    wall = [a[0] / b[0] for a, b in zip(loops, vecs)]
    res = {
        "models": m,
        "loop_s": statistics.median(a[0] for a in loops),
        "vectorised_s": statistics.median(b[0] for b in vecs),
        "speedup": statistics.median(wall),
        "speedup_min": min(wall),
        "speedup_max": max(wall),
        "loop_cpu_s": statistics.median(a[1] for a in loops),
        "vectorised_cpu_s": statistics.median(b[1] for b in vecs),
        "speedup_cpu": _median_ratio(loops, vecs, 1),
        "steps_per_model": recipe.steps(n_train),
        "records_per_model": n_train,
        "recipe": {
            k: getattr(recipe, k)
            for k in (
                "epochs",
                "batch_size",
                "lr",
                "clip",
                "noise_multiplier",
                "sampling",
                "optimizer",
            )
        },
        "max_abs_weight_diff": err,
    }
    if dp:
        res.update(
            {
                "opacus_loop_s": statistics.median(p[0] for p in peers),
                "opacus_loop_cpu_s": statistics.median(p[1] for p in peers),
                "speedup_vs_opacus": _median_ratio(peers, vecs, 0),
                "speedup_vs_opacus_cpu": _median_ratio(peers, vecs, 1),
                "dpsgd_step_loop_s": statistics.median(p[0] for p in steps),
                "dpsgd_step_loop_cpu_s": statistics.median(p[1] for p in steps),
                "speedup_vs_dpsgd_step": _median_ratio(steps, vecs, 0),
                "speedup_vs_dpsgd_step_cpu": _median_ratio(steps, vecs, 1),
            }
        )
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--models", type=int, default=16, help="M, models trained at once (default 16)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument(
        "--device", default="cpu", help="device of the batched path: cpu (default) or cuda"
    )
    ap.add_argument(
        "--loop-device",
        default=None,
        help="device of the reference loop (default: --device); "
        "opacus' and DpSgdStep's loops run on the CPU",
    )
    ap.add_argument("--no-peers", action="store_true", help="skip the opacus and DpSgdStep loops")
    args = ap.parse_args()
    for name in ("models", "repeats", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be >= 1; found {getattr(args, name)}")
    args.loop_device = args.loop_device or args.device
    for name in ("device", "loop_device"):
        value = getattr(args, name)
        if value != "cpu" and not (value.startswith("cuda") and torch.cuda.is_available()):
            raise SystemExit(
                f"--{name.replace('_', '-')} must be cpu or an available cuda device; "
                f"found {value!r}"
            )
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    by_case = {
        case: {
            name: bench(
                case, r, args.models, args.repeats, args.device, args.loop_device, not args.no_peers
            )
            for name, r in _recipes(CASES[case][1]).items()
        }
        for case in CASES
    }
    result = {
        **by_case["mlp"],
        "cnn": by_case["cnn"],
        "setup": {
            "mlp": "privkit mlp 784-128-10, batch 32, 256 records per model, 1 epoch",
            "cnn": "privkit cnn width 8, feature_dim 32 (the quickstart's dpsgd model), batch 128, "
            "1024 records per model, 1 epoch",
            "data": "mnist5k (1x28x28)",
            "device": args.device,
            "loop_device": args.loop_device,
            "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
            "torch_threads": args.threads,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "cpu_count": os.cpu_count(),
            "load_average_start": list(load_start),
            "load_average_end": list(os.getloadavg()),
            "torch": torch.__version__,
            "repeats": args.repeats,
            "loop": "train_one per model on loop_device (torch.func vmap per-example gradients)",
            "vectorised": "train_many (stacked layers, per-layer clipping in chunks of examples)",
            "opacus_loop": "opacus PrivacyEngine per model (DP-SGD only)",
            "dpsgd_step_loop": "privkit DpSgdStep per model (DP-SGD only): Poisson batches, per-layer clipping "
            "by the batched path's code with M = 1",
        },
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    s = result["setup"]
    print(
        f"{args.models} models, torch threads {args.threads}, load average {s['load_average_start'][0]:.1f}"
        f" -> {s['load_average_end'][0]:.1f}"
    )
    for case in CASES:
        print(s[case])
        for name, r in by_case[case].items():
            peer = (
                f"  vs opacus loop {r['speedup_vs_opacus']:5.2f}x (CPU {r['speedup_vs_opacus_cpu']:.2f}x)"
                f"  vs DpSgdStep loop {r['speedup_vs_dpsgd_step']:5.2f}x (CPU "
                f"{r['speedup_vs_dpsgd_step_cpu']:.2f}x)"
                if "opacus_loop_s" in r
                else ""
            )
            print(
                f"  {name:6} loop {r['loop_s']:7.2f} s  batched {r['vectorised_s']:7.2f} s  speed-up "
                f"{r['speedup']:5.2f}x (CPU time {r['speedup_cpu']:5.2f}x){peer}  max |dw| "
                f"{r['max_abs_weight_diff']:.1e}"
            )


if __name__ == "__main__":
    main()
