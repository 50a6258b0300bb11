"""benchmarks/cgroups.py's clean-up of groups left by killed runs (on a plain folder
standing in for the cgroup v1 cpu hierarchy: an empty group is an empty folder)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from benchmarks.cgroups import CpuLimit, own_groups, remove_stale


def _ended_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_groups_of_ended_processes_are_removed_and_no_other(tmp_path: Path) -> None:
    dead = tmp_path / f"fedhet-throttled-{_ended_pid()}-aaaa"
    alive = tmp_path / "fedhet-throttled-1-bbbb"  # init never ends
    mine = tmp_path / f"fedhet-throttled-{os.getpid()}-cccc"
    other = tmp_path / "something-else-12"
    for path in (dead, alive, mine, other):
        path.mkdir()
    assert remove_stale(tmp_path) == [dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (alive, mine, other)
    )


def test_own_groups_are_this_process_groups() -> None:
    group = CpuLimit(None)
    assert group.path.name.startswith(f"fedhet-throttled-{os.getpid()}-")
    assert all(p.name.startswith(f"fedhet-throttled-{os.getpid()}-") for p in own_groups())
