"""privkit.flower in a Flower deployment: a SuperLink and two SuperNodes started here on 127.0.0.1
(killed when the module ends or fails), an app run with ``flwr run``: the DP app accounted (its
ledger where the user ran the federation, epsilon dp-accounting's), a no-DP app refused before round
1, a lifetime budget refused on the second run; rounds accounted as they ran (adaptive clipping
calibrated for more clients than reply, a failed round; LocalDpMod), each against dp-accounting;
canary records audit a deployed app's record-level DP-SGD (tests/privkit/flower_apps/canary: the
correct app consistent, half its noise caught).  Each ``flwr run`` takes about 15 s (Flower's start
of the ServerApp and ClientApp processes; about 2 min for the canary app, whose ClientApp processes
import torch), so the module is marked slow."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import dp_accounting as dpa
import pytest

pytest.importorskip("flwr")

from flower_testapps import report_row

pytestmark = pytest.mark.slow
SMALL = os.environ.get("PRIVKIT_SLOW", "") == "small"
SMALL_SKIP = (
    "PRIVKIT_SLOW=small: CI runs the no-DP refusal only (one accounted flwr run takes 40-80 s on "
    "a loaded 2-core machine); run without PRIVKIT_SLOW for the whole deployment suite"
)

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]
CANARY_APP = Path(__file__).parent / "flower_apps" / "canary"
CANARY_CLIENTS_APP = Path(__file__).parent / "flower_apps" / "canary_clients"
DELTA = 1e-5

PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "pkdeployapp"
version = "1.0.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "privkit"

[tool.flwr.app.components]
serverapp = "pkdeployapp.server:app"
clientapp = "pkdeployapp.client:app"

[tool.flwr.app.config]
num-server-rounds = 2
dp = true
mechanism = "fixed"
sampled = 2
fail-round = 0
budget = 0.0
lifetime-budget = 0.0
store = ""
privkit-dir = ""
"""

SERVER = """\
import numpy as np
from flwr.app import ArrayRecord
from flwr.serverapp import ServerApp
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    FedAvg,
)

from privkit.flower import Accounted

app = ServerApp()


@app.main()
def main(grid, context):
    c = context.run_config
    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=2)
    if c["dp"] and c["mechanism"] == "fixed":
        strategy = DifferentialPrivacyClientSideFixedClipping(
            strategy, noise_multiplier=1.0, clipping_norm=0.5, num_sampled_clients=c["sampled"]
        )
    if c["dp"] and c["mechanism"] == "adaptive":
        strategy = DifferentialPrivacyClientSideAdaptiveClipping(
            strategy, noise_multiplier=1.0, num_sampled_clients=c["sampled"],
            initial_clipping_norm=0.5, clipped_count_stddev=1.0,
        )
    accounted = Accounted(
        strategy, delta=1e-5, budget=c["budget"] or None, out="runs", name="app",
        store=c["store"] or None, lifetime_budget=c["lifetime-budget"] or None, context=context,
    )
    accounted.start(grid=grid, initial_arrays=ArrayRecord([np.zeros(4)]),
                    num_rounds=c["num-server-rounds"])
"""

