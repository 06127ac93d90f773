"""A hand-made report covering every section: DP and non-DP methods, a personalised method,
a failed method, attacks with ROC points and an attack that errored."""

from __future__ import annotations

import math

import pytest

from reports import (
    AttackResult,
    AttributeResult,
    AuditSummary,
    DatasetSummary,
    MethodReport,
    PaperClaim,
    PrivacyAccounting,
    PrivacyReport,
    ReportWarning,
    Roc,
    RunMetadata,
    StageStatus,
    ThreatModel,
    Utility,
    Verdict,
)

DONE = {s: StageStatus(state="done", seconds=1.0) for s in ("train", "account", "audit", "report")}


def _attack(auc: float, lb: float, n: int = 200) -> AttackResult:
    # a concave ROC curve through (0,0) and (1,1) with the given area-ish shape
    fpr = [0.0, 0.001, 0.01, 0.05, 0.1, 0.3, 0.6, 1.0]
    power = (1 - auc) / auc
    tpr = [f**power for f in fpr]
    return AttackResult(
        auc=auc,
        balanced_accuracy=0.5 + (auc - 0.5) / 2,
        advantage=auc - 0.5,
        tpr_at_fpr={"0.001": tpr[1], "0.01": tpr[2]},
        epsilon_lower_bound=lb,
        ceiling=math.log(n) - 0.5,
        confidence=0.95,
        delta=1e-5,
        n_trials=n,
        roc=Roc(fpr=fpr, tpr=tpr),
        notes="hand-made",
    )


def make_report() -> PrivacyReport:
    dp = MethodReport(
        name="fedauxfdp",
        method="fedauxfdp",
        summary="FedAUX with DP scores and heads.",
        paper="Sattler et al. 2022",
        formal_dp=True,
        seed=0,
        config={"epsilon": 1.0, "lr": 0.01},
        utility=Utility(
            test_accuracy=0.71,
            rounds=[{"round": r, "test_accuracy": 0.5 + 0.05 * r} for r in range(1, 5)],
        ),
        privacy=PrivacyAccounting(
            delta=1e-5,
            accountants=["pld", "rdp"],
            primary_accountant="pld",
            worst={"pld": 1.2, "rdp": 1.5},
            clients={"0": {"pld": 1.2, "rdp": 1.5}, "1": {"pld": 0.9, "rdp": 1.1}},
            epsilon_over_rounds=[(1, 0.3), (2, 0.6), (3, 0.9), (4, 1.2)],
            neighbouring=["add_remove"],
            labels=["scores", "class-head"],
            claim=PaperClaim(epsilon=0.6, delta=2e-5, composition="basic", source="Table 2"),
            epsilon_at_claim_delta=1.15,
        ),
        audit=AuditSummary(
            attacks={
                "loss": _attack(0.52, 0.0),
                "shadow": _attack(0.55, 0.1),
                "lira": AttackResult(error="needs >= 4 shadows; found 2"),
            },
            attribute={
                "label": AttributeResult(
                    accuracy=0.3, ci_low=0.25, ci_high=0.35, chance=0.1, n_test=300
                )
            },
            accounted_epsilon=1.2,
            delta=1e-5,
            shadows=2,
            verdict=Verdict(status="consistent", message="0.1 <= 1.2"),
        ),
        verdict=Verdict(
            status="consistent",
            message="lower bound 0.1 <= accounted 1.2",
            epsilon_lower_bound=0.05,
            epsilon_ceiling=3.81,
            detectable_epsilon=1.62,
            accounted_epsilon=1.2,
            confidence=0.95,
            correction="Bonferroni over 2 attack(s)",
        ),
        warnings=[
            ReportWarning(
                code="classic_gaussian_eps_ge_1",
                source="trainer",
                message="classic Gaussian at epsilon = 1.0 (valid for < 1)",
            )
        ],
        stages=dict(DONE),
    )
    nondp = MethodReport(
        name="fedavg",
        method="fedavg",
        summary="Federated averaging.",
        formal_dp=False,
        utility=Utility(test_accuracy=0.85),
        privacy=PrivacyAccounting(
            delta=1e-5,
            accountants=["pld"],
            primary_accountant="pld",
            worst={"pld": math.inf},
            clients={"0": {"pld": math.inf}},
        ),
        audit=AuditSummary(
            attacks={"loss": _attack(0.62, 0.8)},
            shadows=2,
            verdict=Verdict(status="no-claim", message=""),
        ),
        verdict=Verdict(status="no-claim", message="no claim to check"),
        warnings=[ReportWarning(code="no_formal_dp", message="no formal DP claim")],
        stages=dict(DONE),
    )
    personal = MethodReport(
        name="flip-eps8",
        method="flip",
        summary="Personalised heads.",
        formal_dp=True,
        utility=Utility(test_accuracy=0.6, client_accuracy=[0.7, 0.8, 0.9]),
        privacy=PrivacyAccounting(
            delta=1e-5,
            accountants=["pld"],
            primary_accountant="pld",
            worst={"pld": 8.0},
            epsilon_over_rounds=[(1, 4.0), (2, 8.0)],
        ),
        stages={
            "train": StageStatus(state="done"),
            "account": StageStatus(state="done"),
            "audit": StageStatus(state="failed", error="RuntimeError: out of memory"),
            "report": StageStatus(state="done"),
        },
    )
    failed = MethodReport(
        name="fedmd-nfdp",
        method="fedmd-nfdp",
        summary="FedMD with NFDP.",
        stages={
            "train": StageStatus(state="failed", error="ValueError: boom <script>"),
            "account": StageStatus(state="skipped"),
            "audit": StageStatus(state="skipped"),
            "report": StageStatus(state="done"),
        },
    )
    counts = [[5, 0, 3], [0, 7, 1], [2, 2, 2], [9, 0, 0]]
    return PrivacyReport(
        metadata=RunMetadata(
            name="unit",
            created="2024-01-01T00:00:00",
            privkit_version="0.1.0",
            config={"name": "unit"},
            seeds={"run": 0},
            package_versions={"numpy": "2"},
            hardware={"cpus": 2},
            reduced=["2 shadow models instead of 64"],
            wall_seconds=12.0,
        ),
        threat_model=ThreatModel(
            neighbouring="add/remove one record",
            delta=1e-5,
            accountants=["pld", "rdp"],
            primary_accountant="pld",
            shadows=2,
            confidence=0.95,
            assumptions=["public data is public"],
        ),
        dataset=DatasetSummary(
            dataset="mnist5k",
            public_dataset="digits28",
            num_classes=3,
            partition="dirichlet",
            alpha=1.0,
            sizes={"test": 100},
            client_sizes=[sum(c) for c in counts],
            class_counts=counts,
        ),
        methods=[dp, nondp, personal, failed],
        warnings=[ReportWarning(code="delta_ge_1_over_n", message="delta 0.1 >= 1/n")],
    )


@pytest.fixture
def sample_report() -> PrivacyReport:
    return make_report()
