"""Freed memory kept in privkit's processes (privkit.memory): the pages of a freed tensor are
reused by the next one, in the process and in the processes it starts, and only there."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from privkit import memory

glibc = pytest.mark.skipif(not memory._glibc(), reason="the policy applies to glibc only")

#: a child that rewrites a freed 64 MB tensor (above glibc's largest dynamic mmap threshold,
#: 32 MB: without the policy every such block is mapped anew) and prints its page faults per
#: rewrite, after warm-up rewrites that let the heap settle; ``KEEP=1`` applies the policy first,
#: ``SPAWN=1`` measures in a child it starts after applying it
CHILD = textwrap.dedent(
    """
    import os, resource, subprocess, sys
    import torch
    if os.environ.get("KEEP") == "1":
        from privkit.memory import keep_freed_memory
        assert keep_freed_memory() is (os.environ.get("PRIVKIT_KEEP_FREED_MEMORY") != "0")
        if os.environ.get("SPAWN") == "1":
            env = {k: v for k, v in os.environ.items() if k not in ("KEEP", "SPAWN")}
            out = subprocess.run([sys.executable, "-c", sys.argv[1], sys.argv[1]], env=env,
                                 capture_output=True, text=True, check=True).stdout
            print(out.strip())
            sys.exit(0)
    def rewrite():
        t = torch.empty(16 * 2**20)
        t.fill_(1.0)
        del t
    for _ in range(10):
        rewrite()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        rewrite()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
    """
)
PAGES = 64 * 2**20 // os.sysconf("SC_PAGE_SIZE")


def _faults_per_rewrite(**env: str) -> float:
    clean = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", memory.ENV_SWITCH)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, CHILD],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return float(out.split()[-1])


@glibc
def test_freed_pages_are_reused_in_the_process_and_its_children():
    """Without the policy every rewrite of the freed block faults in (nearly) all its pages; with
    it none, in the process that applied it and in a child it started; the switch turns it off."""
    assert _faults_per_rewrite() >= 0.9 * PAGES
    assert _faults_per_rewrite(KEEP="1") <= 0.02 * PAGES
    assert _faults_per_rewrite(KEEP="1", SPAWN="1") <= 0.02 * PAGES
    assert _faults_per_rewrite(KEEP="1", **{memory.ENV_SWITCH: "0"}) >= 0.9 * PAGES


def test_tunables_for_children_keep_the_others():
    got = memory._with_tunables("glibc.malloc.arena_max=2:glibc.malloc.trim_threshold=5")
    assert got.split(":") == [
        "glibc.malloc.arena_max=2",
        f"glibc.malloc.mmap_threshold={memory.MMAP_THRESHOLD}",
        f"glibc.malloc.trim_threshold={memory.TRIM_THRESHOLD}",
    ]
    assert memory._with_tunables("") == memory._with_tunables(got).replace(
        "glibc.malloc.arena_max=2:", ""
    )


def test_the_switch_and_other_c_libraries_leave_the_process_alone(monkeypatch):
    monkeypatch.setenv(memory.ENV_SWITCH, "0")
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert memory.keep_freed_memory() is False
    assert "GLIBC_TUNABLES" not in os.environ
    monkeypatch.delenv(memory.ENV_SWITCH)
    monkeypatch.setattr(memory, "_glibc", lambda: False)
    assert memory.keep_freed_memory() is False
    assert "GLIBC_TUNABLES" not in os.environ


def test_the_command_line_applies_it_first(monkeypatch):
    from privkit.cli.app import main

    calls = []
    monkeypatch.setattr(memory, "keep_freed_memory", lambda: calls.append(1) or True)
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and calls == [1]
