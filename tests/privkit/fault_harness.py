"""benchmarks/fault_injection.py as a module, for the tests that start privkit processes.

Such a test starts privkit through :func:`owned` (a session of its own; on the way out, whether
the test passed, failed or timed out, the process group is SIGKILLed: the command and its
workers), and a test that needs Ctrl-C calls :func:`need_sigint` first.
"""

from __future__ import annotations

import importlib.util
import signal
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "fault_injection", REPO / "benchmarks" / "fault_injection.py"
)
assert _spec is not None and _spec.loader is not None
faults = importlib.util.module_from_spec(_spec)
sys.modules["fault_injection"] = faults  # its dataclasses look their module up
_spec.loader.exec_module(faults)

owned = faults.owned
kill_group = faults.kill_group

SIGINT_IGNORED = (
    "SIGINT is ignored in this test process (as in a background job of a non-interactive shell) "
    "and a child inherits that: privkit would never see the Ctrl-C; run the tests in the "
    "foreground or with SIGINT at its default"
)


def need_sigint() -> None:
    """Skip, saying why, where a child of this process cannot receive Ctrl-C."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        pytest.skip(SIGINT_IGNORED)
