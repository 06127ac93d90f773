"""Training steps with freed memory kept in the process (privkit.memory) and without, side by side.

Each case is one kind of step privkit's trainings and audits take on the CPU, run in a fresh
process under each policy in turn (the policy is set when a process starts and cannot be taken
back), ``--rounds`` times, alternating which goes first:

* ``dpsgd_cnn_stacked``: the clipped per-example gradient sums of a step of 17 of dpsgd's default
  CNNs (an audit's target and 16 reference runs, batch 64; ``StackedModels.clipped_sums``);
* ``dpsgd_cnn_single``: the same for one model (one training's step);
* ``client_cnn_stacked``: the plain gradients of a step of 8 default CNN clients (a CNN
  federation's reference clients, batch 32; ``many_central.step_gradients``);
* ``client_cnn_single``: one such client's forward and backward pass and Adam step.

Per case and policy: the median of a process's step times (CPU seconds, one thread; the median
over rounds), the page faults a step takes (``ru_minflt``), and ``kept_over_system``, the kept
policy's median step time over the C library's own.

    OMP_NUM_THREADS=1 python benchmarks/freed_memory.py [--json] [--rounds 3] [--steps 7]
        [--cases dpsgd_cnn_stacked,...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from audit_cost import fail  # bad input: one line, exit 2

SCHEMA_VERSION = 1
CASES = ("dpsgd_cnn_stacked", "dpsgd_cnn_single", "client_cnn_stacked", "client_cnn_single")
POLICIES = {"kept": "1", "system": "0"}  # privkit.memory.ENV_SWITCH's values


def _step(case: str):
    """A function taking one step of ``case`` (see the module docstring), on generated records."""
    import torch
    import torch.nn.functional as F

    from privkit.batched.many_central import step_gradients
    from privkit.mechanisms.stacked import StackedModels
    from privkit.models import build_model

    stacked, dpsgd = case.endswith("_stacked"), case.startswith("dpsgd")
    models = (17 if dpsgd else 8) if stacked else 1
    batch = 64 if dpsgd else 32
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    nets = [build_model("cnn", (1, 28, 28), 10, width=16, feature_dim=128) for _ in range(models)]
    x = torch.rand(models, batch, 1, 28, 28, generator=gen)
    y = torch.randint(0, 10, (models, batch), generator=gen)
    if case == "client_cnn_single":
        net, opt = nets[0], torch.optim.Adam(nets[0].parameters(), lr=1e-3)

        def single() -> None:
            opt.zero_grad()
            F.cross_entropy(net(x[0]), y[0]).backward()
            opt.step()

        return single
    template = nets[0]
    stack = StackedModels(template, models)
    names = [k for k, _ in template.named_parameters()]
    params = {k: torch.stack([dict(n.named_parameters())[k].detach() for n in nets]) for k in names}
    if dpsgd:

        def losses(logits, rows, s):
            flat = F.cross_entropy(logits.flatten(0, 1), y[rows, s].flatten(), reduction="none")
            return flat.view(logits.shape[0], -1)

        return lambda: stack.clipped_sums(params, {}, x, losses, 1.0)
    counts = torch.full((models,), batch)
    return lambda: step_gradients(stack, params, {}, x, y, counts)


def child(case: str, steps: int) -> dict:
    """One process's measurement of ``case`` under the policy its environment sets."""
    import torch

    from privkit.memory import keep_freed_memory

    torch.set_num_threads(1)
    kept = keep_freed_memory()
    step = _step(case)
    for _ in range(3):  # warm-up: lazy initialisation, and the heap's first growth
        step()
    times, faults = [], []
    for _ in range(steps):
        f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time()
        step()
        times.append(time.process_time() - t0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return {"kept": kept, "step_s": statistics.median(times), "faults": statistics.median(faults)}


def _run_child(case: str, policy: str, steps: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env.update({"OMP_NUM_THREADS": "1", "PRIVKIT_KEEP_FREED_MEMORY": POLICIES[policy]})
    out = subprocess.run(
        [sys.executable, __file__, "--child", case, "--steps", str(steps)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.splitlines()[-1])


def measure(cases: list[str], rounds: int, steps: int) -> dict:
    out: dict = {}
    for case in cases:
        got: dict[str, list[dict]] = {p: [] for p in POLICIES}
        for r in range(rounds):
            for policy in list(POLICIES)[:: 1 if r % 2 == 0 else -1]:
                got[policy].append(_run_child(case, policy, steps))
                print(f"{case} round {r + 1} {policy}: {got[policy][-1]}", file=sys.stderr)
        row = {f"{p}_step_ms": [round(1e3 * g["step_s"], 2) for g in got[p]] for p in POLICIES} | {
            f"{p}_faults_per_step": [g["faults"] for g in got[p]] for p in POLICIES
        }
        row["kept_applied"] = all(g["kept"] for g in got["kept"])
        med = {p: statistics.median(g["step_s"] for g in got[p]) for p in POLICIES}
        row["kept_over_system"] = round(med["kept"] / med["system"], 3)
        out[case] = row
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.steps < 1:
        fail(f"--steps must be at least 1; found {args.steps}")
    if args.child:
        print(json.dumps(child(args.child, args.steps)))
        return 0
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown or not cases:
        fail(f"--cases must name some of {', '.join(CASES)}; found {args.cases!r}")
    if args.rounds < 1:
        fail(f"--rounds must be at least 1; found {args.rounds}")
    result = {
        "schema_version": SCHEMA_VERSION,
        "benchmark": "freed_memory",
        "cases": measure(cases, args.rounds, args.steps),
        "conditions": {
            "torch_threads": 1,
            "rounds": args.rounds,
            "steps": args.steps,
            "platform": platform.platform(),
            "libc": platform.libc_ver(),
        },
    }
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for case, row in result["cases"].items():
            print(f"{case}: kept / system = {row['kept_over_system']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
