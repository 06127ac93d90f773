"""privkit.flower: budgets that hold before anything is sent, failed runs that say so, where the run
lands, ledger.json's convention replayed in dp-accounting, and the lifetime ledger (in-process)."""

from __future__ import annotations

import json
import math

import dp_accounting as dpa
import pytest

pytest.importorskip("flwr")

import flower_testapps as apps
from flwr.clientapp.mod import fixedclipping_mod
from flwr.serverapp.strategy import DifferentialPrivacyClientSideFixedClipping, FedAvg

from privkit.flower import Accounted, run_inprocess
from privkit.flower.accounting import RunFailed, RunRefused

DELTA = 1e-5
REPLACE = dpa.NeighboringRelation.REPLACE_ONE
ADD_REMOVE = dpa.NeighboringRelation.ADD_OR_REMOVE_ONE


def fixed(z=1.0, clip=0.5, m=3, n=5):
    fedavg = FedAvg(
        fraction_train=m / n, fraction_evaluate=0.0, min_available_nodes=n, min_train_nodes=m
    )
    return DifferentialPrivacyClientSideFixedClipping(
        fedavg, noise_multiplier=z, clipping_norm=clip, num_sampled_clients=m
    )


def rdp(event, count=1, relation=REPLACE) -> float:
    acc = dpa.rdp.RdpAccountant(neighboring_relation=relation)
    acc.compose(event, count)
    return float(acc.get_epsilon(DELTA))


def _run(make, rounds=2, nodes=5, client=None, run_config=None):
    sink: dict = {}
    calls: list[int] = []
    client = client or apps.client_app([fixedclipping_mod], on_train=lambda pid: calls.append(pid))
    run_inprocess(apps.server_app(make, rounds, sink), client, nodes, run_config=run_config)
    return sink, calls


def test_a_strategy_without_dp_is_refused_before_round_one(tmp_path):
    calls: list[int] = []
    client = apps.client_app(on_train=lambda pid: calls.append(pid))
    no_dp = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=3)
    sink: dict = {}
    make = lambda: Accounted(no_dp, delta=DELTA, budget=10, out=tmp_path, name="app")
    with pytest.raises(RunRefused) as info:
        run_inprocess(apps.server_app(make, 3, sink), client, 3)
    line = str(info.value)
    assert "\n" not in line and line.startswith("privkit refused round 1 before sending it")
    assert "no recognised DP mechanism covers the release of client 1" in line
    assert calls == []  # no ClientApp ran: nothing left the server
    train = json.loads((tmp_path / "app" / "train.json").read_text())
    assert train["stop"].startswith("stopped before round 1: no recognised DP mechanism")


def test_a_budget_below_one_round_is_refused_before_round_one(tmp_path):
    one_round = rdp(dpa.SampledWithoutReplacementDpEvent(5, 3, dpa.GaussianDpEvent(0.5)))
    make = lambda: Accounted(fixed(), delta=DELTA, budget=one_round * 0.99)
    with pytest.raises(RunRefused, match=f"epsilon {one_round:.4g} > budget"):
        _run(make)


def test_run_config_reaches_every_client_and_failed_rounds_fail_the_run(tmp_path):
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    client = ClientApp(mods=[fixedclipping_mod])
    seen: list[int] = []

    @client.train()
    def train(msg, context):  # the quickstart's ClientApp reads its batch size from the run config
        seen.append(int(context.run_config["batch-size"]))
        arrays = [a + 1.0 for a in msg.content["arrays"].to_numpy_ndarrays()]
        metrics = MetricRecord({"num-examples": 10})
        content = RecordDict({"arrays": ArrayRecord(arrays), "metrics": metrics})
        return Message(content, reply_to=msg)

    make = lambda: Accounted(fixed(), delta=DELTA, out=tmp_path, name="app")
    sink, _ = _run(make, client=client, run_config={"batch-size": 32})
    assert seen == [32] * 6 and sink["strategy"].failures == []
    # without it every ClientApp fails: the run ends with an error, not with epsilon 0
    with pytest.raises(RunFailed) as info:
        _run(make, client=client)
    assert "no round of the federation released a model" in str(info.value)
    assert "KeyError" in str(info.value) and "batch-size" in str(info.value)
    written = json.loads((tmp_path / "app-2" / "train.json").read_text())
    assert any("3 of 3 clients failed" in w for w in written["warnings"])


