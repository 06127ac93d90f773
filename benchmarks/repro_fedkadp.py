"""Reproduce FedKADP's comparison (Sec. 5.4, Fig. 7) on the embedded data, at one privacy budget.

FedKADP, FedKD+DP and DP-FedAvg on mnist5k split into non-IID label shards (2 shards per client,
20 clients), all with the same initial noise multiplier and the same target (epsilon, delta): each
run stops before the round that would take any client past the budget (privkit's per-client,
record-level Poisson-subsampled-Gaussian accounting). Prints a Markdown table (mean +- std over
seeds) and writes ``benchmarks/results/repro_fedkadp.json``.

The paper's setting (MNIST, 100 clients x 600 records, CNN, T=100, E=20, sigma_0=5) is scaled to
the embedded data and 2 shared CPU cores: 20 clients x 160 records, MLP 784-64-10, T=30 rounds,
E=10 steps, B=32, 10 clients per round, sigma_0=2 (see ``SETTING``; sigma_0=5 leaves every method
near chance on 160-record clients).

Usage: ``nice python benchmarks/repro_fedkadp.py [--seeds 3] [--rounds 30] [--target-epsilon 8.5]``;
seeds can run in separate processes (``--first-seed 1 --seeds 1 --out a.json``) and be merged
(``--merge a.json b.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from privkit.data import FederationConfig, build_federation
from privkit.trainers import train

METHODS = ("dp-fedavg", "fedkd-dp", "fedkadp")
SETTING = {"arch": "mlp", "feature_dim": 64, "local_steps": 10, "batch_size": 32, "lr": 0.1,
           "client_fraction": 0.5, "noise_multiplier": 2.0, "clip_norm": 1.0, "delta": 1e-5,
           "accountant": "rdp", "device": "auto"}


def run(seeds: list[int], rounds: int, target_epsilon: float) -> dict:
    fed = build_federation(FederationConfig(dataset="mnist5k", partition="shards", clients=20,
                                            shards_per_client=2, seed=0))
    rows = {m: [] for m in METHODS}
    for seed in seeds:
        for method in METHODS:
            cfg = {**SETTING, "rounds": rounds, "target_epsilon": target_epsilon}
            t0 = time.time()
            res = train(method, fed, cfg, seed=seed)
            eps = res.ledger.epsilon(cfg["delta"], accountant="rdp")
            eps_pld = res.ledger.epsilon(cfg["delta"], accountant="pld")
            rows[method].append({
                "seed": seed, "test_accuracy": res.test_accuracy, "rounds": len(res.rounds),
                "final_sigma": res.rounds[-1]["sigma"] if res.rounds else None,
                "epsilon_rdp": eps, "epsilon_pld": eps_pld, "paper_epsilon": res.claims["epsilon"],
                "paper_epsilon_per_client_form": res.claims["epsilon_per_client_form"],
                "seconds": time.time() - t0, "curve": [r["test_accuracy"] for r in res.rounds]})
            print(f"seed {seed} {method:10s} acc {res.test_accuracy:.3f} rounds {len(res.rounds):3d} "
                  f"eps_rdp {eps:.2f} eps_pld {eps_pld:.2f} paper {res.claims['epsilon']:.2f} "
                  f"({time.time() - t0:.0f} s)", flush=True)
    return {"schema_version": 1, "setting": {**SETTING, "rounds": rounds, "target_epsilon": target_epsilon,
                                             "federation": fed.config.model_dump(), "seeds": len(seeds)},
            "runs": rows}


def _ms(values: list[float], fmt: str = "{:.1f}") -> str:
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.mean(values))} +- {fmt.format(statistics.stdev(values))}"


def table(result: dict) -> str:
    s = result["setting"]
    lines = [(f"mnist5k, 20 clients, label shards (2/client), MLP 784-64-10, E={s['local_steps']}, "
             f"B={s['batch_size']}, lr={s['lr']}, 10 clients/round, sigma_0={s['noise_multiplier']}, "
             f"T<={s['rounds']}, target epsilon {s['target_epsilon']} at delta {s['delta']} (RDP, per client, "
             f"record-level); {s['seeds']} seed(s)"), "",
             ("| method | test accuracy (%) | rounds run | final sigma | epsilon RDP (worst client) | "
             "epsilon PLD | paper formula (server form) |"), "|---|---|---|---|---|---|---|"]
    for m, runs in result["runs"].items():
        lines.append(f"| {m} | {_ms([100 * r['test_accuracy'] for r in runs])} | "
                     f"{_ms([r['rounds'] for r in runs], '{:.0f}')} | "
                     f"{_ms([r['final_sigma'] or 0 for r in runs], '{:.2f}')} | "
                     f"{_ms([r['epsilon_rdp'] for r in runs], '{:.2f}')} | "
                     f"{_ms([r['epsilon_pld'] for r in runs], '{:.2f}')} | "
                     f"{_ms([r['paper_epsilon'] for r in runs], '{:.2f}')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3, help="run seeds first-seed .. first-seed+seeds-1")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="only print the table of these result files")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--target-epsilon", type=float, default=8.5)
    ap.add_argument("--out", default="benchmarks/results/repro_fedkadp.json")
    args = ap.parse_args()
    if args.merge:  # seeds run in separate processes, one table
        parts = [json.loads(Path(p).read_text()) for p in args.merge]
        result = {"schema_version": 1, "setting": {**parts[0]["setting"], "seeds": 0}, "runs": {m: [] for m in METHODS}}
        for part in parts:
            result["setting"]["seeds"] += part["setting"]["seeds"]
            for m in METHODS:
                result["runs"][m] += part["runs"][m]
        print(table(result))
        return
    torch.set_num_threads(1)
    result = run(list(range(args.first_seed, args.first_seed + args.seeds)), args.rounds, args.target_epsilon)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(table(result))


if __name__ == "__main__":
    main()
