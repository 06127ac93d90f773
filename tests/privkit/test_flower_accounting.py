"""privkit.flower: Flower's DP mechanisms as ledger events, checked against dp-accounting directly."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import dp_accounting as dpa
import pytest

pytest.importorskip("flwr")

import flower_testapps as apps
from flwr.clientapp.mod import LocalDpMod, fixedclipping_mod
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedAdam,
    FedAvg,
)

from privkit.flower import (
    Accounted,
    check_flower_dp,
    ledger_mod,
    record_dpsgd,
    recorded,
    run_inprocess,
)
from privkit.flower.mechanisms import central_dp, central_multiplier, local_dp_event

DELTA = 1e-5
REPLACE = dpa.NeighboringRelation.REPLACE_ONE


def rdp_epsilon(event, relation=REPLACE) -> float:
    acc = dpa.rdp.RdpAccountant(neighboring_relation=relation)
    acc.compose(event)
    return float(acc.get_epsilon(DELTA))


def fixed(z=1.0, clip=0.5, m=3, server=False):
    cls = (
        DifferentialPrivacyServerSideFixedClipping
        if server
        else DifferentialPrivacyClientSideFixedClipping
    )
    # min_train_nodes: flwr sizes the sample from the nodes connected when the round starts (fewer
    # while Ray starts them); with it the sample is m of 5 in every round
    return cls(
        FedAvg(
            fraction_train=m / 5, fraction_evaluate=0.0, min_available_nodes=5, min_train_nodes=m
        ),
        noise_multiplier=z,
        clipping_norm=clip,
        num_sampled_clients=m,
    )


def test_import_privkit_never_needs_flwr():
    code = (
        "import sys; sys.modules['flwr'] = None; import privkit, privkit.flower\n"
        "assert 'flwr' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "try:\n    privkit.flower.Accounted\nexcept ImportError as e:\n    print(e)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == 'privkit.flower needs Flower: pip install "privkit-ml[flower]"'


def test_central_multipliers_from_flowers_parameters():
    # fixed clipping, m equal-weight replies: std z C / m on the mean, sensitivity 2C/m (replace-one)
    assert central_multiplier(central_dp(fixed(z=1.2)), 1 / 3, "replace_one") == pytest.approx(0.6)
    assert central_multiplier(central_dp(fixed(z=1.2)), 1 / 3, "add_remove") == pytest.approx(1.2)
    # two replies where the wrapper expected three: the noise is still z C / 3
    assert central_multiplier(central_dp(fixed(z=1.2)), 1 / 2, "replace_one") == pytest.approx(0.4)
    # adaptive clipping: Flower raises the update noise to z_u = (z^-2 - (2 s_b)^-2)^-1/2 (Andrew et al.);
    # under replace-one (update 2C, clip bit 1) the round is exactly a Gaussian of multiplier z/2
    ada = DifferentialPrivacyClientSideAdaptiveClipping(
        FedAvg(), noise_multiplier=1.0, num_sampled_clients=20
    )
    dp = central_dp(ada)
    assert dp.count_std == pytest.approx(1.0)  # Flower's default num_sampled_clients / 20
    assert central_multiplier(dp, 1 / 20, "replace_one") == pytest.approx(0.5, rel=1e-12)
    # zero-out: update sensitivity C but the uncentred bit still moves the count by 1
    z_u = (1.0 - 0.25) ** -0.5
    assert central_multiplier(dp, 1 / 20, "add_remove") == pytest.approx((z_u**-2 + 1.0) ** -0.5)
    with pytest.raises(ValueError, match=r"FedAvg\.aggregate_train"):
        central_dp(DifferentialPrivacyServerSideFixedClipping(FedAdam(), 1.0, 1.0, 3))


def test_local_dp_mod_event_and_checks():
    # classic formula at epsilon = 10: std 0.4845 for sensitivity 1; the clipped update moves by 2C = 2
    mod = LocalDpMod(clipping_norm=1.0, sensitivity=1.0, epsilon=10.0, delta=DELTA)
    std = math.sqrt(2 * math.log(1.25 / DELTA)) / 10.0
    assert local_dp_event(mod, "replace_one") == dpa.GaussianDpEvent(std / 2.0)
    check = check_flower_dp(recorded(mod))
    exact = float(dpa.gaussian_mechanism.get_epsilon_gaussian(std / 2.0, DELTA))
    assert check.epsilon == pytest.approx(exact, rel=1e-6) and check.epsilon > 25
    text = " ".join(check.warnings)
    assert "sensitivity 1 is below the clipped update's sensitivity 2" in text
    assert "classic Gaussian formula" in text and f"{check.epsilon:.4g}" in text
    # at the right sensitivity and epsilon < 1 the classic formula holds: no warning, exact epsilon below 0.5
    ok = check_flower_dp(LocalDpMod(clipping_norm=1.0, sensitivity=2.0, epsilon=0.5, delta=DELTA))
    assert ok.warnings == [] and ok.epsilon < 0.5
    # a central wrapper whose noise hides nothing
    weak = check_flower_dp(fixed(z=0.01), delta=DELTA)
    assert weak.epsilon > 100 and "no meaningful guarantee" in weak.warnings[0]


def _run_fixed(tmp_path, budget=None, rounds=3, mods=(fixedclipping_mod,), **kw):
    sink: dict = {}
    strategy = lambda: Accounted(fixed(**kw), delta=DELTA, budget=budget, out=tmp_path, name="app")
    run_inprocess(apps.server_app(strategy, rounds, sink), apps.client_app(list(mods)), 5)
    return sink


def test_client_side_fixed_clipping_equals_direct_accounting(tmp_path):
    # budget between the 2- and 3-round epsilons: the third round is never sent
    per_round = dpa.SampledWithoutReplacementDpEvent(5, 3, dpa.GaussianDpEvent(0.5))
    direct = [rdp_epsilon(dpa.SelfComposedDpEvent(per_round, t)) for t in (1, 2, 3)]
    sink = _run_fixed(tmp_path, budget=(direct[1] + direct[2]) / 2, rounds=4)
    acc, result = sink["strategy"], sink["result"]
    logged = [result.train_metrics_clientapp[t]["privkit-epsilon"] for t in (1, 2)]
    assert logged == pytest.approx(direct[:2], rel=1e-9)
    assert sorted(result.train_metrics_clientapp) == [1, 2] and acc.stopped.startswith(
        "stopped before round 3"
    )
    assert len(acc.ledger.clients) == 5  # every node: the draw of 3 of 5 stays hidden
    privacy = json.loads((tmp_path / "app" / "privacy.json").read_text())
    assert privacy["summary"]["worst"]["rdp"] == pytest.approx(direct[1], rel=1e-9)
    assert privacy["neighbouring"] == ["replace_one"]
    from typer.testing import CliRunner

    from privkit.cli import app as cli

    res = CliRunner().invoke(
        cli,
        ["budget", "ledger", str(tmp_path / "app" / "ledger.json"), "--delta", "1e-5", "--json"],
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["worst"]["rdp"] == pytest.approx(direct[1], rel=1e-9)
    res = CliRunner().invoke(cli, ["report", str(tmp_path), "--rebuild"])
    assert res.exit_code == 0, res.output
    report = (tmp_path / "report.md").read_text()
    assert "app" in report
    # the report states the unit the ledger accounts: a client's whole data, not one record
    assert "Guarantee unit: one client's whole data (client-level DP" in report
    assert "replace one client's data (replace_one)" in report and "record-level: the" not in report


def test_unclipped_updates_are_recorded_non_private(tmp_path):
    sink = _run_fixed(tmp_path, rounds=1, mods=())  # client-side wrapper, but no fixedclipping_mod
    acc = sink["strategy"]
    assert acc.epsilon == math.inf
    sampled = acc.rounds[0]["clients"]
    assert all(acc.ledger.entries(str(n))[0].label == "round 1: unclipped update" for n in sampled)


def test_local_dp_and_dpsgd_recorded_by_clients(tmp_path):
    from privkit.mechanisms.dp_sgd_step import DpSgdStep

    step = DpSgdStep(clip_norm=1.0, noise_multiplier=1.1, sample_rate=0.1, dataset_size=100)
    local = LocalDpMod(clipping_norm=1.0, sensitivity=1.0, epsilon=0.8, delta=DELTA)
    sink: dict = {}
    strategy = lambda: Accounted(
        FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=4),
        delta=DELTA,
        neighbouring="add_remove",
        client_sampling="none",
    )
    dpsgd_app = apps.client_app([ledger_mod], on_train=lambda pid: record_dpsgd(step, steps=10))
    run_inprocess(apps.server_app(strategy, 2, sink), dpsgd_app, 4)
    direct = rdp_epsilon(
        dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(1.1)), 20),
        dpa.NeighboringRelation.ADD_OR_REMOVE_ONE,
    )
    assert sink["strategy"].epsilon == pytest.approx(direct, rel=1e-9)
    sink = {}
    run_inprocess(apps.server_app(strategy, 2, sink), apps.client_app([recorded(local)]), 4)
    std = math.sqrt(2 * math.log(1.25 / DELTA)) / 0.8  # zero-out: the clipped update moves by C = 1
    direct = rdp_epsilon(
        dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(std), 2),
        dpa.NeighboringRelation.ADD_OR_REMOVE_ONE,
    )
    acc = sink["strategy"]
    assert acc.epsilon == pytest.approx(direct, rel=1e-9)
    assert any("below the clipped update's sensitivity" in w for w in acc.describe()) is False


@pytest.mark.slow
def test_ray_simulation_ledger_equals_direct_accounting(tmp_path):
    """The issue's check: a plain Flower app with Flower's client-side fixed clipping wrapper, on
    Flower's simulation engine (Ray), wrapped by privkit: its ledger's epsilon is dp-accounting's."""
    import ray.cloudpickle
    from flwr.simulation import run_simulation

    ray.cloudpickle.register_pickle_by_value(apps)
    out = tmp_path / "run"
    strategy = lambda: Accounted(fixed(), delta=DELTA, out=out, name="app")
    run_simulation(
        apps.server_app(strategy, 2, {}),
        apps.client_app([fixedclipping_mod]),
        num_supernodes=5,
        backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 2}},
    )
    per_round = dpa.SampledWithoutReplacementDpEvent(5, 3, dpa.GaussianDpEvent(0.5))
    privacy = json.loads((out / "app" / "privacy.json").read_text())
    assert privacy["summary"]["worst"]["rdp"] == pytest.approx(
        rdp_epsilon(dpa.SelfComposedDpEvent(per_round, 2)), rel=1e-9
    )
    assert [
        r["round"] for r in json.loads((out / "app" / "metrics.json").read_text())["rounds"]
    ] == [1, 2]


