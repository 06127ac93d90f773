"""How far a CNN federation's stacked reference clients are from this core's arithmetic floor.

An audit of FedAvg's, FedProx's, FedDF's, FedAUX's or FedMD's default configuration trains its
reference clients eight at a time on stacked parameters (:func:`privkit.batched.stacked_local.
train_stacked`). This script says what one such client step can cost at best on one CPU thread,
in one run:

* ``flops_per_step``: the floating-point work of one Adam step of the default CNN (two 3 x 3
  convolutions of ``width`` and ``2 width`` channels, ``feature_dim`` features, 10 classes) on a
  batch, counted from the layer shapes: forward, the weight gradients, and the input gradients of
  every layer but the first (nothing below it to train); the convolutions' and the dense layers'
  shares apart;
* the ceilings: the same two convolutions' forward and backward passes as one model runs them on a
  large batch (``--ceiling-batch``), in the contiguous and the channels-last layout, the faster
  of the two (the best throughput the library gives these shapes); and a large float32 matrix
  product (the dense layers' ceiling);
* ``floor_ms``: the step's convolution work at the convolution ceiling plus its dense work at the
  matrix product's;
* ``single_ms``: one model's step as the single run takes it (forward, backward, torch's Adam);
  ``stacked_ms``: a model's share of a stacked step of ``--models`` models (``train_stacked``,
  one group).

``stacked_over_floor`` is how many times the floor a stacked client step takes: near 1, the
reference clients are bound by this core's arithmetic, and an audit of ``shadows`` reference runs
cannot cost much less than ``shadows x stacked_ms / single_ms`` trainings on top of the target.

    OMP_NUM_THREADS=1 python benchmarks/stacked_cnn_roofline.py [--json] [--models 8]
        [--batch 32] [--width 16] [--feature-dim 128] [--ceiling-batch 512] [--repeats 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from audit_cost import fail, matmul_gflops  # bad input; this machine's product rate

CLASSES = 10
SIDE = 28  # MNIST's 28 x 28 records, one channel


def step_flops(batch: int, width: int, feature_dim: int) -> dict[str, float]:
    """One Adam step's floating-point work (multiply-adds count two): each layer's forward
    product, its weight gradient (the same work) and, above the first layer, its input gradient
    (the same work again)."""
    conv1 = 2 * width * 9 * SIDE * SIDE  # 1 -> width channels at 28 x 28
    conv2 = 2 * (2 * width) * (9 * width) * (SIDE // 2) ** 2  # width -> 2 width at 14 x 14
    dense = 2 * (2 * width * (SIDE // 4) ** 2) * feature_dim + 2 * feature_dim * CLASSES
    return {
        "convolutions": batch * (2 * conv1 + 3 * conv2),
        "dense": batch * 3 * dense,
    }


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: first calls pick their kernels
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def conv_ceiling(batch: int, width: int, repeats: int, channels_last: bool) -> float:
    """GFLOP/s of the two convolutions' forward and backward passes on ``batch`` records (one
    model, as plain training runs them; the first layer's input gradient not taken), in the
    contiguous or the channels-last layout (the stacked form runs its grouped convolutions in the
    latter)."""
    layout = torch.channels_last if channels_last else torch.contiguous_format

    def tensor(*shape: int) -> torch.Tensor:
        return torch.randn(*shape).to(memory_format=layout).requires_grad_()

    x = torch.randn(batch, 1, SIDE, SIDE).to(memory_format=layout)
    w1, w2 = tensor(width, 1, 3, 3), tensor(2 * width, width, 3, 3)
    h = tensor(batch, width, SIDE // 2, SIDE // 2)

    def run() -> None:
        a = F.conv2d(x, w1, padding=1)
        b = F.conv2d(h, w2, padding=1)
        torch.autograd.grad((a.sum(), b.sum()), (w1, h, w2))

    flops = step_flops(batch, width, 1)["convolutions"]
    return flops / _median_seconds(run, repeats) / 1e9


def _cnn(width: int, feature_dim: int, seed: int) -> torch.nn.Module:
    from privkit.models import build_model

    torch.manual_seed(seed)
    return build_model("cnn", (1, SIDE, SIDE), CLASSES, width=width, feature_dim=feature_dim)


def single_step(batch: int, width: int, feature_dim: int, repeats: int) -> float:
    """Seconds of one model's step: forward, mean cross-entropy, backward, torch's Adam."""
    model = _cnn(width, feature_dim, 0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(batch, 1, SIDE, SIDE), torch.randint(0, CLASSES, (batch,))

    def run() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return _median_seconds(run, repeats)


def stacked_step(models: int, batch: int, width: int, feature_dim: int, repeats: int) -> float:
    """Seconds of a model's share of one stacked step: ``models`` CNNs trained together by
    ``train_stacked`` (one group) for ``repeats`` steps each, its set-up included (as an audit's
    round pays it), divided by models and steps; the median of two timed calls after an untimed
    one."""
    from privkit.batched import stacked_local
    from privkit.batched.exact_mlp import model_for

    gen = torch.Generator().manual_seed(1)
    xs = torch.randn(batch * repeats, 1, SIDE, SIDE, generator=gen)
    ys = torch.randint(0, CLASSES, (batch * repeats,), generator=gen)
    seconds: list[float] = []

    def run() -> None:
        nets = [_cnn(width, feature_dim, 10 + j) for j in range(models)]
        ms = [
            model_for(n, xs, ys, epochs=1, batch_size=batch, seed=j, device=torch.device("cpu"))
            for j, n in enumerate(nets)
        ]
        start = time.process_time()
        stacked_local.train_stacked(nets[0], ms, optimizer="adam", lr=1e-3)
        seconds.append(time.process_time() - start)

    previous = stacked_local.MODELS_PER_GROUP
    stacked_local.MODELS_PER_GROUP = models  # one group of the models asked for
    try:
        for _ in range(3):
            run()
    finally:
        stacked_local.MODELS_PER_GROUP = previous
    return statistics.median(seconds[1:]) / models / repeats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--feature-dim", type=int, default=128)
    ap.add_argument("--ceiling-batch", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    for name in ("models", "batch", "width", "feature_dim", "ceiling_batch", "repeats"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be an integer >= 1; found {getattr(args, name)}")
    torch.set_num_threads(1)

    flops = step_flops(args.batch, args.width, args.feature_dim)
    rates = {
        layout: conv_ceiling(
            args.ceiling_batch, args.width, args.repeats, layout == "channels_last"
        )
        for layout in ("contiguous", "channels_last")
    }
    conv_rate = max(rates.values())  # the best the library gives these shapes
    dense_rate = matmul_gflops(repeats=args.repeats)
    floor = flops["convolutions"] / conv_rate / 1e9 + flops["dense"] / dense_rate / 1e9
    single = single_step(args.batch, args.width, args.feature_dim, args.repeats)
    stacked = stacked_step(args.models, args.batch, args.width, args.feature_dim, args.repeats)
    out = {
        "schema_version": 1,
        "benchmark": "stacked_cnn_roofline",
        "config": {k: getattr(args, k) for k in vars(args) if k != "json"},
        "flops_per_step": flops,
        "conv_ceiling_gflops": round(conv_rate, 1),
        "conv_gflops_by_layout": {k: round(v, 1) for k, v in rates.items()},
        "matmul_gflops": round(dense_rate, 1),
        "floor_ms": round(floor * 1e3, 3),
        "single_ms": round(single * 1e3, 3),
        "stacked_ms": round(stacked * 1e3, 3),
        "single_over_floor": round(single / floor, 2),
        "stacked_over_floor": round(stacked / floor, 2),
        "stacked_over_single": round(stacked / single, 2),
    }
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for k, v in out.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
