"""benchmarks/step_replay.py in a small configuration: its JSON (the plain training and one replayed
per patience timed on the same Poisson batches, the ratios from the repeats' pairs, the replay's own counts, the trainings'
parameters compared), and bad input refused in one line with exit code 2."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "step_replay.py"


def _run(*args, script=SCRIPT):
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=600
    )


def test_the_benchmark_trains_every_way_on_the_same_batches():
    run = _run("--models", "lstm", "--steps", "40", "--records", "4", "--repeats", "2",
               "--host-bound", "--patience", "1,0", "--json")  # fmt: skip
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["schema_version"] == 2 and out["setup"]["host_bound"]
    assert out["setup"]["dataset"] == 16 and out["setup"]["steps"] == 40
    assert out["setup"]["patience"] == [1.0, 0.0]
    r = out["models"]["lstm"]
    plain = r["runs"]["plain"]
    eager, patient = r["runs"]["replay_patience_0"], r["runs"]["replay_patience_1"]
    assert len(plain) == len(eager) == len(patient) == 2
    # the same batches: the same sizes; a batch of under 16 records is its own size
    assert (
        [p["sizes"] for p in plain] == [q["sizes"] for q in eager] == [q["sizes"] for q in patient]
    )
    assert all(q["traces"] <= q["sizes"] and q["replayed"] > 0 for q in eager)
    # patience 1 traces the first size, later ones once paid for: never more than patience 0
    assert all(1 <= q["traces"] <= e["traces"] for q, e in zip(patient, eager, strict=True))
    for variant, runs in (("replay_patience_0", eager), ("replay_patience_1", patient)):
        pairs = zip(runs, plain, strict=True)
        assert r["training_ratio"][variant] == pytest.approx(
            statistics.median(a["seconds"] / b["seconds"] for a, b in pairs)
        )
    assert r["largest_parameter_difference"] < 1e-5  # the same training up to float rounding


@pytest.mark.parametrize(
    "args, named",
    [
        (["--steps", "0"], "--steps must be >= 1; found 0"),
        (["--records", "0"], "--records must be >= 1; found 0"),
        (["--repeats", "0"], "--repeats must be >= 1; found 0"),
        (["--patience", "1,-2"], "--patience must be numbers >= 0; found 1,-2"),
        (["--patience", "soon"], "--patience must be numbers >= 0; found soon"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(args, named):
    run = _run(*args)
    assert run.returncode == 2 and named in run.stderr.splitlines()[-1]


def test_canary_overhead_weighs_the_canaries_against_a_replayed_step():
    run = _run("--models", "resnet_gn", "--canaries", "0,50", "--paths", "sparse", "--repeats",
               "1", "--replay", "--json", script=SCRIPT.parent / "canary_overhead.py")  # fmt: skip
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["replay"] is True
    rows = {(r["noise"], r["canaries"]) for r in out["rows"]}
    assert rows == {("release", 0), ("release", 50), ("seeded", 0), ("seeded", 50)}


def test_canary_overhead_times_opacus_with_the_injected_canaries():
    """``--opacus``: opacus' ghost step without canaries, with the auditor's canaries through
    the sparse ``inject`` and through the dense one it replaced, beside privkit's steps."""
    run = _run("--models", "mlp", "--canaries", "0,50", "--paths", "sparse", "--repeats", "1",
               "--opacus", "--json", script=SCRIPT.parent / "canary_overhead.py")  # fmt: skip
    assert run.returncode == 0, run.stderr
    rows = {(r["noise"], r["canaries"], r["path"]): r for r in json.loads(run.stdout)["rows"]}
    opacus = {k for k in rows if k[0] == "opacus"}
    assert opacus == {
        ("opacus", 0, "none"),
        ("opacus", 50, "inject"),
        ("opacus", 50, "inject-dense"),
    }
    assert all(r["median_ms"] > 0 and r["overhead"] is not None for r in rows.values())
