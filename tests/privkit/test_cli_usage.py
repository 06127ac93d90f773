"""Bad input through the real ``privkit`` console script: one line naming the option or file and
the value found, exit code 2, never a traceback; Ctrl-C exits 130 and keeps finished work; help
renders every word; start-up imports no heavy library; the build has no deprecated metadata.

Usage errors come from click, which typer >= 0.2x vendors as ``typer._click``; to run the usage
cases against another typer release too, install it into a folder and name it::

    pip install --no-deps --target /tmp/typer-old "typer==0.24.1"   # uses the external click
    PRIVKIT_TEST_TYPER_PATH=/tmp/typer-old pytest tests/privkit/test_cli_usage.py
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from fault_harness import kill_group, need_sigint, owned

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).with_name("privkit")
TYPER_PATHS = [None] + (
    [os.environ["PRIVKIT_TEST_TYPER_PATH"]] if os.environ.get("PRIVKIT_TEST_TYPER_PATH") else []
)
HEAVY = ("torch", "opacus", "catboost", "ray", "dp_accounting", "matplotlib", "sklearn", "scipy")


def _env(typer_path: str | None = None) -> dict:
    paths = [p for p in (typer_path, str(REPO), os.environ.get("PYTHONPATH")) if p]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(paths),
        "OMP_NUM_THREADS": "1",
        "COLUMNS": "200",
    }


def _command() -> list[str]:
    if SCRIPT.is_file():
        return [str(SCRIPT)]
    return [sys.executable, "-c", "from privkit.cli import main; main()"]  # pragma: no cover


def privkit(*args: str, typer_path: str | None = None, timeout: int = 300):
    """Run the console script to its end; its process group (workers too) is killed after it,
    also when it times out."""
    argv = [*_command(), *args]
    with owned(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(typer_path)
    ) as proc:
        out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def assert_one_line_error(proc, *needles: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("note:")]
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# ------------------------------------------------------------------------------- fixtures
TINY_TRAIN = [
    "centralized",
    "--quick",
    "--set",
    "arch=mlp",
    "--set",
    "epochs=1",
    "--federation-set",
    "dataset=digits",
    "--federation-set",
    "public_dataset=none",
    "--federation-set",
    "clients=2",
    "--federation-set",
    "partition=iid",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished run written by the console script (seconds: an MLP, one epoch, 8x8 digits)."""
    out = tmp_path_factory.mktemp("cli") / "run"
    proc = privkit("train", *TINY_TRAIN, "--out", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory, trained) -> dict[str, Path]:
    """Damaged copies of every file a command reads."""
    import shutil

    root = tmp_path_factory.mktemp("damaged")
    out: dict[str, Path] = {}
    for name, damage in (
        ("truncated", lambda p: p.write_bytes(p.read_bytes()[:100])),
        ("garbage", lambda p: p.write_bytes(b"not a checkpoint")),
    ):
        run = root / name
        shutil.copytree(trained, run)
        damage(run / "checkpoints" / "model.pt")
        out[f"{name}_checkpoint"] = run
    out["ledger"] = root / "ledger.json"
    out["ledger"].write_text('{"schema_version": 1, "clients": {"0": [{"event": {"kind": "x"}}]}}')
    out["binary_ledger"] = root / "binary.json"
    out["binary_ledger"].write_bytes(bytes(range(256)))
    out["toml"] = root / "broken.toml"
    out["toml"].write_text('name = "x"\n[federation\n')
    report_dir = root / "report"
    report_dir.mkdir()
    (report_dir / "report.json").write_text('{"schema_version": 1, "title": ')
    out["report_dir"] = report_dir
    x = np.random.default_rng(0).random((40, 1, 8, 8)).astype(np.float32)
    x[3, 0, 1, 1], x[7, 0, 2, 2], x[9, 0, 0, 0] = np.nan, np.nan, np.inf
    out["nan_npz"] = root / "nan.npz"
    np.savez(out["nan_npz"], x=x, y=np.arange(40) % 4)
    out["not_a_run"] = root / "not-a-run"
    out["not_a_run"].mkdir()
    (out["not_a_run"] / "notes.txt").write_text("mine")
    return out


