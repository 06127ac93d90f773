"""Files of a run directory, written so that a crash never leaves a file that reads as valid.

Every stored artefact (JSON, checkpoints, ``.npz`` arrays, report pages) goes through
:func:`write_bytes`, built on :mod:`atomicfiles` (the writer the libraries use too): a temporary
file in the same folder, flushed and fsynced, renamed over the target with :func:`os.replace`,
then the folder fsynced, so a reader sees the old file or the new one, never a part. Beside each artefact a sidecar ``.<name>.sha256`` (``sha256sum`` format, so
``sha256sum -c`` checks it in that folder) holds its checksum; :func:`verify` compares them, and a
file whose checksum fails is treated as absent (the pipeline re-runs the stage that writes it, with
a warning), never read as valid. :func:`run_lock` keeps a second process out of a directory in
use. A full or read-only file system is one :class:`StorageError` naming the file.

For fault-injection tests, ``PRIVKIT_FAULT_KILL=N:PHASE`` makes this process kill itself with
SIGKILL at its N-th file write (privkit's and the libraries' alike): ``start`` (before any byte), ``sidecar`` (the new checksum
listed beside the old one, the old file in place), ``mid`` (half the bytes in the temporary file),
``renamed`` (the new file in place, the old checksum not yet dropped). ``PRIVKIT_FAULT_TRACE=FILE``
appends one line per artefact write (pid, count, path), so a test can choose its kill points.
"""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import signal
import socket
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import ValidationError

import atomicfiles
from privkit.errors import PrivkitError
from privkit.jsonutil import json_default

