"""``python -m privkit.precompile`` (run by ``make demo`` after a ``--no-compile`` install) writes the
bytecode of what a pipeline run imports, even where ``PYTHONDONTWRITEBYTECODE`` is set."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_precompile_writes_the_bytecode_a_run_imports(tmp_path):
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-m", "privkit.precompile"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "modules imported and byte-compiled" in out.stdout
    written = {p.name.split(".")[0] for p in Path(tmp_path).rglob("*.pyc")}
    # the pipeline's own modules, a trainer, the report and the libraries a run calls
    assert {"runner", "stages", "flip", "render", "torch", "opacus", "catboost"} <= {
        *written,
        *(p.parent.name for p in Path(tmp_path).rglob("__init__*.pyc")),
    }
