"""A DP-SGD training with its clipped sums replayed, against the same training without: what
:class:`privkit.mechanisms.step_replay.StepReplay` saves once its traces are paid for.

Each repeat trains the model of ``dpsgd_step.py`` from the same weights on Poisson batches (the
same batches, the same seeded noise): once with ``DpSgdStep.apply`` as it is, once per
``--patience`` value with a fresh ``StepReplay`` (its unreplayed steps, its traces, their checked
first replays, all counted in its time). The trainings alternate within a repeat, their order
reversed at every other repeat, so that drifts of the machine hit all of them alike. Per
training: the whole training's CPU time (one torch thread), its steps' median, how many sizes
the batches took, how many traces the replay took and how many steps it replayed. Ratios:
replay over plain, per repeat, medians. The trainings end at the same parameters up to float
rounding (checked at each repeat: the largest difference is reported).

``--host-bound`` crops the images to 8x8 and the sequences to 8 positions and takes privkit's GPU
forms (``device_waits.gpu_forms``), as ``dpsgd_step.py --host-bound`` does: the host's work of a
step, what bounds a GPU that waits for its host.

    python benchmarks/step_replay.py --json [--models resnet_small,transformer,lstm] [--steps 200]
        [--records 16] [--repeats 3] [--host-bound] [--patience 1,0]

``--patience``: a replayed training per value of ``StepReplay(patience=...)`` (when a batch size
is traced: 1, once its unreplayed steps have cost a trace; 0, at its second step), each against
the plain training of its repeat (schema 2: ``training_ratio`` and ``step_ratio`` by variant,
``replay_patience_1`` ...).
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

SCHEMA_VERSION = 2
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


def measure(
    name: str, steps: int, records: int, repeats: int, host_bound: bool, patience: list[float]
) -> dict:
    torch.manual_seed(0)
    model, description, _ = build(name)
    x, y = batch(name, records * DATASET_PER_RECORD, torch.device("cpu"))
    if host_bound:
        x, y = _host_bound(name, x, y)
    variants = {"plain": None, **{f"replay_patience_{p:g}": p for p in patience}}
    rows: dict[str, list] = {v: [] for v in variants}
    differences = []
    for r in range(repeats):
        ends = {}
        order = list(variants) if r % 2 == 0 else list(variants)[::-1]
        for variant in order:
            m = copy.deepcopy(model)
            p = variants[variant]
            replay = None if p is None else StepReplay(patience=p)
            row = train(m, x, y, steps, records, replay)
            if replay is not None:
                row |= {"traces": replay.traced, "replayed": replay.replayed}
                row["refused"] = replay.refused
            rows[variant].append(row)
            ends[variant] = {k: q.detach() for k, q in m.named_parameters()}
        differences.append(
            max(
                float((ends["plain"][k] - v).abs().max())
                for variant in variants
                for k, v in ends[variant].items()
            )
        )

    def ratio(variant: str, key: str) -> float:
        pairs = zip(rows[variant], rows["plain"], strict=True)
        return statistics.median(a[key] / b[key] for a, b in pairs)

    return {
        "model": description,
        "parameters": sum(q.numel() for q in model.parameters()),
        "training_ratio": {v: ratio(v, "seconds") for v in variants if v != "plain"},
        "step_ratio": {v: ratio(v, "step_ms") for v in variants if v != "plain"},
        "largest_parameter_difference": max(differences),
        "runs": rows,
    }


def _patience(text: str) -> list[float] | None:
    """``--patience``'s values, or ``None`` where one is not a number >= 0."""
    try:
        values = [float(p) for p in text.split(",")]
    except ValueError:
        return None
    return values if all(p >= 0 for p in values) else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet_small,transformer,lstm")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--records", type=int, default=16, help="expected records of a batch")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--host-bound", action="store_true")
    ap.add_argument(
        "--patience", default="1", help="StepReplay's patience, one replayed training per value"
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    for flag in ("steps", "records", "repeats"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be >= 1; found {getattr(args, flag)}")
    patience = _patience(args.patience)
    if patience is None:
        ap.error(f"--patience must be numbers >= 0; found {args.patience}")
    torch.set_num_threads(1)
    forms = contextlib.nullcontext()
    if args.host_bound:
        from device_waits import gpu_forms

        forms = gpu_forms()
    models = {}
    with forms:
        for name in args.models.split(","):
            models[name] = r = measure(
                name, args.steps, args.records, args.repeats, args.host_bound, patience
            )
            if not args.json:
                for v, t in r["training_ratio"].items():
                    print(
                        f"{name}, {v}: training {t:.2f}x, step {r['step_ratio'][v]:.2f}x "
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
            "patience": patience,
            "clock": "process CPU time, one torch thread",
        },
        "models": models,
    }
    if args.json:
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
