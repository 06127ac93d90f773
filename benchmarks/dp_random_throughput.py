"""Release-mode DP noise (AES-CTR, privkit.dp_random) against the torch generator it replaced.

Measures, in one run on the CPU (best of ``--repeats``): 10M float32 standard normals from a seeded
torch Generator (the old release stream) and from ``DpRandom.secret()`` (AES-128-CTR + numpy's
ziggurat, then a torch tensor); 10M Bernoulli inclusions (Poisson masks) likewise; and one batched
DP-SGD training (privkit.trainers.batched_sgd.train_many, 8 MLPs) in reproducible vs release mode.

    OMP_NUM_THREADS=1 python benchmarks/dp_random_throughput.py
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from privkit.dp_random import DpRandom


def best_of(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def training(reproducible: bool) -> None:
    from privkit.trainers.batched_sgd import SGDRecipe, train_many

    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((2000, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, 2000)
    spec = {"arch": "mlp", "input_shape": [1, 8, 8], "num_classes": 10, "feature_dim": 256}
    recipe = SGDRecipe(epochs=2, batch_size=64, clip=1.0, noise_multiplier=1.0, sampling="poisson")
    train_many(spec, x, y, [np.arange(1000)] * 8, recipe, list(range(8)), reproducible=reproducible)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10_000_000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    old = torch.Generator().manual_seed(1)
    new = DpRandom.secret()
    res = {
        "normals_torch_s": best_of(lambda: torch.randn(args.n, generator=old), args.repeats),
        "normals_aes_s": best_of(lambda: new.randn(args.n), args.repeats),
        "mask_torch_s": best_of(lambda: torch.rand(args.n, generator=old) < 0.01, args.repeats),
        "mask_aes_s": best_of(lambda: new.mask(args.n, rate=0.01), args.repeats),
        "train_reproducible_s": best_of(lambda: training(True), 2),
        "train_release_s": best_of(lambda: training(False), 2),
    }
    res["normals_ratio"] = res["normals_aes_s"] / res["normals_torch_s"]
    res["mask_ratio"] = res["mask_aes_s"] / res["mask_torch_s"]
    res["train_ratio"] = res["train_release_s"] / res["train_reproducible_s"]
    print(json.dumps({k: round(v, 4) for k, v in res.items()}, indent=1))


if __name__ == "__main__":
    main()
