"""FedKADP (with and without feedback), DP-FedAvg: feedback Metric, paper formula, ledger, budget stop, determinism."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from accountants import dpsgd_epsilon
from privkit.data import FederationConfig, build_federation
from privkit.trainers import train
from privkit.trainers.dp_fedavg import kd_loss, paper_epsilon, paper_round_rdp
from privkit.trainers.fedkadp import (
    adapt_noise,
    adapt_temperature,
    feedback_metric,
    metric_accuracy,
    metric_gradient,
    metric_loss,
    metric_time,
)

# Small runs: 5 of 20 clients per round, 3 DP-SGD steps per round, MLP with 16 hidden units.
TINY = {
    "arch": "mlp",
    "feature_dim": 16,
    "rounds": 4,
    "local_steps": 3,
    "batch_size": 32,
    "client_fraction": 0.25,
    "noise_multiplier": 3.0,
    "target_epsilon": 1e6,
    "lr": 0.1,
    "device": "cpu",
}
DELTA = 1e-5


@pytest.fixture(scope="module")
def fed():
    return build_federation(FederationConfig(partition="shards", clients=20, seed=0))


# ---------------------------------------------------------------------------- Metric (Sec. 3.2)
def test_metric_components_on_hand_inputs():
    assert metric_gradient(1.5, [1.0, 1.0]) == pytest.approx(50.0)  # |1.5-1|/1 = 0.5
    assert metric_gradient(0.8, [1.0, 0.6]) == pytest.approx(100.0)  # equals the average
    assert metric_gradient(3.0, [1.0]) == 0.0  # clamped at 0
    assert metric_gradient(2.0, []) == 100.0  # round 1: average := g_t
    assert metric_loss(0.9, 1.0) == pytest.approx(110.0)  # r_l = -0.1 -> 100 (1 + 0.1)
    assert metric_loss(1.2, 1.0) == pytest.approx(90.0)  # r_l = 0.2 -> 100 (1 - 0.1)
    assert metric_loss(4.0, 1.0) == 0.0  # r_l = 3 -> max(1 - 1.5, 0)
    assert metric_accuracy(0.6, 0.5, 0.4) == pytest.approx(100.0)
    assert metric_accuracy(0.55, 0.5, 0.4) == pytest.approx(50.0)
    assert metric_accuracy(0.4, 0.5, 0.4) == pytest.approx(-100.0)
    assert metric_accuracy(0.9, 0.5, 0.49) == 100.0  # 4000 capped
    assert metric_accuracy(0.9, 0.5, None) == 0.0 and metric_accuracy(0.9, 0.5, 0.5) == 0.0
    assert metric_time(0, 100) == pytest.approx(100 / (1 + math.exp(0.5)))  # 37.75
    assert metric_time(50, 100) == pytest.approx(50.0)
    assert metric_time(100, 100) == pytest.approx(100 / (1 + math.exp(-0.5)))  # 62.25
    comp = {"g": 80.0, "l": 110.0, "a": -20.0, "t": 50.0}
    w = {"g": 0.1, "l": 0.2, "a": 0.3, "t": 0.4}
    assert feedback_metric(comp, w) == pytest.approx(8 + 22 - 6 + 20)


def test_temperature_and_noise_updates():
    # Eq. 17: midpoint at Metric = Metric_KD, towards rho_max above, rho_min below
    assert adapt_temperature(50.0, 2.0, 3.0, 0.1, 50.0) == pytest.approx(2.5)
    assert adapt_temperature(60.0, 2.0, 3.0, 0.1, 50.0) == pytest.approx(2 + 1 / (1 + math.exp(-1)))
    assert adapt_temperature(-1e6, 2.0, 3.0, 0.1, 50.0) == pytest.approx(2.0)
    assert adapt_temperature(1e6, 2.0, 3.0, 0.1, 50.0) == pytest.approx(3.0)
    # Eq. 20: decay only when Metric >= Metric_DP
    assert adapt_noise(5.0, 60.0, 0.9, 60.0) == pytest.approx(4.5)
    assert adapt_noise(5.0, 59.9, 0.9, 60.0) == 5.0


def test_kd_loss_matches_hand_formula():
    logits = torch.tensor([[1.0, -0.5, 2.0]])
    teacher = torch.tensor([[0.2, 0.3, -1.0]])
    y = torch.tensor([2])
    rho = 2.5
    p = torch.softmax(teacher / rho, 1)
    q = torch.softmax(logits / rho, 1)
    want = F.cross_entropy(logits, y) + rho**2 * (p * (p.log() - q.log())).sum()
    torch.testing.assert_close(kd_loss(rho)(logits, y, teacher), want)


# ---------------------------------------------------------------------------- the paper's formula
@pytest.mark.parametrize("sigma,expected", [(5, 8.26), (10, 7.88), (15, 7.81)])
def test_paper_formula_reproduces_its_arithmetic(sigma, expected):
    # Values from the project's independent re-implementation of Sec. 4.1 (notes/methods.md s6,
    # calc_dp.py): s=0.1, n=10 clients per round, E=20, T=100, delta=1e-5.
    eps, alpha = paper_epsilon([sigma] * 100, 0.1, 20, 1e-5, n=10)
    assert eps == pytest.approx(expected, abs=0.006)
    assert alpha == 3


def test_paper_round_rdp_at_order_two_is_closed_form():
    s, sigma, e = 0.1, 2.0, 20
    v = 1 / sigma**2
    want = e * math.log1p(s**2 * min(4 * math.expm1(v), 2 * math.exp(v)))
    assert paper_round_rdp(2, s, sigma, e) == pytest.approx(want, rel=1e-12)


# ---------------------------------------------------------------------------- ledger and budget
def _participation(res) -> dict[int, int]:
    counts: dict[int, int] = {}
    for row in res.rounds:
        for k in row["clients"]:
            counts[k] = counts.get(k, 0) + 1
    return counts


def test_dp_fedavg_ledger_matches_dpsgd_epsilon(fed):
    res = train("dp-fedavg", fed, TINY, seed=0)
    assert len(res.rounds) == 4
    q = 32 / 160
    counts = _participation(res)
    assert sum(counts.values()) == 4 * 5
    for k, m in counts.items():
        entries = res.ledger.entries(k)
        assert len(entries) == m
        assert [e.label for e in entries] == [
            f"round {r['round']}: dp-sgd" for r in res.rounds if k in r["clients"]
        ]
        if k not in sorted(counts)[:3]:
            continue  # epsilon checked on three clients (each ledger query recomputes RDP)
        want = dpsgd_epsilon(q, 3.0, m * 3, DELTA, accountant="rdp")
        assert res.ledger.epsilon(DELTA, client=k, accountant="rdp") == pytest.approx(
            want, rel=1e-9
        )
    assert res.rounds[-1]["epsilon"] == pytest.approx(
        res.ledger.epsilon(DELTA, accountant="rdp"), rel=1e-9
    )
    assert all(r["rho"] is None and r["sigma"] == 3.0 for r in res.rounds)


def test_fedkadp_heterogeneous_sigma_ledger_matches_opacus(fed):
    from opacus.accountants import RDPAccountant

    cfg = {
        **TINY,
        "rounds": 6,
        "metric_dp": -1e9,
    }  # Metric always >= threshold: sigma decays each round
    res = train("fedkadp", fed, cfg, seed=1)
    sigmas = [r["sigma"] for r in res.rounds]
    assert sigmas == pytest.approx([3.0 * 0.95**i for i in range(6)])
    assert len({r["rho"] for r in res.rounds}) > 1  # temperature adapts too
    counts = _participation(res)
    worst = max(counts, key=counts.get)  # a client with the most rounds
    acc = RDPAccountant()  # independent peer implementation of the Poisson subsampled Gaussian RDP
    acc.history = [(r["sigma"], 32 / 160, 3) for r in res.rounds if worst in r["clients"]]
    ours = res.ledger.epsilon(DELTA, client=worst, accountant="rdp")
    assert ours == pytest.approx(acc.get_epsilon(DELTA), rel=0.02)  # different RDP order grids
    assert res.rounds[-1]["epsilon"] == pytest.approx(
        res.ledger.epsilon(DELTA, accountant="rdp"), rel=1e-9
    )
    assert res.claims["privkit_epsilon"] == pytest.approx(res.rounds[-1]["epsilon"])
    assert res.claims["epsilon"] == pytest.approx(paper_epsilon(sigmas, 0.25, 3, DELTA, n=5)[0])
    assert any("adaptive" in w for w in res.warnings)
    assert any("not a sound bound" in w for w in res.warnings)


def test_fedkadp_never_releases_a_round_past_the_budget(fed):
    # reproducible noise: the capped run must repeat the free run's rounds exactly
    free = train("fedkadp", fed, {**TINY, "rounds": 6, "reproducible_noise": True}, seed=2)
    eps = [r["epsilon"] for r in free.rounds]
    # first round (after round 1) that raises the worst-client epsilon: the budget ends just before it
    i = next(j for j in range(1, len(eps)) if eps[j] > eps[j - 1] * 1.001)
    target = (eps[i - 1] + eps[i]) / 2
    capped = train(
        "fedkadp",
        fed,
        {**TINY, "rounds": 6, "target_epsilon": target, "reproducible_noise": True},
        seed=2,
    )
    assert len(capped.rounds) == i  # rounds 1..i ran, round i+1 was refused
    assert capped.rounds == free.rounds[:i]  # identical up to the stop
    assert f"stopped before round {i + 1}" in capped.claims["stop"]
    for k in capped.ledger.clients:
        assert capped.ledger.epsilon(DELTA, client=k, accountant="rdp") <= target
    assert max(e.round for k in capped.ledger.clients for e in capped.ledger.entries(k)) == i
    # a budget smaller than one round releases nothing
    none = train("fedkadp", fed, {**TINY, "target_epsilon": eps[0] / 2}, seed=2)
    assert none.rounds == [] and len(none.ledger) == 0


@pytest.mark.parametrize(
    "method, extra", [("fedkadp", {}), ("fedkadp", {"feedback": False}), ("fedkd-dp", {})]
)
def test_same_seed_same_result(fed, method, extra):
    # same seed, same result in reproducible-noise mode (release mode draws the noise from the OS)
    cfg = {**TINY, **extra, "rounds": 2, "reproducible_noise": True}
    a = train(method, fed, cfg, seed=5)
    b = train(method, fed, cfg, seed=5)
    for (k, v), w in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        torch.testing.assert_close(v, w, rtol=0, atol=0, msg=k)
    assert a.rounds == b.rounds
    c = train(method, fed, cfg, seed=6)
    assert not torch.equal(a.model.head.weight, c.model.head.weight)


def test_fedkadp_without_feedback_uses_its_fixed_temperature(fed):
    res = train(
        "fedkadp", fed, {**TINY, "rounds": 2, "temperature": 3.5, "feedback": False}, seed=0
    )
    assert [r["rho"] for r in res.rounds] == [3.5, 3.5]
    assert [r["sigma"] for r in res.rounds] == [3.0, 3.0]


def test_bad_config_names_the_field(fed):
    with pytest.raises(ValueError, match="client_fraction"):
        train("fedkadp", fed, {**TINY, "client_fraction": 0.0})
    with pytest.raises(ValueError, match="delta"):
        train("dp-fedavg", fed, {**TINY, "delta": 2.0})
    with pytest.raises(ValueError, match="temperature"):
        train("dp-fedavg", fed, {**TINY, "temperature": 2.0})  # DP-FedAvg distils nothing


def test_fedkadp_runs_under_a_renyi_filter_fixed_before_training(fed):
    """Adaptive sigma and stopping: every client's RDP at the filter's order stays within its budget
    (Feldman & Zrnic 2021), the order depends on the config only, and the ledger records the guarantee."""
    from accountants import RenyiFilter
    from accountants.fast import poisson_gaussian_rdp

    cfg = {
        **TINY,
        "rounds": 8,
        "noise_multiplier": 2.0,
        "target_epsilon": 6.0,
        "reproducible_noise": True,
    }
    res = train("fedkadp", fed, cfg, seed=2)
    filt = res.claims["adaptive_filter"]
    assert filt["epsilon"] == pytest.approx(6.0) and res.ledger.adaptive == filt
    assert RenyiFilter.for_epsilon(6.0, DELTA, filt["order"]).budget == pytest.approx(
        filt["rdp_budget"]
    )
    # recompute each client's spend from its ledger (the sigma_t it actually ran with)
    for k in res.ledger.clients:
        spent = sum(
            TINY["local_steps"]
            * poisson_gaussian_rdp(
                e.event.event.sampling_probability,
                e.event.event.event.noise_multiplier,
                [filt["order"]],
            )[0]
            for e in res.ledger.entries(k)
        )
        assert spent == pytest.approx(filt["spent"][k]) and spent <= filt["rdp_budget"]
    other = train("fedkadp", fed, {**cfg, "reproducible_noise": False}, seed=9)
    assert other.claims["adaptive_filter"]["order"] == filt["order"]  # fixed before any output
    assert "Renyi filter" in " ".join(res.warnings)
    assert "adaptive_filter" not in train("fedkd-dp", fed, {**TINY, "rounds": 1}, seed=2).claims


def test_report_shows_the_renyi_filter_beside_the_paper_claim(fed, tmp_path):
    """privacy.json and the report carry the filter's guarantee (epsilon 6 at the run's delta,
    Feldman & Zrnic) beside the paper's claim, and the reproducible-noise stamp of a seeded run."""
    import json

    from privkit.pipeline.report import _read_privacy
    from privkit.pipeline.stages import account_method
    from reports import (
        MethodReport,
        PrivacyReport,
        RunMetadata,
        ThreatModel,
        fmt_eps,
        render_markdown,
    )

    cfg = {
        **TINY,
        "rounds": 2,
        "noise_multiplier": 2.0,
        "target_epsilon": 6.0,
        "reproducible_noise": True,
    }
    res = train("fedkadp", fed, cfg, seed=2)
    res.save(tmp_path)
    privacy = account_method(tmp_path, DELTA, accountants=["rdp", "pld"])
    assert privacy["adaptive_composition"]["epsilon"] == pytest.approx(6.0)
    assert privacy["noise"] == "reproducible noise: not for release"
    (tmp_path / "privacy.json").write_text(json.dumps(privacy))
    acc = _read_privacy(tmp_path, {}, [])
    assert (
        acc.reproducible_noise
        and acc.adaptive_composition["order"] == res.claims["adaptive_filter"]["order"]
    )
    report = PrivacyReport(
        metadata=RunMetadata(
            name="k", created="2026-01-01T00:00:00", privkit_version="0", config={}
        ),
        threat_model=ThreatModel(neighbouring="add/remove", delta=DELTA),
        methods=[MethodReport(name="fedkadp", method="fedkadp", privacy=acc)],
    )
    md = render_markdown(report)
    order = res.claims["adaptive_filter"]["order"]
    assert acc.claim is not None and acc.claim.epsilon is not None
    assert (
        f"Rényi filter at order {order}): ε = 6 whatever the adaptive choices, beside the paper's "
        f"claim ε = {fmt_eps(acc.claim.epsilon)}."
    ) in md
    assert md.count("**WARNING — reproducible noise: not for release.**") == 1
