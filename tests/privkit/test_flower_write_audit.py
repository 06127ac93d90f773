"""privkit.flower.write_audit: an audit of a Flower run lands next to its ledger, and privkit report
shows its verdict.  The run: the canary-clients app of the deployment test
(tests/privkit/flower_apps/canary_clients) in-process, 2 clients and 8 canary clients, 4 of 10
drawn per round, 6 rounds; its ServerApp audits and calls write_audit itself."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr")

from flower_testapps import report_row

APP = Path(__file__).parent / "flower_apps" / "canary_clients"


@pytest.fixture
def canary_clients_app(monkeypatch):
    monkeypatch.syspath_prepend(str(APP))
    from pkccapp.client import app as client
    from pkccapp.server import app as server

    yield server, client
    for name in [m for m in sys.modules if m == "pkccapp" or m.startswith("pkccapp.")]:
        del sys.modules[name]


@pytest.mark.parametrize(("scale", "verdict"), [(1.0, "consistent"), (0.5, "violation")])
def test_the_servers_audit_is_in_the_run_and_in_the_report(
    canary_clients_app, tmp_path, scale, verdict
):
    from privkit.flower import run_inprocess

    server, client = canary_clients_app
    config = {"privkit-dir": str(tmp_path), "seed": 0, "noise-scale": scale}
    config |= {"num-server-rounds": 6, "sampled": 4, "canaries": 8}
    state = random.getstate(), np.random.get_state()  # the ServerApp seeds Flower's draw and noise
    try:
        run_inprocess(server, client, 10, run_config=config)
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
    audit = json.loads((tmp_path / "runs" / "canary-clients" / "audit.json").read_text())
    assert audit["verdict"]["status"] == verdict
    assert audit["audited"] == "the server's client-level Gaussian"
    privacy = json.loads((tmp_path / "runs" / "canary-clients" / "privacy.json").read_text())
    assert audit["accounted_epsilon"] == pytest.approx(privacy["summary"]["worst"]["rdp"], rel=1e-9)
    assert audit["audit_kind"] == "canary-clients"
    row = report_row(tmp_path / "runs", "canary-clients")
    assert f"| {verdict} |" in row, row
    assert "| canary-client audit (client-level) |" in row, row  # white-box, not black-box


def test_write_audit_names_a_folder_that_holds_no_run(tmp_path):
    from privkit.flower import write_audit

    with pytest.raises(
        ValueError, match=r"run must be a folder written by privkit\.flower .*; found "
    ):
        write_audit(tmp_path, object(), 1e-5, "x")
