"""The CPU allocator's policy of privkit's processes: freed memory stays for the next step.

torch allocates every CPU tensor through the C library's ``malloc``. glibc's gives a freed block
larger than its mmap threshold (128 KB at start, raised with the blocks freed, to at most 32 MB)
back to the system at once, and trims the top of its heap when more than its trim threshold is
free there. A training step that makes and frees tens of megabytes of activations (a stacked CNN
step's chunks, a DP-SGD step's per-example pieces) then writes fresh pages at every step, which
the kernel maps and zeroes on first touch: a step of 17 of dpsgd's default CNNs took 9,000-20,000
page faults and 1.09x the time it takes with its freed blocks reused (docs/performance.md, "Freed
memory kept in the process").

:func:`keep_freed_memory` raises both thresholds, so that freed blocks stay in the process's
heap and the next step reuses them. What it costs: the process keeps the heap of its peak until
it exits (its resident memory does not fall after a peak; ``make demo``'s largest process peaked
4-5% higher).
``privkit``'s command line applies it at start; the environment variable
``PRIVKIT_KEEP_FREED_MEMORY=0`` turns it off. Other allocators (musl, macOS, Windows) are left
alone.
"""

from __future__ import annotations

import ctypes
import os

#: blocks larger than this still map pages of their own (a tensor of a gigabyte is long-lived)
MMAP_THRESHOLD = 2**30
#: free memory at the heap's top kept before any of it goes back to the system
TRIM_THRESHOLD = 2**31 - 1
#: mallopt's parameter numbers (glibc's malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: the same policy for processes this one starts (spawned workers read it at their start)
TUNABLES = {
    "glibc.malloc.mmap_threshold": MMAP_THRESHOLD,
    "glibc.malloc.trim_threshold": TRIM_THRESHOLD,
}
#: set to 0 to leave the C library's allocator as it is
ENV_SWITCH = "PRIVKIT_KEEP_FREED_MEMORY"


def keep_freed_memory() -> bool:
    """Keep freed memory in this process's heap (glibc on Linux; see the module docstring) and in
    the processes it starts (``GLIBC_TUNABLES``, which each child's C library reads at its start).
    Returns whether the policy is in force; calling it again changes nothing."""
    if os.environ.get(ENV_SWITCH) == "0" or not _glibc():
        return False
    libc = ctypes.CDLL(None)  # the C library this process already runs
    # the mmap threshold first: a raised trim threshold alone fixes the mmap threshold at its
    # start (128 KB, no longer raised as blocks are freed), which made the dpsgd CNN step slower
    # (527 against 325 ms), so the trim threshold is raised only once the other is
    applied = all(
        libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) == 1
        for param, value in (
            (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        )
    )
    if applied:
        os.environ["GLIBC_TUNABLES"] = _with_tunables(os.environ.get("GLIBC_TUNABLES", ""))
    return applied


def _glibc() -> bool:
    """Whether this process runs on glibc (its own answer: no scan of the executable, as
    ``platform.libc_ver`` does)."""
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (AttributeError, ValueError, OSError):  # no confstr, or no such name on this system
        return False
    return version.startswith("glibc")


def _with_tunables(current: str) -> str:
    """``current`` (``name=value`` pairs joined by ``:``) with :data:`TUNABLES` set, the others kept."""
    pairs = [p for p in current.split(":") if p and p.split("=", 1)[0] not in TUNABLES]
    pairs += [f"{name}={value}" for name, value in TUNABLES.items()]
    return ":".join(pairs)


__all__ = ["keep_freed_memory"]
