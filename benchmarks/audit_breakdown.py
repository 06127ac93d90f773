"""Where an audit's time goes: per method, one training and the parts of its audit, in one process.

``audit_cost.py`` gives an audit's ratio to one training; ``audit_roofline.py --kernels`` what the
reference runs' kernels alone cost. This script says what the rest of an audit is, so that a
ratio's distance from its floor can be read part by part. In one process, one torch thread, per
method (its ``quick`` configuration on the quickstart federation, as ``audit_cost.py``): one
untimed training, two timed trainings as ``privkit train`` trains (``train_cpu_s``: the batched
engine's single run where the method has a batched form) and two by the loop
(``train_loop_cpu_s``, :func:`privkit.trainers.train`), the demo's account stage, one untimed
audit (a process's first audit pays one-time costs), then one audit timed as a whole
(``audit_cpu_s``) and by part, each part the process CPU seconds spent inside one function:

* ``target_exact_s``: the Adam federations' exact per-model kernels
  (:func:`privkit.batched.exact_mlp.train_exact` without ``stacked``): the audit's target run,
  bit for bit its single run;
* ``reference_stacked_s``: the same function with ``stacked=True``: the reference runs' clients;
* ``rounds_setup_s``: :func:`privkit.batched.many_fedavg.local_epochs` less the two above (the
  clients' records, batches and modules);
* ``rounds_finish_s``: :func:`privkit.batched.many_fedavg.finish_rounds` (averaging, server step,
  evaluation);
* ``shadow_fit_s``: :meth:`attacks.mia.ShadowModelAttack.fit` (the shadow-model attack's CatBoost
  fit, a fixed cost of every audit);
* ``claims_s``: :func:`privkit.audit.run._claims` (the ledger's own trade-off curve tested with
  the same guesses, its f-DP bound and detectable epsilon: a fixed cost of a DP method's audit);
* ``other_s``: the audit less all of these (the attacks' scoring, the federations).

The first four are zero for methods whose batched form is not FedAvg's (the DP-SGD federations,
FLiP, centralized training): their audits are then the total and the attack's fit.

With ``--kernels FILE`` (an ``audit_roofline.py --kernels`` result), for each method in it:
``floor_with_fixed_parts`` = (target_exact_s + reference_kernel_s + shadow_fit_s) / train_cpu_s,
the audit's ratio if the reference runs did nothing but their kernels at the replayed rates and
the target run and the attack's fit cost what they cost here (neither can be removed: the target
run is the release; the attack is part of the audit); and ``goal_leaves_s``: what the method's
goal (issue 32: 3x or 6x, ``audit_roofline.audit_goal``) leaves for every other operation.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/audit_breakdown.py [--methods fedavg,fedprox] [--json]
        [--kernels benchmarks/results/audit_roofline_kernels_cpu_model_chunks.json] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import audit_cost
from audit_roofline import audit_goal

PARTS = (
    "target_exact",
    "reference_stacked",
    "local_epochs",
    "rounds_finish",
    "shadow_fit",
    "claims",
)


class _Clock:
    """Process CPU seconds spent inside wrapped functions, by part (outermost call only)."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PARTS, 0.0)

    def wrap(self, part: str, fn):
        def timed(*args, **kwargs):
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += time.process_time() - start

        return timed


def _instrument(clock: _Clock) -> None:
    """Wrap the functions whose time is reported, where the audit's code looks them up."""
    import attacks.mia as mia
    import privkit.audit.run as audit_stages
    import privkit.batched.many_fedavg as many_fedavg

    exact = many_fedavg.train_exact

    def train_exact(*args, stacked: bool = False, **kwargs):
        part = "reference_stacked" if stacked else "target_exact"
        return clock.wrap(part, exact)(*args, stacked=stacked, **kwargs)

    many_fedavg.train_exact = train_exact
    many_fedavg.local_epochs = clock.wrap("local_epochs", many_fedavg.local_epochs)
    many_fedavg.finish_rounds = clock.wrap("rounds_finish", many_fedavg.finish_rounds)
    mia.ShadowModelAttack.fit = clock.wrap("shadow_fit", mia.ShadowModelAttack.fit)
    audit_stages._claims = clock.wrap("claims", audit_stages._claims)


