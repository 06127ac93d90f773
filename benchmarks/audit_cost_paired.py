"""An audit's cost before and after a change: `audit_cost.py` in paired processes, alternating.

This machine's speed moves by 20-40% within minutes, more than most changes to an audit's cost,
so a before/after comparison runs the two versions in turn: pair i runs the code at ``--before``
(a git revision, checked out in a temporary worktree) and then this checkout, each as
``OMP_NUM_THREADS=1 python benchmarks/audit_cost.py --json --repeats 1 --workers 1 --methods M``
(one process, one thread: both cores are not contended by the benchmark itself). Per method it
reports both versions' audit CPU seconds per pair, the median of the pairs' relative changes, and
ratios that divide each version's median audit by the median of all the trainings of the method:
the single training is the same code on both sides where the change touches only the audit, and
pooling its 2 x ``--pairs`` measurements steadies the denominator (each pair's own ratios are kept
in ``pairs``). Each pair's two runs are printed to stderr as they end.

Usage::

    python benchmarks/audit_cost_paired.py --before REV [--methods a,b] [--pairs 3]
        [--config quick|default] [--rounds N] [--json] [--out FILE]

Output (``--json``; ``--out`` writes the same file)::

    {"schema_version": 1, "benchmark": "audit_cost", "design": ..., "summary": {method: {...}},
     "pairs": [{"before": {...}, "after": {...}}, ...]}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from audit_cost import fail  # noqa: E402  (the benchmarks' one-line bad input)

KEPT = (
    "load_average_start",
    "load_average_end",
    "matmul_gflops_start",
    "matmul_gflops_end",
    "shadows",
    "config",
)


def _revision(rev: str) -> str:
    """``rev``'s full commit hash in this repository; a bad one is a one-line error (exit 2)."""
    out = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        fail(f"--before must name a commit of this repository; found {rev!r}")
    return out.stdout.strip()


def _run(tree: Path, methods: str, config: str = "quick", rounds: int | None = None) -> dict:
    """One ``audit_cost.py`` process in ``tree`` (its own code first on the path); with
    ``rounds``, this checkout's ``audit_cost.py`` (earlier ones have no ``--rounds``), the same
    measurement of either tree's code."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree)}
    script = (
        "benchmarks/audit_cost.py" if rounds is None else str(ROOT / "benchmarks/audit_cost.py")
    )
    cmd = [sys.executable, script, "--json", "--repeats", "1"]
    cmd += ["--workers", "1", "--methods", methods]
    if config != "quick":  # revisions before audit_cost.py's --config know the quick ones only
        cmd += ["--config", config]
    if rounds is not None:
        cmd += ["--rounds", str(rounds)]
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=True)
    d = json.loads(out.stdout)
    return {"methods": d["methods"], "conditions": {k: d["conditions"].get(k) for k in KEPT}}


def summarise(pairs: list[dict]) -> dict:
    """Per method: each version's audit CPU seconds per pair, the median of the pairs' relative
    changes, all the trainings' CPU seconds, and each version's median audit over the median
    training."""
    out = {}
    for m in pairs[0]["before"]["methods"]:
        before = [p["before"]["methods"][m]["audit_cpu_s"] for p in pairs]
        after = [p["after"]["methods"][m]["audit_cpu_s"] for p in pairs]
        trains = [p[s]["methods"][m]["train_cpu_s"] for p in pairs for s in ("before", "after")]
        train = statistics.median(trains)
        out[m] = {
            "audit_cpu_s_before": before,
            "audit_cpu_s_after": after,
            "audit_change_median_of_pairs": round(
                statistics.median(a / b - 1 for a, b in zip(after, before)), 3
            ),
            "train_cpu_s_all": trains,
            "train_cpu_s_median": round(train, 2),
            "ratio_before_median_audit_over_median_train": round(
                statistics.median(before) / train, 2
            ),
            "ratio_after_median_audit_over_median_train": round(
                statistics.median(after) / train, 2
            ),
        }
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, help="the git revision measured as 'before'")
    ap.add_argument("--methods", default="dp-fedavg,fedkadp,fedkd-dp,fedavg,fedprox")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument(
        "--config",
        choices=("quick", "default"),
        default="quick",
        help="each method's quick or default configuration (audit_cost.py --config)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="the configuration's rounds (audit_cost.py --rounds)",
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.pairs < 1:
        fail(f"--pairs must be an integer >= 1; found {args.pairs}")
    before = _revision(args.before)
    after = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    pairs = []
    with tempfile.TemporaryDirectory(prefix="privkit-before-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), before],
            check=True,
        )
        try:
            for i in range(args.pairs):
                pair = {
                    "before": _run(tree, args.methods, args.config, args.rounds),
                    "after": _run(ROOT, args.methods, args.config, args.rounds),
                }
                print(json.dumps({"pair": i, **summarise([pair])}), file=sys.stderr, flush=True)
                pairs.append(pair)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)])
    result: dict = {
        "schema_version": 1,
        "benchmark": "audit_cost",
        "design": (
            f"paired processes, {before[:7]} (before) and {after[:7]} (after, this checkout "
            "with its uncommitted changes) alternating; each `OMP_NUM_THREADS=1 python "
            "benchmarks/audit_cost.py --json --repeats 1 --workers 1 --methods "
            f"{args.methods}"
            + ("" if args.config == "quick" else f" --config {args.config}")
            + ("" if args.rounds is None else f" --rounds {args.rounds}")
            + "`; ratios: each version's median audit over the median of all the "
            "method's trainings"
        ),
        "summary": summarise(pairs),
        "pairs": pairs,
    }
    text = json.dumps(result, indent=1)
    if args.out is not None:
        args.out.write_text(text + "\n")
    if args.json:
        print(text)
    else:
        for m, s in result["summary"].items():
            print(
                f"{m}: audit {s['audit_cpu_s_before']} -> {s['audit_cpu_s_after']} s "
                f"({s['audit_change_median_of_pairs']:+.1%}), ratio "
                f"{s['ratio_before_median_audit_over_median_train']}x -> "
                f"{s['ratio_after_median_audit_over_median_train']}x"
            )


if __name__ == "__main__":
    main()