def test_flowers_own_accountant_is_privkits_zero_out_without_amplification():
    """flwr 1.42's RdpAccountant (fixed clipping only: add-or-remove, no amplification, multiplier z)
    is privkit's ``neighbouring="add_remove", client_sampling="none"`` reading of the same wrapper."""
    from flwr.supercore.privacy_accounting import (
        GaussianPrivacyEvent,
        NeighboringRelation,
        PrivacyConfig,
        SamplingMethod,
    )
    from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

    from accountants import Ledger
    from privkit.flower.mechanisms import central_event

    config = PrivacyConfig(
        DELTA, 5, NeighboringRelation.ADD_OR_REMOVE_ONE, SamplingMethod.NO_AMPLIFICATION
    )
    flower = RdpAccountant(config)
    flower.compose(GaussianPrivacyEvent(1.3, 3, 5), count=4)
    ledger = Ledger()
    for t in range(4):
        event = central_event(central_dp(fixed(z=1.3)), 1 / 3, "add_remove")
        ledger.add(0, event, f"round {t}", neighbouring="add_remove")
    assert ledger.epsilon(DELTA, accountant="rdp") == pytest.approx(
        flower.get_epsilon(DELTA), rel=1e-12
    )


def test_adaptive_noise_is_charged_to_a_renyi_filter(tmp_path):
    """Noise the server lowers round by round (sigma_t in the train config, each client one Gaussian
    release of its update): rounds run while the filter admits them, the ledger carries the filter's
    (budget, delta) guarantee. Expected counts from the closed form RDP alpha / (2 sigma^2) and the
    RDP conversion of Canonne, Kamath & Steinke (2020, Prop. 12)."""
    from privkit.flower import record

    sigmas = {t: 4.0 - 0.5 * t for t in range(1, 7)}

    class Lowering(FedAvg):
        def configure_train(self, server_round, arrays, config, grid):
            config["sigma"] = sigmas[server_round]
            return super().configure_train(server_round, arrays, config, grid)

    def on_train(pid):  # the client reads sigma_t from the config the mod saw
        record(dpa.GaussianDpEvent(_seen["sigma"]), "gaussian update")

    _seen: dict = {}

    def remember(msg, ctxt, call_next):
        _seen["sigma"] = float(next(iter(msg.content.config_records.values()))["sigma"])
        return call_next(msg, ctxt)

    budget, sink = 6.0, {}
    strategy = lambda: Accounted(
        Lowering(fraction_train=1.0, fraction_evaluate=0.0),
        delta=DELTA,
        budget=budget,
        adaptive=True,
        neighbouring="add_remove",
        client_sampling="none",
        client_mechanism=lambda rnd, cfg: [
            (dpa.GaussianDpEvent(float(cfg["sigma"])), "gaussian update", "add_remove")
        ],
    )
    run_inprocess(
        apps.server_app(strategy, 6, sink), apps.client_app([ledger_mod, remember], on_train), 3
    )
    acc = sink["strategy"]
    order = acc.filter.filter.order
    rdp_budget = budget - (math.log1p(-1 / order) - math.log(DELTA * order) / (order - 1))
    spent, expected = 0.0, 0
    for t in range(1, 7):
        step = order / (2 * sigmas[t] ** 2)
        if spent + step > rdp_budget:
            break
        spent, expected = spent + step, t
    assert expected == 5 and len(acc.rounds) == expected  # sigma 3.5 .. 1.5 admitted, 1.0 refused
    assert acc.stopped.startswith(f"stopped before round {expected + 1}: the Renyi filter")
    assert acc.ledger.adaptive["epsilon"] == pytest.approx(budget, rel=1e-12)
    assert max(acc.ledger.adaptive["spent"].values()) == pytest.approx(spent, rel=1e-12)


