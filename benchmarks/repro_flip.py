"""FLiP (Xu et al.) Tables I and II on the embedded data: the paper's numbers beside privkit's, each
claim marked reproduced or not.

Table I (accuracy): mnist5k, 5 IID clients (as the paper) of 640 records, test 1000 images; an MLP
with 64 hidden units (paper: TinyResNet / AlexNet / ConvNet); FLiP ``--rounds`` rounds (default
10; paper 100) of Eps = 10 local epochs (paper 30), Adam step 0.05 (paper 0.01, larger for the
fewer outer steps), k in ``--ks`` distilled samples per class (default 1, 2, 5; paper 10, 15, 20:
the unroll through K = 10 k samples, one sample per step, dominates the cost); vanilla FedAvg on
the same MLP and split, all clients every round, ``--rounds`` rounds of 2 local epochs.

Table II (task-irrelevant attribute inference, Sec. V-A) with the paper's protocol and attacker:
four binary FLiP runs (p1,s1), (p1,s2), (p2,s1), (p2,s2) on the same clients (p1=0, p2=1, s1=3,
s2=8), psi_{s1-s2} trained on every round's distilled samples of the p1 runs and tested on those of
the p2 runs, with CatBoost (depth 1, ``--iterations``, paper 10 000). Binary runs use
``--table2-k`` samples per class (default 5; paper 20) and ``--table2-rounds`` rounds of 5 local
epochs. A positive control runs the same attacker on the p2 runs' raw s1/s2 images: it must be
far above 50 %, or a 50 % on distilled data would say nothing. It trains on the clients'
raw s1/s2 images and is tested on the test set's.

Measured (1 seed, defaults; 563 s wall on 2 heavily shared cores): vanilla FedAvg 89.9 %, FLiP
75.3 / 85.3 / 87.1 % at k = 1 / 2 / 5 (rises with k; 2.8 points below vanilla at k = 5); Table II
attack 48.8 % (95 % CI [44.3, 53.3], 500 distilled test samples from 5 rounds x 5 clients x 2 runs),
positive control 93.2 %: the claim (attack at chance) reproduces on MNIST.

Usage: ``python benchmarks/repro_flip.py [--seeds 1] [--ks 1,2,5] [--rounds 10] [--json] [--out f.json]``
"""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import repro_common as rc
import torch

from attacks.attribute import AttributeInferenceAttack
from privkit.audit.instantiations import flip_table2_attack, table2_classifier
from privkit.data import FederationConfig, build_federation
from privkit.trainers import train

MODEL = {"arch": "mlp", "feature_dim": 64, "device": "cpu"}
PAPER_MNIST = {"vanilla FL": 99.03, 10: 95.56, 15: 95.51, 20: 95.17}  # Table I, MNIST, TinyResNet
PAPER_TABLE2 = [46.88, 48.38, 49.94, 50.00, 50.00, 54.69]  # Table II, CIFAR-10 rows 1-6


def table1(report: rc.Report, fed, args) -> None:
    acc: dict[str, list[float]] = {}
    for seed in range(args.seeds):
        res = train(
            "fedavg",
            fed,
            {**MODEL, "rounds": args.rounds, "participation": 1.0, "local_epochs": 2},
            seed=seed,
        )
        acc.setdefault("vanilla FL (FedAvg)", []).append(res.test_accuracy)
        rc.log(args, f"seed {seed} FedAvg {res.test_accuracy:.3f}")
        for k in args.ks:
            res = train(
                "flip", fed, {**MODEL, "k": k, "rounds": args.rounds, "local_epochs": 10}, seed=seed
            )
            acc.setdefault(f"FLiP k={k}", []).append(res.test_accuracy)
            rc.log(args, f"seed {seed} FLiP k={k} {res.test_accuracy:.3f}")
    report.row("vanilla FL (FedAvg)", acc["vanilla FL (FedAvg)"], PAPER_MNIST["vanilla FL"])
    for k in args.ks:
        report.row(f"FLiP k={k}", acc[f"FLiP k={k}"], PAPER_MNIST.get(k))
    means = [report.mean(f"FLiP k={k}") for k in args.ks]
    rising = all(b >= a for a, b in pairwise(means))
    report.claim(
        "accuracy rises with k",
        "95.56 / 95.51 / 95.17 at k=10/15/20 on MNIST (TinyResNet): "
        "the paper's own MNIST row falls; +0.12 points per 5 samples on average",
        " / ".join(f"{m:.1f}" for m in means) + f" at k={args.ks}",
        rising,
    )
    gap = report.mean("vanilla FL (FedAvg)") - means[-1]
    report.claim(
        "FLiP within 5 points of vanilla FL",
        "99.03 vs 95.56 (k=10, TinyResNet MNIST): 3.5",
        f"{gap:.1f} points at k={args.ks[-1]}",
        gap <= 5.0,
        "privkit's k is far below the paper's 10-20 (CPU)",
    )


