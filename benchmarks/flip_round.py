"""FLiP's round of client updates: the rank-one lockstep form against one client after the other.

One round of FLiP's quick configuration on the quickstart federation (20 clients, the demo's
``flip`` settings), from the same initial distilled data, in one process with one torch thread:

* ``loop_s``: :func:`privkit.trainers.flip.client_update` for each client in turn (the generic path:
  ``autograd.grad(create_graph=True)`` through the K single-sample steps, then the double backward);
* ``rank_one_s``: :func:`privkit.trainers.flip.round_updates` (every client at once, the unroll in
  rank-one form: :mod:`privkit.trainers.flip_rank_one`);
* ``speedup`` = loop / rank-one (medians of ``--repeats``, CPU seconds, the two interleaved), and
  ``max_abs_diff``: the largest difference between the two paths' uploads (samples, label logits,
  rates) in float32, which the float64 tests bound at rounding.

With ``--runs R`` (an audit has 16 reference runs), also the round of R runs (each its own initial
model and distilled data, the same 20 clients' data), as an audit's reference runs take it:
``runs.one_after_the_other_s`` (each run's :func:`~privkit.trainers.flip.round_updates`, R calls)
against ``runs.together_s`` (:func:`~privkit.trainers.flip.runs_round_updates`: every client of
every run in one lockstep, the weights stacked per run), each with its padded rows kept from an
untimed first round (as from an audit's second round on), interleaved; ``runs.speedup`` their
quotient.

    OMP_NUM_THREADS=1 python benchmarks/flip_round.py [--json] [--repeats 3] [--runs 16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch


def _setup():
    from privkit.data import FederationConfig, build_federation
    from privkit.methods import get_trainer
    from privkit.seeding import derive_seed
    from privkit.trainers import flip
    from privkit.trainers.common import as_tensor, new_model

    fed = build_federation(FederationConfig())
    cfg = flip.FlipConfig.model_validate(get_trainer("flip").quick_config())
    model, _ = new_model(fed, cfg, derive_seed(0, "flip-init-model"))
    init = flip.initial_params(model)
    state = flip.initial_distilled(
        cfg.k, fed.num_classes, fed.input_shape, cfg, 1, torch.device("cpu")
    )
    clients = [
        (as_tensor(x, "cpu", torch.float32), as_tensor(y, "cpu", torch.long))
        for x, y in (fed.client_arrays(i) for i in range(fed.num_clients))
    ]
    seeds = [derive_seed(0, f"flip-client-{i}-1") for i in range(len(clients))]
    return fed, model, init, state, clients, cfg, seeds


def _runs_round(fed, model, clients, cfg, count: int, repeats: int) -> dict:
    """One round of ``count`` runs' clients: one run after the other against all together."""
    from privkit.seeding import derive_seed
    from privkit.trainers import flip
    from privkit.trainers.common import new_model

    runs = []
    for r in range(count):
        init = flip.initial_params(new_model(fed, cfg, derive_seed(r, "flip-init-model"))[0])
        state = flip.initial_distilled(
            cfg.k, fed.num_classes, fed.input_shape, cfg, r, torch.device("cpu")
        )
        seeds = [derive_seed(r, f"flip-client-{i}-1") for i in range(len(clients))]
        runs.append((init, *state, seeds, {}))
    together_cache: dict = {}
    lr = cfg.distill_lr

    def alone():
        return [
            u
            for init, S, L, eta, seeds, cache in runs
            for u in flip.round_updates(model, init, S, L, eta, clients, cfg, lr, seeds, cache)
        ]

    def together():
        return flip.runs_round_updates(
            model,
            [(init, S, L, eta) for init, S, L, eta, _, _ in runs for _ in clients],
            list(clients) * count,
            cfg,
            lr,
            [seed for *_, seeds, _ in runs for seed in seeds],
            together_cache,
        )

    alone(), together()  # the first round builds the padded rows each path keeps
    alone_s, together_s = [], []
    for _ in range(repeats):
        alone_s.append(_cpu(alone)[1])
        together_s.append(_cpu(together)[1])
    a, b = statistics.median(alone_s), statistics.median(together_s)
    return {
        "count": count,
        "clients": count * len(clients),
        "one_after_the_other_s": round(a, 3),
        "together_s": round(b, 3),
        "speedup": round(a / b, 2),
    }


def _cpu(fn):
    start = time.process_time()
    out = fn()
    return out, time.process_time() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--runs", type=int, default=0, help="also a round of this many runs' clients")
    args = ap.parse_args()
    if args.repeats < 1 or args.runs < 0:
        bad = ("--repeats", args.repeats) if args.repeats < 1 else ("--runs", args.runs)
        floor = 1 if bad[0] == "--repeats" else 0
        print(f"flip_round: {bad[0]} must be >= {floor}; found {bad[1]}", file=sys.stderr)
        raise SystemExit(2)
    torch.set_num_threads(1)
    from privkit.trainers import flip

    fed, model, init, (S, L, eta), clients, cfg, seeds = _setup()
    lr = cfg.distill_lr

    def loop():
        return [
            flip.client_update(model, init, S, L, eta, x, y, cfg, lr, s)
            for (x, y), s in zip(clients, seeds)
        ]

    def rank_one():
        return flip.round_updates(model, init, S, L, eta, clients, cfg, lr, seeds)

    loop_s, rank_s = [], []
    for _ in range(args.repeats):
        a, t = _cpu(loop)
        loop_s.append(t)
        b, t = _cpu(rank_one)
        rank_s.append(t)
    diff = max(float((u - v).abs().max()) for ua, ub in zip(a, b) for u, v in zip(ua[:3], ub[:3]))
    out = {
        "schema_version": 1,
        "benchmark": "flip_round",
        "conditions": {
            "clients": len(clients),
            "distilled_samples": int(S.shape[0]),
            "local_epochs": cfg.local_epochs,
            "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "load_average": list(os.getloadavg()),
            "repeats": args.repeats,
        },
        "loop_s": round(statistics.median(loop_s), 3),
        "rank_one_s": round(statistics.median(rank_s), 3),
        "speedup": round(statistics.median(loop_s) / statistics.median(rank_s), 2),
        "max_abs_diff": diff,
    }
    if args.runs:
        out["runs"] = _runs_round(fed, model, clients, cfg, args.runs, args.repeats)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(
            f"one FLiP round, {len(clients)} clients: loop {out['loop_s']} s, rank-one "
            f"{out['rank_one_s']} s ({out['speedup']}x); uploads differ by at most {diff:.2g}"
        )
        if args.runs:
            r = out["runs"]
            print(
                f"one round of {r['count']} runs ({r['clients']} clients): one after the other "
                f"{r['one_after_the_other_s']} s, together {r['together_s']} s ({r['speedup']}x)"
            )


if __name__ == "__main__":
    main()
