"""Where a DP-SGD step waits for its device: the synchronising calls of steady-state steps.

A call that waits for a CUDA device (a plain copy between host and device, ``.cpu()``, ``.item()``,
``torch.nonzero``, a stream's synchronisation) stops the host until every kernel queued before it
has run: inside a step, the host can then no longer queue the step's kernels while the device
runs them. This runs privkit's :class:`~privkit.mechanisms.dp_sgd_step.DpSgdStep` on the models of
``dpsgd_step.py`` (release noise and seeded noise, with and without white-box canaries) past its
first steps (the first pass's checks, the first release's direct draw, the caches), then a few
more steps under torch's synchronisation check (``torch.cuda.set_sync_debug_mode("warn")``), and
lists each synchronising call with the line of privkit (or of its ``attacks`` library) that made
it. ``tests/privkit/test_on_device.py`` asserts that there are none; this says where they are
when there are.

    python benchmarks/device_waits.py --device cuda --json [--models resnet_small,transformer]
        [--steps 3] [--canaries 500] [--train dp-fedavg,dpsgd]

With ``--train`` it also lists the waits of one quick training of each method named, by
``privkit train``'s engine (the batched one where the method has it), after a first training.

The check is CUDA's. On the CPU (``--device cpu``) the script counts instead the operations that
on a CUDA device read a value of the device back to the host (``.item()``, ``int()`` or
``bool()`` of a tensor, ``torch.nonzero``, ``torch.unique``, a boolean mask's indexing,
``bincount``, ...: :class:`HostReads`), in the same steps with privkit's GPU forms forced
(:func:`gpu_forms`: the release stream's ChaCha20 normals and draws ahead computed on the CPU,
the canaries' joined read and device coins): the sites a GPU's check would list among its
waits. The reads made by the functions that settle a queued copy's result on the host
(:data:`HOST_SIDE`: the release's open draws, the canaries' observation) are counted apart, as
host memory's. What the count cannot see: copies between host and device (on the CPU there is
none), torch's own waits inside an operation, reads by numpy (the CPU's own forms of some
steps: the GPU forms above take torch's), and a device read slipped into a host-side function.
``tests/privkit/test_host_reads.py`` asserts that the benchmark's models make none. Any other
device is refused in one line (exit code 2).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from privkit.mechanisms.step_replay import StepReplay

SCHEMA_VERSION = 1
ROOT = Path(__file__).resolve().parents[1]
#: where a wait is attributed: the innermost frame in these packages of this repository
PACKAGES = ("privkit", "attacks", "accountants", "reports")
#: what torch's synchronisation check says when it warns
SYNC_MESSAGE = "synchroniz"


def site_of(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame of ``stack`` in this repository's packages, as ``path:line function``
    (``outside privkit`` where none is: a wait made by torch or a user's code alone)."""
    for frame in reversed(stack):
        path = Path(frame.filename).resolve()
        try:
            rel = path.relative_to(ROOT)
        except ValueError:
            continue
        if rel.parts and rel.parts[0] in PACKAGES:
            return f"{rel.as_posix()}:{frame.lineno} {frame.name}"
    return "outside privkit"


@contextmanager
def waits() -> Iterator[Counter]:
    """Count the synchronising calls made inside, by :func:`site_of` (torch's check set to warn
    while inside, where the device is CUDA; the warnings are counted, not shown)."""
    sites: Counter = Counter()

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        if SYNC_MESSAGE in str(message).lower():
            sites[site_of(traceback.extract_stack()[:-1])] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield sites
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)


#: operations that read a device's value back to the host, by ATen name: a scalar read
#: (``.item()``, ``int()``, ``bool()``), a count of selected elements, a result's size found by
#: the device (on CUDA each waits for every kernel queued before it)
READS = frozenset(
    {
        "_local_scalar_dense",
        "nonzero",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "masked_select",
        "bincount",
        "repeat_interleave",
        "equal",
    }
)


