"""``privkit audit RUN_DIR --mechanisms``: the white-box audit of a run's method at its mechanisms,
its positive control (``--mutation``), and one-line errors for bad options."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from audit_helpers import make_run, tiny_federation_config
from typer.testing import CliRunner

from privkit.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    return make_run(
        tmp_path_factory.mktemp("mech"),
        "dp-fedavg",
        tiny_federation_config(clients=3),
        {"arch": "mlp", "rounds": 4},
    )


def test_correct_run_conforms_and_the_broken_copy_is_caught(dp_run):
    res = runner.invoke(app, ["audit", str(dp_run), "--mechanisms", "--json", "--canaries", "300"])
    assert res.exit_code == 0, res.output
    record = json.loads(res.stdout)
    assert record["status"] == "consistent" and record["probes"][0]["mechanism"] == "dp-sgd"
    saved = json.loads((dp_run / "mechanism-audit.json").read_text())
    assert saved["status"] == "consistent" and saved["mutation"]["name"] == "correct"
    tests = saved["probes"][0]["audit"]["conformance"]["tests"]
    assert set(tests) == {"releases", "noise", "influence"}

    res = runner.invoke(
        app, ["audit", str(dp_run), "--mechanisms", "--mutation", "noise x1/2", "--canaries", "300"]
    )
    assert res.exit_code == 0, res.output
    assert "verdict: violation" in " ".join(res.output.split())
    broken = json.loads((dp_run / "mechanism-audit-noise-x1-2.json").read_text())
    assert broken["status"] == "violation" and broken["probes"][0]["rejected"] == ["noise"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mutation", "bogus"], "--mutation must be one of"),
        (["--canaries", "1"], "--canaries must be >= 2"),
        (["--clients", "a,b"], "--clients must be comma-separated"),
        (["--clients", "7"], "--clients must be below the federation's 3 clients"),
    ],
)
def test_bad_options_are_refused_before_training(dp_run, args, message):
    res = runner.invoke(app, ["audit", str(dp_run), "--mechanisms", *args])
    assert isinstance(res.exception, ValueError) and message in str(res.exception)


def test_subprocess_one_line_error_exit_2(dp_run):
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from privkit.cli import main; main()",
            "audit",
            str(dp_run),
            "--mechanisms",
            "--mutation",
            "noise x3",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--mutation" in lines[0] and "noise x3" in lines[0]
