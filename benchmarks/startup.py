"""Start-up time of the ``privkit`` console script, side by side with importing every heavy library.

A command that only prints help or refuses a bad value should answer before torch, opacus,
catboost, ray, dp-accounting or matplotlib is imported. Each case runs the real console script in a
fresh process ``--repeats`` times (median wall time); the baseline is a bare interpreter importing
those libraries, in the same run, so the ratio holds on a loaded machine. Run:

    PYTHONPATH=$PWD /work/venv/bin/python benchmarks/startup.py [--repeats 5] [--json]

Each case also reports which heavy modules the command imported (from ``python -X importtime``).
Two cases are whole commands: ``train dpsgd --quick`` and ``train dp-fedavg --quick`` into a
fresh run directory (start-up, the embedded data, the training, its headline's accounting and
files).

Measured on the 2-core development machine under a load average of ~10, median of 3, before
(commit 151f475) and after lazy imports, same run: ``privkit --help`` 7.9-8.2 s -> 0.44-0.60 s,
``train --bogus`` 7.9-8.3 s -> 0.48-0.65 s, ``budget dpsgd --steps 1.5`` 8.0 s -> 0.45-0.66 s,
``audit --executor banana`` 8.0-9.5 s -> 0.71-0.90 s, ``run missing.toml`` 6.3-8.9 s -> 0.75-0.97 s;
importing every heavy library took 9.4-12.2 s (ratio 0.56-0.81 before, 0.047-0.080 after).

Trainer configs in the torch-free ``privkit.methods`` (two alternating runs, median of 3, load ~4,
before = main 8d2a5f9): ``train dpsgd --set epochs=-1`` 3.8-4.2 s -> 0.33-0.50 s, ``--set bogus=1``
5.2-7.7 s -> 0.38-0.47 s, ``train --list`` 3.9-5.9 s -> 0.29-0.51 s, ``run`` with a bad trainer value
4.4-4.5 s -> 0.45-0.66 s (ratio 0.37-0.75 before, 0.058-0.096 after; torch, scipy, sklearn and
dp_accounting no longer imported).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HEAVY = ("torch", "opacus", "catboost", "ray", "dp_accounting", "matplotlib", "sklearn", "scipy")

# a run config whose only method has a bad trainer value, written to a temporary file by main()
BAD_RUN_CONFIG = "{bad_run_config}"
# a fresh run directory for each invocation (a whole quick training: start-up, data, training,
# accounting and files)
FRESH_RUN_DIR = "{fresh_run_dir}"
BAD_RUN_TOML = 'name = "bad"\n[[methods]]\nname = "dpsgd"\noverrides = { epochs = -1 }\n'

# (name, argv after `privkit`, expected exit code)
CASES: list[tuple[str, list[str], int]] = [
    ("help", ["--help"], 0),
    ("train --help", ["train", "--help"], 0),
    ("unknown option", ["train", "--bogus"], 2),
    (
        "non-integer --steps",
        [
            "budget",
            "dpsgd",
            "--steps",
            "1.5",
            "--sample-rate",
            "0.01",
            "--noise-multiplier",
            "1",
            "--delta",
            "1e-5",
        ],
        2,
    ),
    (
        "--delta out of range",
        [
            "budget",
            "dpsgd",
            "--steps",
            "10",
            "--sample-rate",
            "0.01",
            "--noise-multiplier",
            "1",
            "--delta",
            "1.5",
        ],
        2,
    ),
    ("bad trainer value", ["train", "dpsgd", "--set", "epochs=-1", "--out", "unused-run-dir"], 2),
    ("unknown trainer key", ["train", "dpsgd", "--set", "bogus=1", "--out", "unused-run-dir"], 2),
    ("train --list", ["train", "--list"], 0),
    ("run: bad trainer value", ["run", BAD_RUN_CONFIG], 2),
    ("bad --executor", ["audit", "missing-run-dir", "--executor", "banana"], 2),
    ("missing config file", ["run", "missing.toml"], 2),
    ("train dpsgd --quick", ["train", "dpsgd", "--quick", "--out", FRESH_RUN_DIR], 0),
    # a federation of 20 DP-SGD clients: its headline accounts every client's rounds
    ("train dp-fedavg --quick", ["train", "dp-fedavg", "--quick", "--out", FRESH_RUN_DIR], 0),
]


def _script() -> list[str]:
    exe = Path(sys.executable).with_name("privkit")
    if exe.is_file():
        return [str(exe)]
    found = shutil.which("privkit")
    if found:
        return [found]
    return [sys.executable, "-c", "from privkit.cli import main; main()"]


def _time(cmd: list[str], repeats: int, env: dict, fresh: Path | None = None) -> tuple[float, int]:
    """Median wall seconds of ``cmd`` and its last exit code; ``fresh``: a folder under which
    each invocation gets its own run directory in place of :data:`FRESH_RUN_DIR`."""
    times, code = [], 0
    for i in range(repeats):
        run = (
            cmd
            if fresh is None
            else [str(fresh / f"run-{i}") if a == FRESH_RUN_DIR else a for a in cmd]
        )
        t0 = time.perf_counter()
        proc = subprocess.run(run, capture_output=True, env=env)
        times.append(time.perf_counter() - t0)
        code = proc.returncode
    return statistics.median(times), code


def _heavy_imports(cmd: list[str], env: dict) -> list[str]:
    """Top-level heavy packages imported by ``cmd`` (``-X importtime`` on the same interpreter)."""
    if Path(cmd[0]).name == "privkit":  # run the script's entry point under -X importtime
        cmd = [
            sys.executable,
            "-X",
            "importtime",
            "-c",
            "import sys; from privkit.cli import main; sys.argv[0] = 'privkit'; main()",
            *cmd[1:],
        ]
    else:
        cmd = [cmd[0], "-X", "importtime", *cmd[1:]]
    err = subprocess.run(cmd, capture_output=True, env=env, text=True).stderr
    names = {
        line.split("|")[-1].strip() for line in err.splitlines() if line.startswith("import time:")
    }
    return sorted(h for h in HEAVY if h in names)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script = _script()
    bare, _ = _time([sys.executable, "-c", "pass"], args.repeats, env)
    heavy_stmt = "import " + ", ".join(HEAVY)
    everything, _ = _time([sys.executable, "-c", heavy_stmt], args.repeats, env)
    rows = []
    with tempfile.TemporaryDirectory(prefix="privkit-startup-") as tmp:
        bad_run = Path(tmp) / "bad.toml"
        bad_run.write_text(BAD_RUN_TOML)
        for name, argv, expected in CASES:
            argv = [str(bad_run) if a == BAD_RUN_CONFIG else a for a in argv]
            fresh = Path(tmp) / f"case-{len(rows)}"
            seconds, code = _time([*script, *argv], args.repeats, env, fresh)
            rows.append(
                {
                    "case": name,
                    "argv": argv,
                    "seconds": round(seconds, 3),
                    "exit_code": code,
                    "expected_exit_code": expected,
                    "ratio_to_import_everything": round(seconds / everything, 3),
                    "heavy_imports": _heavy_imports(
                        [
                            *script,
                            *[str(fresh / "imports") if a == FRESH_RUN_DIR else a for a in argv],
                        ],
                        env,
                    ),
                }
            )
    out = {
        "schema_version": 1,
        "benchmark": "startup",
        "repeats": args.repeats,
        "python_bare_seconds": round(bare, 3),
        "import_everything_seconds": round(everything, 3),
        "import_everything": heavy_stmt,
        "cases": rows,
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"median of {args.repeats}; bare python {bare:.2f} s; `{heavy_stmt}` {everything:.2f} s")
    print(f"{'case':22} {'seconds':>8} {'ratio':>6} {'exit':>5}  heavy imports")
    for r in rows:
        flag = (
            ""
            if r["exit_code"] == r["expected_exit_code"]
            else f" (expected {r['expected_exit_code']})"
        )
        print(
            f"{r['case']:22} {r['seconds']:8.2f} {r['ratio_to_import_everything']:6.2f} "
            f"{r['exit_code']:>5}{flag}  {', '.join(r['heavy_imports']) or '-'}"
        )


if __name__ == "__main__":
    main()
