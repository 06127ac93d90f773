"""Atomic, checksummed file writes: the one writer every file of privkit and its libraries uses.

A small standard-library-only module at the bottom of the project, so that the libraries
(``accountants``, ``reports``) and the application (``privkit.files`` builds on it)
share one writer without importing each other.

:func:`write_bytes` stores a file atomically: the bytes go to a temporary file in the same
folder, are flushed and fsynced, and the file is renamed over the target (:func:`os.replace`),
after which the folder is fsynced, so a reader sees the old file or the new one, never a part.
Beside it a hidden sidecar ``.<name>.sha256`` (``sha256sum`` format: ``sha256sum -c`` checks it in
that folder) holds its checksum. While a file is replaced the sidecar lists the new checksum
beside the old one, so at every instant the file on disk is a complete version its sidecar
vouches for. :func:`verify` says why a file is not valid; :func:`read_verified` returns the
bytes of a valid one and raises :class:`CorruptFileError` (one line naming the file) otherwise.

``fault_hook``, when set, is called at four moments of every write with the phase and the path:
``start`` (before any byte), ``sidecar`` (the new checksum listed, the old file in place),
``mid`` (half the bytes in the temporary file), ``renamed`` (the new file in place, the old
checksum not yet dropped); privkit's fault-injection tests kill the process there.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "PHASES",
    "CorruptFileError",
    "checksum_path",
    "fault_hook",
    "fsync_dir",
    "read_verified",
    "sha256",
    "verify",
    "write_bytes",
    "write_text",
]

PHASES = ("start", "sidecar", "mid", "renamed")
fault_hook: Callable[[str, Path], None] | None = None
"""Called as ``fault_hook(phase, path)`` at each phase of every write (tests set it)."""


class CorruptFileError(ValueError):
    """A stored file whose checksum does not match its content (or is unreadable)."""


def _hook(phase: str, path: Path) -> None:
    if fault_hook is not None:
        fault_hook(phase, path)


def checksum_path(path: Path | str) -> Path:
    """The sidecar holding ``path``'s sha256 (hidden, beside it)."""
    p = Path(path)
    return p.with_name(f".{p.name}.sha256")


def sha256(data: bytes) -> str:
    """The hex sha256 digest of ``data`` (what a sidecar holds)."""
    return hashlib.sha256(data).hexdigest()


def fsync_dir(folder: Path | str) -> None:
    """Make renames in ``folder`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    return mask


def _replace(path: Path, data: bytes, *, hooked: bool) -> None:
    """``data`` into ``path`` through a temporary file in the same folder, fsync and a rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 would hide the file from its group
        with os.fdopen(fd, "wb") as fh:
            if hooked and len(data) > 1:
                half = len(data) // 2
                fh.write(data[:half])
                fh.flush()
                _hook("mid", path)
                fh.write(data[half:])
            else:
                fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _sidecar(path: Path, hashes: list[str]) -> None:
    lines = "".join(f"{h}  {path.name}\n" for h in hashes)
    _replace(checksum_path(path), lines.encode(), hooked=False)


def _stored_hashes(path: Path) -> list[str]:
    side = checksum_path(path)
    try:
        return [ln.split()[0] for ln in side.read_text().splitlines() if ln.strip()]
    except (OSError, UnicodeDecodeError, IndexError):
        return []


def write_bytes(path: Path | str, data: bytes) -> Path:
    """Store ``data`` at ``path`` atomically, with its checksum sidecar (see the module doc).

    The sidecar first lists the new checksum beside the current file's, then the file is
    replaced, then the sidecar keeps the new checksum only: a crash anywhere leaves a valid file
    (old or new), and a torn or damaged one never passes :func:`verify`. ``OSError`` of the file
    system (full, read-only) propagates; the temporary file is removed."""
    path = Path(path)
    _hook("start", path)
    new = sha256(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    # the current file stays valid through the swap only if it is valid now
    current = sha256(path.read_bytes()) if path.is_file() else None
    old = [current] if current in _stored_hashes(path) else []
    _sidecar(path, [new] + [h for h in old if h != new])
    _hook("sidecar", path)
    _replace(path, data, hooked=True)
    _hook("renamed", path)
    if old and old != [new]:
        _sidecar(path, [new])
    fsync_dir(path.parent)
    return path


def write_text(path: Path | str, text: str) -> Path:
    """Store ``text`` (UTF-8) at ``path`` through :func:`write_bytes`."""
    return write_bytes(path, text.encode("utf-8"))


def verify(path: Path | str, *, required: bool = False) -> str | None:
    """Why ``path`` is not a valid stored file, or None when its checksum is one its sidecar
    lists.

    A missing sidecar is accepted unless ``required`` (files made by hand or by an older
    writer)."""
    path = Path(path)
    if not path.is_file():
        return "missing"
    if not checksum_path(path).is_file():
        return "no checksum" if required else None
    expected = _stored_hashes(path)
    try:
        actual = sha256(path.read_bytes())
    except OSError as exc:
        return f"unreadable ({type(exc).__name__})"
    return None if actual in expected else "checksum mismatch"


def read_verified(path: Path | str, what: str = "file") -> bytes:
    """The bytes of ``path`` once its checksum is verified; a mismatch is one
    :class:`CorruptFileError` line naming the file (a missing file is ``FileNotFoundError``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}")
    data = path.read_bytes()
    side = checksum_path(path)
    if side.is_file() and sha256(data) not in _stored_hashes(path):
        raise CorruptFileError(
            f"{what} {path} is corrupted (checksum mismatch with {side.name}); "
            "refused: re-run the command that wrote it"
        )
    return data
