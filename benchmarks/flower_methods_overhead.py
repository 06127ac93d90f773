"""What the Flower engine adds to privkit's methods: in-process and Flower runs side by side.

For each method ported to Flower (:func:`privkit.flower_engine.engine.flower_methods`, fedprox aside: it
is fedavg's loop) this trains the method's ``quick`` configuration (what ``privkit train METHOD
--quick`` runs) on the quickstart federation (mnist5k, 20 clients, Dirichlet alpha=1, digits28
public data) twice in one process, seeded alike:

1. ``inprocess_s``: :func:`privkit.trainers.train`, privkit's in-process federation (the default);
2. ``flower_s``: :func:`privkit.flower_engine.engine.train_on_flower`, the method's ServerApp/ClientApp on
   Flower's simulation engine (``flwr.simulation.run_simulation``, Ray backend, one CPU per
   ClientApp actor, one node per client): what ``privkit train METHOD --quick --engine flower``
   runs. ``flower_startup_s`` is the time from the call until the ServerApp knows every node's
   client (Ray started, the actors up, one ``query`` round), ``flower_rounds_s`` the rest;
   ``flower_first_round_s`` the first training round (the actors import torch and privkit's
   trainers and load the federation there), ``flower_later_round_s`` the mean of the later ones,
   beside ``inprocess_round_s``, the in-process run's time over its rounds.

``ratio`` is ``flower_s / inprocess_s``, ``added_s`` their difference. Before the timed runs each
method trains once in-process, untimed (torch warm, public-data pretraining cached for both).
With ``--reproducible-noise`` the two released models are also compared (``max_abs_diff``).

Usage::

    OMP_NUM_THREADS=1 python benchmarks/flower_methods_overhead.py [--json] [--methods a,b]
        [--reproducible-noise]

Output (``--json``)::

    {"methods": {"dp-fedavg": {"inprocess_s": ..., "flower_s": ..., "ratio": ..., ...}, ...}, ...}

Times are wall-clock seconds on the machine it ran on (the load average is printed with them).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import time

METHODS = ("fedavg", "dp-fedavg", "fedkadp", "fedauxfdp")


def _max_abs_diff(a, b) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max(float((sa[k].double() - sb[k].double()).abs().max()) for k in sa)


def measure(method: str, federation, reproducible: bool) -> dict:
    """One method: an untimed warm-up, the timed in-process run, the timed Flower run."""
    import privkit.flower_engine.apps as apps
    from privkit.flower_engine.engine import train_on_flower
    from privkit.trainers import get_trainer, train

    cfg = {**get_trainer(method).quick_config(), "reproducible_noise": reproducible}
    train(method, federation, cfg, seed=0)  # warm-up: torch, pretraining cache
    t0 = time.perf_counter()
    inproc = train(method, federation, cfg, seed=0)
    inprocess_s = time.perf_counter() - t0

    mapped: list[float] = []
    original = apps.partition_nodes

    def timed(grid, num_clients):
        out = original(grid, num_clients)
        mapped.append(time.perf_counter())
        return out

    rounds_done: list[float] = []
    make_port = apps.make_port

    def timed_port(*args, **kwargs):  # marks the end of each round on the server
        port = make_port(*args, **kwargs)
        finish = port.finish_round

        def finish_round(replies):
            finish(replies)
            rounds_done.append(time.perf_counter())

        port.finish_round = finish_round
        return port

    apps.partition_nodes, apps.make_port = timed, timed_port
    try:
        t0 = time.perf_counter()
        flower = train_on_flower(method, federation, cfg, seed=0)
        end = time.perf_counter()
    finally:
        apps.partition_nodes, apps.make_port = original, make_port
    flower_s = end - t0
    later = [b - a for a, b in itertools.pairwise(rounds_done)]
    row = {
        "inprocess_s": round(inprocess_s, 3),
        "flower_s": round(flower_s, 3),
        "ratio": round(flower_s / inprocess_s, 3),
        "added_s": round(flower_s - inprocess_s, 3),
        "flower_startup_s": round(mapped[0] - t0, 3),
        "flower_rounds_s": round(end - mapped[0], 3),
        "flower_first_round_s": round(rounds_done[0] - mapped[0], 3),
        "flower_later_round_s": round(sum(later) / len(later), 3) if later else None,
        "inprocess_round_s": round(inprocess_s / max(len(inproc.rounds), 1), 3),
        "rounds": len(inproc.rounds),
        "clients": federation.num_clients,
        "test_accuracy": {"inprocess": inproc.test_accuracy, "flower": flower.test_accuracy},
    }
    if reproducible:
        row["max_abs_diff"] = _max_abs_diff(inproc.model, flower.model)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated methods")
    parser.add_argument(
        "--reproducible-noise",
        action="store_true",
        help="seed the DP noise and compare the released models",
    )
    args = parser.parse_args()

    import torch

    from privkit.data import FederationConfig, build_federation
    from privkit.flower_engine.engine import check_engine

    torch.set_num_threads(1)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        check_engine("flower", m)
    fed = build_federation(FederationConfig())  # the quickstart federation (privkit train --quick)
    rows = {}
    for m in methods:
        rows[m] = measure(m, fed, args.reproducible_noise)
        print(json.dumps({m: rows[m]}), file=sys.stderr)
    import flwr
    import ray

    out = {
        "methods": rows,
        "federation": "mnist5k, 20 clients, dirichlet alpha=1, digits28 public",
        "reproducible_noise": args.reproducible_noise,
        "flwr": flwr.__version__,
        "ray": ray.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average": list(os.getloadavg()),
        "conditions": "one torch thread; Ray backend, 1 CPU per ClientApp actor; wall seconds",
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    for m, r in rows.items():
        print(
            f"{m:10s} in-process {r['inprocess_s']:7.2f} s  Flower {r['flower_s']:7.2f} s  "
            f"ratio {r['ratio']:5.2f}  (start-up {r['flower_startup_s']:.2f} s, rounds {r['flower_rounds_s']:.2f} s)"
        )


if __name__ == "__main__":
    main()