# ------------------------------------------------------------------------------- usage errors
DPSGD = ["budget", "dpsgd", "--sample-rate", "0.01", "--noise-multiplier", "1", "--delta", "1e-5"]

# (argv, what the one line must name): click-level errors, before any command code runs
USAGE_CASES = [
    (["train", "--bogus"], ["--bogus"]),
    ([*DPSGD, "--steps", "1.5"], ["--steps", "1.5"]),
    ([*DPSGD[:4], "--steps", "10"], ["--noise-multiplier"]),
    (["nosuch"], ["nosuch"]),
    (["audit", "RUN", "--shadows", "abc"], ["--shadows", "abc"]),
    (["audit", "RUN", "--n-audit", "5"], ["--n-audit", "5"]),
    (["audit", "RUN", "--iterations", "0"], ["--iterations", "0"]),
    (["data", "split", "--clients", "two"], ["--clients", "two"]),
    (["budget", "ledger"], ["Missing argument"]),
]


@pytest.mark.parametrize("typer_path", TYPER_PATHS)
@pytest.mark.parametrize(
    "argv, needles", USAGE_CASES, ids=[" ".join(c[0][:3]) for c in USAGE_CASES]
)
def test_usage_error_is_one_line_exit_2(argv, needles, typer_path, tmp_path):
    argv = [str(tmp_path) if a == "RUN" else a for a in argv]
    assert_one_line_error(privkit(*argv, typer_path=typer_path), *needles)


# (argv, needles): errors found inside commands, before any work; "{name}" in argv is
# filled with the path of the fixture file of that name (see test_bad_input_is_one_line_exit_2)
def _input_cases():
    return [
        (["audit", "{trained}", "--executor", "banana"], ["--executor", "banana"]),
        (["audit", "{trained}", "--delta", "1.5"], ["--delta", "1.5"]),
        (
            [
                "audit",
                "{trained}",
                "--n-audit",
                "100000",
                "--attacks",
                "threshold",
                "--shadows",
                "2",
            ],
            ["n_audit must be between 10 and the pool size", "found 100000"],
        ),
        (["audit", "{missing}"], ["run_dir", "missing"]),
        (["audit", "{not_a_run}"], ["config.json", "not-a-run"]),
        (
            ["audit", "{truncated_checkpoint}", "--attacks", "threshold", "--shadows", "2"],
            ["checkpoint", "truncated/checkpoints/model.pt"],
        ),
        (
            ["audit", "{garbage_checkpoint}", "--attacks", "threshold", "--shadows", "2"],
            ["checkpoint", "garbage/checkpoints/model.pt"],
        ),
        (["budget", "ledger", "{ledger}", "--delta", "1e-5"], ["ledger file", "ledger.json"]),
        (
            ["budget", "ledger", "{binary_ledger}", "--delta", "1e-5"],
            ["ledger file", "binary.json"],
        ),
        (["run", "{toml}"], ["broken.toml"]),
        (["run", "{missing}.toml"], ["config file not found", "missing.toml"]),
        (["report", "{report_dir}"], ["report file", "report.json"]),
        (
            [
                "data",
                "split",
                "--dataset",
                "{nan_npz}",
                "--public-dataset",
                "none",
                "--clients",
                "2",
            ],
            ["array x", "2 NaN and 1 infinite", "nan.npz"],
        ),
        (["train", *TINY_TRAIN, "--seed", "5", "--out", "{trained}"], ["--out", "--force"]),
        (["train", *TINY_TRAIN, "--out", "{not_a_run}"], ["--out", "not-a-run"]),
    ]


