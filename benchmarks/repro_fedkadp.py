"""FedKADP (Jiang et al.) Sec. 5.4 / Fig. 7 on the embedded data at one privacy budget: the paper's
numbers beside privkit's, each claim marked reproduced or not, and the corrections to the paper's
privacy accounting.

mnist5k in non-IID label shards (2 shards per client, 20 clients; the paper: MNIST, 100 clients
of 600 records), MLP 784-64-10, E = 10 DP-SGD steps per round, B = 32, lr 0.1, 10 clients per
round, sigma_0 = 2 (sigma_0 = 5 leaves every method near chance on 160-record clients), at most
``--rounds`` rounds (default 30; paper 100), every run stopped before the round that would take
any client past ``--target-epsilon`` (default 8.5) at delta = 1e-5 (privkit's per-client,
record-level Poisson-subsampled-Gaussian accounting, RDP). Rows: DP-FedAvg ("DP-FL"), FedKD+DP
(``fedkd-dp``: Wu et al.'s mentor/mentee FedKD with joint DP-SGD), FedKADP, and FedKADP without its
feedback (``feedback=false``: fixed temperature and noise; an ablation, not in the paper).

Measured (2 seeds; 254 s CPU, 731 s wall on 2 heavily shared cores), test accuracy % at target
epsilon 8.5: DP-FedAvg 72.9 +- 2.0 (30 rounds), FedKD+DP 73.5 +- 1.5 (30), FedKADP 72.5 +- 1.2
(stopped after 18 rounds), FedKADP without feedback 76.6 +- 0.2 (30). The paper's ordering
(FedKADP 85.1 > FedKD+DP 81.9 > DP-FL 76.5) does not reproduce under a sound per-client
accountant: FedKADP's decaying noise reaches the budget after fewer rounds (as the paper's 83 vs
100 updates), and the rounds it loses cost more than the feedback gains; the three methods are
within the spread over seeds of one another.

Runtime: about 4 minutes CPU for 2 seeds on one idle core.

Usage: ``python benchmarks/repro_fedkadp.py [--seeds 2] [--rounds 30] [--target-epsilon 8.5] [--json]``
"""

from __future__ import annotations

import numpy as np
import repro_common as rc
import torch

from privkit.data import FederationConfig, build_federation
from privkit.trainers import train
from privkit.trainers.dp_fedavg import paper_epsilon

SETTING = {
    "arch": "mlp",
    "feature_dim": 64,
    "local_steps": 10,
    "batch_size": 32,
    "lr": 0.1,
    "client_fraction": 0.5,
    "noise_multiplier": 2.0,
    "clip_norm": 1.0,
    "delta": 1e-5,
    "accountant": "rdp",
    "device": "auto",
}
RUNS = [
    ("DP-FedAvg (DP-FL)", "dp-fedavg", {}),
    ("FedKD+DP", "fedkd-dp", {}),
    ("FedKADP", "fedkadp", {}),
    ("FedKADP without feedback (ablation)", "fedkadp", {"feedback": False}),
]
PAPER = {"DP-FedAvg (DP-FL)": 76.5, "FedKD+DP": 81.9, "FedKADP": 85.1}  # Fig. 7 / Sec. 5.4, MNIST
PAPER_UPDATES = {"DP-FedAvg (DP-FL)": 100, "FedKD+DP": 100, "FedKADP": 83}


def main(argv=None) -> None:
    ap = rc.parser(__doc__, seeds=2)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--target-epsilon", type=float, default=8.5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    fed = build_federation(
        FederationConfig(
            dataset="mnist5k", partition="shards", clients=20, shards_per_client=2, seed=0
        )
    )
    cfg = {**SETTING, "rounds": args.rounds, "target_epsilon": args.target_epsilon}
    report = rc.Report(
        "repro_fedkadp",
        "Jiang et al., FedKADP, Sec. 5.4 / Fig. 7 (same privacy budget)",
        {**cfg, "clients": 20, "partition": "2 label shards per client", "seeds": args.seeds},
    )
    acc: dict[str, list[float]] = {}
    info: dict[str, list[dict]] = {}
    for seed in range(args.seeds):
        for label, method, extra in RUNS:
            res = train(method, fed, {**cfg, **extra}, seed=seed)
            acc.setdefault(label, []).append(res.test_accuracy)
            info.setdefault(label, []).append(
                {
                    "rounds": len(res.rounds),
                    "epsilon_rdp": res.ledger.epsilon(1e-5, accountant="rdp"),
                    "paper_formula": res.claims.get("epsilon")
                    if method == "fedkadp" or method == "dp-fedavg"
                    else None,
                }
            )
            rc.log(
                args, f"seed {seed} {label}: {res.test_accuracy:.3f} after {len(res.rounds)} rounds"
            )
    for label, _, _ in RUNS:
        rows = info[label]
        report.row(
            label,
            acc[label],
            PAPER.get(label),
            rounds=float(np.mean([r["rounds"] for r in rows])),
            paper_updates=PAPER_UPDATES.get(label),
            epsilon_rdp=float(max(r["epsilon_rdp"] for r in rows)),
        )
    report.order_claim(
        "FedKADP", "FedKD+DP", 85.1, 81.9, note="same target epsilon, privkit's accounting"
    )
    report.order_claim("FedKD+DP", "DP-FedAvg (DP-FL)", 81.9, 76.5)
    report.order_claim("FedKADP", "DP-FedAvg (DP-FL)", 85.1, 76.5)
    r_kadp = report.rows[2]["rounds"]
    r_fixed = report.rows[3]["rounds"]
    report.claim(
        "FedKADP's decaying noise spends the budget in fewer rounds",
        "83 vs 100 updates",
        f"{r_kadp:.0f} vs {r_fixed:.0f} rounds (without feedback)",
        r_kadp < r_fixed,
    )
    privacy_arithmetic(report)
    rc.emit(report, args)


def privacy_arithmetic(report: rc.Report) -> None:
    """The paper's RDP formula against a sound per-client accountant, at the paper's own settings."""
    from accountants import dpsgd_epsilon

    T, E, s, delta, n_per_round = 100, 20, 0.1, 1e-5, 10
    paper = {
        sig: paper_epsilon([sig] * T, s, E, delta, n=n_per_round)[0] for sig in (5.0, 10.0, 15.0)
    }
    report.arithmetic(
        "the paper's formula (Sec. 4.1-4.2), T=100, E=20, s=0.1, 10 clients per round",
        ", ".join(f"sigma {k:g}: epsilon {v:.2f}" for k, v in paper.items()),
        "a floor that more noise does not lower: the min{2, .} terms do not shrink with sigma",
        "the formula is not a sound bound (privkit's trainer lists why)",
    )
    q = 32 / 600  # record-level rate of a 600-record client with B = 32
    sound = dpsgd_epsilon(q, 5.0, T * E, delta, accountant="rdp")
    report.arithmetic(
        "per-client record-level accounting, sigma 5, a client in every round (worst case)",
        "uses s (client sampling) as the record-level rate, divides the variance by the "
        "number of clients (trusted aggregator), and WBK19's replace-one bound with the "
        "add/remove RDP j/(2 sigma^2)",
        f"epsilon {sound:.2f} (Poisson rate q = B/n = {q:.3f}, {T * E} steps, RDP, delta {delta:g})",
        "privkit records each round a client takes part in as E Poisson-subsampled Gaussian steps",
    )


if __name__ == "__main__":
    main()
