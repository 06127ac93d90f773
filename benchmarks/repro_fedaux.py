"""FedAUX (Sattler et al.) Table 1 on the embedded data: the paper's numbers beside privkit's, each
claim marked reproduced or not, and why the headline does (not) reproduce.

Setting: 20 clients holding ``mnist5k`` (FedAUX's balanced Dirichlet split), ``digits28`` as
auxiliary data (20 % negatives D^-, 80 % distillation, ~1.4k images), C = 0.4, ``--rounds`` rounds
(default 5) of 10 local epochs (Adam 1e-3, batch 32; one epoch over ~160 records is 5 steps and
leaves every method at chance after a few rounds), distillation 5 epochs of Adam 1e-4 (FedAUX
Table 8's best step at alpha=0.01; the paper's single epoch at 5e-5 is ~625 steps on 80k STL-10
images, 12 here), every "+P" model started from the same SimCLR h0 (20 epochs on all of digits28).
Model: a 784-64-10 MLP (``--arch cnn`` for a 2-conv CNN; the paper: ResNet-8 on CIFAR-10).
Paper: Table 1, C = 0.4, T = 100, maximum accuracy over rounds; privkit reports the maximum over
its rounds too.

Rows at alpha = 0.01 (and FedAvg+P / FedAUX at alpha = 100):

* FedAUX (default): privkit's defaults: lambda = 0.1 (the paper's main text), score epsilon 4
  (the paper's 0.1 scaled by n eps: noise ~ 1/(lambda n eps), n = |D_i| + |D^-| ~ 520 here against
  22 500), analytic Gaussian.
* FedAUX (sharp scores): lambda = 1e-3 at epsilon 40: the regime of the official code, whose
  scikit-learn ``C = 1/lambda`` is the paper's objective at lambda / N (sharp scores).
* FedAUX (non-DP sharp scores): the same head without noise (the official code's noise is N times
  too small, see the privacy arithmetic).
* FedAUX (oracle weights): diagnostic, not a method: weight 1 for every client that holds the
  point's class (the public label), 0 otherwise; the best any certainty score could do.

Diagnostics per FedAUX row: ``routing`` = mean weight share the scores give to clients that hold
the distillation point's class (``uniform`` = the share of equal weights); ``labeller`` = accuracy
of the last round's soft labels on the distillation set's public labels.

Measured (3 seeds, MLP, 5 rounds; maximum test accuracy %, mean +- std):

    row (alpha = 0.01)                 paper   privkit       routing  labeller
    FedAvg                             23.6    32.6 +- 3.4
    FedAvg+P                           32.1    33.3 +- 2.0
    FedDF+P                            39.3    24.8 +- 3.8            0.11
    FedAUX (lambda 0.1, eps 4)         71.2    30.4 +- 2.3   0.20     0.18   (uniform 0.19)
    FedAUX (lambda 1e-3, eps 40)        -      39.9 +- 3.3   0.34     0.41
    FedAUX (lambda 1e-3, no DP)         -      41.5 +- 3.2   0.35     0.44
    FedAUX (oracle weights)             -      46.3 +- 3.4   1.00     0.81
    alpha = 100: FedAvg+P 89.9 +- 0.7, FedAUX 89.8 +- 0.7 (paper 89.5, 89.0)

Why the headline does not reproduce at privkit's defaults: at lambda = 0.1 the scoring heads are
so regularised that the scores hardly route (0.20 of the weight on the clients holding a point's
class, against 0.19 for equal weights), so FedAUX is FedDF with near-equal weights, and FedDF's
mean-logit ensemble of single-class models labels only 11 % of the distillation set correctly.
The official code fits ``LogisticRegression(C=1/lambda)`` with lambda = 0.01, i.e. the paper's
objective at lambda / N: sharp scores, with noise calibrated N times too small for that head (see
the privacy arithmetic). Sharp scores (lambda 1e-3) route 0.34 of the weight and lift FedAUX
above FedAvg+P, but under correct DP they need epsilon ~40 here. Even oracle weights stop at ~46 %:
distilling a labeller that is right on 81 % of 1.4k digits28 images transfers only part of it to
MNIST, so the paper's 39-point margin is out of reach at this scale.

Runtime: 340 s wall for 3 seeds on 2 heavily shared cores (MLP); ``--arch cnn`` about 5x longer.

Usage: ``python benchmarks/repro_fedaux.py [--seeds 3] [--rounds 5] [--arch mlp] [--json] [--out f.json]``
"""

from __future__ import annotations

import numpy as np
import repro_common as rc
import torch