CLIENT = """\
from pathlib import Path

from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import LocalDpMod, adaptiveclipping_mod, fixedclipping_mod

from privkit.flower import recorded

LOCAL = recorded(LocalDpMod(clipping_norm=0.5, sensitivity=1.0, epsilon=2.0, delta=1e-5))
MODS = {"fixed": fixedclipping_mod, "adaptive": adaptiveclipping_mod, "local": LOCAL}


def chosen(msg, context, call_next):  # the run config's mechanism, client side
    return MODS[context.run_config["mechanism"]](msg, context, call_next)


app = ClientApp(mods=[chosen])


@app.train()
def train(msg, context):
    pid = int(context.node_config["partition-id"])
    Path(context.run_config["privkit-dir"], f"client-{pid}-trained").touch()
    if pid == 1 and msg.content["config"]["server-round"] == context.run_config["fail-round"]:
        raise RuntimeError("node 1 fails this round")
    arrays = [a + pid + 1.0 for a in msg.content["arrays"].to_numpy_ndarrays()]
    metrics = MetricRecord({"num-examples": 10})
    return Message(RecordDict({"arrays": ArrayRecord(arrays), "metrics": metrics}), reply_to=msg)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Federation:
    """A SuperLink and ``nodes`` SuperNodes (two by default) on 127.0.0.1, with a Flower home naming
    the SuperLink."""

    def __init__(self, root: Path, nodes: int = 2) -> None:
        self.root, self.procs, self.nodes = root, [], nodes
        self.port = _free_port()
        self.home = root / "flwr-home"
        self.home.mkdir()
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "local"\n[superlink.local]\n'
            f'address = "127.0.0.1:{self.port}"\ninsecure = true\n'
        )
        self.env = {
            **os.environ,
            "FLWR_HOME": str(self.home),
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
            ),
        }
        self.link_dir = root / "superlink-cwd"
        self.link_dir.mkdir()
        self.app = root / "app"
        (self.app / "pkdeployapp").mkdir(parents=True)
        (self.app / "pyproject.toml").write_text(PYPROJECT)
        (self.app / "pkdeployapp" / "__init__.py").write_text("")
        (self.app / "pkdeployapp" / "server.py").write_text(SERVER)
        (self.app / "pkdeployapp" / "client.py").write_text(CLIENT)
        self.canary_app = root / "canary-app"
        self.canary_clients_app = root / "canary-clients-app"
        for src, dst in (
            (CANARY_APP, self.canary_app),
            (CANARY_CLIENTS_APP, self.canary_clients_app),
        ):
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))

    def _spawn(self, name: str, args: list[str], cwd: Path) -> None:
        log = open(self.root / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
        self.procs.append(
            (subprocess.Popen(args, cwd=cwd, env=self.env, stdout=log, stderr=log), log)
        )

    def start(self, timeout: float = 90.0) -> None:
        self._spawn(
            "superlink",
            [str(BIN / "flower-superlink"), "--insecure", "--port", str(self.port)],
            self.link_dir,
        )
        for pid in range(self.nodes):
            self._spawn(
                f"supernode-{pid}",
                [
                    str(BIN / "flower-supernode"),
                    "--insecure",
                    "--superlink",
                    f"127.0.0.1:{self.port}",
                    "--port",
                    str(_free_port()),
                    "--node-config",
                    f"partition-id={pid} num-partitions={self.nodes}",
                ],
                self.root,
            )
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if any(p.poll() is not None for p, _ in self.procs):
                break
            if self.log("superlink").count("Activated node_id") >= self.nodes:
                return
            time.sleep(0.5)
        raise RuntimeError(
            f"the local SuperLink and {self.nodes} SuperNodes did not start within "
            f"{timeout:g} s; SuperLink log tail: {self.log('superlink')[-600:]!r}"
        )

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        for p, _ in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p, log in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            log.close()

    def run(
        self, user: Path, app: Path | None = None, **config: object
    ) -> subprocess.CompletedProcess:
        """``flwr run`` typed in ``user`` (the app folder given by path, ``app`` or the DP test app),
        its log streamed."""
        user.mkdir(parents=True, exist_ok=True)
        values = {"privkit-dir": str(user), **config}
        overrides = " ".join(f"{k}={json.dumps(v)}" for k, v in values.items())
        return subprocess.run(
            [str(BIN / "flwr"), "run", str(app or self.app), "local", "--stream", "-c", overrides],
            cwd=user,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=240,
        )


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    fed = Federation(tmp_path_factory.mktemp("deployment"))
    try:
        fed.start()
    except Exception:
        fed.stop()
        raise
    yield fed
    fed.stop()


def _gaussian_rdp(multiplier: float, rounds: int) -> float:
    acc = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
    acc.compose(dpa.GaussianDpEvent(multiplier), rounds)
    return float(acc.get_epsilon(DELTA))


@pytest.mark.skipif(SMALL, reason=SMALL_SKIP)
def test_dp_app_is_accounted_where_the_user_ran_it(federation, tmp_path):
    user = tmp_path / "user"
    res = federation.run(user)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ledger = user / "runs" / "app" / "ledger.json"
    assert ledger.is_file(), res.stdout[-3000:]
    assert not (federation.link_dir / "runs").exists()  # not in the SuperLink's directory
    privacy = json.loads((user / "runs" / "app" / "privacy.json").read_text())
    # both nodes sampled: each round is the Gaussian of multiplier z/2 under replace-one
    assert privacy["summary"]["worst"]["rdp"] == pytest.approx(_gaussian_rdp(0.5, 2), rel=1e-9)
    assert json.loads(ledger.read_text())["convention"]["neighbouring"] == "replace_one"
    assert "client-level DP under replace-one" in res.stdout + res.stderr


def test_no_dp_app_is_refused_before_round_one(federation, tmp_path):
    user = tmp_path / "user"
    res = federation.run(user, dp=False, budget=10.0)
    out = res.stdout + res.stderr
    assert "privkit refused round 1 before sending it: no recognised DP mechanism" in out, out[
        -3000:
    ]
    assert not list(user.glob("client-*-trained"))  # no ClientApp ran
    train = json.loads((user / "runs" / "app" / "train.json").read_text())
    assert train["rounds_run"] == 0 and train["stop"].startswith("stopped before round 1")


@pytest.mark.skipif(SMALL, reason=SMALL_SKIP)
def test_lifetime_budget_is_refused_on_the_second_run(federation, tmp_path):
    user = tmp_path / "user"
    store = str(user / "lifetime")
    two, three = _gaussian_rdp(0.5, 2), _gaussian_rdp(0.5, 3)
    res = federation.run(user, store=store, **{"lifetime-budget": 100.0})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    res = federation.run(user, store=store, **{"lifetime-budget": (two + three) / 2})
    out = res.stdout + res.stderr
    assert f"lifetime epsilon {three:.4g} > lifetime budget" in out, out[-3000:]
    from typer.testing import CliRunner

    from privkit.cli import app as cli

    cmd = ["budget", "lifetime", store, "--delta", "1e-5", "--json"]
    res = CliRunner().invoke(cli, cmd)
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["lifetime"]["rdp"] == pytest.approx(two, rel=1e-9)
    assert len(json.loads(res.output)["runs"]) == 1


def _worst(user: Path, name: str = "app") -> dict:
    return json.loads((user / "runs" / name / "privacy.json").read_text())["summary"]["worst"]


@pytest.mark.skipif(SMALL, reason=SMALL_SKIP)
def test_adaptive_clipping_with_a_dropout_and_a_failed_round_accounted_as_they_ran(
    federation, tmp_path
):
    """Adaptive clipping asked for z = 1 (sigma_b = 1) calibrated for m = 3 clients, 2 replying
    (noise for 3 averaged over 2); node 1 fails in round 2, which Flower then skips (no release).
    Each released round is the Gaussian with mult^-2 = (z_u 2 / (2 3))^-2 + sigma_b^-2 (see
    test_flower_dropouts)."""
    user = tmp_path / "user"
    config = {"mechanism": "adaptive", "sampled": 3, "fail-round": 2, "num-server-rounds": 3}
    res = federation.run(user, **config)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    z_u = (1.0 - 0.25) ** -0.5
    mult = ((z_u * 2 / (2 * 3)) ** -2 + 1.0) ** -0.5
    assert _worst(user)["rdp"] == pytest.approx(_gaussian_rdp(mult, 2), rel=1e-9)
    metrics = json.loads((user / "runs" / "app" / "metrics.json").read_text())
    assert [r["round"] for r in metrics["rounds"]] == [1, 3], metrics
    train = json.loads((user / "runs" / "app" / "train.json").read_text())
    assert "round 2: 1 of 2 clients failed" in json.dumps(train), train


@pytest.mark.skipif(SMALL, reason=SMALL_SKIP)
def test_local_dp_mod_accounted_in_deployment(federation, tmp_path):
    """LocalDpMod(clipping_norm 0.5, sensitivity 1, epsilon 2, delta 1e-5) on both nodes, no central
    wrapper: each round costs a client the Gaussian of std sqrt(2 ln(1.25/delta)) / 2 over the
    replace-one sensitivity 2 x 0.5."""
    import math

    user = tmp_path / "user"
    res = federation.run(user, mechanism="local")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    std = 1.0 * math.sqrt(2 * math.log(1.25 / DELTA)) / 2.0
    assert _worst(user)["rdp"] == pytest.approx(_gaussian_rdp(std / 1.0, 2), rel=1e-9)


@pytest.mark.skipif(SMALL, reason=SMALL_SKIP)
def test_canary_records_audit_a_deployed_app(federation, tmp_path):
    """Canary records in node 0's own data (tests/privkit/flower_apps/canary): the claim tested is
    the client's record-level DP-SGD as its ledger entries state it (Poisson q = 0.05, sigma 1.5,
    100 steps: the audit's claim is the ledger's epsilon).  The correct app is consistent; the app
    whose ClientApp adds half that noise is caught by the noise conformance test."""
    event = dpa.SelfComposedDpEvent(
        dpa.PoissonSampledDpEvent(0.05, dpa.GaussianDpEvent(1.5)), 5 * 20
    )
    acc = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(event)

    from privkit.flower import write_audit

    results = {}
    for scale in (1.0, 0.5):
        user = tmp_path / f"user-{scale}"
        res = federation.run(user, app=federation.canary_app, **{"noise-scale": scale})
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        worst = _worst(user, "canary-app")
        assert worst["rdp"] == pytest.approx(float(acc.get_epsilon(DELTA)), rel=1e-9)
        canaries = pickle.loads((user / "canaries.pkl").read_bytes())
        assert canaries.steps == 100
        results[scale] = audit = canaries.audit(delta=DELTA)
        assert audit.accounted_epsilon == pytest.approx(worst["best"], rel=1e-6)
        # the result lands next to the run's ledger, where privkit report reads it
        write_audit(user / "runs" / "canary-app", audit, DELTA, "node 0's record-level DP-SGD")
        row = report_row(user / "runs", "canary-app")
        assert f"| {audit.verdict} |" in row, row
    assert results[1.0].verdict == "consistent", results[1.0].conformance.failed
    assert results[0.5].verdict == "violation"
    assert "noise" in results[0.5].conformance.failed


@pytest.fixture(scope="module")
def ten_nodes(tmp_path_factory):
    fed = Federation(tmp_path_factory.mktemp("deployment-10"), nodes=10)
    try:
        fed.start(timeout=180.0)
    except Exception:
        fed.stop()
        raise
    yield fed
    fed.stop()


@pytest.mark.skipif(SMALL, reason=SMALL_SKIP)
def test_canary_clients_audit_the_servers_noise_in_deployment(ten_nodes, tmp_path):
    """Canary clients (tests/privkit/flower_apps/canary_clients) on ten SuperNodes, 8 of them canary
    clients, 4 of 10 sampled per round for 6 rounds, Flower's client-side fixed clipping (z = 1,
    C = 1): the claim tested is the server's client-level Gaussian as the ledger states it.  The
    correct app is consistent; the app whose wrapper adds half the noise privkit read from it is
    caught by the noise test.  (In-process, this configuration gave 10 of 10 seeds each way.)"""
    # the ledger's claim, replayed: every node, each round, 4 of 10 drawn, Gaussian z / 2
    per_round = dpa.SampledWithoutReplacementDpEvent(10, 4, dpa.GaussianDpEvent(0.5))
    acc = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
    acc.compose(per_round, 6)
    for scale, verdict in ((1.0, "consistent"), (0.5, "violation")):
        user = tmp_path / f"user-{scale}"
        res = ten_nodes.run(user, app=ten_nodes.canary_clients_app, **{"noise-scale": scale})
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        run = user / "runs" / "canary-clients"
        assert _worst(user, "canary-clients")["rdp"] == pytest.approx(
            float(acc.get_epsilon(DELTA)), rel=1e-9
        )
        audit = json.loads((run / "audit.json").read_text())
        assert audit["verdict"]["status"] == verdict, audit["verdict"]
        if scale == 0.5:
            assert "noise" in audit["verdict"]["conformance"]["failed"]
        row = report_row(user / "runs", "canary-clients")
        assert f"| {verdict} |" in row, row
