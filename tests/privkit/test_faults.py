"""Faults a run survives (issue 24): SIGKILL anywhere, a damaged file, two runs on one directory,
a full or read-only output file system.

Every command here is the real console script in a subprocess (a kill must not take the test
down); the run is one DP-SGD method on scikit-learn's 8x8 digits, in reproducible-noise mode.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fault_harness import faults, owned

from privkit.errors import PrivkitError
from privkit.files import (
    DirectoryInUse,
    checksum_path,
    intact,
    lock_path,
    read_json,
    run_lock,
    verify,
    write_json,
)

REPO = Path(__file__).resolve().parents[2]


def privkit(*argv: str, **env: str) -> subprocess.CompletedProcess:
    return faults.invoke(list(argv), timeout=600, **env)


def one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    assert all(n in lines[0] for n in needles), lines[0]
    return lines[0]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


# ---------------------------------------------------------------------------- checksums
def test_a_damaged_artefact_is_treated_as_absent(tmp_path):
    path = write_json(tmp_path / "privacy.json", {"epsilon": 1.5})
    assert verify(path, required=True) is None and checksum_path(path).is_file()
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # as open() would make it, not 0600
    # sha256sum's own format: `sha256sum -c` checks the file in its folder
    check = subprocess.run(
        ["sha256sum", "-c", checksum_path(path).name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert check.returncode == 0 and "privacy.json: OK" in check.stdout
    path.write_text('{"epsilon": 0.5}')  # same length, different number: still parses as JSON
    assert verify(path) == "checksum mismatch"
    with pytest.warns(UserWarning, match="privacy.json: checksum mismatch; treated as absent"):
        assert not intact(path)
    with pytest.raises(PrivkitError, match=r"privacy.json is corrupted \(checksum mismatch\)"):
        read_json(path)


def test_every_instant_of_a_rewrite_leaves_a_valid_file(tmp_path, monkeypatch):
    """Killed at the start, with the new checksum listed, midway, or after the rename, the file
    on disk is the old or the new version and verifies; never a part."""
    old, new = {"v": 1, "pad": "x" * 5000}, {"v": 2, "pad": "y" * 5000}
    for phase in faults.FAULT_PHASES:
        folder = tmp_path / phase
        folder.mkdir()
        code = (
            f"import json, sys; from privkit.files import write_json; "
            f"write_json(sys.argv[1], {old!r}); write_json(sys.argv[1], {new!r})"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code, str(folder / "f.json")],
            check=False,
            env=faults.child_env(**{faults.FAULT_ENV: f"2:{phase}"}),
            cwd=REPO,
        )
        assert proc.returncode == -9, phase
        assert verify(folder / "f.json", required=True) is None, phase
        assert json.loads((folder / "f.json").read_text()) == (new if phase == "renamed" else old)


# ---------------------------------------------------------------------------- SIGKILL, re-run
@pytest.mark.slow
def test_killed_run_train_and_audit_resume_identically(tmp_path):
    """The fast form of benchmarks/fault_injection.py: each command killed midway through a file
    write after some stages finished, re-run: it finishes, every JSON number equals the
    uninterrupted run's, and no finished stage ran again."""
    record = faults.main(["--quick", "--out", str(tmp_path / "faults.json")])
    rows = record["rows"]
    assert {r["command"] for r in rows} == {"run", "train", "audit"}
    for r in rows:
        assert r["killed"] and r["resumed"] and r["identical"], r
        assert r["stages_recomputed"] == [], r
    run = next(r for r in rows if r["command"] == "run")
    assert run["finished_at_kill"] >= 2  # train and account had finished: they were not redone
    # the audit killed while storing its second reference run: the target and the first
    # reference run were stored, and the re-run trained (and stored) the second one alone
    audit = next(r for r in rows if r["command"] == "audit")
    assert audit["kill"] == "write 3 (model-002.pkl) mid" and audit["finished_at_kill"] == 2
    assert [w for w in audit["rerun_writes"] if w.startswith("model-")] == ["model-002.pkl"]