def test_lines_name_the_relation_and_flowers_number():
    """The per-round reading of Flower's own accountant equals Flower's RdpAccountant."""
    from flwr.supercore.privacy_accounting import (
        GaussianPrivacyEvent,
        NeighboringRelation,
        PrivacyConfig,
        SamplingMethod,
    )
    from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

    sink, _ = _run(lambda: Accounted(fixed(z=1.3), delta=DELTA), rounds=3)
    acc = sink["strategy"]
    line = acc.relation_line()
    assert "replace-one" in line and "2C" in line and "Flower's own accountant" in line
    assert "neighbouring='add_remove', client_sampling='none'" in line
    config = PrivacyConfig(
        DELTA, 5, NeighboringRelation.ADD_OR_REMOVE_ONE, SamplingMethod.NO_AMPLIFICATION
    )
    flower = RdpAccountant(config)
    flower.compose(GaussianPrivacyEvent(1.3, 3, 5), count=3)
    assert acc._flower_epsilon() == pytest.approx(flower.get_epsilon(DELTA), rel=1e-12)
    assert acc.epsilon > acc._flower_epsilon()  # replace-one with amplification: larger here


@pytest.mark.parametrize("sampling", ["without_replacement", "none"])
def test_ledger_convention_replays_in_dp_accounting(tmp_path, sampling):
    """ledger.json's events, replayed as its convention says, give privacy.json's rdp and pld."""
    n = 5 if sampling == "without_replacement" else 3  # PLD is slow: 3 of 3, one history
    dp = lambda: fixed(z=1.0 if n == 5 else 4.0, m=3, n=n)
    make = lambda: Accounted(dp(), delta=DELTA, client_sampling=sampling, out=tmp_path)
    _run(make, rounds=3, nodes=n)
    ledger = json.loads((tmp_path / "flower-app" / "ledger.json").read_text())
    privacy = json.loads((tmp_path / "flower-app" / "privacy.json").read_text())
    conv = ledger["convention"]
    assert conv["neighbouring"] == "replace_one" and "REPLACE_ONE" in conv["replay_rdp"]
    assert "ADD_OR_REMOVE_ONE" in conv["replay_pld"]
    from accountants import event_from_dict

    worst = {"rdp": 0.0, "pld": 0.0}
    histories = {json.dumps(v, sort_keys=True): v for v in ledger["clients"].values()}
    for entries in histories.values():
        events = [event_from_dict(e["event"]) for e in entries]
        assert {e["neighbouring"] for e in entries} == {"replace_one"}
        acc = dpa.rdp.RdpAccountant(neighboring_relation=REPLACE)
        for ev in events:
            acc.compose(ev)
        worst["rdp"] = max(worst["rdp"], acc.get_epsilon(DELTA))
        if sampling == "none":
            pld = dpa.pld.PLDAccountant(ADD_REMOVE, value_discretization_interval=1e-4)
            for ev in events:
                pld.compose(ev)
            worst["pld"] = max(worst["pld"], pld.get_epsilon(DELTA))
    assert privacy["summary"]["worst"]["rdp"] == pytest.approx(worst["rdp"], rel=1e-9)
    if sampling == "none":
        assert privacy["summary"]["worst"]["pld"] == pytest.approx(worst["pld"], rel=1e-6)


