"""The process helpers of the tests that start privkit: a failing test leaves no process behind
(the command nor its workers), and a test needing Ctrl-C says why it cannot run where SIGINT is
ignored."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_harness import SIGINT_IGNORED, need_sigint, owned

# a parent that starts a worker in its process group (as privkit's pools do), prints both pids
# and waits: what a privkit command stuck in training looks like from the test
PARENT = (
    "import subprocess, sys, time\n"
    "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "print(w.pid, flush=True); time.sleep(600)\n"
)


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a dead orphan waits for init to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_a_failing_test_kills_the_command_and_its_workers():
    pids: list[int] = []
    with (
        pytest.raises(AssertionError, match="the test failed here"),
        owned([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True) as proc,
    ):
        pids += [proc.pid, int(proc.stdout.readline())]
        assert all(_alive(p) for p in pids)
        assert os.getpgid(pids[1]) == proc.pid != os.getpgid(0)  # a group of their own
        raise AssertionError("the test failed here")
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [_alive(p) for p in pids] == [False, False]
    assert proc.returncode == -signal.SIGKILL


def test_ctrl_c_tests_skip_with_the_reason_where_sigint_is_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job's disposition
    try:
        with pytest.raises(pytest.skip.Exception, match="SIGINT is ignored in this test process"):
            need_sigint()
        child = subprocess.run(  # what makes the test pointless: the child inherits it
            [sys.executable, "-c", "import signal as s; print(s.getsignal(s.SIGINT) == s.SIG_IGN)"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert child.stdout.strip() == "True"
    finally:
        signal.signal(signal.SIGINT, previous)
    need_sigint()  # SIGINT at its default (or Python's handler): the test runs
    assert "background job" in SIGINT_IGNORED
