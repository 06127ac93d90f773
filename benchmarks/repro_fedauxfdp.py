"""Reproduce the ordering of FedAUXfdp Table 2 (Hoech et al.) on the embedded data.

One-shot setting: 20 clients holding ``mnist5k`` (Dirichlet alpha in {0.01, 10.24}, FedAUX's
balanced split), ``digits28`` as the auxiliary data (20 % negatives, 80 % distillation), three
seeds. Methods: FedAvg+P (``fedavg-dphead``: mean of the DP heads), FedD+P (``fedd-dphead``:
student distilled from ``softmax(mean logits)`` of the DP heads, the FedD/FedDF aggregation of
FedAUX Eq. 2) and FedAUXfdp (``fedauxfdp``: score-weighted mean of the heads' probabilities,
Eq. 1), all at the same total budget. Paper: at alpha=0.01 FedAUXfdp beats both baselines by ~30
points; at alpha=10.24 the baselines catch up (and overtake it slightly). A fourth, diagnostic row
``FedD+P[prob]`` (``fedd-dphead`` with ``ensemble="probabilities"``) averages the heads'
probabilities with equal weights: it is not a paper baseline; it separates what the certainty
scores add from what averaging probabilities instead of logits adds.

Scaling of epsilon (printed by the script). Output-perturbation noise is
``sigma ~ sensitivity / eps ~ 1 / (lam n eps)``. The embedded clients hold ~160 records against
the paper's 2500 (CIFAR-10 over 20 clients), and the scoring heads see |D_i| + |D^-| ~ 520 against
2500 + 20000 (STL-10's 100k unlabelled images, 20 % negatives). Keeping ``n * eps`` at the paper's
values keeps the noise, relative to the head, where the paper had it:
``eps_c = 0.5 * 2500 / mean|D_i|``, ``eps_s = 0.1 * 22500 / (mean|D_i| + |D^-|)``. Calibration is
``classic`` as in the paper (the ledger's accountants then give the exact, smaller, epsilon).

Other settings (stated in the output): CNN (width 16, 128-d features), h0 from 60 epochs of SimCLR
on all of digits28 (linear probe of h0 on the pooled client data: 93.6 % test accuracy at seed 0,
against 92.3 % after 20 epochs; the longer pretraining lifts every method by a few points and does
not change the ordering), lambda_c = 0.1 (the paper uses 0.01; its Fig. 2 shows a larger lambda
closes the DP gap), lambda_s = 0.01, paper sensitivity bound 2 sqrt(C)/(lam n), student = h0 +
head trained on the soft labels for 10 epochs (Adam 1e-2, head only: the 1.4k distillation images
are too few to fine-tune the extractor at the paper's 5e-5).

Command: ``nice python benchmarks/repro_fedauxfdp.py --seeds 3``. Runtime: 231 s wall (209 s CPU)
on 2 shared CPU cores (h0 is pretrained once per seed and reused by all methods and both alphas).

Measured (3 seeds; server test accuracy %, mean +- std):

    method          alpha=0.01     alpha=10.24
    FedAvg+P        44.5 +- 3.3    66.6 +- 4.2
    FedD+P          43.8 +- 1.9    65.9 +- 4.0
    FedAUXfdp       74.1 +- 1.7    56.8 +- 5.9
    FedD+P[prob]    71.5 +- 3.3    66.2 +- 4.4   (diagnostic, not a Table 2 baseline)

FedAUXfdp minus the best paper baseline: +29.6 points at alpha=0.01, -9.8 at alpha=10.24: the
ordering and the size of the alpha=0.01 gap match Table 2 (75.2 vs 46.0 / 41.8 for ShuffleNet);
at alpha=10.24 the baselines overtake FedAUXfdp by more than in the paper (its class heads get
eps_c only, the baselines' the whole budget, and noisy scores average over fewer teachers).
FedD+P lies within 1 point of FedAvg+P, as it must: on the shared frozen h0 the mean of the
heads' logits is the logit of the mean head, so FedD+P is a distilled FedAvg+P.

What drives the alpha=0.01 gap here. Most of it is the aggregation of Eq. 1, a mean of the
heads' *probabilities*: a single-class client's head puts almost all its probability on its
class everywhere, so averaging probabilities behaves like a vote, while averaging logits (FedD,
FedAvg) lets the heads' large class biases and noise swamp the input-dependent part. The scores
themselves add ~3 points over the equally weighted probability average (FedD+P[prob]): the share
of the normalised score weight on clients that hold the class of x is only 0.27, against 0.19
under equal weights (an oracle weighting would make the labeller ~99 % accurate). Noise-free
scores concentrate no better (0.27), nor do scores from held-out MNIST as the auxiliary data
(0.29 vs 0.17), so neither the DP noise nor the MNIST/digits28 domain gap is the cause: a
linear logistic head at lambda_s = 0.01 on unit-normalised features only separates a client's
classes from the mixed-class negatives weakly (smaller lambda_s sharpens clean scores, 0.44 at
1e-4, but the noise at the scaled eps_s then wipes them out).

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

# (trainer, label, config overrides). The last row is a diagnostic, not a paper baseline: FedD+P
# with the heads' probabilities averaged instead of their logits (FedAUXfdp's Eq. 1 averages
# probabilities), so the table separates what the scores add from what probability averaging adds.
METHODS = [("fedavg-dphead", "FedAvg+P", {}), ("fedd-dphead", "FedD+P", {}), ("fedauxfdp", "FedAUXfdp", {}),
           ("fedd-dphead", "FedD+P[prob]", {"ensemble": "probabilities"})]
BASELINES = ("FedAvg+P", "FedD+P")
ALPHAS = (0.01, 10.24)
PAPER_N_CLASS, PAPER_EPS_CLASS = 2500, 0.5          # CIFAR-10 / 20 clients, Table 2
PAPER_N_SCORE, PAPER_EPS_SCORE = 2500 + 20000, 0.1  # |D_i| + |D^-| (STL-10 100k, 20 %)

BASE = {"arch": "cnn", "width": 16, "feature_dim": 128, "pretrain_data": "all", "pretrain_epochs": 60,
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


def score_weight_on_holders(fed, scores: np.ndarray) -> tuple[float, float]:
    """Mean share of the normalised score weight on clients holding the class of x, and the share
    equal weights would give (distillation data; its labels are used here only for this diagnostic)."""
    y = fed.public.y[fed.distill]
    held = np.zeros((fed.num_clients, fed.num_classes), bool)
    for i in range(fed.num_clients):
        held[i, np.unique(fed.private.y[fed.clients[i]])] = True
    holders = held[:, y]                              # (clients, n_distill)
    w = scores / scores.sum(0, keepdims=True)
    return float((w * holders).sum(0).mean()), float(holders.mean(0).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    results: dict[str, dict[str, list[float]]] = {}
    budget_rows = []
    conc: dict[str, list[tuple[float, float]]] = {}
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
            for method, label, extra in METHODS:
                t = time.time()
                res = train(method, fed, {**cfg, **extra}, seed=seed)
                results.setdefault(label, {}).setdefault(str(alpha), []).append(res.test_accuracy)
                eps_best = res.ledger.epsilon(2e-5)
                budget_rows.append((label, alpha, seed, eps_best))
                note = ""
                if "scores" in res.artifacts:
                    w = score_weight_on_holders(fed, res.artifacts["scores"])
                    conc.setdefault(str(alpha), []).append(w)
                    note = f"  score weight on holders of y(x) {w[0]:.2f} (uniform {w[1]:.2f})"
                print(f"  seed {seed} alpha {alpha:<6} {label:<12} acc {res.test_accuracy:.3f}  labeller "
                      f"{res.rounds[0].get('labeller_test_accuracy', float('nan')):.3f}  ledger eps(best, "
                      f"delta=2e-5) {eps_best:.3f}{note}  ({time.time() - t:.0f} s)", flush=True)
    print(f"\nServer test accuracy (%), mean +- std over {args.seeds} seed(s), one round, 20 clients, "
          f"mnist5k / digits28 aux:")
    header = f"{'method':<13}" + "".join(f"{'alpha=' + str(a):>18}" for a in ALPHAS)
    print(header)
    for _, label, _ in METHODS:
        row = f"{label:<13}"
        for a in ALPHAS:
            v = 100 * np.array(results[label][str(a)])
            row += f"{v.mean():>11.1f} +- {v.std():>4.1f}"
        print(row)
    gap = {a: 100 * (np.mean(results["FedAUXfdp"][str(a)]) -
                     max(np.mean(results[b][str(a)]) for b in BASELINES)) for a in ALPHAS}
    print("FedAUXfdp minus best paper baseline (points): " +
          ", ".join(f"alpha={a}: {g:+.1f}" for a, g in gap.items()))
    print("FedD+P[prob] is a diagnostic (probabilities averaged, not FedD's logits), not a Table 2 baseline")
    for a in ALPHAS:
        w = np.array(conc[str(a)])
        print(f"FedAUXfdp, alpha={a}: mean share of the score weight on clients holding the class of x "
              f"(distillation data) {w[:, 0].mean():.2f} vs {w[:, 1].mean():.2f} under equal weights")
    worst = max(r[3] for r in budget_rows if r[0] == "FedAUXfdp")
    print(f"FedAUXfdp worst-client ledger epsilon (best accountant, delta=2e-5): {worst:.3f} vs the "
          f"basic-composition sum eps_c + eps_s")
    print(f"total time {time.time() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"schema_version": 1, "results": results, "settings": BASE}, fh, indent=2)


if __name__ == "__main__":
    main()
