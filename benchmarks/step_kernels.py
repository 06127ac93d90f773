"""How many operations one DP-SGD step dispatches: privkit against opacus and non-private SGD.

On a GPU a small or mid-size model's DP-SGD step is bound by the CPU issuing kernels, not by the
GPU running them (``benchmarks/results/profile_step_cuda.txt``: ResNet-18's privkit step kept
the H200 busy 26 ms of its 50): there the number of operations a step dispatches sets its time.
This counts them on any device, with the variants and models of ``benchmarks/dpsgd_step.py``:
every ATen operation one step (forward, backward, clipping, noise, optimiser) dispatches, views
excluded (they launch nothing), counted by a ``TorchDispatchMode`` after one warm-up step. On a
CPU the count is the device-independent proxy for launches; ``--gpu-form`` makes privkit take its
GPU forms there (per-example convolution gradients offset by offset, as on a GPU), so the count
is the one a GPU would see for the clipping and the seeded noise. Release noise on a CPU is the
AES stream's grid draws in cache-sized chunks (thousands of operations for ResNet-18), where a
GPU draws it in one pass: on a CPU read ``privkit_seeded`` for a GPU's count.

    python benchmarks/step_kernels.py --json [--big] [--gpu-form] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import warnings
from collections import Counter

import torch
from dpsgd_step import VARIANTS, batch, build, steps  # this folder is on sys.path
from torch.utils._python_dispatch import TorchDispatchMode

from privkit.mechanisms import ghost_clipping

SCHEMA_VERSION = 1


class OperationCount(TorchDispatchMode):
    """Counts the ATen operations dispatched inside it, views excluded."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def count(name: str, device: torch.device) -> dict:
    torch.manual_seed(0)
    model, description, size = build(name)
    x, y = batch(name, size, device)
    fns = steps(model.to(device), x, y, device)
    out = {"model": description, "batch": size, "operations": {}, "most_frequent": {}}
    for variant in VARIANTS:
        fns[variant]()  # warm-up: opacus' first hooks, lazy state
        with OperationCount() as c:
            fns[variant]()
        out["operations"][variant] = sum(c.counts.values())
        out["most_frequent"][variant] = dict(c.counts.most_common(8))
    out["vs_sgd"] = {v: n / out["operations"]["sgd"] for v, n in out["operations"].items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--big", action="store_true", help="add ResNet-18 (a minute on a CPU)")
    ap.add_argument("--gpu-form", action="store_true", help="privkit's GPU forms on any device")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    device = torch.device(args.device)
    warnings.filterwarnings("ignore")  # opacus' hook warnings
    torch.set_num_threads(1)
    if args.gpu_form:
        ghost_clipping._offsets_on = lambda device: True
    names = ["resnet_small", "transformer", "encoder", "vit"] + (["resnet18"] if args.big else [])
    start = time.perf_counter()
    res = {
        "schema_version": SCHEMA_VERSION,
        "device": str(device),
        "gpu_form": args.gpu_form,
        "torch": torch.__version__,
        "platform": platform.platform(),
        "counted": "ATen operations of one step after one warm-up step, views excluded",
        "models": {name: count(name, device) for name in names},
    }
    res["wall_s"] = round(time.perf_counter() - start, 1)
    if args.json:
        print(json.dumps(res, indent=2))
        return
    for name, r in res["models"].items():
        print(name, {v: r["operations"][v] for v in VARIANTS})


if __name__ == "__main__":
    main()
