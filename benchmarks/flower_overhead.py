"""What Flower's simulation engine adds to an accounted federated run, side by side in one process.

One mechanism, three ways, same rounds: 5 clients, 3 sampled per round without replacement, their
4-parameter updates clipped to 0.5 and averaged, Gaussian noise of multiplier 1 on the mean
(Flower's ``DifferentialPrivacyClientSideFixedClipping`` with ``fixedclipping_mod``), every round
recorded in a privkit ledger and its worst epsilon computed (RDP, delta 1e-5):

1. ``direct``: numpy and :class:`accountants.Ledger`, no Flower: the in-process baseline;
2. ``inprocess``: the Flower ServerApp/ClientApp pair with :class:`privkit.flower.Accounted`, driven
   by :func:`privkit.flower.run_inprocess` (no Ray);
3. ``ray``: the same pair on Flower's simulation engine (``flwr.simulation.run_simulation``, Ray
   backend, 2 CPUs, 1 per client): ``startup_s`` is the time from the call to the first round,
   ``teardown_s`` from the end of the strategy to the return.

Run: ``python benchmarks/flower_overhead.py [--rounds 5] [--json]`` (about 30 s on 2 cores; not run
in CI).  Times are wall-clock seconds on a shared machine; the load average is printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "privkit"))
import flower_testapps as apps

NODES, SAMPLED, CLIP, Z, DELTA = 5, 3, 0.5, 1.0, 1e-5


def direct(rounds: int) -> dict:
    """The same mechanism in numpy, accounted round by round in a privkit ledger."""
    import dp_accounting as dpa

    from accountants import Ledger

    _cold_ledger()
    t0 = time.perf_counter()
    rng, model, ledger, marks = np.random.default_rng(0), np.zeros(apps.N_PARAMS), Ledger(), []
    event = dpa.SampledWithoutReplacementDpEvent(NODES, SAMPLED, dpa.GaussianDpEvent(Z / 2))
    for t in range(1, rounds + 1):
        marks.append(time.perf_counter())  # the start of round t
        chosen = rng.choice(NODES, SAMPLED, replace=False)
        updates = [np.full(apps.N_PARAMS, pid + 1.0) for pid in chosen]
        clipped = [u * min(1.0, CLIP / np.linalg.norm(u)) for u in updates]
        model = model + np.mean(clipped, axis=0) + rng.normal(0, Z * CLIP / SAMPLED, apps.N_PARAMS)
        for c in range(NODES):
            ledger.add(c, event, f"round {t}", round=t, neighbouring="replace_one")
        eps = ledger.account(DELTA, accountant="rdp").epsilon
    end = time.perf_counter()
    later = (end - marks[1]) / (rounds - 1) if rounds > 1 else float("nan")
    return {
        "total_s": end - t0,
        "first_round_s": marks[1] - t0 if rounds > 1 else end - t0,
        "per_round_s": later,
        "epsilon": eps,
    }


def _flower_apps(rounds: int, marks: list[float]):
    from flwr.clientapp.mod import fixedclipping_mod
    from flwr.serverapp.strategy import DifferentialPrivacyClientSideFixedClipping, FedAvg

    from privkit.flower import Accounted

    def strategy():
        inner = FedAvg(
            fraction_train=SAMPLED / NODES,
            fraction_evaluate=0.0,
            min_available_nodes=NODES,
            min_train_nodes=SAMPLED,
        )
        acc = Accounted(
            DifferentialPrivacyClientSideFixedClipping(inner, Z, CLIP, SAMPLED), delta=DELTA
        )
        configure = acc.configure_train

        def timed(*args, **kwargs):
            marks.append(time.perf_counter())
            return configure(*args, **kwargs)

        acc.configure_train = timed
        return acc

    sink: dict = {}
    return apps.server_app(strategy, rounds, sink), apps.client_app([fixedclipping_mod]), sink


def _timings(t0: float, marks: list[float], end_strategy: float, end: float, sink: dict) -> dict:
    """``first_round_s``: from the call to the end of round 1 (Ray starts its actors in it);
    ``per_round_s``: the mean of the later rounds."""
    per_round = (end_strategy - marks[1]) / (len(marks) - 1) if len(marks) > 1 else float("nan")
    return {
        "total_s": end - t0,
        "first_round_s": marks[1] - t0,
        "per_round_s": per_round,
        "teardown_s": end - end_strategy,
        "epsilon": sink["strategy"].epsilon,
    }


def _cold_ledger() -> None:
    """Empty the ledger's accountant cache, so that no path reuses another's RDP computations."""
    from accountants import ledger

    ledger._CACHE.clear()


def inprocess(rounds: int) -> dict:
    from privkit.flower import run_inprocess

    marks: list[float] = []
    server, client, sink = _flower_apps(rounds, marks)
    _cold_ledger()
    t0 = time.perf_counter()
    run_inprocess(server, client, NODES)
    end = time.perf_counter()
    return _timings(t0, marks, end, end, sink)


def ray(rounds: int) -> dict:
    import logging

    import ray.cloudpickle
    from flwr.simulation import run_simulation

    ray.cloudpickle.register_pickle_by_value(apps)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    marks: list[float] = []
    server, client, sink = _flower_apps(rounds, marks)
    done: list[float] = []
    main = server._main

    def timed_main(grid, context):
        main(grid, context)
        done.append(time.perf_counter())

    server._main = timed_main
    _cold_ledger()
    t0 = time.perf_counter()
    run_simulation(
        server,
        client,
        num_supernodes=NODES,
        backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 2}},
    )
    end = time.perf_counter()
    return _timings(t0, marks, done[0], end, sink)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds per path (>= 2)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    t0 = time.perf_counter()
    import flwr  # noqa: F401  (import cost, paid once by both Flower paths)

    import_s = time.perf_counter() - t0
    import accountants.ledger  # noqa: F401  (dp-accounting and scipy, loaded before any timing)

    out = {
        "rounds": args.rounds,
        "nodes": NODES,
        "sampled": SAMPLED,
        "flwr_import_s": import_s,
        "load_average": os.getloadavg(),
        "direct": direct(args.rounds),
        "inprocess": inprocess(args.rounds),
        "ray": ray(args.rounds),
    }
    base = out["direct"]["per_round_s"]
    out["ratios"] = {
        "inprocess_per_round_over_direct": out["inprocess"]["per_round_s"] / base,
        "ray_per_round_over_direct": out["ray"]["per_round_s"] / base,
        "ray_total_over_inprocess_total": out["ray"]["total_s"] / out["inprocess"]["total_s"],
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    for k in ("direct", "inprocess", "ray"):
        print(k, {m: round(v, 4) for m, v in out[k].items()})
    print("ratios", {m: round(v, 2) for m, v in out["ratios"].items()}, "load", out["load_average"])


if __name__ == "__main__":
    main()
