"""benchmarks/flip_round.py: its bad input is one line naming the option, and exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "flip_round.py"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--repeats", "0"], "flip_round: --repeats must be >= 1; found 0"),
        (["--runs", "-2"], "flip_round: --runs must be >= 0; found -2"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [message]
