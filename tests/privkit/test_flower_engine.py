"""privkit's methods on Flower's simulation engine (privkit.flower_engine.engine): with reproducible noise
and the same seed, each ported method's released model (fedavg, fedprox, dp-fedavg, fedkadp,
fedauxfdp) equals the in-process run's (max abs difference at most 1e-5) and the ledgers are
identical; in release mode only the noise differs.

All Flower runs of this module share ONE simulation (one Ray start-up, the slow part): the runs go
one after the other through the same five nodes.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("flwr")
pytest.importorskip("ray")

from audit_helpers import tiny_federation_config

from privkit.data import build_federation
from privkit.errors import PrivkitError
from privkit.flower_engine.engine import check_engine, train_jobs_on_flower
from privkit.trainers import get_trainer, train

SEED = 3
# small configurations of the quick settings: a few rounds, every method's own client step
SMALL = {
    "dp-fedavg": {"rounds": 3, "local_steps": 3},
    "fedkadp": {"rounds": 3, "local_steps": 3},
    "fedavg": {"rounds": 2, "local_epochs": 1},
    "fedprox": {"rounds": 2, "local_epochs": 1},
    "fedauxfdp": {},
}


def _config(method: str, reproducible: bool = True) -> dict:
    return {
        **get_trainer(method).quick_config(),
        **SMALL[method],
        "reproducible_noise": reproducible,
    }


@pytest.fixture(scope="module")
def fed():
    # five clients, as the dp-fedavg check asks
    return build_federation(tiny_federation_config(clients=5, public_size=0.2, shadow_size=0.1))


@pytest.fixture(scope="module")
def runs(fed):
    """{(method, reproducible): (in-process result, Flower result)}; the Flower runs in one simulation."""
    torch.set_num_threads(1)
    keys = [(m, True) for m in SMALL] + [("dp-fedavg", False)]
    flower = train_jobs_on_flower([(m, fed, _config(m, r), SEED) for m, r in keys])
    return {k: (train(k[0], fed, _config(*k), seed=SEED), f) for k, f in zip(keys, flower)}


def _max_diff(a, b) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    return max(float((sa[k].double() - sb[k].double()).abs().max()) for k in sa)


def _ledger(res) -> str:
    return json.dumps(res.ledger.to_dict(), sort_keys=True)


@pytest.mark.parametrize("method", list(SMALL))
def test_flower_reproduces_the_inprocess_run(runs, method):
    inproc, flower = runs[(method, True)]
    assert _max_diff(inproc.model, flower.model) <= 1e-5
    assert _ledger(inproc) == _ledger(flower)
    assert inproc.ledger.clients == flower.ledger.clients and inproc.ledger.clients
    assert [r["test_accuracy"] for r in inproc.rounds] == pytest.approx(
        [r["test_accuracy"] for r in flower.rounds], abs=1e-6
    )
    assert flower.reproducible_noise and flower.warnings == inproc.warnings
    assert json.dumps(flower.claims, sort_keys=True, default=str) == json.dumps(
        inproc.claims, sort_keys=True, default=str
    )


def test_dp_fedavg_on_five_clients_every_client_accounted(runs, fed):
    inproc, flower = runs[("dp-fedavg", True)]
    assert fed.num_clients == 5
    # every client took part (client fraction of the quick config) and its rounds are in the ledger
    assert sorted(flower.ledger.clients) == sorted(inproc.ledger.clients)
    assert flower.ledger.epsilon(1e-5) == inproc.ledger.epsilon(1e-5) > 0


def test_release_mode_only_the_noise_differs(runs):
    inproc, flower = runs[("dp-fedavg", False)]
    seeded, _ = runs[("dp-fedavg", True)]
    # same mechanisms, same accounting: the ledgers agree (stamped as release, not reproducible)
    assert _ledger(inproc) == _ledger(flower) and not flower.reproducible_noise
    assert json.loads(_ledger(flower)) != json.loads(
        _ledger(seeded)
    )  # the reproducible stamp differs
    # the noise is fresh from the OS in each run: the models differ from each other and from the seeded run
    assert _max_diff(inproc.model, flower.model) > 1e-4
    assert _max_diff(seeded.model, flower.model) > 1e-4


def test_engine_refuses_methods_it_does_not_run():
    with pytest.raises(PrivkitError, match=r"method fedmd-nfdp does not run on the Flower engine"):
        check_engine("flower", "fedmd-nfdp")
    with pytest.raises(PrivkitError, match=r"engine must be one of inprocess, flower; found 'ray'"):
        check_engine("ray", "fedavg")
    check_engine("inprocess", "fedmd-nfdp")  # every method runs in-process


def test_run_config_engine_is_validated_before_any_work():
    from privkit.pipeline.config import resolve_config

    data = {
        "name": "fl",
        "engine": "flower",
        "federation": {"dataset": "digits", "public_dataset": None},
        "methods": [
            {"name": "dp-fedavg", "quick": True},
            {"name": "fedmd-nfdp", "quick": True, "engine": "inprocess"},
        ],
    }
    resolved = resolve_config(data)
    assert [(m.method, m.engine) for m in resolved.methods] == [
        ("dp-fedavg", "flower"),
        ("fedmd-nfdp", "inprocess"),
    ]
    data["methods"][1]["engine"] = (
        None  # the run's engine: flower, which fedmd-nfdp does not run on
    )
    with pytest.raises(PrivkitError, match=r"^method fedmd-nfdp does not run on the Flower engine"):
        resolve_config(data)
    with pytest.raises(PrivkitError, match=r"engine"):
        resolve_config({**data, "engine": "spark"})


def test_train_config_file_engine(tmp_path):
    from privkit.cli.train import resolve_run

    path = tmp_path / "run.toml"
    path.write_text('method = "fedkadp"\nengine = "flower"\n')
    assert resolve_run(None, path, [], [], None, True)["engine"] == "flower"
    assert resolve_run(None, path, [], [], None, True, engine="inprocess")["engine"] == "inprocess"
    path.write_text('method = "flip"\nengine = "flower"\n')
    with pytest.raises(PrivkitError, match=r"^method flip does not run on the Flower engine"):
        resolve_run(None, path, [], [], None, True)


def test_cli_refuses_an_unported_method_in_one_line(tmp_path):
    import subprocess
    import sys

    cmd = ["train", "fedmd-nfdp", "--quick", "--engine", "flower", "--out", str(tmp_path / "r")]
    proc = subprocess.run(
        [sys.executable, "-c", "from privkit.cli import main; main()", *cmd],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and "method fedmd-nfdp does not run on the Flower engine" in lines[0]
    assert not (tmp_path / "r").exists()  # refused before anything was written


def test_a_failing_clientapp_is_named_in_one_line():
    from privkit.flower_engine.apps import _error_text

    # what Flower's Ray backend puts in the error reply of a ClientApp that raised ValueError("boom")
    reason = (
        "<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'\x1b[36mray::ClientAppActor.run()"
        '\x1b[39m (pid=1, ip=1.2.3.4)\n  File "x.py", line 65, in run\nflwr.clientapp.client_app.'
        "ClientAppException: \nException ClientAppException occurred. Message: boom in client'>"
    )
    assert _error_text(reason) == "boom in client"
    assert _error_text("plain failure\nlast line") == "last line"


def test_privkit_run_on_the_flower_engine_writes_the_inprocess_run(tmp_path):
    """`privkit run` with `engine = "flower"` (the pipeline, not only `privkit train`): with
    reproducible noise the method's run directory holds the in-process pipeline's ledger and model
    (at most 1e-5 apart), and its config and the report's metadata say which engine ran it."""
    from privkit.pipeline import load_run_config, run_pipeline

    def run(engine: str):
        path = tmp_path / f"{engine}.toml"
        path.write_text(
            f'name = "{engine}"\nseed = 3\ndelta = 1e-5\nengine = "{engine}"\nworkers = 1\n'
            "reproducible_noise = true\n"
            '[federation]\ndataset = "digits"\npublic_dataset = "none"\nclients = 5\npartition = "iid"\n'
            "public_size = 0.2\nshadow_size = 0.1\ntest_size = 0.25\n"
            "[audit]\nenabled = false\n"
            '[[methods]]\nname = "dp-fedavg"\nquick = true\n'
            "overrides = { rounds = 2, local_steps = 2 }\n"
        )
        out = run_pipeline(load_run_config(path, []), tmp_path / "runs")
        assert not out.failures
        return out.root / "dp-fedavg"

    flower, inprocess = run("flower"), run("inprocess")
    assert (flower / "ledger.json").read_text() == (inprocess / "ledger.json").read_text()
    a = torch.load(flower / "checkpoints" / "model.pt", weights_only=True)
    b = torch.load(inprocess / "checkpoints" / "model.pt", weights_only=True)
    a, b = (x.get("state_dict", x) for x in (a, b))
    assert list(a) == list(b) and max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-5
    assert json.loads((flower / "config.json").read_text())["engine"] == "flower"
    report = json.loads((flower.parent / "report.json").read_text())
    assert [m["engine"] for m in report["metadata"]["config"]["resolved_methods"]] == ["flower"]