def table2(report: rc.Report, fed, args) -> None:
    p1, p2, s1, s2 = 0, 1, 3, 8
    attack = {
        "catboost_iterations": args.iterations,
        "table2_rounds": "all",
        "table2_classifier": "catboost",
    }
    cfg = {
        **MODEL,
        "k": args.table2_k,
        "rounds": args.table2_rounds,
        "local_epochs": 5,
        "attack": attack,
    }
    accs, controls = [], []
    for seed in range(args.seeds):
        res = flip_table2_attack(fed, cfg, p1=p1, p2=p2, s1=s1, s2=s2, seed=seed)
        accs.append(res.accuracy)
        # positive control: the same attacker on raw images (clients' s1/s2 images -> test images)
        x, y = fed.pooled_arrays()
        xt, yt = fed.test_arrays()
        tr, te = np.isin(y, (s1, s2)), np.isin(yt, (s1, s2))
        att = AttributeInferenceAttack(
            classifier=table2_classifier(attack, seed), random_state=seed
        )
        att.fit(x[tr].reshape(tr.sum(), -1), (y[tr] == s2).astype(int))
        ctrl = att.evaluate(xt[te].reshape(te.sum(), -1), (yt[te] == s2).astype(int), chance=0.5)
        controls.append(ctrl.accuracy)
        rc.log(
            args,
            f"seed {seed} Table II attack {res.accuracy:.3f} [{res.ci_low:.3f}, {res.ci_high:.3f}] "
            f"control {ctrl.accuracy:.3f}",
        )
        last = res
    report.row(
        f"Table II attack accuracy (p={p1}/{p2}, s={s1}/{s2}), every round's release, CatBoost",
        accs,
        float(np.mean(PAPER_TABLE2)),
        ci_low=last.ci_low,
        ci_high=last.ci_high,
        n_test=last.n_test,
    )
    report.row("Table II positive control: same attacker on raw s1/s2 images", controls, None)
    mean, ctrl = report.rows[-2]["privkit_mean"], report.rows[-1]["privkit_mean"]
    report.claim(
        "task-irrelevant attribute attack at chance (about 50 %)",
        "46.9-54.7 on CIFAR-10 (mean 50.0); 50.0-63.4 on CIFAR-100",
        f"{mean:.1f} (95% CI of last seed [{100 * last.ci_low:.1f}, {100 * last.ci_high:.1f}])",
        last.ci_low <= 0.5 <= last.ci_high or mean <= 55.0,
        f"positive control {ctrl:.1f}: the attacker itself separates s1 from s2",
    )
    report.arithmetic(
        "FLiP's privacy claim",
        "none (no formal DP; 'principle of least privilege')",
        "privkit's ledger: epsilon = inf (distilled data shared in the clear every round)",
    )
    report.arithmetic(
        "Table II internal consistency",
        "beetle-bear 88.00 (row 8) and 92.50 (row 11); "
        "chair-bed 88.00 (rows 7, 10) and 96.50 (row 12)",
        "the same binary task has two accuracies in the table",
        "",
    )


def main(argv=None) -> None:
    ap = rc.parser(__doc__, seeds=1)
    ap.add_argument("--ks", default="1,2,5")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument(
        "--iterations", type=int, default=10_000, help="CatBoost iterations (paper 10 000)"
    )
    ap.add_argument("--table2-k", type=int, default=5)
    ap.add_argument("--table2-rounds", type=int, default=5)
    args = ap.parse_args(argv)
    args.ks = [int(k) for k in args.ks.split(",")]
    torch.set_num_threads(1)
    fed = build_federation(
        FederationConfig(
            dataset="mnist5k", public_dataset="digits28", clients=5, partition="iid", seed=0
        )
    )
    report = rc.Report(
        "repro_flip",
        "Xu et al., FLiP, Tables I-II (5 IID clients)",
        {
            **MODEL,
            "clients": 5,
            "records_per_client": int(np.mean([len(c) for c in fed.clients])),
            "rounds": args.rounds,
            "ks": args.ks,
            "table2_k": args.table2_k,
            "table2_rounds": args.table2_rounds,
            "catboost_iterations": args.iterations,
            "seeds": args.seeds,
        },
    )
    table1(report, fed, args)
    table2(report, fed, args)
    rc.emit(report, args)


if __name__ == "__main__":
    main()