# ---------------------------------------------------------------------------- two runs, one dir
def test_a_directory_in_use_is_refused_and_a_stale_lock_taken_over(tmp_path):
    target = tmp_path / "run"
    with (
        run_lock(target),
        pytest.raises(
            DirectoryInUse,
            match=rf"{target} is in use by pid "
            rf"{os.getpid()} on ",
        ),
        run_lock(target),
    ):
        pass
    assert lock_path(target).read_text() == ""  # released cleanly: nothing to take over
    lock_path(target).write_text("pid 999999 on elsewhere\n")  # its holder died (no flock held)
    with (
        pytest.warns(
            UserWarning,
            match=r"took over the lock of .*run left by pid 999999 on "
            r"elsewhere \(no longer running\)",
        ),
        run_lock(target),
    ):
        pass


def test_second_run_and_train_on_a_directory_in_use_fail_at_once(tmp_path):
    toml = tmp_path / "fi.toml"
    toml.write_text(faults.RUN_TOML.format(controls="false"))
    with owned(  # holds both locks, as a running `privkit run` / `train` would
        [
            sys.executable,
            "-c",
            "import sys, time; from privkit.files import run_lock\n"
            "with run_lock(sys.argv[1]), run_lock(sys.argv[2]):\n print('held', flush=True); "
            "time.sleep(600)",
            str(tmp_path / "runs" / "fi"),
            str(tmp_path / "train"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    ) as holder:
        assert holder.stdout.readline().strip() == "held"
        run = privkit("run", str(toml), "--out", str(tmp_path / "runs"), "--quiet")
        assert run.returncode == 2
        one_line_error(run, "runs/fi is in use by pid", str(holder.pid))
        train = privkit(*faults.TRAIN, "--out", str(tmp_path / "train"))
        assert train.returncode == 2
        one_line_error(train, "train is in use by pid", str(holder.pid))
        assert not (tmp_path / "train").exists()
    # the holder died without releasing: its lock is taken over, the run goes on
    again = privkit(*faults.TRAIN, "--out", str(tmp_path / "train"))
    assert again.returncode == 0, again.stderr
    assert f"left by pid {holder.pid}" in again.stderr and "no longer running" in again.stderr


# ---------------------------------------------------------------------------- full / read-only disk
def test_a_write_that_runs_out_of_space_is_one_line_and_keeps_the_old_file(tmp_path, monkeypatch):
    """Without a mount: the file system fails the new version's write with ENOSPC (EROFS alike);
    the error names the file and the cause, the old version stays in place and verifies."""
    import errno

    from privkit import files

    target = tmp_path / "ledger.json"
    files.write_json(target, {"v": 1})
    before = target.read_bytes()
    for code, words in ((errno.ENOSPC, "no space left on device"), (errno.EROFS, "read-only")):

        def refuse(fd, *_a, code=code):
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(files.os, "fsync", refuse)
        with pytest.raises(files.StorageError) as err:
            files.write_json(target, {"v": 2})
        monkeypatch.undo()
        message = str(err.value)
        assert "\n" not in message and str(target) in message and words in message
        assert target.read_bytes() == before and files.read_json(target) == {"v": 1}
        assert not list(tmp_path.glob(".ledger.json.*.tmp"))  # no half-written file left behind


@pytest.fixture()
def small_fs(tmp_path):
    """A 4 MiB tmpfs (root only; skipped with the reason elsewhere)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip() or proc.returncode}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(folder: Path) -> Path:
    """Fill the file system of ``folder`` to the last byte."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        for size in (1 << 16, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


def test_full_disk_is_one_line_keeps_the_finished_run_and_resumes(small_fs):
    toml = small_fs.parent / "fi.toml"
    toml.write_text(
        faults.RUN_TOML.format(controls="false").replace(
            'attacks = ["threshold"]', 'attacks = ["threshold"]\nenabled = false'
        )
    )
    runs = small_fs / "runs"
    first = privkit("run", str(toml), "--out", str(runs), "--quiet")
    assert first.returncode == 0, first.stderr
    before = snapshot(runs / "fi")
    filler = _fill(small_fs)
    full = privkit("run", str(toml), "--out", str(runs), "--quiet", "--force", "--set", "seed=1")
    assert full.returncode == 2
    one_line_error(full, "no space left on device (errno ENOSPC)", "re-run the same command")
    assert snapshot(runs / "fi") == before  # the finished run is intact, byte for byte
    filler.unlink()
    resumed = privkit("run", str(toml), "--out", str(runs), "--quiet", "--force", "--set", "seed=1")
    assert resumed.returncode == 0, resumed.stderr
    assert read_json(runs / "fi" / "config.resolved.json")["seed"] == 1
    assert (
        read_json(runs / "fi" / "status.json")["methods"]["dpsgd"]["stages"]["train"]["state"]
        == "done"
    )


def test_read_only_output_is_one_line_and_resumes_once_writable(small_fs):
    out = small_fs / "train"
    first = privkit(*faults.TRAIN, "--out", str(out))
    assert first.returncode == 0, first.stderr
    before = snapshot(out)
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    try:
        ro = privkit(*faults.TRAIN, "--seed", "1", "--out", str(out), "--force")
        assert ro.returncode == 2
        one_line_error(ro, "read-only file system (errno EROFS)")
        assert snapshot(out) == before
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_fs)], check=True)
    again = privkit(*faults.TRAIN, "--seed", "1", "--out", str(out), "--force")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["seed"] == 1
    assert shutil.disk_usage(small_fs).free > 0


