"""Why batched DP-SGD of the quickstart CNN gains about 2x over a loop on one CPU core: a roofline.

The batched path (:func:`privkit.batched.batched_sgd.train_many`) removes the loop's per-model
overheads; what is left is arithmetic and memory traffic that batching cannot remove. This script
measures, in one run with one torch thread:

* the loop of ``--models`` single-model trainings (``train_one``) and the batched run, CPU seconds;
* the batched run's profile by kind of operation (torch.profiler, self CPU time) and the floating-
  point work of each kind, counted from the layer shapes and the examples actually processed;
* this core's ceilings for that work: a large float32 matrix product (the arithmetic peak the
  libraries reach), the same convolutions run as plain training runs them (one ``batch x channels``
  convolution per layer, batch 2048: the best throughput oneDNN gives these shapes), and the memory
  bandwidth of a large copy.

From these, ``floor_s``: the time of the batched run's arithmetic at the plain convolutions' and the
matrix product's throughput plus the memory operations' traffic at the copy bandwidth, and
``ceiling_speedup`` = loop time / floor: what any batched implementation could gain at best on this
core. ``--json`` prints everything.

    OMP_NUM_THREADS=1 python benchmarks/cnn_roofline.py [--json] [--models 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from privkit.batched.batched_sgd import SGDRecipe, train_many, train_one
from privkit.data import load_dataset
from privkit.mechanisms import stacked
from privkit.models import build_from_spec, model_spec

KINDS = {
    "conv_forward": ("aten::mkldnn_convolution", "aten::_convolution", "aten::conv2d"),
    "conv_backward": ("aten::convolution_backward",),
    "dense_matmul": ("aten::bmm", "aten::baddbmm", "aten::mm", "aten::addmm"),
    "layout_copies": ("aten::copy_", "aten::clone", "aten::contiguous"),
    "pooling": ("aten::max_pool2d_with_indices", "aten::max_pool2d_with_indices_backward"),
    "fills": ("aten::fill_", "aten::zero_"),
    "noise": ("aten::normal_",),
}


def _cpu_time(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def conv_flops_per_example(model: torch.nn.Module, shape: tuple[int, ...]) -> dict[str, float]:
    """Multiply-adds x 2 per example: forward, per-example weight gradients, input gradients (all
    convolutions but the first, whose input needs no gradient), for convolutions and linear layers."""
    h = torch.zeros(1, *shape)
    conv = {"forward": 0.0, "weight_grad": 0.0, "input_grad": 0.0}
    dense = 0.0
    first = True
    for layer in list(model.features) + [model.head]:
        if isinstance(layer, torch.nn.Conv2d):
            out = layer(h)
            macs = out[0].numel() * layer.in_channels * layer.kernel_size[0] * layer.kernel_size[1]
            conv["forward"] += 2 * macs
            conv["weight_grad"] += 2 * macs
            conv["input_grad"] += 0 if first else 2 * macs
            first = False
            h = out
        elif isinstance(layer, torch.nn.Linear):
            dense += 3 * 2 * layer.in_features * layer.out_features  # forward, weight, input
            h = layer(h.flatten(1))
        else:
            h = layer(h)
    return {**{f"conv_{k}": v for k, v in conv.items()}, "dense": dense}


def ceilings(model: torch.nn.Module, shape: tuple[int, ...], batch: int = 256) -> dict[str, float]:
    """This core's throughputs: float32 matrix product (GFLOP/s); the model's convolutions as plain
    training runs them (one convolution per layer for ``batch`` examples, forward + summed weight
    gradient + input gradient, in the faster of the two memory layouts, GFLOP/s); and the bandwidth
    of a copy between two preallocated 64 MB buffers (GB/s, bytes read + written)."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    t = min(_cpu_time(lambda: a @ b) for _ in range(5))
    out = {"matmul_gflops": 2 * 1024**3 / t / 1e9}
    best = 0.0
    for fmt in (torch.contiguous_format, torch.channels_last):
        h = torch.randn(batch, *shape).contiguous(memory_format=fmt)
        flops, secs, first = 0.0, 0.0, True
        for layer in model.features:
            if isinstance(layer, torch.nn.Flatten):
                break
            if not isinstance(layer, torch.nn.Conv2d):
                h = layer(h)
                continue
            w = layer.weight.detach().contiguous(memory_format=fmt)
            y = F.conv2d(h, w, None, layer.stride, layer.padding)
            g = torch.randn_like(y)
            macs = y[0].numel() * layer.in_channels * w.shape[2] * w.shape[3] * batch
            mask = [not first, True, False]

            def run(h=h, w=w, g=g, layer=layer, mask=mask):
                for _ in range(4):
                    F.conv2d(h, w, None, layer.stride, layer.padding)
                    torch.ops.aten.convolution_backward(
                        g,
                        h,
                        w,
                        None,
                        layer.stride,
                        layer.padding,
                        layer.dilation,
                        False,
                        [0, 0],
                        1,
                        mask,
                    )

            secs += min(_cpu_time(run) for _ in range(3))
            flops += 4 * 2 * macs * (3 if not first else 2)
            first = False
            h = y
        best = max(best, flops / secs / 1e9)
    out["plain_conv_gflops"] = best
    src, dst = torch.randn(16 << 20), torch.empty(16 << 20)
    t = min(_cpu_time(lambda: dst.copy_(src)) for _ in range(5))
    out["copy_gbs"] = 2 * src.numel() * 4 / t / 1e9
    return out