def measure(method: str, clock: _Clock) -> dict:
    from privkit.audit import audit_run
    from privkit.flower_engine.engine import train
    from privkit.trainers import REGISTRY
    from privkit.trainers import train as train_loop
    from privkit.trainers.pretrain import clear_cache

    _, settings, seed = audit_cost._demo_settings()
    fed = audit_cost._federation()
    cfg = REGISTRY[method].quick_config()
    train(method, fed, cfg, seed=seed)  # the process's lazy imports and first calls
    train_loop(method, fed, cfg, seed=seed)
    trains, loops = [], []
    for _ in range(2):
        clear_cache()
        start = time.process_time()
        result = train(method, fed, cfg, seed=seed)
        trains.append(time.process_time() - start)
        clear_cache()
        start = time.process_time()
        train_loop(method, fed, cfg, seed=seed)
        loops.append(time.process_time() - start)
    task = dict(settings, method=method, seed=seed)
    with tempfile.TemporaryDirectory(prefix="audit-breakdown-") as tmp:
        run = Path(tmp)
        audit_cost.run_directory(run, method, seed, cfg, fed, result, task)

        def audit():
            return audit_run(
                run,
                shadows=task["shadows"],
                executor="serial",
                seed=0,
                delta=task["delta"],
                write=False,
            )

        audit()  # a process's first audit pays one-time costs (docs/performance.md)
        clock.seconds = dict.fromkeys(PARTS, 0.0)
        start = time.process_time()
        audit()
        total = time.process_time() - start
    s = clock.seconds
    setup = s["local_epochs"] - s["target_exact"] - s["reference_stacked"]
    parts = {
        "target_exact_s": s["target_exact"],
        "reference_stacked_s": s["reference_stacked"],
        "rounds_setup_s": max(setup, 0.0) if s["local_epochs"] else 0.0,
        "rounds_finish_s": s["rounds_finish"],
        "shadow_fit_s": s["shadow_fit"],
        "claims_s": s["claims"],
    }
    parts["other_s"] = (
        total - s["local_epochs"] - s["rounds_finish"] - s["shadow_fit"] - s["claims"]
    )
    train_s = statistics.median(trains)
    return {
        "train_cpu_s": round(train_s, 3),
        "train_cpu_s_all": [round(t, 3) for t in trains],
        "train_loop_cpu_s": round(statistics.median(loops), 3),
        "audit_cpu_s": round(total, 3),
        "ratio_cpu": round(total / train_s, 2),
        **{k: round(v, 3) for k, v in parts.items()},
    }


def with_floor(row: dict, kernels: dict | None, goal: float) -> dict:
    """``row`` with the floor that keeps the target run and the attack's fit, and what ``goal``
    (an audit's cost in trainings) leaves beside them (module docstring)."""
    if kernels is None or "reference_kernel_s" not in kernels:
        return row
    fixed = row["target_exact_s"] + kernels["reference_kernel_s"] + row["shadow_fit_s"]
    return {
        **row,
        "reference_kernel_s": kernels["reference_kernel_s"],
        "floor_with_fixed_parts": round(fixed / row["train_cpu_s"], 2),
        "goal": goal,
        "goal_leaves_s": round(goal * row["train_cpu_s"] - fixed, 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", default="fedavg,fedprox")
    ap.add_argument("--kernels", type=Path, help="an audit_roofline.py --kernels result file")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path, help="write the JSON here too")
    args = ap.parse_args(argv)
    audit_cost._one_thread()
    kernels = json.loads(args.kernels.read_text())["methods"] if args.kernels else {}
    clock = _Clock()
    _instrument(clock)
    gflops_start = audit_cost.matmul_gflops()
    rows = {}
    for method in [m for m in args.methods.split(",") if m]:
        rows[method] = with_floor(measure(method, clock), kernels.get(method), audit_goal(method))
        print(json.dumps({method: rows[method]}), file=sys.stderr)
    out = {
        "schema_version": 1,
        "benchmark": "audit_breakdown",
        "methods": rows,
        "conditions": {
            "torch_threads": 1,
            "platform": platform.platform(),
            "config": "quick",
            "shadows": audit_cost._demo_settings()[1]["shadows"],
            "kernels_from": str(args.kernels) if args.kernels else None,
            "matmul_gflops_start": round(gflops_start, 1),
            "matmul_gflops_end": round(audit_cost.matmul_gflops(), 1),
        },
    }
    audit_cost.emit(out, args.out, args.json, skip=("train_cpu_s_all",))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