from privkit.data import FederationConfig, build_federation
from privkit.trainers import fedaux as fedaux_module
from privkit.trainers import train

PAPER = {
    0.01: {"FedAvg": 23.6, "FedAvg+P": 32.1, "FedDF+P": 39.3, "FedAUX": 71.2},
    100.0: {"FedAvg+P": 89.5, "FedDF+P": 88.9, "FedAUX": 89.0},
}
DISTILL = {"distill_epochs": 5, "distill_lr": 1e-4, "distill_batch_size": 128}
SHARP = {"score_lambda": 1e-3, "score_epsilon": 40.0}


def common(args) -> dict:
    return {
        "arch": args.arch,
        "width": 16,
        "feature_dim": 64 if args.arch == "mlp" else 128,
        "pretrain": True,
        "pretrain_data": "all",
        "pretrain_epochs": 20,
        "pretrain_seed": 0,
        "participation": 0.4,
        "local_epochs": 10,
        "batch_size": 32,
        "lr": 1e-3,
        "rounds": args.rounds,
        "keep_client_models": False,
    }


def holders(fed) -> np.ndarray:
    """(clients, distill points): does the client hold the point's class?"""
    held = np.stack(
        [
            np.bincount(fed.client_arrays(i)[1], minlength=fed.num_classes) > 0
            for i in range(fed.num_clients)
        ]
    )
    return held[:, fed.public.y[fed.distill]]


class OracleScores:
    """Context manager: FedAUX's score release replaced by the oracle weights (a diagnostic)."""

    def __init__(self, weights: np.ndarray):
        self.weights, self.real = weights, fedaux_module.release_scoring_heads

    def __enter__(self):
        def patched(*a, **k):
            rel = self.real(*a, **k)
            rel.scores = self.weights.astype(float) + 1e-8
            return rel

        fedaux_module.release_scoring_heads = patched

    def __exit__(self, *exc):
        fedaux_module.release_scoring_heads = self.real


def diagnostics(res, fed, held: np.ndarray) -> dict:
    out = {"uniform": float(held.mean())}
    if "scores" in res.artifacts:
        s = res.artifacts["scores"].astype(np.float64)
        out["routing"] = float(((s / s.sum(0, keepdims=True)) * held).sum(0).mean())
    if "soft_labels" in res.artifacts:
        out["labeller"] = float(
            (res.artifacts["soft_labels"].argmax(1) == fed.public.y[fed.distill]).mean()
        )
    return out


def runs(alpha: float) -> list[tuple[str, str, dict]]:
    if alpha != 0.01:
        return [("FedAvg+P", "fedavg", {}), ("FedAUX", "fedaux", DISTILL)]
    return [
        ("FedAvg", "fedavg", {"pretrain": False}),
        ("FedAvg+P", "fedavg", {}),
        ("FedDF+P", "feddf", DISTILL),
        ("FedAUX", "fedaux", DISTILL),
        ("FedAUX (sharp scores, eps 40)", "fedaux", {**DISTILL, **SHARP}),
        ("FedAUX (sharp scores, no DP)", "fedaux", {**DISTILL, **SHARP, "score_dp": False}),
        ("FedAUX (oracle weights)", "fedaux", {**DISTILL, "score_dp": False}),
    ]


