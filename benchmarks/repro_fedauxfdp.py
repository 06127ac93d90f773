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

Command: ``python benchmarks/repro_fedauxfdp.py --seeds 3``. Runtime: 231 s wall (209 s CPU)
on 2 shared CPU cores (h0 is pretrained once per seed and reused by all methods and both alphas);
a later run with the same numbers took ~20 minutes wall on the same machine under heavy load.

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

Usage: ``python benchmarks/repro_fedauxfdp.py [--seeds 3] [--json] [--out out.json] [--progress]``
"""

from __future__ import annotations

import numpy as np
import repro_common as rc
import torch

from privkit.data import FederationConfig, build_federation
from privkit.trainers import train

# (trainer, label, config overrides). The last row is a diagnostic, not a paper baseline: FedD+P
# with the heads' probabilities averaged instead of their logits (FedAUXfdp's Eq. 1 averages
# probabilities), so the table separates what the scores add from what probability averaging adds.
METHODS = [
    ("fedavg-dphead", "FedAvg+P", {}),
    ("fedd-dphead", "FedD+P", {}),
    ("fedauxfdp", "FedAUXfdp", {}),
    ("fedd-dphead", "FedD+P[prob]", {"ensemble": "probabilities"}),
]
BASELINES = ("FedAvg+P", "FedD+P")
ALPHAS = (0.01, 10.24)
PAPER_N_CLASS, PAPER_EPS_CLASS = 2500, 0.5  # CIFAR-10 / 20 clients, Table 2
PAPER_N_SCORE, PAPER_EPS_SCORE = 2500 + 20000, 0.1  # |D_i| + |D^-| (STL-10 100k, 20 %)

BASE = {
    "arch": "cnn",
    "width": 16,
    "feature_dim": 128,
    "pretrain_data": "all",
    "pretrain_epochs": 60,
    "class_lambda": 0.1,
    "score_lambda": 0.01,
    "class_delta": 1e-5,
    "score_delta": 1e-5,
    "calibration": "classic",
    "sensitivity_bound": "paper",
    "student_epochs": 10,
    "student_lr": 1e-2,
    "student_freeze": True,
    "keep_client_models": False,
}


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
    holders = held[:, y]  # (clients, n_distill)
    w = scores / scores.sum(0, keepdims=True)
    return float((w * holders).sum(0).mean()), float(holders.mean(0).mean())


PAPER = {
    0.01: {"FedAvg+P": 46.0, "FedD+P": 41.8, "FedAUXfdp": 75.2},  # Table 2, ShuffleNet
    10.24: {"FedAvg+P": 74.1, "FedD+P": 72.3, "FedAUXfdp": 71.7},
}


def main(argv=None) -> None:
    ap = rc.parser(__doc__, seeds=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    report = rc.Report(
        "repro_fedauxfdp",
        "Hoech et al., FedAUXfdp, Table 2 (one-shot, 20 clients)",
        {**BASE, "alphas": list(ALPHAS), "seeds": args.seeds},
    )
    results: dict[tuple[float, str], list[float]] = {}
    conc: dict[float, list[tuple[float, float]]] = {}
    eps_ledger: dict[str, list[float]] = {}
    scaling = None
    for seed in range(args.seeds):
        for alpha in ALPHAS:
            fed = build_federation(
                FederationConfig(
                    dataset="mnist5k", public_dataset="digits28", clients=20, alpha=alpha, seed=seed
                )
            )
            eps_c, eps_s, info = scaled_epsilons(fed)
            scaling = scaling or {**info, "eps_class": eps_c, "eps_score": eps_s}
            cfg = {**BASE, "class_epsilon": eps_c, "score_epsilon": eps_s}
            for method, label, extra in METHODS:
                res = train(method, fed, {**cfg, **extra}, seed=seed)
                results.setdefault((alpha, label), []).append(res.test_accuracy)
                eps_ledger.setdefault(label, []).append(res.ledger.epsilon(2e-5))
                if "scores" in res.artifacts:
                    conc.setdefault(alpha, []).append(
                        score_weight_on_holders(fed, res.artifacts["scores"])
                    )
                rc.log(args, f"seed {seed} alpha {alpha} {label}: {res.test_accuracy:.3f}")
    report.setting["epsilon_scaling"] = scaling
    for (alpha, label), v in results.items():
        extra = {}
        if label == "FedAUXfdp":
            w = np.array(conc[alpha])
            extra = {"routing": float(w[:, 0].mean()), "uniform": float(w[:, 1].mean())}
        report.row(f"{label}, alpha={alpha:g}", v, PAPER[alpha].get(label), **extra)
    for alpha in ALPHAS:
        for base in BASELINES:
            if alpha == 0.01:
                report.order_claim(
                    f"FedAUXfdp, alpha={alpha:g}",
                    f"{base}, alpha={alpha:g}",
                    PAPER[alpha]["FedAUXfdp"],
                    PAPER[alpha][base],
                )
            else:
                report.order_claim(
                    f"{base}, alpha={alpha:g}",
                    f"FedAUXfdp, alpha={alpha:g}",
                    PAPER[alpha][base],
                    PAPER[alpha]["FedAUXfdp"],
                    note="the baselines catch up and overtake FedAUXfdp at low heterogeneity",
                )
    gap = report.mean("FedAUXfdp, alpha=0.01") - max(
        report.mean(f"{b}, alpha=0.01") for b in BASELINES
    )
    report.claim(
        "FedAUXfdp's margin at alpha=0.01 >= 20 points",
        "75.2 - 46.0 = 29.2",
        f"{gap:.1f}",
        gap >= 20,
    )
    d = report.mean("FedD+P, alpha=0.01") - report.mean("FedAvg+P, alpha=0.01")
    report.claim(
        "FedD+P within a few points of FedAvg+P (distilled mean head)",
        "41.8 vs 46.0",
        f"{d:+.1f} points",
        abs(d) <= 5.0,
    )
    worst = max(eps_ledger["FedAUXfdp"])
    report.arithmetic(
        "the embedded run's budget",
        f"eps_c + eps_s = {scaling['eps_class'] + scaling['eps_score']:.2f} "
        "(basic composition, classic calibration at the scaled epsilons)",
        f"ledger epsilon (best accountant, delta 2e-5): {worst:.3f} (worst client, FedAUXfdp)",
        "the classic formula is outside its stated range at epsilon >= 1",
    )
    privacy_arithmetic(report)
    rc.emit(report, args)


def privacy_arithmetic(report: rc.Report) -> None:
    """The paper's composition (0.5 + 0.1 by basic composition), the classic formula at epsilon=1,
    and Theorem 1's sqrt(C)."""
    import math

    from accountants import analytic_gaussian_delta, calibrate_gaussian, gaussian_epsilon

    z_c = calibrate_gaussian(
        0.5, 1e-5, 1.0, method="classic"
    ).sigma  # noise multipliers (sigma / sensitivity)
    z_s = calibrate_gaussian(0.1, 1e-5, 1.0, method="classic").sigma
    z = 1.0 / math.sqrt(1.0 / z_c**2 + 1.0 / z_s**2)  # two Gaussians compose into one (exactly)
    report.arithmetic(
        "cumulative loss of the class head (0.5, 1e-5) and the scores (0.1, 1e-5), classic",
        "(0.6, 2e-5) by basic composition (Sec. 4.3)",
        f"({gaussian_epsilon(z, 2e-5, 1.0, method='analytic'):.3f}, 2e-5) exact: the two Gaussian "
        f"releases (noise multipliers {z_c:.3g}, {z_s:.3g}) are one Gaussian of multiplier {z:.3g}",
        "basic composition is sound but loose; privkit's ledger composes exactly (PLD/RDP)",
    )
    z1 = calibrate_gaussian(1.0, 1e-5, 1.0, method="classic").sigma
    report.arithmetic(
        "class epsilon 1.0 (Table 3 / Fig. 2) with the classic formula",
        "(1.0, 1e-5): classic Gaussian, stated for epsilon < 1",
        f"exact delta at epsilon 1 for multiplier {z1:.3g}: {analytic_gaussian_delta(z1, 1.0, 1.0):.2g} "
        "<= 1e-5: the claim holds, its justification does not",
        "privkit's default calibration is analytic (Balle & Wang 2018)",
    )
    report.arithmetic(
        "Theorem 1's class-head sensitivity 2 sqrt(C)/(lambda n)",
        "2 sqrt(10)/(lambda n) for C = 10",
        f"2 sqrt(2)/(lambda n) for every C (proof in privkit.trainers.heads): "
        f"{math.sqrt(10 / 2):.2f}x less noise at C = 10",
        "choosing C from a client's own labels ('fewer classes, less noise') is data-dependent",
    )


if __name__ == "__main__":
    main()
