"""privkit's own commands on one device: ``privkit train`` and ``privkit audit`` (issue 32, item 5).

For each method, one quick training (``privkit train METHOD --quick --set device=DEVICE``) and its
black-box audit with 16 reference runs (``privkit audit RUN --attacks threshold,lira --shadows
16``), each a fresh process timed on the wall clock (start-up included, as a user meets it);
``training_s`` is what ``privkit train`` reports for the training alone (the rest of its wall
time: start-up, loading the data, the headline's accounting, writing the run). On the
CPU torch runs ``--threads`` threads (default 2: the demo's machine). Run it once per device on the
same machine and compare; ``benchmarks/run_gpu.sh`` runs the CPU side alongside the GPU side.

    python benchmarks/pipeline_device.py --device cuda --json [--methods dp-fedavg,dpsgd]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCHEMA_VERSION = 1


def _privkit(args: list[str], env: dict, timeout: float) -> dict:
    start = time.perf_counter()
    try:
        r = subprocess.run(
            [sys.executable, "-c", "from privkit.cli import main; main()", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
        )
        rc, err, out = r.returncode, r.stderr, r.stdout
    except subprocess.TimeoutExpired:
        rc, err, out = 124, f"timed out after {timeout} s", ""
    row = {"wall_s": round(time.perf_counter() - start, 2), "rc": rc}
    # `privkit train --json` says how long the training itself took (its "seconds")
    with contextlib.suppress(ValueError, KeyError, TypeError):
        row["training_s"] = json.loads(out)["seconds"]
    if rc:
        row["stderr_tail"] = err[-400:]
    return row


def measure(method: str, device: str, threads: int, shadows: int, root: Path, timeout: float):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    run = root / f"{method}-{device}"
    row = {"method": method, "device": device}
    row["train"] = _privkit(
        ["train", method, "--quick", "--set", f"device={device}", "--out", str(run), "--json"],
        env,
        timeout,
    )
    if row["train"]["rc"] == 0 and shadows:
        row["audit"] = _privkit(
            ["audit", str(run), "--attacks", "threshold,lira", "--shadows", str(shadows)],
            env,
            timeout,
        )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--methods", default="dp-fedavg,dpsgd")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    ap.add_argument("--shadows", type=int, default=16, help="reference runs (0: no audit)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per command")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.threads < 1 or args.shadows < 0:
        ap.error(f"--threads must be >= 1 and --shadows >= 0; found {args.threads}, {args.shadows}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods.split(","):
            rows.append(
                measure(method, args.device, args.threads, args.shadows, Path(tmp), args.timeout)
            )
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    out = {
        "schema_version": SCHEMA_VERSION,
        "benchmark": "pipeline_device",
        "device": args.device,
        "threads": args.threads,
        "shadows": args.shadows,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "load_average": list(os.getloadavg()),
        "clock": "wall clock of each command, its process start-up included",
        "rows": rows,
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for r in rows:
            print(r)


if __name__ == "__main__":
    main()