# ---------------------------------------------------------------------------- lost pipeline workers
def _spawned_workers(parent: int) -> list[int]:
    """The multiprocessing workers among ``parent``'s children (not its resource tracker)."""
    out = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (proc / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if ppid == parent and "spawn_main" in cmd:
            out.append(int(proc.name))
    return out


def _but_workers(results: dict) -> dict:
    """Every number but the ``workers`` setting itself (serial 1, parallel 2)."""
    return {
        f: {k: v for k, v in nums.items() if not k.endswith("/workers")}
        for f, nums in results.items()
    }


@pytest.mark.slow
def test_run_with_workers_survives_a_killed_worker(tmp_path):
    """`privkit run` with two worker processes: its workers SIGKILLed while one trains, the run
    trains that method again in a fresh pool and ends as the serial run does."""
    text = faults.RUN_TOML.format(controls="false").replace("epochs = 1", "epochs = 15")
    serial, parallel = tmp_path / "serial.toml", tmp_path / "parallel.toml"
    serial.write_text(text)
    parallel.write_text(text.replace("workers = 1", "workers = 2"))
    ref = privkit("run", str(serial), "--out", str(tmp_path / "a"), "--quiet")
    assert ref.returncode == 0, ref.stderr
    with owned(
        faults.command(["run", str(parallel), "--out", str(tmp_path / "b"), "--quiet"]),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        staging = tmp_path / "b" / "fi" / ".staging-dpsgd"
        killed: list[int] = []
        while proc.poll() is None and not killed:
            if staging.is_dir():  # the method trains in a worker now
                for pid in _spawned_workers(proc.pid):
                    os.kill(pid, 9)
                    killed.append(pid)
        _, err = proc.communicate(timeout=600)
    assert killed, "the run ended before a worker could be killed"
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert _but_workers(faults.results(tmp_path / "b" / "fi")) == _but_workers(
        faults.results(tmp_path / "a" / "fi")
    )
    status = read_json(tmp_path / "b" / "fi" / "status.json")
    assert {s["state"] for s in status["methods"]["dpsgd"]["stages"].values()} == {"done"}