@pytest.mark.parametrize("argv, needles", _input_cases(), ids=lambda v: None)
def test_bad_input_is_one_line_exit_2(argv, needles, trained, files, tmp_path):
    names = {"trained": trained, "missing": tmp_path / "missing", **files}
    argv = [a.format(**{k: str(v) for k, v in names.items()}) for a in argv]
    before = {p: p.stat().st_mtime_ns for p in trained.rglob("*")}
    assert_one_line_error(privkit(*argv), *needles)
    assert {p: p.stat().st_mtime_ns for p in trained.rglob("*")} == before  # nothing touched


def test_public_dataset_none_means_the_same_everywhere(tmp_path):
    """`none` carves public data from the private dataset in `data split` and in `train`."""
    split = privkit(
        "data",
        "split",
        "--dataset",
        "digits",
        "--clients",
        "2",
        "--public-dataset",
        "none",
        "--json",
    )
    assert split.returncode == 0, split.stderr
    from privkit.data import FederationConfig

    cfg = FederationConfig.model_validate({"dataset": "digits", "public_dataset": "none"})
    assert cfg.public_dataset is None and cfg.public_size == 0.1
    assert json.loads(split.stdout)["public_dataset"] == "digits"  # carved from the private set


def test_force_replaces_a_finished_run(trained, tmp_path):
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(trained, run)
    (run / "audit.json").write_text("{}")  # a file of the old run must not survive the new one
    proc = privkit("train", *TINY_TRAIN, "--seed", "1", "--out", str(run), "--force", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((run / "config.json").read_text())["seed"] == 1
    assert not (run / "audit.json").exists()
    assert not list(tmp_path.glob(".*-copy"))  # no staging or old folder left behind


def test_train_headline_follows_the_formal_dp_rule(tmp_path):
    """FedMD-NFDP's (0, delta) guarantee has delta >= 1/n: `privkit train` says so (as a report
    would), instead of printing epsilon 0 at the paper's delta."""
    argv = [
        "train",
        "fedmd-nfdp",
        "--quick",
        *TINY_TRAIN[6:],
        "--federation-set",
        "clients=3",
        "--out",
        str(tmp_path / "nfdp"),
    ]
    proc = privkit(*argv, "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert (out["formal_dp"], out["formal_dp_label"], out["claim_void"]) == (False, "δ ≥ 1/n", True)
    assert out["delta"] == 1e-5 and out["epsilon"] is None and out["epsilon_infinite"] is True
    text = privkit(*argv[:-1], str(tmp_path / "again")).stdout
    assert "formal DP: δ ≥ 1/n" in " ".join(text.split())
    assert "(best accountant): 0" not in text


# ------------------------------------------------------------------------------- Ctrl-C
def test_ctrl_c_exits_130_and_leaves_no_half_run(trained, tmp_path):
    """SIGINT during training: exit 130, the resume hint, and --out untouched (no half run)."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    argv = [
        *_command(),
        "train",
        *TINY_TRAIN[:4],
        "--set",
        "epochs=100000",
        *TINY_TRAIN[6:],
        "--out",
        str(run),
        "--force",
        "--json",
    ]
    need_sigint()
    with owned(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()) as proc:
        staging = tmp_path / ".staging-run"
        deadline = time.monotonic() + 240
        while not (staging / "federation.json").exists():  # training has started
            assert proc.poll() is None and time.monotonic() < deadline, kill_group(proc)
            time.sleep(0.2)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted; re-run the same command to resume" in err and "Traceback" not in err
    after = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert after == before and not staging.exists()


RUN_TOML = """
name = "c"
delta = 1e-5
accountants = ["rdp"]
workers = {workers}

[federation]
dataset = "digits"
public_dataset = "none"
clients = 2
partition = "iid"

[audit]
enabled = false

[[methods]]
name = "centralized"
label = "short"
overrides = {{ arch = "mlp", epochs = 1 }}

[[methods]]
name = "centralized"
label = "long"
overrides = {{ arch = "mlp", epochs = {long_epochs} }}
"""


@pytest.mark.parametrize("workers", [1, 2])
def test_ctrl_c_during_run_keeps_finished_stages_and_resumes(tmp_path, workers):
    """Ctrl-C from a terminal (SIGINT to the whole process group) while `long` trains, after
    `short` finished: exit 130, `short` intact, no half-written folder; the same command resumes;
    a changed config is refused until --force, which keeps the unchanged finished stages."""
    cfg = tmp_path / "run.toml"
    cfg.write_text(RUN_TOML.format(workers=workers, long_epochs=100000))
    out = tmp_path / "runs"
    root = out / "c"
    argv = [*_command(), "run", str(cfg), "--out", str(out), "--quiet"]

    def short_done() -> bool:
        try:
            stages = json.loads((root / "status.json").read_text())["methods"]["short"]["stages"]
        except (OSError, ValueError, KeyError):
            return False
        return stages.get("account", {}).get("state") == "done"

    need_sigint()
    with owned(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()) as proc:
        deadline = time.monotonic() + 300
        while not short_done():
            assert proc.poll() is None and time.monotonic() < deadline, kill_group(proc)
            time.sleep(0.3)
        time.sleep(1.0)  # `long` is training now
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C from a terminal: the whole process group
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted; re-run the same command to resume" in err and "Traceback" not in err
    kept = {p.relative_to(root): p.stat().st_mtime_ns for p in (root / "short").rglob("*")}
    assert (root / "short" / "train.json").is_file() and (root / "short" / "privacy.json").is_file()
    assert not (root / "long").exists() and not list(root.glob(".staging-*"))

    cfg.write_text(RUN_TOML.format(workers=workers, long_epochs=1))  # a changed config
    assert_one_line_error(privkit("run", str(cfg), "--out", str(out), "--quiet"), "--force", "c")
    done = privkit("run", str(cfg), "--out", str(out), "--quiet", "--force")
    assert done.returncode == 0, done.stderr
    assert "short: train already done, skipped" in done.stderr
    assert {p.relative_to(root): p.stat().st_mtime_ns for p in (root / "short").rglob("*")} == kept
    assert (root / "long" / "privacy.json").is_file() and (root / "report.json").is_file()


# ------------------------------------------------------------------------------- help text
def test_help_renders_every_word():
    """Every option's help and every command's first docstring line appear verbatim in --help
    (rich markup would swallow words such as "[trainer]")."""
    script = (
        "import sys, typer\n"
        "from privkit.cli import app, main\n"
        "def walk(cmd, path):\n"
        "    yield path, cmd\n"
        "    for name, sub in sorted(getattr(cmd, 'commands', {}).items()):\n"
        "        yield from walk(sub, path + [name])\n"
        "for path, cmd in walk(typer.main.get_command(app), []):\n"
        "    print('=====', ' '.join(path), flush=True)\n"
        "    try:\n"
        "        main(path + ['--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
    )
    env = {**_env(), "COLUMNS": "2000", "TERMINAL_WIDTH": "2000"}
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    pages = {}
    for chunk in proc.stdout.split("===== ")[1:]:
        head, _, body = chunk.partition("\n")
        pages[head.strip()] = " ".join(body.replace("│", " ").split())

    import typer

    from privkit.cli import app

    def walk(cmd, path):
        yield path, cmd
        for name, sub in sorted(getattr(cmd, "commands", {}).items()):
            yield from walk(sub, path + [name])

    checked = 0
    for path, cmd in walk(typer.main.get_command(app), []):
        page = pages[" ".join(path)]
        texts = [p.help for p in cmd.params if getattr(p, "help", None)]
        if cmd.help:
            texts.append(cmd.help.strip().splitlines()[0])
        for text in texts:
            want = " ".join(text.replace("\\[", "[").split())
            assert want in page, (" ".join(path), want)
            checked += 1
    assert checked > 50  # every command and option was seen


# ------------------------------------------------------------------------------- start-up
@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["train", "--bogus"],
        [*DPSGD, "--steps", "1.5"],
        ["budget", "gaussian", "--help"],
        ["audit", "nowhere", "--executor", "banana"],
        [*DPSGD[:-2], "--delta", "1.5", "--steps", "10"],
        [*DPSGD[:-2], "--delta", "1e-5", "--steps", "10", "--sampler", "x"],
        ["train", "dpsgd", "--set", "epochs=-1", "--out", "unused"],
        ["train", "dpsgd", "--set", "bogus=1", "--out", "unused"],
        ["train", "fedavg", "--quick", "--set", "freeze=true", "--out", "unused"],
        ["train", "--list", "--json"],
    ],
)
def test_start_up_imports_no_heavy_library(argv):
    """Help and refused input never import torch, dp-accounting & co. (timed in
    benchmarks/startup.py; here the mechanism is checked, not the clock)."""
    assert _heavy_imports(argv) == []
    assert not (REPO / "unused").exists()  # refused before any work


def test_run_refusing_a_trainer_value_imports_no_heavy_library(tmp_path):
    """``privkit run`` validates every method's trainer config before it loads torch."""
    config = tmp_path / "bad.toml"
    config.write_text('name = "bad"\n[[methods]]\nname = "dpsgd"\noverrides = { epochs = -1 }\n')
    assert _heavy_imports(["run", str(config), "--out", str(tmp_path / "run")], expect=2) == []
    assert not (tmp_path / "run").exists()


def test_run_refusing_an_attack_name_imports_no_heavy_library(tmp_path):
    """``[audit].attacks`` is checked against the run audit's names without loading the audit layer;
    those names are the attacks library's family plus the attribute attack."""
    from attacks.family import ATTACKS as FAMILY
    from privkit.audit.names import ATTRIBUTE_ATTACKS, MEMBERSHIP_ATTACKS

    assert {n.removesuffix("-offline") for n in FAMILY} == set(MEMBERSHIP_ATTACKS)
    assert ATTRIBUTE_ATTACKS == ("attribute",)
    config = tmp_path / "bad.toml"
    config.write_text('name = "bad"\n[audit]\nattacks = ["banana"]\n[[methods]]\nname = "fedavg"\n')
    assert _heavy_imports(["run", str(config), "--out", str(tmp_path / "run")], expect=2) == []
    assert not (tmp_path / "run").exists()


def _heavy_imports(argv: list[str], expect: int | None = None) -> list[str]:
    """The heavy libraries ``privkit ARGV`` imported (``-X importtime``); exit code 0 or 2."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "from privkit.cli import main; main()", *argv],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=REPO,
        timeout=120,
        check=False,
    )
    assert proc.returncode in ((0, 2) if expect is None else (expect,)), proc.stderr[-2000:]
    imported = {
        ln.split("|")[-1].strip()
        for ln in proc.stderr.splitlines()
        if ln.startswith("import time:")
    }
    assert imported, "no -X importtime output"
    return sorted(imported & set(HEAVY))


# ------------------------------------------------------------------------------- build
def test_pyproject_metadata_has_no_deprecation_warning():
    """setuptools >= 77 reads the SPDX license string; the old table form warns on every build."""
    pytest.importorskip("setuptools", minversion="77")
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), REPO / "pyproject.toml")
    assert [str(w.message) for w in caught] == []
    assert dist.metadata.license_expression == "Apache-2.0"


def test_ray_executor_without_ray_is_refused_up_front(monkeypatch):
    """`--executor ray` (CLI) and `audit.executor = "ray"` (run config) need Ray installed: said
    before any work, with the install command, instead of every shadow-based attack failing."""
    import importlib.util

    from attacks.executor import EXECUTORS
    from privkit.pipeline.config import EXECUTORS as CHECKED
    from privkit.pipeline.config import check_executor

    assert CHECKED == EXECUTORS  # the CLI checks the names the audit layer runs
    check_executor("serial")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        ValueError, match=r'--executor ray needs Ray.*pip install "privkit-ml\[ray\]"'
    ):
        check_executor("ray", "--executor")
    with pytest.raises(
        ValueError,
        match=r"audit\.executor must be one of serial, process, ray; "
        "found 'banana'",
    ):
        check_executor("banana", "audit.executor")
