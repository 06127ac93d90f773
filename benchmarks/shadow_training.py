"""Vectorised shadow training (privkit.trainers.batched_sgd.train_many) vs a plain loop (privkit.trainers.batched_sgd.train_one).

Same recipe, same seeds, same batches: the two produce the same weights (checked here on the first
model), so the ratio is pure speed. Prints ms per model-step and the speed-up for M in {16, 64,
256}, for SGD and DP-SGD, on CPU (and on CUDA when one is present). Run:

    .venv/bin/python benchmarks/shadow_training.py [--quick]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from privkit.trainers.batched_sgd import SGDRecipe, train_many, train_one
from privkit.data import load_dataset
from privkit.models import model_spec


def bench(device: str, m: int, recipe: SGDRecipe, x, y, spec, n_train: int) -> tuple[float, float, float]:
    rng = np.random.default_rng(0)
    indices = [rng.choice(len(y), n_train, replace=False) for _ in range(m)]
    seeds = list(range(m))
    chunk = 16 if recipe.clip is not None else None  # DP: M x B per-example grads; chunk for memory
    train_many(spec, x, y, indices[:2], SGDRecipe(epochs=1, batch_size=recipe.batch_size, lr=0.1,
                                                  clip=recipe.clip, noise_multiplier=recipe.noise_multiplier),
               seeds[:2], device=device)  # warm-up (vmap tracing) outside the timing
    t0 = time.perf_counter()
    many = train_many(spec, x, y, indices, recipe, seeds, device=device, chunk_size=chunk)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t_vec = time.perf_counter() - t0
    t0 = time.perf_counter()
    one = None
    for j in range(m):  # the plain loop (on CPU; train_one is the reference implementation)
        st = train_one(spec, x, y, indices[j], recipe, seeds[j])
        one = st if j == 0 else one
    t_loop = time.perf_counter() - t0
    err = max((many[0][k] - one[k]).abs().max().item() for k in one)
    steps = m * recipe.epochs * (n_train // recipe.batch_size)
    return 1e3 * t_loop / steps, 1e3 * t_vec / steps, err


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="M in {16, 64} only")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ds = load_dataset("mnist5k")
    x, y = ds.x[:2000], ds.y[:2000]
    spec = model_spec("mlp", ds.input_shape, 10, feature_dim=128)
    sizes = (16, 64) if args.quick else (16, 64, 256)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    print("MLP 784-128-10, 256 training points per model, batch 32, 1 epoch; torch threads = 1; "
          "DP-SGD vectorised in chunks of 16 models")
    print(f"{'device':6} {'recipe':7} {'M':>4} {'loop ms/step':>13} {'vmap ms/step':>13} {'speed-up':>9} {'max |dw|':>9}")
    for dev in devices:
        for name, recipe in [("sgd", SGDRecipe(epochs=1, batch_size=32, lr=0.1)),
                             ("dp-sgd", SGDRecipe(epochs=1, batch_size=32, lr=0.1, clip=1.0, noise_multiplier=1.0))]:
            for m in sizes:
                loop, vec, err = bench(dev, m, recipe, x, y, spec, 256)
                print(f"{dev:6} {name:7} {m:>4} {loop:>13.3f} {vec:>13.3f} {loop / vec:>8.2f}x {err:>9.1e}")


if __name__ == "__main__":
    main()