def test_runs_in_one_folder_keep_their_own_files_and_the_report_lists_them(tmp_path):
    from typer.testing import CliRunner

    from privkit.cli import app as cli

    for _ in range(2):
        _run(lambda: Accounted(fixed(), delta=DELTA, out=tmp_path, name="app"), rounds=1)
    assert (tmp_path / "app" / "ledger.json").is_file()
    assert (tmp_path / "app-2" / "ledger.json").is_file()
    config = json.loads((tmp_path / "config.resolved.json").read_text())
    assert [m["key"] for m in config["resolved_methods"]] == ["app", "app-2"]
    res = CliRunner().invoke(cli, ["report", str(tmp_path), "--rebuild"])
    assert res.exit_code == 0, res.output
    report = (tmp_path / "report.md").read_text()
    assert "app-2" in report and "pending" not in report.lower()


def test_the_run_lands_in_the_users_folder_never_in_the_app_folder(tmp_path):
    from flwr.app import Context, RecordDict

    app = tmp_path / "myapp"
    app.mkdir()
    (app / "pyproject.toml").write_text('[tool.flwr.app]\npublisher = "me"\n')
    user = tmp_path / "user"
    context = Context(1, 0, {}, RecordDict(), {"privkit-dir": str(user)})
    _run(lambda: Accounted(fixed(), delta=DELTA, out="runs", context=context), rounds=1)
    assert (user / "runs" / "flower-app" / "ledger.json").is_file()
    # a folder inside the app folder (flwr run packs its *.json) moves next to it
    _run(lambda: Accounted(fixed(), delta=DELTA, out=app / "runs"), rounds=1)
    assert not (app / "runs").exists()
    assert (tmp_path / "myapp-privkit" / "runs" / "flower-app" / "ledger.json").is_file()


def test_lifetime_budget_is_refused_up_front_on_the_next_run(tmp_path):
    from typer.testing import CliRunner

    from privkit.cli import app as cli

    round_event = dpa.SampledWithoutReplacementDpEvent(5, 3, dpa.GaussianDpEvent(0.5))
    two, three = rdp(round_event, 2), rdp(round_event, 3)
    store = tmp_path / "lifetime"
    make = lambda budget: (
        lambda: Accounted(fixed(), delta=DELTA, store=store, lifetime_budget=budget)
    )
    sink, _ = _run(make(100.0), rounds=2)
    assert sink["strategy"]._lifetime_epsilon({}) == pytest.approx(two, rel=1e-9)
    res = CliRunner().invoke(cli, ["budget", "lifetime", str(store), "--delta", "1e-5", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["lifetime"]["rdp"] == pytest.approx(two, rel=1e-9)
    # a second run whose first round would pass the lifetime budget: refused before it is sent
    calls: list[int] = []
    with pytest.raises(RunRefused, match=f"lifetime epsilon {three:.4g} > lifetime budget"):
        _run(make((two + three) / 2), rounds=2)
    assert calls == [] and len(list((store / "runs").glob("*.json"))) == 1
    res = CliRunner().invoke(
        cli, ["budget", "lifetime", str(tmp_path / "nothing"), "--delta", "1e-5"]
    )
    assert isinstance(res.exception, ValueError)
    assert "store must be a lifetime ledger folder" in str(res.exception)
    assert math.isfinite(two)


def test_a_corrupted_lifetime_store_run_is_refused_in_one_line(tmp_path):
    """The store's runs are written atomically with a checksum; a run damaged on disk is named
    and refused, never counted as a smaller budget."""
    import atomicfiles
    from privkit.flower.lifetime import append_run, read_store

    path = append_run(tmp_path, {"run": "app", "events": []})
    assert atomicfiles.checksum_path(path).is_file()
    assert [r["run"] for r in read_store(tmp_path)] == ["app"]
    path.write_text(path.read_text().replace('"app"', '"ap2"'))
    with pytest.raises(ValueError, match=str(path.name)) as err:
        read_store(tmp_path)
    assert "\n" not in str(err.value)