def profile_kinds(run) -> tuple[dict[str, float], int]:
    """Self CPU seconds of the batched run by kind of operation, and the number of operator calls."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    by_kind = dict.fromkeys([*KINDS, "other"], 0.0)
    calls = 0
    for ev in prof.key_averages():
        kind = next((k for k, names in KINDS.items() if ev.key in names), "other")
        by_kind[kind] += ev.self_cpu_time_total / 1e6
        calls += ev.count
    return by_kind, calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.models < 1 or args.repeats < 1:
        raise SystemExit(
            f"--models and --repeats must be >= 1; found {args.models} and {args.repeats}"
        )
    torch.set_num_threads(1)
    ds = load_dataset("mnist5k")
    spec = model_spec("cnn", ds.input_shape, ds.num_classes, width=8, feature_dim=32)
    rng = np.random.default_rng(0)
    idx = [rng.choice(len(ds.y), 1024, replace=False) for _ in range(args.models)]
    seeds = list(range(args.models))
    recipe = SGDRecipe(
        epochs=1, batch_size=128, lr=0.5, clip=1.0, noise_multiplier=1.0, sampling="poisson"
    )

    def batched():
        train_many(spec, ds.x, ds.y, idx, recipe, seeds)

    def loop():
        for j in seeds:
            train_one(spec, ds.x, ds.y, idx[j], recipe, j)

    batched()
    loops, batches = [], []
    for _ in range(args.repeats):
        loops.append(_cpu_time(loop))
        batches.append(_cpu_time(batched))
    # examples the batched run processed (its Poisson batches), counted where they are clipped
    examples = [0]
    original = stacked.StackedModels.clipped_sums

    def counting(self, params, buffers, x, losses, clip, record=None, counts=None):
        examples[0] += sum(counts) if counts is not None else x.shape[0] * x.shape[1]
        return original(self, params, buffers, x, losses, clip, record, counts)

    stacked.StackedModels.clipped_sums = counting
    try:
        batched()
    finally:
        stacked.StackedModels.clipped_sums = original
    by_kind, calls = profile_kinds(batched)
    # the profiler slows every operator down; its shares, scaled to the unprofiled run's time
    scale = statistics.median(batches) / sum(by_kind.values())
    by_kind = {k: v * scale for k, v in by_kind.items()}
    model = build_from_spec(spec)
    per_example = conv_flops_per_example(model, tuple(ds.input_shape))
    flops = {k: v * examples[0] for k, v in per_example.items()}
    ceil = ceilings(model, tuple(ds.input_shape))
    conv_flops = sum(v for k, v in flops.items() if k.startswith("conv"))
    # memory operations at the copy bandwidth: the bytes they moved at least (their measured time
    # at the measured bandwidth would be their own speed; the floor counts each activation written
    # once and read once per pass: forward, backward), estimated from the activations' sizes
    act_bytes = _activation_bytes(model, tuple(ds.input_shape)) * examples[0]
    floor = {
        "conv_s": conv_flops / (ceil["plain_conv_gflops"] * 1e9),
        "dense_s": flops["dense"] / (ceil["matmul_gflops"] * 1e9),
        "memory_s": 4 * act_bytes / (ceil["copy_gbs"] * 1e9),
    }
    floor_s = sum(floor.values())
    loop_s, batched_s = statistics.median(loops), statistics.median(batches)
    conv_time = by_kind["conv_forward"] + by_kind["conv_backward"]
    res = {
        "models": args.models,
        "examples_processed": examples[0],
        "loop_cpu_s": loop_s,
        "batched_cpu_s": batched_s,
        "speedup": statistics.median(a / b for a, b in zip(loops, batches)),
        "profile_s": by_kind,
        "profile_total_s": sum(by_kind.values()),
        "operator_calls": calls,
        "gflop": {k: v / 1e9 for k, v in flops.items()},
        "achieved_conv_gflops": conv_flops / conv_time / 1e9,
        "achieved_dense_gflops": flops["dense"] / max(by_kind["dense_matmul"], 1e-9) / 1e9,
        "ceilings": ceil,
        "activation_mb_per_example": act_bytes / examples[0] / 1e6,
        "floor": floor,
        "floor_s": floor_s,
        "ceiling_speedup": loop_s / floor_s,
        "setup": {
            "model": "privkit cnn width 8, feature_dim 32 (quickstart dpsgd), mnist5k 1x28x28",
            "recipe": "batch 128 (Poisson), 1024 records per model, 1 epoch, clip 1, noise 1",
            "torch": torch.__version__,
            "threads": 1,
            "load_average": list(os.getloadavg()),
        },
    }
    if args.json:
        print(json.dumps(res, indent=2))
        return
    print(
        f"{args.models} CNNs, {examples[0]} examples: loop {loop_s:.2f} s, batched {batched_s:.2f} s "
        f"(CPU), speed-up {res['speedup']:.2f}x"
    )
    print("batched profile: " + ", ".join(f"{k} {v:.3f} s" for k, v in by_kind.items()))
    print(
        f"convolutions: {conv_flops / 1e9:.1f} GFLOP at {res['achieved_conv_gflops']:.1f} GFLOP/s (plain "
        f"training's convolutions on this core: {ceil['plain_conv_gflops']:.1f}; matrix product "
        f"{ceil['matmul_gflops']:.1f}); copy bandwidth {ceil['copy_gbs']:.1f} GB/s"
    )
    print(
        f"floor {floor_s:.3f} s ({', '.join(f'{k} {v:.3f}' for k, v in floor.items())}): "
        f"at best {res['ceiling_speedup']:.2f}x the loop"
    )


def _activation_bytes(model: torch.nn.Module, shape: tuple[int, ...]) -> float:
    """Bytes of one example's activations (every layer's output, float32)."""
    h, total = torch.zeros(1, *shape), 0
    for layer in model.features:
        h = layer(h)
        total += h.numel() * 4
    return float(total)


if __name__ == "__main__":
    main()
