"""One atomic, checksummed writer for every file privkit and its libraries write (issue 33,
item 3): ``atomicfiles`` at the bottom, ``reports.atomic_write_text`` (report pages),
``accountants.Ledger.save`` and ``privkit.files`` on it; a corrupted file is never
trusted: refused with one line naming it (the libraries) or recomputed (the pipeline)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import accountants as acc
import atomicfiles

ROOT = Path(__file__).resolve().parents[1]


def _damage(path: Path) -> None:
    """Change one byte, keeping the file parseable where it was (a silent corruption)."""
    data = bytearray(path.read_bytes())
    i = data.index(b"1")
    data[i : i + 1] = b"2"
    path.write_bytes(bytes(data))


def test_the_writer_core_imports_the_standard_library_only():
    code = (
        "import sys; before = set(sys.modules); import atomicfiles; "
        "extra = sorted(m for m in set(sys.modules) - before "
        "if m.split('.')[0] not in sys.stdlib_module_names and m != 'atomicfiles'); print(extra)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert out.stdout.strip() == "[]"


def test_core_write_verify_and_refuse(tmp_path):
    path = atomicfiles.write_text(tmp_path / "a" / "x.json", '{"v": 1}')
    side = atomicfiles.checksum_path(path)
    digest = hashlib.sha256(b'{"v": 1}').hexdigest()  # what sha256sum prints
    assert side.read_text() == f"{digest}  x.json\n"
    assert atomicfiles.verify(path, required=True) is None
    assert atomicfiles.read_verified(path) == b'{"v": 1}'
    assert not list(path.parent.glob("*.tmp"))
    _damage(path)
    assert atomicfiles.verify(path) == "checksum mismatch"
    with pytest.raises(atomicfiles.CorruptFileError) as err:
        atomicfiles.read_verified(path, "thing")
    assert str(err.value) == (
        f"thing {path} is corrupted (checksum mismatch with .x.json.sha256); "
        "refused: re-run the command that wrote it"
    )
    # a file without a sidecar (written by hand) is read as it is
    (tmp_path / "hand.json").write_text("{}")
    assert atomicfiles.read_verified(tmp_path / "hand.json") == b"{}"
    assert atomicfiles.verify(tmp_path / "hand.json", required=True) == "no checksum"


def test_the_fault_hook_sees_every_phase_of_every_write(tmp_path, monkeypatch):
    seen: list[tuple[str, str]] = []
    monkeypatch.setattr(atomicfiles, "fault_hook", lambda phase, p: seen.append((phase, p.name)))
    atomicfiles.write_text(tmp_path / "r.md", "report")
    acc.Ledger().save(tmp_path / "ledger.json")
    assert seen == [(ph, "r.md") for ph in atomicfiles.PHASES] + [
        (ph, "ledger.json") for ph in atomicfiles.PHASES
    ]


def test_a_ledger_is_checksummed_and_a_corrupted_one_refused(tmp_path):
    ledger = acc.Ledger()
    ledger.add(0, acc.dpsgd_event(0.01, 1.1, 100), "dp-sgd")
    path = ledger.save(tmp_path / "ledger.json")
    assert atomicfiles.verify(path, required=True) is None
    assert acc.Ledger.load(path).summary(1e-5) == ledger.summary(1e-5)
    data = json.loads(path.read_text())
    data["clients"]["0"][0]["event"]["count"] = 1  # a ledger edited to charge less: refused
    path.write_text(json.dumps(data, indent=2) + "\n")
    with pytest.raises(ValueError, match=r"ledger file .*ledger.json is corrupted \(checksum"):
        acc.Ledger.load(path)
