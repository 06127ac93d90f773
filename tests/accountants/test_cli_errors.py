"""Every bad ``privkit budget`` input: one line on stderr naming the field and the value, exit code 2.

The table runs through ``privkit.cli.main`` (the console script's entry point) in-process; a few
rows also run through the installed console script itself (all of them unless PRIVKIT_SLOW=small,
since each process start costs seconds on CI).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import accountants as acc
from privkit.cli import main

DPSGD = ["budget", "dpsgd", "--sample-rate", "0.01", "--noise-multiplier", "1", "--delta", "1e-5"]
CAL = ["budget", "calibrate", "--epsilon", "1", "--delta", "1e-5", "--sample-rate", "0.01"]


def _ledger(tmp: Path, name: str, mutate) -> str:
    ledger = acc.Ledger()
    ledger.add("c0", acc.dpsgd_event(0.01, 1.0, 10), "round 1: dp-sgd")
    data = ledger.to_dict()
    mutate(data)
    path = tmp / name
    path.write_text(json.dumps(data).replace("NaN", "NaN"))
    return str(path)


def _file(tmp: Path, name: str, text: str) -> str:
    path = tmp / name
    path.write_text(text)
    return str(path)


def _event(data):
    return data["clients"]["c0"][0]["event"]["fields"]["event"]["fields"]


# (id, argv builder, substrings the one line must contain)
CASES = [
    ("dpsgd-steps-float", lambda t: DPSGD + ["--steps", "1.5"], ["--steps", "1.5"]),
    ("calibrate-steps-float", lambda t: CAL + ["--steps", "1.5"], ["--steps", "1.5"]),
    ("dpsgd-steps-text", lambda t: DPSGD + ["--steps", "abc"], ["--steps", "abc"]),
    ("dpsgd-steps-zero", lambda t: DPSGD + ["--steps", "0"], ["--steps", "0"]),
    (
        "dpsgd-q-above-one",
        lambda t: [
            "budget",
            "dpsgd",
            "--sample-rate",
            "1.5",
            "--noise-multiplier",
            "1",
            "--steps",
            "10",
            "--delta",
            "1e-5",
        ],
        ["--sample-rate", "1.5"],
    ),
    (
        "dpsgd-q-nan",
        lambda t: [
            "budget",
            "dpsgd",
            "--sample-rate",
            "nan",
            "--noise-multiplier",
            "1",
            "--steps",
            "10",
            "--delta",
            "1e-5",
        ],
        ["--sample-rate", "nan"],
    ),
    (
        "dpsgd-sigma-negative",
        lambda t: [
            "budget",
            "dpsgd",
            "--sample-rate",
            "0.1",
            "--noise-multiplier",
            "-1",
            "--steps",
            "10",
            "--delta",
            "1e-5",
        ],
        ["--noise-multiplier", "-1"],
    ),
    (
        "dpsgd-delta-zero",
        lambda t: [
            "budget",
            "dpsgd",
            "--sample-rate",
            "0.1",
            "--noise-multiplier",
            "1",
            "--steps",
            "10",
            "--delta",
            "0",
        ],
        ["delta", "0"],
    ),
    (
        "dpsgd-accountant",
        lambda t: DPSGD + ["--steps", "10", "--accountant", "exact"],
        ["--accountant", "exact"],
    ),
    (
        "dpsgd-sampler",
        lambda t: DPSGD + ["--steps", "10", "--sampler", "bagging"],
        ["--sampler", "bagging"],
    ),
    (
        "dpsgd-prv-memory",
        lambda t: [
            "budget",
            "dpsgd",
            "--sample-rate",
            "0.41",
            "--noise-multiplier",
            "1",
            "--steps",
            "41327",
            "--delta",
            "1e-5",
            "--accountant",
            "prv",
        ],
        ["steps=41327", "pld"],
    ),
    (
        "dpsgd-steps-past-float",
        lambda t: DPSGD + ["--steps", "1" + "0" * 400],
        ["--steps", "<= 1e+300", "401"],
    ),
    (
        "dpsgd-prv-sigma-underflow",
        lambda t: [
            "budget",
            "dpsgd",
            "--sample-rate",
            "1",
            "--noise-multiplier",
            "1e-300",
            "--steps",
            "5",
            "--delta",
            "1e-5",
            "--accountant",
            "prv",
        ],
        ["prv", "noise_multiplier=1e-300", "rdp"],
    ),
    (
        "calibrate-past-the-pld-grid",
        lambda t: [
            "budget",
            "calibrate",
            "--epsilon",
            "3000",
            "--delta",
            "1e-5",
            "--sample-rate",
            "1",
            "--steps",
            "500",
        ],
        ["grid of", "rdp"],
    ),
    (
        "calibrate-epsilon-negative",
        lambda t: [
            "budget",
            "calibrate",
            "--epsilon",
            "-1",
            "--delta",
            "1e-5",
            "--sample-rate",
            "0.01",
            "--steps",
            "10",
        ],
        ["epsilon", "-1"],
    ),
    (
        "calibrate-epsilon-inf",
        lambda t: [
            "budget",
            "calibrate",
            "--epsilon",
            "inf",
            "--delta",
            "1e-5",
            "--sample-rate",
            "0.01",
            "--steps",
            "10",
        ],
        ["epsilon", "inf"],
    ),
    (
        "gaussian-delta",
        lambda t: ["budget", "gaussian", "--epsilon", "0.5", "--delta", "1.5"],
        ["delta", "1.5"],
    ),
    (
        "gaussian-sensitivity-text",
        lambda t: [
            "budget",
            "gaussian",
            "--epsilon",
            "0.5",
            "--delta",
            "1e-5",
            "--sensitivity",
            "x",
        ],
        ["--sensitivity", "'x'"],
    ),
    (
        "nfdp-k",
        lambda t: ["budget", "nfdp", "--n", "10", "--k", "11", "--no-replacement"],
        ["k", "11"],
    ),
    (
        "nfdp-n-float",
        lambda t: ["budget", "nfdp", "--n", "10.5", "--k", "3", "--replacement"],
        ["--n", "10.5"],
    ),
    (
        "logreg-lambda",
        lambda t: ["budget", "sensitivity", "logreg", "--n", "100", "--lambda", "-2"],
        ["lam", "-2"],
    ),
    (
        "compose-eps-delta-text",
        lambda t: ["budget", "compose", "--eps-delta", "abc:1e-5"],
        ["epsilon", "'abc'"],
    ),
    (
        "compose-gaussian-eps-method",
        lambda t: ["budget", "compose", "--gaussian-eps", "1:1e-5:exact"],
        ["method", "'exact'"],
    ),
    (
        "compose-gaussian-text",
        lambda t: ["budget", "compose", "--gaussian", "two", "--delta", "1e-5"],
        ["--gaussian", "'two'"],
    ),
    (
        "compose-file-missing",
        lambda t: ["budget", "compose", "--file", str(t / "none.json")],
        ["none.json"],
    ),
    (
        "compose-file-not-json",
        lambda t: ["budget", "compose", "--file", _file(t, "bad.json", "{releases: [")],
        ["bad.json", "not valid JSON"],
    ),
    (
        "compose-file-scalar",
        lambda t: ["budget", "compose", "--file", _file(t, "scalar.json", "3")],
        ["scalar.json", "list of releases"],
    ),
    (
        "compose-file-releases-object",
        lambda t: ["budget", "compose", "--file", _file(t, "obj.json", '{"releases": {"a": 1}}')],
        ["obj.json", '{"a": 1}'],
    ),
    (
        "compose-file-number-item",
        lambda t: ["budget", "compose", "--file", _file(t, "nums.json", "[1, 2]")],
        ["releases[0]", "1"],
    ),
    (
        "compose-file-gaussian-text",
        lambda t: [
            "budget",
            "compose",
            "--delta",
            "1e-5",
            "--file",
            _file(t, "g.json", '[{"gaussian": "abc"}]'),
        ],
        ["releases[0]", "gaussian", "'abc'"],
    ),
    (
        "compose-file-gaussian-eps-short",
        lambda t: ["budget", "compose", "--file", _file(t, "ge.json", '[{"gaussian_eps": [1]}]')],
        ["releases[0]", "gaussian_eps", "[1]"],
    ),
    (
        "compose-file-unknown-key",
        lambda t: ["budget", "compose", "--file", _file(t, "k.json", '[{"laplace": 1}]')],
        ["releases[0]", "laplace"],
    ),
    (
        "compose-file-epsilon-null",
        lambda t: [
            "budget",
            "compose",
            "--file",
            _file(t, "n.json", '[{"epsilon": null, "delta": 1e-5}]'),
        ],
        ["releases[0]", "epsilon", "None"],
    ),
    (
        "ledger-nan-sigma",
        lambda t: [
            "budget",
            "ledger",
            "--delta",
            "1e-5",
            _ledger(
                t,
                "nan.json",
                lambda d: _event(d).__setitem__(
                    "event",
                    {
                        "type": "dp_accounting.dp_event:GaussianDpEvent",
                        "fields": {"noise_multiplier": float("nan")},
                    },
                ),
            ),
        ],
        ["noise_multiplier", "nan", "'c0'"],
    ),
    (
        "ledger-inf-sigma",
        lambda t: [
            "budget",
            "ledger",
            "--delta",
            "1e-5",
            _ledger(
                t,
                "inf.json",
                lambda d: _event(d).__setitem__(
                    "event",
                    {
                        "type": "dp_accounting.dp_event:GaussianDpEvent",
                        "fields": {"noise_multiplier": {"float": "inf"}},
                    },
                ),
            ),
        ],
        ["noise_multiplier", "inf", "'c0'"],
    ),
    (
        "ledger-q-out-of-range",
        lambda t: [
            "budget",
            "ledger",
            "--delta",
            "1e-5",
            _ledger(t, "q.json", lambda d: _event(d).__setitem__("sampling_probability", 1.5)),
        ],
        ["sampling_probability", "1.5", "'c0'"],
    ),
    (
        "ledger-count-float",
        lambda t: [
            "budget",
            "ledger",
            "--delta",
            "1e-5",
            _ledger(
                t,
                "count.json",
                lambda d: d["clients"]["c0"][0]["event"]["fields"].__setitem__("count", 2.5),
            ),
        ],
        ["count", "2.5"],
    ),
    (
        "ledger-clients-list",
        lambda t: [
            "budget",
            "ledger",
            "--delta",
            "1e-5",
            _ledger(t, "list.json", lambda d: d.__setitem__("clients", [])),
        ],
        ["clients", "[]"],
    ),
    (
        "ledger-entry-without-event",
        lambda t: [
            "budget",
            "ledger",
            "--delta",
            "1e-5",
            _ledger(t, "noev.json", lambda d: d["clients"]["c0"][0].pop("event")),
        ],
        ["entry 0", "event"],
    ),
    (
        "ledger-not-json",
        lambda t: ["budget", "ledger", "--delta", "1e-5", _file(t, "x.json", "{")],
        ["x.json"],
    ),
    (
        "ledger-pld-grid",
        lambda t: [
            "budget",
            "ledger",
            "--delta",
            "1e-5",
            "--pld-grid",
            "0",
            _ledger(t, "ok.json", lambda d: None),
        ],
        ["pld_grid", "0"],
    ),
]
SCRIPT_ROWS = {
    "dpsgd-steps-float",
    "calibrate-steps-float",
    "compose-file-not-json",
    "ledger-nan-sigma",
    "ledger-inf-sigma",
}


def _check(rc: int, out: str, err: str, needles: list[str]) -> None:
    assert rc == 2, (rc, out, err)
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_one_line_exit_2(case, tmp_path, monkeypatch, capsys):
    _, argv, needles = case
    monkeypatch.setattr(sys, "argv", ["privkit", *argv(tmp_path)])
    monkeypatch.setenv("COLUMNS", "400")  # one line however long the message
    with pytest.raises(SystemExit) as exc:
        main()
    captured = capsys.readouterr()
    _check(exc.value.code, captured.out, captured.err, needles)


SLOW = os.environ.get("PRIVKIT_SLOW", "") != "small"


@pytest.mark.parametrize(
    "case", [c for c in CASES if SLOW or c[0] in SCRIPT_ROWS], ids=lambda c: c[0]
)
def test_bad_input_through_console_script(case, tmp_path):
    # the installed console script; without one (privkit not pip-installed), its entry point
    script = shutil.which("privkit", path=str(Path(sys.executable).parent))
    command = [script] if script else [sys.executable, "-c", "from privkit.cli import main; main()"]
    _, argv, needles = case
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "COLUMNS": "400"}
    proc = subprocess.run(
        [*command, *argv(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    _check(proc.returncode, proc.stdout, proc.stderr, needles)