def test_the_server_ledger_records_the_receipts_clients_send_back(fed):
    """The Flower port's ledger is built from the release receipts each client sends with its
    update: a reply without them, or with releases other than those the round admitted, is refused
    (the round's plan never stands in for what ran)."""
    from accountants import dpsgd_event
    from privkit.flower_engine.apps import RECEIPTS, DpFedPort
    from privkit.mechanisms.gaussian import Receipt
    from privkit.methods import make_config

    cfg = make_config("dp-fedavg", _config("dp-fedavg"))

    def rate(k):
        return min(1.0, cfg.batch_size / len(fed.client_arrays(k)[1]))

    def round_with(receipt_of):
        """A fresh run's first round, finished with the replies ``receipt_of(port, k)`` gives."""
        port = DpFedPort("dp-fedavg", fed, cfg, SEED)
        selected = port.next_round()
        state = port.run.model.state_dict()
        replies = {}
        for k in selected:
            receipt = receipt_of(port, k)
            body = json.dumps([receipt.__dict__] * cfg.local_steps) if receipt else None
            replies[k] = (state, {RECEIPTS: body} if body else {})
        port.finish_round(replies)
        return port, selected

    with pytest.raises(PrivkitError, match="carries no release receipts"):
        round_with(lambda port, k: None)
    with pytest.raises(PrivkitError, match="the budget admitted"):  # half the admitted noise
        round_with(lambda port, k: Receipt(port.run.sigma / 2, cfg.clip_norm, rate(k)))
    port, selected = round_with(lambda port, k: Receipt(port.run.sigma, cfg.clip_norm, rate(k)))
    for k in selected:
        (entry,) = port.run.ledger.entries(k)
        assert entry.event == dpsgd_event(rate(k), port.run.sigma, cfg.local_steps)
