"""Release-mode DP noise (AES-CTR, privkit.mechanisms.dp_random) against the torch generator it replaced.

Measures, in one run on the CPU (best of ``--repeats``): 10M float32 standard normals from a seeded
torch Generator (the old release stream) and from ``DpRandom.secret()`` (AES-128-CTR + numpy's
ziggurat, then a torch tensor); 10M Bernoulli inclusions (Poisson masks) likewise; 10M released
coordinates, ``x + sigma * z`` with torch's generator (naive float noise) against privkit's release
(the grid of privkit.mechanisms.grid_noise: the exact rounded-Gaussian draws alone, and the whole release with
its snapping); and one batched DP-SGD training (privkit.batched.batched_sgd.train_many, 8 MLPs) in
reproducible vs release mode.

    OMP_NUM_THREADS=1 python benchmarks/dp_random_throughput.py [--json]

With ``--json`` one JSON object is printed (recorded in benchmarks/results/dp_random_throughput_cpu.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np
import torch

from privkit.mechanisms.dp_random import DpRandom


def best_of(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def training(reproducible: bool) -> None:
    from privkit.batched.batched_sgd import SGDRecipe, train_many

    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((2000, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, 2000)
    spec = {"arch": "mlp", "input_shape": [1, 8, 8], "num_classes": 10, "feature_dim": 256}
    recipe = SGDRecipe(epochs=2, batch_size=64, clip=1.0, noise_multiplier=1.0, sampling="poisson")
    train_many(spec, x, y, [np.arange(1000)] * 8, recipe, list(range(8)), reproducible=reproducible)


def release_timings(n: int, repeats: int, old: torch.Generator, new: DpRandom) -> dict[str, float]:
    """10M coordinates released with Gaussian noise: naive float noise against the grid release."""
    from privkit.mechanisms import gaussian_release
    from privkit.mechanisms.grid_noise import Grid, rounded_gaussian

    clean = {"w": torch.randn(n, generator=torch.Generator().manual_seed(0))}
    grid = Grid.for_release(1.0, 1.0, n)
    bits = new.bits()
    return {
        "release_torch_s": best_of(
            lambda: gaussian_release(clean, std=1.0, sensitivity=1.0, source=old)[0], repeats
        ),
        "release_grid_s": best_of(
            lambda: gaussian_release(clean, std=1.0, sensitivity=1.0, source=new)[0], repeats
        ),
        "grid_draws_s": best_of(lambda: rounded_gaussian(grid.scale, n, bits), repeats),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10_000_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    torch.set_num_threads(1)
    old = torch.Generator().manual_seed(1)
    new = DpRandom.secret()
    res = {
        "normals_torch_s": best_of(lambda: torch.randn(args.n, generator=old), args.repeats),
        "normals_aes_s": best_of(lambda: new.randn(args.n), args.repeats),
        "mask_torch_s": best_of(lambda: torch.rand(args.n, generator=old) < 0.01, args.repeats),
        "mask_aes_s": best_of(lambda: new.mask(args.n, rate=0.01), args.repeats),
        **release_timings(args.n, args.repeats, old, new),
        "train_reproducible_s": best_of(lambda: training(True), 2),
        "train_release_s": best_of(lambda: training(False), 2),
    }
    res["normals_ratio"] = res["normals_aes_s"] / res["normals_torch_s"]
    res["mask_ratio"] = res["mask_aes_s"] / res["mask_torch_s"]
    res["release_ratio"] = res["release_grid_s"] / res["release_torch_s"]
    res["grid_draws_ratio"] = res["grid_draws_s"] / res["normals_torch_s"]
    res["train_ratio"] = res["train_release_s"] / res["train_reproducible_s"]
    out = {
        "n": args.n,
        "repeats": args.repeats,
        "cpu": platform.processor() or platform.machine(),
        "load_average": [round(v, 2) for v in os.getloadavg()],
        **{k: round(v, 4) for k, v in res.items()},
    }
    if args.json:
        print(json.dumps(out, indent=1))
        return
    for k, v in out.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
