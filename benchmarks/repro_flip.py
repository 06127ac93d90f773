"""Reproduce FLiP's qualitative claim on the embedded data: accuracy rises with k and stays at or
below vanilla FedAvg on the same split (paper, Table I).

Command (about 15 minutes on one busy CPU core for 3 seeds and k in {1, 2, 5}; add ``--ks 1,2,5,10``
for a longer run)::

    nice .venv/bin/python benchmarks/repro_flip.py --seeds 3 --out flip_repro.json

Setting (scaled down from Sec. VI-A; what a CPU and the embedded data force):

* mnist5k, 5 IID clients (as the paper) of 640 records each; test set 1000 images;
* model: an MLP with one hidden layer of 64 units (paper: TinyResNet, AlexNet, ConvNet);
* FLiP: 30 rounds of Eps = 10 local epochs (paper: 100 rounds of Eps = 30), one raw batch per
  epoch (batch 1024 > 640 records), Adam step 0.05 (paper 0.01; larger to make up for the 10x
  fewer outer steps), k in {1, 2, 5} distilled samples per class (paper: 10, 15, 20: the unroll
  through K = 10k samples, one sample per step, dominates the cost);
* vanilla FedAvg: privkit's ``fedavg`` trainer, same MLP and split, all clients every round,
  30 rounds of 2 local epochs (Adam 1e-3, batch 32), i.e. trained to convergence.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from privkit.data import FederationConfig, build_federation
from privkit.trainers import get_trainer, train

MODEL = {"arch": "mlp", "feature_dim": 64, "device": "cpu"}


def run(seeds: int, ks: list[int], rounds: int, progress: bool) -> dict:
    fed = build_federation(
        FederationConfig(
            dataset="mnist5k", public_dataset="digits28", clients=5, partition="iid", seed=0
        )
    )
    rows: dict[str, dict] = {}

    def add(name: str, acc: float, seconds: float, extra: dict) -> None:
        row = rows.setdefault(name, {"accuracy": [], "seconds": [], **extra})
        row["accuracy"].append(acc)
        row["seconds"].append(seconds)
        if progress:
            print(f"{name}: {acc:.3f} ({seconds:.0f} s)", flush=True)

    for seed in range(seeds):
        t = time.time()
        res = train(
            "fedavg",
            fed,
            {**MODEL, "rounds": rounds, "participation": 1.0, "local_epochs": 2},
            seed=seed,
        )
        add("vanilla FedAvg", float(res.test_accuracy), time.time() - t, {"k": None})
        for k in ks:
            t = time.time()
            res = train(
                "flip", fed, {**MODEL, "k": k, "rounds": rounds, "local_epochs": 10}, seed=seed
            )
            add(
                f"FLiP k={k}",
                float(res.test_accuracy),
                time.time() - t,
                {"k": k, "distilled_samples": k * fed.num_classes},
            )
    return {
        "schema_version": 1,
        "benchmark": "repro_flip",
        "clients": fed.num_clients,
        "records_per_client": int(np.mean([len(c) for c in fed.clients])),
        "rounds": rounds,
        "seeds": seeds,
        "rows": rows,
    }


def table(result: dict) -> str:
    lines = [
        (
            f"{result['clients']} IID clients x {result['records_per_client']} records, "
            f"{result['rounds']} rounds, {result['seeds']} seed(s)"
        ),
        "",
        "| method | k (per class) | shared samples per client | test accuracy (%) | s/run |",
        "|---|---|---|---|---|",
    ]
    for name, row in result["rows"].items():
        acc = np.array(row["accuracy"]) * 100
        k = "" if row["k"] is None else row["k"]
        shared = "model weights" if row["k"] is None else row["distilled_samples"]
        lines.append(
            f"| {name} | {k} | {shared} | {acc.mean():.1f} +- {acc.std():.1f} | "
            f"{np.mean(row['seconds']):.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--ks", type=str, default="1,2,5")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", type=str, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    get_trainer("fedavg")  # fail early if the reference trainer is missing
    result = run(args.seeds, [int(k) for k in args.ks.split(",")], args.rounds, progress=True)
    print(table(result))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