class HostReads(TorchDispatchMode):
    """Counts, by :func:`site_of`, the operations dispatched inside it that on a CUDA device read
    a device value to the host: :data:`READS`, and indexing by a boolean mask (``x[mask]``,
    ``x[mask] = v``: its ``nonzero``)."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in READS or (name in ("index", "index_put", "index_put_") and _masked(args[1])):
            self.sites[site_of(traceback.extract_stack()[:-1])] += 1
        return func(*args, **(kwargs or {}))


def _masked(indices) -> bool:
    return any(t is not None and t.dtype == torch.bool for t in indices)


#: the functions that read, on the host, what a queued copy (``attacks.transfers.HostCopy``)
#: brought back from the device: the reads they make are of host memory (on a GPU too)
HOST_SIDE = (
    ("privkit/mechanisms/grid_ahead.py", "settled"),  # the open draws, settled on the host
    ("attacks/whitebox.py", "read"),  # the canaries' observation
)


def host_side(site: str) -> bool:
    """Whether a :func:`site_of` site lies in one of the :data:`HOST_SIDE` functions."""
    path, _, function = site.partition(" ")
    return any(path.startswith(f"{f}:") and function == name for f, name in HOST_SIDE)


@contextmanager
def gpu_forms() -> Iterator[None]:
    """privkit's GPU forms on any device while inside: the convolutions' per-example gradients
    offset by offset (``step_kernels.py --gpu-form``), the canaries added to the joined sum and
    read back in one queued copy, a seeded generator's canary coins kept where it draws them, and
    a release stream's normals and draws ahead computed where the model is (ChaCha20 on the
    CPU)."""
    from attacks import whitebox
    from privkit.mechanisms import dp_sgd_step, ghost_clipping
    from privkit.mechanisms.dp_random import DpRandom

    secret = DpRandom.__dict__["secret"]
    forms = [
        (ghost_clipping, "_offsets_on", lambda device: True),
        (whitebox, "joined_on", lambda device: True),
        (
            dp_sgd_step,
            "_coins_on_device",
            lambda source, canaries: isinstance(source.source, torch.Generator),
        ),
        (
            DpRandom,
            "secret",
            classmethod(
                lambda cls, device="cpu", on_device=None: secret.__func__(cls, device, True)
            ),
        ),
    ]
    kept = [(owner, name, owner.__dict__[name]) for owner, name, _ in forms]
    try:
        for owner, name, form in forms:
            setattr(owner, name, form)
        yield
    finally:
        for owner, name, value in kept:
            setattr(owner, name, value)


def measure_reads(
    name: str,
    noise: str,
    canaries: int,
    steps: int,
    batch: int | None = None,
    replay: bool = False,
) -> dict:
    """The host reads of ``steps`` steady-state CPU steps of ``dpsgd_step.py``'s model ``name``
    with privkit's GPU forms (:func:`gpu_forms`), by site (at ``batch`` records where given; with
    ``replay``, the clipped sum replayed by a ``StepReplay``): ``host_reads_per_step`` those of
    device values, ``host_side_per_step`` those of a queued copy's result (:data:`HOST_SIDE`)."""
    with gpu_forms():
        from privkit.mechanisms.step_replay import StepReplay

        recorded = StepReplay() if replay else None
        one = _step(name, noise, canaries, torch.device("cpu"), batch, recorded)
        # first passes: the row checks, the first release's own draw, caches; a replay's first
        # step, its recording and its checked first replay
        for _ in range(3):
            one()
        with HostReads() as reads:
            for _ in range(steps):
                one()
    sites = reads.sites.most_common()
    return {
        "model": name,
        "noise": noise,
        "canaries": canaries,
        "host_reads_per_step": sum(n for site, n in sites if not host_side(site)) / steps,
        "host_side_per_step": sum(n for site, n in sites if host_side(site)) / steps,
        "sites": {site: n / steps for site, n in sites},
        **({"replayed_steps": recorded.replayed} if recorded else {}),
    }


def _step(
    name: str,
    noise: str,
    canaries: int,
    device: torch.device,
    records: int | None = None,
    replay: StepReplay | None = None,
) -> Callable[[], None]:
    """One privkit DP-SGD step of ``dpsgd_step.py``'s model ``name`` on its fixed batch (of
    ``records`` records where given, else the benchmark's; its clipped sum replayed by
    ``replay`` where given)."""
    from dpsgd_step import (  # this folder is on sys.path
        CLIP,
        DATASET,
        LR,
        SIGMA,
        _per_example_loss,
        batch,
        build,
    )

    from attacks.whitebox import GradientCanaries
    from privkit.mechanisms.dp_random import DpRandom
    from privkit.mechanisms.dp_sgd_step import DpSgdStep

    torch.manual_seed(0)
    model, _, size = build(name)
    size = records or size
    model = model.to(device)
    x, y = batch(name, size, device)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    step = DpSgdStep(CLIP, SIGMA, size / DATASET, DATASET)
    source = (
        DpRandom.secret(device)
        if noise == "release"
        else DpRandom(torch.Generator(device=device).manual_seed(1), device)
    )
    can = (
        GradientCanaries.for_parameters(
            list(model.parameters()),
            canaries,
            clip_norm=CLIP,
            sample_rate=size / DATASET,
            noise_multiplier=SIGMA,
        )
        if canaries
        else None
    )

    def one() -> None:
        step.apply(model, opt, x, y, _per_example_loss, source, canaries=can, replay=replay)

    return one


