"""A DP-SGD training with its clipped sums replayed, against the same training without: what
:class:`privkit.mechanisms.step_replay.StepReplay` saves once its traces are paid for.

Each repeat trains the model of ``dpsgd_step.py`` twice from the same weights on Poisson batches
(the same batches, the same seeded noise): once with ``DpSgdStep.apply`` as it is, once with a
fresh ``StepReplay`` (its first step of each padded size unreplayed, its trace, its checked
first replay, all counted in its time). The two trainings alternate within a repeat, in turn
first, so that drifts of the machine hit both alike. Per training: the whole training's CPU
time (one torch thread), its steps' median, how many sizes the batches took and how many traces
the replay took. Ratios: replay over plain, per repeat, medians. Both trainings end at the same
parameters up to float rounding (checked at each repeat: the largest difference is reported).

``--host-bound`` crops the images to 8x8 and the sequences to 8 positions and takes privkit's GPU
forms (``device_waits.gpu_forms``), as ``dpsgd_step.py --host-bound`` does: the host's work of a
step, what bounds a GPU that waits for its host.

    python benchmarks/step_replay.py --json [--models resnet_small,transformer,lstm] [--steps 200]
        [--records 16] [--repeats 3] [--host-bound]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dpsgd_step import (
    CLIP,
    LR,
    SIGMA,
    _host_bound,
    _per_example_loss,
    batch,
    build,
)

from privkit.mechanisms.dp_random import DpRandom
from privkit.mechanisms.dp_sgd_step import DpSgdStep
from privkit.mechanisms.step_replay import StepReplay

SCHEMA_VERSION = 1
#: the dataset the Poisson batches are drawn from, per expected record of a batch
DATASET_PER_RECORD = 4


def train(model, x, y, steps: int, records: int, replay: StepReplay | None) -> dict:
    """``steps`` DP-SGD steps on Poisson batches (seeded: the same batches and noise for every
    call); CPU seconds of the whole training and of each step."""
    n = x.shape[0]
    step = DpSgdStep(CLIP, SIGMA, records / n, n)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    noise = DpRandom(torch.Generator().manual_seed(1), torch.device("cpu"))
    batches = torch.Generator().manual_seed(2)
    times, sizes = [], set()
    start = time.process_time()
    for _ in range(steps):
        keep = step.sample(batches)
        sizes.add(int(keep.numel()))
        t = time.process_time()
        step.apply(model, opt, x[keep], y[keep], _per_example_loss, noise, replay=replay)
        times.append(time.process_time() - t)
    return {
        "seconds": time.process_time() - start,
        "step_ms": 1e3 * statistics.median(times),
        "sizes": len(sizes),
    }


def measure(name: str, steps: int, records: int, repeats: int, host_bound: bool) -> dict:
    torch.manual_seed(0)
    model, description, _ = build(name)
    x, y = batch(name, records * DATASET_PER_RECORD, torch.device("cpu"))
    if host_bound:
        x, y = _host_bound(name, x, y)
    rows: dict[str, list] = {"plain": [], "replay": []}
    differences = []
    for r in range(repeats):
        ends = {}
        for variant in ("plain", "replay") if r % 2 == 0 else ("replay", "plain"):
            m = copy.deepcopy(model)
            replay = StepReplay() if variant == "replay" else None
            row = train(m, x, y, steps, records, replay)
            if replay is not None:
                row |= {"traces": replay.traced, "replayed": replay.replayed}
                row["refused"] = replay.refused
            rows[variant].append(row)
            ends[variant] = {k: p.detach() for k, p in m.named_parameters()}
        differences.append(
            max(float((ends["plain"][k] - v).abs().max()) for k, v in ends["replay"].items())
        )

    def ratio(key: str) -> float:
        pairs = zip(rows["replay"], rows["plain"], strict=True)
        return statistics.median(a[key] / b[key] for a, b in pairs)

    return {
        "model": description,
        "parameters": sum(p.numel() for p in model.parameters()),
        "training_ratio": ratio("seconds"),
        "step_ratio": ratio("step_ms"),
        "largest_parameter_difference": max(differences),
        "runs": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet_small,transformer,lstm")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--records", type=int, default=16, help="expected records of a batch")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--host-bound", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    for flag in ("steps", "records", "repeats"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be >= 1; found {getattr(args, flag)}")
    torch.set_num_threads(1)
    forms = contextlib.nullcontext()
    if args.host_bound:
        from device_waits import gpu_forms

        forms = gpu_forms()
    models = {}
    with forms:
        for name in args.models.split(","):
            models[name] = measure(name, args.steps, args.records, args.repeats, args.host_bound)
            r = models[name]
            if not args.json:
                print(
                    f"{name}: training {r['training_ratio']:.2f}x, step {r['step_ratio']:.2f}x "
                    f"(replayed over plain), parameters within "
                    f"{r['largest_parameter_difference']:.1e}",
                    flush=True,
                )
    out = {
        "schema_version": SCHEMA_VERSION,
        "torch": torch.__version__,
        "platform": platform.platform(),
        "setup": {
            "steps": args.steps,
            "expected_records": args.records,
            "dataset": args.records * DATASET_PER_RECORD,
            "repeats": args.repeats,
            "host_bound": args.host_bound,
            "clock": "process CPU time, one torch thread",
        },
        "models": models,
    }
    if args.json:
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
