"""``privkit budget`` CLI: JSON keys and values, and one-line errors with exit code 2."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

import accountants as acc
from privkit.cli import app

runner = CliRunner()


def _json(*args):
    result = runner.invoke(app, ["budget", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_gaussian_both_directions():
    out = _json("gaussian", "--epsilon", "0.5", "--delta", "1e-5")
    assert out["classic_sigma"] == pytest.approx(acc.classic_gaussian_sigma(0.5, 1e-5))
    # notes §3c: 7.0318266756; privkit rounds toward more noise by a relative 1e-8 at most
    assert 7.0318266756 - 1e-10 <= out["analytic_sigma"] <= 7.0318266756 * (1 + 1e-8)
    assert out["ratio"] == pytest.approx(out["classic_sigma"] / out["analytic_sigma"])
    assert out["warnings"] == []
    out = _json("gaussian", "--sigma", "2", "--delta", "1e-5", "--sensitivity", "1")
    assert out["analytic_epsilon"] == pytest.approx(acc.gaussian_epsilon(2.0, 1e-5))
    assert out["warnings"]  # classic epsilon 2.42 >= 1
    assert _json("gaussian", "--epsilon", "2", "--delta", "1e-5")["warnings"]


def test_nfdp():
    out = _json("nfdp", "--n", "100", "--k", "10", "--no-replacement")
    assert (out["epsilon"], out["delta"]) == pytest.approx(acc.nfdp_epsilon_delta(100, 10, False))
    assert out["profile"][0] == {"epsilon": 0.0, "delta": pytest.approx(0.1)}
    assert any("1/n" in w for w in out["warnings"])
    assert _json("nfdp", "--n", "100", "--k", "10", "--replacement")["delta"] == pytest.approx(
        1 - 0.99**10
    )


def test_dpsgd_all_and_calibrate():
    out = _json(
        "dpsgd",
        "--sample-rate",
        "0.01",
        "--noise-multiplier",
        "1",
        "--steps",
        "1000",
        "--delta",
        "1e-5",
        "--accountant",
        "all",
    )
    assert set(out["epsilon"]) == {"rdp", "pld", "prv"}
    assert out["epsilon"]["rdp"] == pytest.approx(2.10137, rel=1e-5)  # notes §3b
    assert out["neighbouring"] == "add_remove"
    bracket = out["epsilon_bracket"]  # certified: the printed tight epsilon is its upper end
    assert bracket["upper"] == min(out["epsilon"]["pld"], out["epsilon"]["prv"])
    assert bracket["lower"] <= bracket["upper"] and bracket["upper"] - bracket["lower"] < 1e-3
    out = _json(
        "dpsgd",
        "--sample-rate",
        "0.1",
        "--noise-multiplier",
        "5",
        "--steps",
        "100",
        "--delta",
        "1e-5",
        "--sampling",
        "without-replacement",
        "--accountant",
        "rdp",
    )
    assert out["neighbouring"] == "replace_one" and out["epsilon"] == pytest.approx(
        4.02487643, rel=1e-8
    )
    assert out["epsilon_bracket"] is None and out["bracket_reason"] == "not-tight"
    out = _json(
        "calibrate", "--epsilon", "3", "--delta", "1e-5", "--sample-rate", "0.01", "--steps", "500"
    )
    assert out["epsilon"] <= 3.0
    assert out["epsilon_bracket"]["lower"] <= out["epsilon"] == out["epsilon_bracket"]["upper"]
    assert out["epsilon_bracket"]["lower"] > 0.99 * out["epsilon"]
    rdp = _json(
        "calibrate",
        "--epsilon",
        "3",
        "--delta",
        "1e-5",
        "--sample-rate",
        "0.01",
        "--steps",
        "500",
        "--accountant",
        "rdp",
    )
    assert rdp["epsilon_bracket"] is None and rdp["bracket_reason"] == "not-tight"
    assert (
        acc.dpsgd_epsilon(
            0.01,
            out["noise_multiplier"],
            500,
            1e-5,
            accountant="pld",
            value_discretization_interval=1e-3,
        )
        <= 3.0
    )


def test_sensitivity_and_compose_fedauxfdp():
    out = _json("sensitivity", "logreg", "--n", "1000", "--lambda", "0.01", "--classes", "10")
    assert out["multinomial"] == pytest.approx(2 * 10**0.5 / 10)
    out = _json(
        "compose", "--gaussian-eps", "0.1:1e-5:classic", "--gaussian-eps", "0.5:1e-5:classic"
    )
    assert out["basic"] == {"epsilon": pytest.approx(0.6), "delta": pytest.approx(2e-5)}
    assert out["best"]["epsilon"] < 0.6
    out2 = _json("compose", "--gaussian", "3", "--eps-delta", "0.5:1e-6", "--delta", "1e-5")
    assert out2["basic"] is None and out2["best"]["epsilon"] > 0.5
    pld = out2["epsilon_bracket"][
        "pld"
    ]  # a Gaussian and a fixed (0.5, 1e-6): both ends hold the 0.5
    assert 0.5 < pld["lower"] <= out2["accountants"]["pld"] == pld["upper"]
    assert out2["epsilon_bracket"]["rdp"] is None and out2["bracket_reason"]["rdp"] == "not-tight"


def test_ledger_command(tmp_path):
    ledger = acc.Ledger()
    ledger.add("a", acc.dpsgd_event(0.01, 1.0, 100), "dp")
    ledger.add("b", acc.dpsgd_event(0.01, 0.8, 100), "dp")
    path = ledger.save(tmp_path / "ledger.json")
    result = runner.invoke(app, ["budget", "ledger", str(path), "--delta", "1e-5", "--json"])
    out = json.loads(result.stdout)
    coarse = acc.Ledger.from_dict({**ledger.to_dict(), "value_discretization_interval": 1e-3})
    assert out["pld_grid"] == 1e-3 and out["worst"]["best"] == pytest.approx(coarse.epsilon(1e-5))
    # the pessimistic 1e-3 grid never undercuts the 1e-4 grid, and --pld-grid 1e-4 reproduces it
    assert out["worst"]["pld"] >= ledger.epsilon(1e-5, accountant="pld")
    fine = json.loads(
        runner.invoke(
            app, ["budget", "ledger", str(path), "--delta", "1e-5", "--pld-grid", "1e-4", "--json"]
        ).stdout
    )
    assert fine["worst"]["best"] == pytest.approx(ledger.epsilon(1e-5))
    assert set(out["clients"]["a"]) >= {"basic", "rdp", "pld", "best"}
    pld = out["epsilon_bracket"]["pld"]
    assert (
        pld["worst"]["upper"] == out["worst"]["pld"]
        and pld["worst"]["lower"] <= out["worst"]["pld"]
    )
    assert (
        pld["clients"]["a"]["lower"] <= out["clients"]["a"]["pld"] == pld["clients"]["a"]["upper"]
    )
    assert out["bracket_reason"] == {
        "basic": "not-tight",
        "advanced": "not-tight",
        "rdp": "not-tight",
    }
    human = runner.invoke(app, ["budget", "ledger", str(path), "--delta", "1e-5"])
    assert human.exit_code == 0 and "worst" in human.stdout
    assert "certified bracket" in human.stdout and f"{pld['worst']['lower']:.6g}" in human.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["gaussian", "--epsilon", "0.5", "--delta", "1.5"],
        ["gaussian", "--sigma", "-1", "--delta", "1e-5"],
        ["nfdp", "--n", "10", "--k", "11", "--no-replacement"],
        [
            "dpsgd",
            "--sample-rate",
            "0.01",
            "--noise-multiplier",
            "1",
            "--steps",
            "0",
            "--delta",
            "1e-5",
        ],
        ["calibrate", "--epsilon", "1", "--delta", "0", "--sample-rate", "0.01", "--steps", "10"],
        ["compose", "--eps-delta", "abc:1e-5"],
        ["sensitivity", "logreg", "--n", "0", "--lambda", "1"],
    ],
)
def test_invalid_values_raise_value_error(args):
    result = runner.invoke(app, ["budget", *args])
    assert isinstance(result.exception, ValueError), result.output


def test_subprocess_one_line_error_exit_2(tmp_path):
    cmd = [
        sys.executable,
        "-c",
        "from privkit.cli import main; main()",
        "budget",
        "gaussian",
        "--epsilon",
        "0.5",
        "--delta",
        "1.5",
        "--json",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "delta must be in (0, 1); found 1.5" in lines[0]
    missing = runner.invoke(
        app, ["budget", "ledger", str(tmp_path / "none.json"), "--delta", "1e-5"]
    )
    assert isinstance(missing.exception, FileNotFoundError)  # main() maps it to one line, exit 2


def test_accountants_does_not_import_torch():
    code = "import sys, accountants, accountants.ledger; assert 'torch' not in sys.modules, 'torch imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