FAULT_ENV = "PRIVKIT_FAULT_KILL"
FAULT_PHASES = atomicfiles.PHASES
# file-system states that no retry fixes while they last: said in one line, never a traceback
_STORAGE_ERRNOS = {
    errno.ENOSPC: "no space left on device",
    errno.EROFS: "read-only file system",
    errno.EDQUOT: "disk quota exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}
_writes = 0  # artefact writes of this process (the fault hook counts them)


class StorageError(PrivkitError):
    """The output directory cannot be written (full, read-only, no permission)."""


class CorruptFileError(PrivkitError, atomicfiles.CorruptFileError):
    """A stored artefact whose checksum does not match its content."""


class DirectoryInUse(PrivkitError):
    """Another live process holds the directory's lock."""


def one_line(exc: BaseException) -> str:
    """An exception as one line (pydantic errors as ``field: message (found value)``)."""
    if isinstance(exc, ValidationError):
        parts = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "config"
            parts.append(f"{loc}: {err['msg']} (found {err.get('input')!r})")
        return "; ".join(parts)
    return " ".join(str(exc).split()) or type(exc).__name__


def now() -> str:
    """The current UTC time, ISO 8601 to the second (status records)."""
    return datetime.now(UTC).isoformat(timespec="seconds")


# ---------------------------------------------------------------------------- storage errors
def storage_error(exc: OSError, path: Path | str) -> StorageError | None:
    """The :class:`StorageError` for an ``OSError`` of a full or read-only file system (else None)."""
    code = exc.errno or 0
    what = _STORAGE_ERRNOS.get(code)
    if what is None:
        return None
    return StorageError(
        f"cannot write {path}: {what} (errno {errno.errorcode[code]}); files "
        "finished earlier are intact; re-run the same command once it is writable "
        "to resume"
    )


@contextmanager
def storage_errors(path: Path | str) -> Iterator[None]:
    """Turn a full or read-only file system's ``OSError`` in the block into a :class:`StorageError`."""
    try:
        yield
    except OSError as exc:
        err = storage_error(exc, path)
        if err is None:
            raise
        raise err from None


# ---------------------------------------------------------------------------- the fault hook
def _fault_point() -> tuple[int, str] | None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    n, _, phase = spec.partition(":")
    if not n.isdigit() or phase not in FAULT_PHASES:
        raise PrivkitError(
            f"{FAULT_ENV} must be N:PHASE with PHASE in {', '.join(FAULT_PHASES)}; found {spec!r}"
        )
    return int(n), phase


def _trace(path: Path) -> None:
    trace = os.environ.get("PRIVKIT_FAULT_TRACE")
    if trace:
        with open(trace, "a") as fh:
            fh.write(f"{os.getpid()} {_writes} {path}\n")


def _fault_hook(phase: str, path: Path) -> None:
    """Called by :mod:`atomicfiles` at each phase of every write of this process (privkit's own
    and the libraries'): counts the writes, lists them, and dies at the chosen point."""
    global _writes
    if phase == "start":
        _writes += 1
        _trace(path)
    point = _fault_point()
    if point is not None and point == (_writes, phase):
        os.kill(os.getpid(), signal.SIGKILL)


atomicfiles.fault_hook = _fault_hook

# ---------------------------------------------------------------------------- atomic writes
checksum_path = atomicfiles.checksum_path
sha256 = atomicfiles.sha256
fsync_dir = atomicfiles.fsync_dir


def write_bytes(path: Path | str, data: bytes) -> Path:
    """Store ``data`` at ``path`` atomically, with its checksum sidecar
    (:func:`atomicfiles.write_bytes`); a full or read-only file system is one
    :class:`StorageError` naming the file."""
    with storage_errors(path):
        return atomicfiles.write_bytes(path, data)


def write_text(path: Path | str, text: str) -> Path:
    """Store ``text`` (UTF-8) at ``path`` through :func:`write_bytes`."""
    return write_bytes(path, text.encode("utf-8"))


def write_json(path: Path | str, obj: Any) -> Path:
    """``obj`` as indented JSON (numpy values through :func:`privkit.jsonutil.json_default`)."""
    return write_text(path, json.dumps(obj, indent=2, default=json_default))


atomic_write_json = write_json  # the name earlier modules use
"""Alias of :func:`write_json` (atomic, with its checksum sidecar)."""


def write_with(path: Path | str, save: Callable[[io.BytesIO], Any]) -> Path:
    """Store what ``save(buffer)`` writes (``torch.save``, ``np.savez_compressed``) atomically."""
    buf = io.BytesIO()
    save(buf)
    return write_bytes(path, buf.getvalue())


def append_log(path: Path | str, text: str) -> None:
    """Append to a log file (not an artefact: nothing reads it back; a torn line is harmless)."""
    path = Path(path)
    with storage_errors(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as fh:
            fh.write(text)


# ---------------------------------------------------------------------------- verified reads
verify = atomicfiles.verify


def intact(path: Path | str, say: Callable[[str], None] | None = None) -> bool:
    """True when ``path`` exists with a matching checksum; a file present but failing is treated
    as absent, with a warning (``say``, else :mod:`warnings`)."""
    problem = verify(path, required=True)
    if problem is None:
        return True
    if problem != "missing":
        msg = f"{path}: {problem}; treated as absent and recomputed"
        (say or (lambda m: warnings.warn(m, stacklevel=3)))(msg)
    return False


def checked(path: Path | str, what: str = "file") -> Path:
    """``path``, once its checksum is verified: a mismatch is one error naming the file (a missing
    file is left to the reader's own message)."""
    path = Path(path)
    problem = verify(path) if path.is_file() else None
    if problem is not None:
        raise CorruptFileError(
            f"{what} {path} is corrupted ({problem}); re-run the command that wrote it"
        )
    return path


def read_json(path: Path | str, what: str = "run file") -> Any:
    """Parse a stored JSON file (checksum verified); a corrupted one is a one-line error naming it."""
    from privkit.jsonutil import read_json as _read

    return _read(checked(path, what), what)


# ---------------------------------------------------------------------------- staged folders
def staging_dir(target: Path) -> Path:
    """Where :func:`staged_dir` writes ``target`` before swapping it into place."""
    return target.parent / f".staging-{target.name}"


def _old_dir(target: Path) -> Path:
    return target.parent / f".old-{target.name}"


def recover_dir(target: Path) -> None:
    """Undo a swap a crash interrupted: ``target`` moved aside, the new content not yet in place."""
    old = _old_dir(target)
    if old.is_dir() and not target.exists():
        old.rename(target)
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def staged_dir(target: Path):
    """Yield an empty sibling folder to write ``target``'s new content into; on success it replaces
    ``target`` (the old content is removed last), on any error or Ctrl-C it is deleted and
    ``target`` stays as it was. Nothing half-written is ever found at ``target``; a crash during
    the swap is undone by :func:`recover_dir` on the next use."""
    staging = staging_dir(target)
    with storage_errors(staging):
        recover_dir(target)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    old = _old_dir(target)
    with storage_errors(target):
        if target.exists():
            target.rename(old)
        staging.rename(target)
        fsync_dir(target.parent)
    shutil.rmtree(old, ignore_errors=True)


def tidy_after_crash(root: Path) -> None:
    """Undo what a killed writer left under ``root``: folder swaps it interrupted (one level down),
    staging folders and temporary files (never read by anyone)."""
    for old in root.glob(".old-*"):
        recover_dir(root / old.name.removeprefix(".old-"))
    for staging in root.glob(".staging-*"):
        shutil.rmtree(staging, ignore_errors=True)
    for tmp in root.rglob(".*.tmp"):
        tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------------------- one run per directory
def lock_path(target: Path) -> Path:
    """The lock of a directory: a hidden sibling, so it outlives the directory's swaps."""
    return target.parent / f".{target.name}.lock"


@contextmanager
def run_lock(target: Path | str, say: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold ``target``'s lock (``fcntl.flock``, released by the kernel when the process dies) for
    the block; the lock file names the holder (pid and host). A directory in use is one
    :class:`DirectoryInUse` line naming its holder; a lock left by a dead process is taken over
    with a warning."""
    import fcntl

    target = Path(target)
    path = lock_path(target)
    with storage_errors(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            raise DirectoryInUse(
                f"{target} is in use by {holder}; wait for it to finish or stop it (lock {path})"
            ) from None
        previous = os.pread(fd, 200, 0).decode(errors="replace").strip()
        if previous:  # written by a holder that never released it: it died
            (say or (lambda m: warnings.warn(m, stacklevel=3)))(
                f"took over the lock of {target} left by {previous} (no longer running)"
            )
        with storage_errors(path):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # an empty lock file: released cleanly, nothing to take over
    finally:
        os.close(fd)  # closing releases the flock