@pytest.mark.parametrize("wrapper", ["server-fixed", "client-adaptive", "server-adaptive"])
def test_other_central_wrappers_equal_direct_accounting(tmp_path, wrapper):
    """Server-side fixed clipping with z = 1, and adaptive clipping asked for z = 1 (count noise 1,
    Flower's update noise (1 - 1/4)^-1/2): under replace-one each round is a Gaussian of multiplier
    1/2 for 3 of 5 clients, as in the client-side fixed-clipping run."""
    from flwr.clientapp.mod import adaptiveclipping_mod
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideAdaptiveClipping

    inner = FedAvg(
        fraction_train=0.6, fraction_evaluate=0.0, min_available_nodes=5, min_train_nodes=3
    )
    make = {
        "server-fixed": lambda: DifferentialPrivacyServerSideFixedClipping(inner, 1.0, 0.5, 3),
        "client-adaptive": lambda: DifferentialPrivacyClientSideAdaptiveClipping(
            inner, 1.0, 3, initial_clipping_norm=0.5, clipped_count_stddev=1.0
        ),
        "server-adaptive": lambda: DifferentialPrivacyServerSideAdaptiveClipping(
            inner, 1.0, 3, initial_clipping_norm=0.5, clipped_count_stddev=1.0
        ),
    }[wrapper]
    mods = [adaptiveclipping_mod] if wrapper == "client-adaptive" else []
    sink: dict = {}
    strategy = lambda: Accounted(make(), delta=DELTA)
    run_inprocess(apps.server_app(strategy, 2, sink), apps.client_app(mods), 5)
    per_round = dpa.SampledWithoutReplacementDpEvent(5, 3, dpa.GaussianDpEvent(0.5))
    assert sink["strategy"].epsilon == pytest.approx(
        rdp_epsilon(dpa.SelfComposedDpEvent(per_round, 2)), rel=1e-9
    )