def main(argv=None) -> None:
    ap = rc.parser(__doc__, seeds=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--arch", choices=["mlp", "cnn"], default="mlp")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    report = rc.Report(
        "repro_fedaux",
        "Sattler et al., FedAUX, Table 1 (20 clients, C=0.4)",
        {
            **common(args),
            **DISTILL,
            "clients": 20,
            "dataset": "mnist5k",
            "auxiliary": "digits28",
            "seeds": args.seeds,
            "sharp": SHARP,
        },
    )
    values: dict[tuple[float, str], list[float]] = {}
    diag: dict[tuple[float, str], list[dict]] = {}
    for alpha in (0.01, 100.0):
        for seed in range(args.seeds):
            fed = build_federation(FederationConfig(clients=20, alpha=alpha, seed=seed))
            held = holders(fed)
            for label, method, extra in runs(alpha):
                cfg = {**common(args), **extra}
                if label.endswith("(oracle weights)"):
                    with OracleScores(held):
                        res = train(method, fed, cfg, seed=seed)
                else:
                    res = train(method, fed, cfg, seed=seed)
                best = max(r["test_accuracy"] for r in res.rounds)
                values.setdefault((alpha, label), []).append(best)
                if method == "fedaux" or method == "feddf":
                    diag.setdefault((alpha, label), []).append(diagnostics(res, fed, held))
                rc.log(
                    args,
                    f"alpha {alpha} seed {seed} {label}: max {best:.3f} final {res.test_accuracy:.3f}",
                )
    for (alpha, label), v in values.items():
        d = diag.get((alpha, label), [])
        extra = {k: float(np.mean([x[k] for x in d])) for k in (d[0] if d else {})}
        report.row(f"{label}, alpha={alpha:g}", v, PAPER[alpha].get(label), **extra)

    a = "alpha=0.01"
    report.order_claim(
        f"FedAvg+P, {a}", f"FedAvg, {a}", 32.1, 23.6, claim="pretrained h0 helps (+P)"
    )
    report.order_claim(
        f"FedAUX, {a}",
        f"FedDF+P, {a}",
        71.2,
        39.3,
        note="privkit defaults (lambda 0.1, scaled epsilon)",
    )
    report.order_claim(
        f"FedAUX, {a}",
        f"FedAvg+P, {a}",
        71.2,
        32.1,
        note="privkit defaults (lambda 0.1, scaled epsilon)",
    )
    report.order_claim(
        f"FedAUX (sharp scores, eps 40), {a}",
        f"FedAvg+P, {a}",
        71.2,
        32.1,
        claim="FedAUX > FedAvg+P with sharp scores",
        note="lambda 1e-3 at epsilon 40: what the official code's regularisation amounts to",
    )
    report.order_claim(f"FedDF+P, {a}", f"FedAvg+P, {a}", 39.3, 32.1)
    gain = report.mean(f"FedAUX (sharp scores, eps 40), {a}") - report.mean(f"FedAvg+P, {a}")
    report.claim(
        "margin FedAUX - FedAvg+P >= 20 points at alpha=0.01",
        "71.2 - 32.1 = 39.1",
        f"{gain:.1f} (sharp scores)",
        gain >= 20.0,
        "bounded here by distillation on 1.4k digits28 images: see the oracle row",
    )
    gap = report.mean("FedAUX, alpha=100") - report.mean("FedAvg+P, alpha=100")
    report.claim(
        "alpha=100: FedAUX within 1 point of FedAvg+P",
        "89.0 vs 89.5",
        f"{gap:+.1f} points",
        abs(gap) <= 1.0,
    )
    privacy_arithmetic(report)
    rc.emit(report, args)


def privacy_arithmetic(report: rc.Report) -> None:
    """Eq. 10's |D_aux| for |D^-|, and the official code's noise N times too small."""
    from accountants import calibrate_gaussian, gaussian_epsilon

    delta, eps, lam = 1e-5, 0.1, 0.1
    n_i, n_aux = 2500, 100_000  # CIFAR-10 over 20 clients; STL-10's unlabelled split
    n_neg = n_aux // 5
    thm = 2.0 / (lam * (n_i + n_neg))
    s_eq10 = calibrate_gaussian(eps, delta, 2.0 / (lam * (n_i + n_aux)), method="classic").sigma
    s_thm = calibrate_gaussian(eps, delta, thm, method="classic").sigma
    report.arithmetic(
        "Eq. 10 calibrates sigma with |D_i|+|D_aux| where Thm 1 needs |D_i|+|D^-| "
        f"(|D_i|={n_i}, |D_aux|={n_aux}, |D^-|={n_neg})",
        f"epsilon {eps} (sigma {s_eq10:.4g})",
        f"epsilon {gaussian_epsilon(s_eq10, delta, thm, method='analytic'):.3g} at that sigma; "
        f"sigma must be {s_thm / s_eq10:.2f}x larger for {eps}",
        "privkit uses |D_i|+|D^-| (Alg. 1, Thm 1)",
    )
    lam_code, n = 0.01, n_i + n_neg
    sens_code = 2.0 / (n * lam_code)  # what fl_devices.py calibrates to
    sens_true = 2.0 / lam_code  # LogisticRegression(C=1/lam) minimises J at lambda/N
    s_code = calibrate_gaussian(eps, delta, sens_code, method="classic").sigma
    report.arithmetic(
        "official code: LogisticRegression(C=1/lambda) solves the paper's objective at "
        f"lambda/N (N={n}), whose sensitivity is 2/lambda, but adds noise for 2/(N lambda)",
        f"epsilon {eps} (sigma {s_code:.4g}, lambda {lam_code})",
        f"epsilon {gaussian_epsilon(s_code, delta, sens_true, method='analytic'):.4g} at that "
        f"sigma (noise {n}x too small)",
        "privkit solves J with lambda exactly (L-BFGS) and calibrates to 2/(lambda n)",
    )


if __name__ == "__main__":
    main()
