"""The release noise's exact draw of a past revision against this one, interleaved in one process.

This machine's speed moves between processes by more than a change to the release noise moves a
training, so both versions run in the same process, alternating within each repeat: the past
revision's ``privkit/mechanisms/grid_noise.py`` (read with ``git show REV:...``) is loaded as a
module of its own, and "before" swaps its ``grid_release``, ``rounded_gaussian`` and ``snap_add``
into ``privkit.mechanisms.grid_noise`` and its ``NumpyBits`` over the release stream into
``DpRandom.bits`` (the release's bits as that revision drew them); "after" is this checkout.
Everything else (the trainers, the batched engine, the seeded reference noise) is the same code.

Measured, one torch thread, CPU seconds (``process_time``), medians over ``--repeats``, their
quotient (``ratio``) and the median of each repeat's quotient (``ratio_paired_median``):

* ``release_<n>``: a grid release of ``n`` float32 coordinates at noise 1, sensitivity 1, for
  each ``n`` of ``--n`` (10 million, and 51,000: one step's release of the quick DP-SGD MLP; the
  small one repeated 20 times a measurement);
* ``train_s`` per method: one release-mode training (``privkit.batched.many.train_one``, the
  method's quick configuration on the quickstart federation: what ``privkit train`` runs).

Usage::

    OMP_NUM_THREADS=1 python benchmarks/release_noise_paired.py --before 8b006d1 \\
        [--methods dpsgd,dp-fedavg,fedkadp,fedkd-dp] [--repeats 5] [--n 10000000,51000] [--json]

Bad input (an unknown method, a revision git does not know, ``--repeats`` or a size below 1) exits with
code 2 and one line naming it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parent.parent
MODULE = "privkit/mechanisms/grid_noise.py"


def load_revision(rev: str):
    """``grid_noise`` as it was at ``rev``, as a module of its own."""
    text = subprocess.run(
        ["git", "show", f"{rev}:{MODULE}"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    with tempfile.TemporaryDirectory() as folder:  # read once, by exec_module
        path = Path(folder) / "grid_noise_before.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location("grid_noise_before", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    return module


@contextmanager
def revision(old):
    """Within it, the release noise is ``old``'s: its functions in ``grid_noise``, its bits."""
    from privkit.mechanisms import grid_noise
    from privkit.mechanisms.dp_random import DpRandom

    names = ("grid_release", "rounded_gaussian", "snap_add")
    kept = {name: getattr(grid_noise, name) for name in names}
    bits, cipher = DpRandom.bits, getattr(grid_noise, "CipherBits", None)
    for name in names:
        setattr(grid_noise, name, getattr(old, name))
    DpRandom.bits = lambda self: old.NumpyBits(self.source, self.device)
    if cipher is not None:  # a one-off numpy release keyed its own bits
        grid_noise.CipherBits = lambda rng, device="cpu": old.NumpyBits(rng, device)
    try:
        yield
    finally:
        for name, fn in kept.items():
            setattr(grid_noise, name, fn)
        DpRandom.bits = bits
        if cipher is not None:
            grid_noise.CipherBits = cipher


def cpu_seconds(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def measure(old, methods: list[str], repeats: int, sizes: list[int]) -> dict:
    import audit_cost

    from privkit.batched.many import train_one
    from privkit.mechanisms import grid_noise
    from privkit.mechanisms.dp_random import DpRandom
    from privkit.trainers import REGISTRY
    from privkit.trainers.pretrain import clear_cache

    fed = audit_cost._federation()

    def release(n):
        clean = torch.randn(n, generator=torch.Generator().manual_seed(0))
        grid = grid_noise.Grid.for_release(1.0, 1.0, n)
        times = 20 if n < 1_000_000 else 1  # a small release: 20 of them a measurement

        def run():
            bits = DpRandom.secret().bits()
            for _ in range(times):
                grid_noise.grid_release(clean, grid, bits)

        return run

    def training(method):
        clear_cache()
        train_one(method, fed, REGISTRY[method].quick_config(), 0)

    jobs = {f"release_{n}": release(n) for n in sizes}
    jobs.update({m: (lambda m=m: training(m)) for m in methods})
    times: dict[str, dict[str, list[float]]] = {k: {"before": [], "after": []} for k in jobs}
    for job in jobs.values():  # untimed: lazy imports, first calls
        with revision(old):
            job()
        job()
    for r in range(repeats):
        for name, job in jobs.items():
            order = ("before", "after") if r % 2 == 0 else ("after", "before")
            for side in order:
                if side == "before":
                    with revision(old):
                        times[name][side].append(cpu_seconds(job))
                else:
                    times[name][side].append(cpu_seconds(job))
        print(f"repeat {r + 1}/{repeats} done", file=sys.stderr, flush=True)
    out = {}
    for name, sides in times.items():
        before, after = (statistics.median(sides[s]) for s in ("before", "after"))
        out[name] = {
            "before_s": round(before, 6),
            "after_s": round(after, 6),
            "ratio": round(after / before, 4),
            # each repeat's two measurements ran back to back: the median of their quotients
            # is what the machine's drift between repeats moves least
            "ratio_paired_median": round(
                statistics.median(a / b for a, b in zip(sides["after"], sides["before"])), 4
            ),
            "before_all_s": [round(t, 6) for t in sides["before"]],
            "after_all_s": [round(t, 6) for t in sides["after"]],
        }
    return out


def main() -> None:
    from privkit.trainers import REGISTRY

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the git revision to compare against")
    ap.add_argument("--methods", default="dpsgd,dp-fedavg,fedkadp,fedkd-dp")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--n", default="10000000,51000", help="comma-separated release sizes")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in REGISTRY]
    if unknown:
        print(f"--methods: unknown method {unknown[0]!r}", file=sys.stderr)
        sys.exit(2)
    try:
        sizes = [int(v) for v in args.n.split(",") if v]
    except ValueError:
        sizes = [0]
    if not sizes or min(sizes) < 1:
        print(f"--n must be sizes >= 1, comma-separated; found {args.n!r}", file=sys.stderr)
        sys.exit(2)
    if args.repeats < 1:
        print(f"--repeats must be >= 1; found {args.repeats}", file=sys.stderr)
        sys.exit(2)
    try:
        old = load_revision(args.before)
    except subprocess.CalledProcessError:
        print(f"--before: git does not know {MODULE} at {args.before!r}", file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(1)
    res = {
        "schema_version": 1,
        "benchmark": "release_noise_paired",
        "before_rev": args.before,
        "after_rev": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
        "repeats": args.repeats,
        "sizes": sizes,
        "torch_threads": 1,
        "platform": platform.platform(),
        "load_average_start": [round(v, 2) for v in os.getloadavg()],
        "results": measure(old, methods, args.repeats, sizes),
        "load_average_end": [round(v, 2) for v in os.getloadavg()],
    }
    if args.json:
        print(json.dumps(res, indent=1))
        return
    for name, r in res["results"].items():
        print(
            f"{name}: before {r['before_s']} s, after {r['after_s']} s, {r['ratio']}x "
            f"(paired {r['ratio_paired_median']}x)"
        )


if __name__ == "__main__":
    main()
