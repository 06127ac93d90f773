"""Reproduce the ordering of FedAUXfdp Table 2 (Hoech et al.) on the embedded data.

One-shot setting: 20 clients holding ``mnist5k`` (Dirichlet alpha in {0.01, 10.24}, FedAUX's
balanced split), ``digits28`` as the auxiliary data (20 % negatives, 80 % distillation), three
seeds. Methods: FedAvg+P (``fedavg-dphead``), FedD+P (``fedd-dphead``) and FedAUXfdp
(``fedauxfdp``), all at the same total budget. Paper: at alpha=0.01 FedAUXfdp beats both
baselines by ~30 points; at alpha=10.24 the baselines catch up (and overtake it slightly).

Scaling of epsilon (printed by the script). Output-perturbation noise is
``sigma ~ sensitivity / eps ~ 1 / (lam n eps)``. The embedded clients hold ~160 records against
the paper's 2500 (CIFAR-10 over 20 clients), and the scoring heads see |D_i| + |D^-| ~ 520 against
2500 + 20000 (STL-10's 100k unlabelled images, 20 % negatives). Keeping ``n * eps`` at the paper's
values keeps the noise, relative to the head, where the paper had it:
``eps_c = 0.5 * 2500 / mean|D_i|``, ``eps_s = 0.1 * 22500 / (mean|D_i| + |D^-|)``. Calibration is
``classic`` as in the paper (the ledger's accountants then give the exact, smaller, epsilon).

Other settings (stated in the output): CNN (width 16, 128-d features), h0 from 20 epochs of SimCLR
on all of digits28, lambda_c = 0.1 (the paper uses 0.01; its Fig. 2 shows a larger lambda closes
the DP gap; our features are weaker than a ResNet's), lambda_s = 0.01, paper sensitivity bound
2 sqrt(C)/(lam n), student = h0 + head trained on the soft labels for 10 epochs (Adam 1e-2, head
only: the 1.4k distillation images are too few to fine-tune the extractor at the paper's 5e-5).

Runtime: 638 s for 3 seeds on 2 heavily shared CPU cores (h0 is pretrained once per seed and
reused by all methods and both alphas). ``--seeds 1`` for a ~3-minute check.

Measured (3 seeds): alpha=0.01: FedAvg+P 39.7 +- 1.7, FedD+P 67.0 +- 3.1, FedAUXfdp 70.0 +- 2.4;
alpha=10.24: 61.1 +- 6.3, 59.7 +- 6.1, 52.8 +- 6.3. The ordering matches Table 2 (FedAUXfdp first
at 0.01, the baselines ahead at 10.24), but the margin over FedD+P at 0.01 is 3 points, not ~30:
with these weak SimCLR features even the noise-free score-weighted labeller reaches only ~75 %.
At the scaled epsilons the classic formula is outside its range (epsilon >= 1): the ledger's exact
epsilon is 8.75 for FedAUXfdp (below 7.81 + 4.34) but 13.37 for the baselines' single release
calibrated "classically" at 12.15 (above it), which the calibration warnings also say.

Usage: ``python benchmarks/repro_fedauxfdp.py [--seeds 3] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from privkit.data import FederationConfig, build_federation
from privkit.trainers import train

METHODS = [("fedavg-dphead", "FedAvg+P"), ("fedd-dphead", "FedD+P"), ("fedauxfdp", "FedAUXfdp")]
ALPHAS = (0.01, 10.24)
PAPER_N_CLASS, PAPER_EPS_CLASS = 2500, 0.5          # CIFAR-10 / 20 clients, Table 2
PAPER_N_SCORE, PAPER_EPS_SCORE = 2500 + 20000, 0.1  # |D_i| + |D^-| (STL-10 100k, 20 %)

BASE = {"arch": "cnn", "width": 16, "feature_dim": 128, "pretrain_data": "all", "pretrain_epochs": 20,
        "class_lambda": 0.1, "score_lambda": 0.01, "class_delta": 1e-5, "score_delta": 1e-5,
        "calibration": "classic", "sensitivity_bound": "paper", "student_epochs": 10,
        "student_lr": 1e-2, "student_freeze": True, "keep_client_models": False}


def scaled_epsilons(fed) -> tuple[float, float, dict]:
    n_i = float(np.mean([len(c) for c in fed.clients]))
    n_neg = len(fed.negative)
    eps_c = PAPER_EPS_CLASS * PAPER_N_CLASS / n_i
    eps_s = PAPER_EPS_SCORE * PAPER_N_SCORE / (n_i + n_neg)
    info = {"mean_client_size": n_i, "negatives": n_neg, "eps_class": eps_c, "eps_score": eps_s}
    return round(eps_c, 2), round(eps_s, 2), info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    results: dict[str, dict[str, list[float]]] = {}
    budget_rows = []
    start = time.time()
    for seed in range(args.seeds):
        for alpha in ALPHAS:
            fed = build_federation(FederationConfig(dataset="mnist5k", public_dataset="digits28",
                                                    clients=20, alpha=alpha, seed=seed))
            eps_c, eps_s, info = scaled_epsilons(fed)
            if seed == 0 and alpha == ALPHAS[0]:
                print(f"epsilon scaling (noise ~ 1/(lam n eps), keep n*eps at the paper's values): "
                      f"mean |D_i| = {info['mean_client_size']:.0f} (paper {PAPER_N_CLASS}) -> eps_c = "
                      f"{PAPER_EPS_CLASS} x {PAPER_N_CLASS}/{info['mean_client_size']:.0f} = {eps_c}; "
                      f"|D_i|+|D^-| = {info['mean_client_size'] + info['negatives']:.0f} (paper {PAPER_N_SCORE}) "
                      f"-> eps_s = {PAPER_EPS_SCORE} x {PAPER_N_SCORE}/"
                      f"{info['mean_client_size'] + info['negatives']:.0f} = {eps_s}; "
                      f"total budget (basic composition) = {eps_c + eps_s:.2f}, delta = 2e-5")
                print("settings:", json.dumps(BASE))
            cfg = {**BASE, "class_epsilon": eps_c, "score_epsilon": eps_s}
            for method, label in METHODS:
                t = time.time()
                res = train(method, fed, cfg, seed=seed)
                results.setdefault(label, {}).setdefault(str(alpha), []).append(res.test_accuracy)
                eps_best = res.ledger.epsilon(2e-5)
                budget_rows.append((label, alpha, seed, eps_best))
                print(f"  seed {seed} alpha {alpha:<6} {label:<10} acc {res.test_accuracy:.3f}  "
                      f"ledger eps(best, delta=2e-5) {eps_best:.3f}  ({time.time() - t:.0f} s)", flush=True)
    print(f"\nServer test accuracy (%), mean +- std over {args.seeds} seed(s), one round, 20 clients, "
          f"mnist5k / digits28 aux:")
    header = f"{'method':<11}" + "".join(f"{'alpha=' + str(a):>18}" for a in ALPHAS)
    print(header)
    for _, label in METHODS:
        row = f"{label:<11}"
        for a in ALPHAS:
            v = 100 * np.array(results[label][str(a)])
            row += f"{v.mean():>11.1f} +- {v.std():>4.1f}"
        print(row)
    gap = {a: 100 * (np.mean(results["FedAUXfdp"][str(a)]) -
                     max(np.mean(results[l][str(a)]) for l in ("FedAvg+P", "FedD+P"))) for a in ALPHAS}
    print("FedAUXfdp minus best baseline (points): " + ", ".join(f"alpha={a}: {g:+.1f}" for a, g in gap.items()))
    worst = max(r[3] for r in budget_rows if r[0] == "FedAUXfdp")
    print(f"FedAUXfdp worst-client ledger epsilon (best accountant, delta=2e-5): {worst:.3f} vs the "
          f"basic-composition sum eps_c + eps_s")
    print(f"total time {time.time() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"schema_version": 1, "results": results, "settings": BASE}, fh, indent=2)


if __name__ == "__main__":
    main()