def measure(name: str, noise: str, canaries: int, device: torch.device, steps: int) -> dict:
    """The synchronising calls of ``steps`` steady-state steps, by site."""
    one = _step(name, noise, canaries, device)
    for _ in range(3):  # first passes: the row checks, the first release's own draw, caches
        one()
    torch.cuda.synchronize(device)
    with waits() as sites:
        for _ in range(steps):
            one()
    torch.cuda.synchronize(device)
    total = sum(sites.values())
    return {
        "model": name,
        "noise": noise,
        "canaries": canaries,
        "waits_per_step": total / steps,
        "sites": {site: n / steps for site, n in sites.most_common()},
    }


def measure_training(method: str, device: torch.device) -> dict:
    """The synchronising calls of one quick training of ``method`` on the quickstart federation
    (``privkit train``'s engine, the batched one where the method has it), after one training
    that pays the first-use costs."""
    from audit_cost import _federation  # this folder is on sys.path

    from privkit.flower_engine.engine import train
    from privkit.trainers import REGISTRY

    cfg = {**REGISTRY[method].quick_config(), "device": str(device)}
    fed = _federation()
    train(method, fed, cfg, seed=0)
    torch.cuda.synchronize(device)
    with waits() as sites:
        train(method, fed, cfg, seed=0)
    torch.cuda.synchronize(device)
    return {
        "method": method,
        "waits_per_training": sum(sites.values()),
        "sites": dict(sites.most_common()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--models", default="resnet_small,transformer")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--canaries", type=int, default=500)
    ap.add_argument(
        "--train",
        default="",
        help="comma-separated methods whose quick training's waits are listed too (privkit "
        "train's engine)",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.canaries < 0:
        print(
            f"--steps must be >= 1 and --canaries >= 0; found {args.steps}, {args.canaries}",
            file=sys.stderr,
        )
        return 2
    from dpsgd_step import build  # this folder is on sys.path

    from privkit.trainers import REGISTRY

    methods = [m for m in args.train.split(",") if m]
    unknown = [m for m in methods if m not in REGISTRY]
    if unknown:
        print(f"--train must name privkit's methods; found {unknown[0]!r}", file=sys.stderr)
        return 2

    for name in args.models.split(","):
        try:
            build(name)
        except ValueError:
            print(f"--models must name models of dpsgd_step.py; found {name!r}", file=sys.stderr)
            return 2
    try:
        device = torch.device(args.device)
    except RuntimeError:
        device = torch.device("meta")  # refused below, by its name
    if device.type == "cpu":
        if methods:
            print(
                "--train lists a training's waits on a CUDA device; found --device cpu",
                file=sys.stderr,
            )
            return 2
        return _report_reads(args.models.split(","), args.steps, args.canaries, args.json)
    if device.type != "cuda" or not torch.cuda.is_available():
        print(
            f"--device must be an available CUDA device (the synchronisation check is CUDA's) or "
            f"cpu (the host reads); found {args.device}",
            file=sys.stderr,
        )
        return 2
    rows = [
        measure(name, noise, n, device, args.steps)
        for name in args.models.split(",")
        for noise in ("release", "seeded")
        for n in sorted({0, args.canaries})
    ]
    out = {
        "schema_version": SCHEMA_VERSION,
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "steps": args.steps,
        "rows": rows,
        "trainings": [measure_training(method, device) for method in methods],
    }
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for r in rows:
            print(r["model"], r["noise"], r["canaries"], r["waits_per_step"], r["sites"])
        for r in out["trainings"]:
            print(r["method"], r["waits_per_training"], r["sites"])
    return 0


def _report_reads(models: list[str], steps: int, canaries: int, as_json: bool) -> int:
    """The CPU's report: each model's host reads per step (:func:`measure_reads`)."""
    torch.set_num_threads(1)
    rows = [
        measure_reads(name, noise, n, steps)
        for name in models
        for noise in ("release", "seeded")
        for n in sorted({0, canaries})
    ]
    out = {
        "schema_version": SCHEMA_VERSION,
        "device": "cpu",
        "measured": "host reads (HostReads): the operations that on a CUDA device read a device "
        "value back to the host, in steps with privkit's GPU forms",
        "torch": torch.__version__,
        "platform": platform.platform(),
        "steps": steps,
        "rows": rows,
    }
    if as_json:
        print(json.dumps(out, indent=1))
    else:
        for r in rows:
            print(r["model"], r["noise"], r["canaries"], r["host_reads_per_step"], r["sites"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
