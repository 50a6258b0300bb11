"""cgroup v1 ``cpu`` groups for benchmarks: a CPU-limited (or CPU-favoured) group of
processes, and a sampler of the processes in it (start, CPU time, last seen alive).

    CpuLimit(0.25, shares=8192)  # a quarter of one core, and its floor too
"""

from __future__ import annotations

import bisect
import contextlib
import os
import sys
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

CPU_CGROUPS = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------- the cgroup
def cgroup_unavailable(root: Path = CPU_CGROUPS) -> str | None:
    """Why a CPU-limited cgroup cannot be made here (None: it can)."""
    probe = root / f"fedhet-probe-{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
    except OSError as exc:
        return f"cgroup v1 cpu controller not writable at {root}: {exc}"
    try:
        (probe / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (probe / "cpu.cfs_quota_us").write_text(str(PERIOD_US // 4))
    except OSError as exc:
        return f"cgroup v1 cpu controller not writable at {root}: {exc}"
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()
    return None


class CpuLimit:
    """A cgroup v1 ``cpu`` group limited to ``quota`` of one core (None: no limit);
    a context manager that moves every process left in it back to the parent group
    and removes it on exit."""

    def __init__(
        self,
        quota: float | None,
        root: Path = CPU_CGROUPS,
        period_us: int = PERIOD_US,
        shares: int | None = None,
    ) -> None:
        self.quota, self.root, self.period_us, self.shares = quota, root, period_us, shares
        self.path = root / f"fedhet-throttled-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def __enter__(self) -> CpuLimit:
        remove_stale(self.root)
        self.path.mkdir()
        try:
            (self.path / "cpu.cfs_period_us").write_text(str(self.period_us))
            limit = -1 if self.quota is None else max(1000, round(self.quota * self.period_us))
            (self.path / "cpu.cfs_quota_us").write_text(str(limit))
            if self.shares is not None:
                (self.path / "cpu.shares").write_text(str(self.shares))
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add(self, pids: Iterable[int]) -> list[int]:
        """Move ``pids`` (each a whole process) into the group; the ones moved."""
        moved = []
        for pid in pids:
            try:
                (self.path / "cgroup.procs").write_text(str(pid))
            except OSError:  # ended meanwhile
                continue
            moved.append(pid)
        return moved

    def pids(self) -> list[int]:
        try:
            text = (self.path / "cgroup.procs").read_text()
        except OSError:
            return []
        return [int(p) for p in text.split()]

    def stat(self) -> dict[str, int]:
        """``cpu.stat``: nr_periods, nr_throttled, throttled_time (ns), ..."""
        try:
            lines = (self.path / "cpu.stat").read_text().splitlines()
        except OSError:
            return {}
        return {k: int(v) for k, v in (line.split() for line in lines if line.strip())}

    def close(self) -> None:
        """Processes still in the group go back to the parent; the group is removed."""
        remove_group(self.path, self.root)


def remove_group(path: Path, root: Path = CPU_CGROUPS) -> None:
    """Move what ``path`` still holds to ``root`` and remove the group (retried for up
    to 15 s while its last processes leave)."""
    if not path.exists():
        return
    deadline = time.monotonic() + 15
    while True:
        with contextlib.suppress(OSError):
            for pid in (path / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    (root / "cgroup.procs").write_text(pid)
        try:
            path.rmdir()
            return
        except OSError:
            if time.monotonic() > deadline:
                print(f"warning: could not remove {path}", file=sys.stderr)
                return
            time.sleep(0.2)


def own_groups(root: Path = CPU_CGROUPS) -> list[Path]:
    """The groups this process made and has not removed."""
    return sorted(root.glob(f"fedhet-throttled-{os.getpid()}-*"))


def remove_stale(root: Path = CPU_CGROUPS) -> list[Path]:
    """Remove the groups of processes that have ended (a run killed before its clean-up:
    its group outlives it, empty or holding its orphans, which go back to the parent);
    the groups removed."""
    removed = []
    for path in root.glob("fedhet-throttled-*"):
        try:
            owner = int(path.name.split("-")[2])
        except (IndexError, ValueError):
            continue
        if Path(f"/proc/{owner}").exists():  # this process, or another still running
            continue
        remove_group(path, root)
        if not path.exists():
            removed.append(path)
    return removed


# ---------------------------------------------------------------------- sampling
def proc_stat(pid: int) -> tuple[int, float, float] | None:
    """(ppid, CPU seconds, start in seconds since boot) of ``pid``; None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / CLK_TCK, int(fields[19]) / CLK_TCK


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@dataclass
class Seen:
    """A process of the cgroup as the sampler saw it."""

    pid: int
    ppid: int
    start_s: float
    """Start, seconds since boot (``/proc/<pid>/stat``, clock-tick resolution)."""
    cpu_first: float
    cpu_last: float
    last_seen_s: float
    """Last time it was alive, seconds since boot (``CLOCK_BOOTTIME``)."""
    command: str


class CgroupSampler(threading.Thread):
    """Every process in ``limit`` every ``interval`` s: when it started, when it was
    last seen alive, its CPU time (a process shorter than ``interval`` may be missed;
    the last ``interval`` of a process's CPU time is)."""

    def __init__(self, limit: CpuLimit, interval: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.limit, self.interval = limit, interval
        self.seen: dict[int, Seen] = {}
        self.series: list[tuple[float, dict[int, float]]] = []
        """(time since boot, CPU seconds of each process then), every sample."""
        self.halt = threading.Event()

    def sample(self) -> None:
        now = time.clock_gettime(time.CLOCK_BOOTTIME)
        cpus: dict[int, float] = {}
        for pid in self.limit.pids():
            st = proc_stat(pid)
            if st is None:
                continue
            ppid, cpu, start = st
            cpus[pid] = cpu
            known = self.seen.get(pid)
            if known is None or known.start_s != start:  # new (or a reused pid)
                self.seen[pid] = Seen(pid, ppid, start, cpu, cpu, now, cmdline(pid))
            else:
                known.cpu_last, known.last_seen_s = cpu, now
        self.series.append((now, cpus))

    def cpu_between(self, start_s: float, end_s: float, pids: set[int]) -> float:
        """CPU seconds ``pids`` spent from the last sample at or before ``start_s`` to
        the first at or after ``end_s`` (both: seconds since boot)."""
        times = [t for t, _ in self.series]
        if not times:
            return 0.0
        i = max(bisect.bisect_right(times, start_s) - 1, 0)
        j = min(bisect.bisect_left(times, end_s), len(times) - 1)
        before, after = self.series[i][1], self.series[j][1]
        return sum(after[p] - before.get(p, 0.0) for p in pids if p in after)

    def run(self) -> None:
        while not self.halt.wait(self.interval):
            self.sample()

    def finish(self) -> None:
        self.halt.set()
        self.join()

    def tasks(self, executor_pid: int) -> list[Seen]:
        """The ClientApp task processes: children of the executor's fork server
        (or of the executor itself), by start."""
        below = [s for s in self.seen.values() if s.ppid == executor_pid]
        servers = {s.pid for s in below if "forkserver" in s.command}
        parents = servers or {executor_pid}
        return sorted(
            (s for s in self.seen.values() if s.ppid in parents and s.pid not in servers),
            key=lambda s: s.start_s,
        )

    def cpu_by_role(self, supernode_pid: int, executor_pid: int) -> dict[str, float]:
        """CPU seconds spent in the group while sampled, by role."""
        task_pids = {t.pid for t in self.tasks(executor_pid)}
        out: dict[str, float] = {}
        for s in self.seen.values():
            if s.pid == supernode_pid:
                role = "supernode"
            elif s.pid in task_pids:
                role = "tasks"
            elif s.pid == executor_pid or s.ppid == executor_pid:
                role = "executor"
            else:
                role = "other"
            first = s.cpu_first if s.pid in (supernode_pid, executor_pid) else 0.0
            out[role] = out.get(role, 0.0) + s.cpu_last - first
        return out
