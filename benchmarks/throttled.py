"""The virtual clock against a real slow node: one SuperNode under a CPU quota.

A loopback federation (``cli.federation.Federation``: SuperLink + 2 SuperNodes with
their warm executors, TLS + node auth) runs ``lgfedavg``; node 1's SuperNode and
executor (and so every ClientApp task process they fork) run in a cgroup v1 ``cpu``
group limited to ``q`` of one core (``cpu.cfs_quota_us = q × cpu.cfs_period_us``;
``cpu.shares`` raised so that other work on the machine does not push it below q).
Both nodes get a device through node-config: node 0 ``speed = host speed``, node 1
``speed = host speed × q``, 1000 Mbit/s links, no latency, so compute dominates. The
host speed is :func:`models.workload.measure_speed` with one thread, measured here
before the federations start and given to all their processes
(``FEDHET_HOST_SPEED``).

Predicted: node 1's ``client-virtual-time-s`` (its ``virtual-compute-s`` =
``train-cpu-s × host speed / (host speed × q)`` plus the transfers); a quota does not
inflate CPU time, so this is ``train-cpu-s / q``. Measured: the wall time of node 1's
training as its reply reports it (``train-time-s``); also, from outside, the wall and
CPU time of node 1's whole training task process (sampled from the cgroup) and the
server's round time. Medians over rounds 2..R (round 1 builds the partition cache).

    python -m benchmarks.throttled [--quotas 1,0.5,0.25] [--rounds 5] [--archive]
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cli.federation import Federation
from cli.launch import descendants

ROOT = Path(__file__).resolve().parent.parent
CPU_CGROUPS = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000
FASHION = Path("/usr/share/datasets/fashion-mnist")
THROTTLED = 1
"""The node (index and partition id) that runs under the quota."""
LINK_MBPS = 1000.0
SHARES: int | None = 8192
"""``cpu.shares`` of node 1's group (the kernel's default is 1024): the quota is the
node's ceiling, these shares make it its floor too when other work shares the
machine's cores (a real slow device does not compete with them). None: 1024."""
HOST_SPEED_ENV = "FEDHET_HOST_SPEED"
"""The federation's processes take the host speed from it (``models.workload.host_speed``)."""
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
        if not self.path.exists():
            return
        deadline = time.monotonic() + 15
        while True:
            for pid in self.pids():
                with contextlib.suppress(OSError):
                    (self.root / "cgroup.procs").write_text(str(pid))
            try:
                self.path.rmdir()
                return
            except OSError:
                if time.monotonic() > deadline:
                    print(f"warning: could not remove {self.path}", file=sys.stderr)
                    return
                time.sleep(0.2)


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


# ---------------------------------------------------------------------- one federation
def data_overrides(fraction: float) -> dict[str, Any]:
    if FASHION.exists():
        return {"data.name": "fashion-mnist", "data.fraction": fraction}
    return {"data.name": "synthetic", "data.fraction": fraction}


def node_configs(work: Path, host: float, quota: float) -> list[dict[str, Any]]:
    return [
        {
            "partition-id": i,
            "num-partitions": 2,
            "state-dir": str(work / "state" / f"node-{i}"),
            "speed": host * (quota if i == THROTTLED else 1.0),
            "uplink-mbps": LINK_MBPS,
            "downlink-mbps": LINK_MBPS,
            "latency-ms": 0.0,
        }
        for i in range(2)
    ]


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def run_quota(
    quota: float,
    host: float,
    rounds: int,
    fraction: float,
    tmpd: Path,
    cache: Path,
    period_us: int = PERIOD_US,
    shares: int | None = SHARES,
    echo: bool = False,
) -> dict[str, Any]:
    """One federation with node 1 under ``quota`` of a core (1.0: in the group, no
    limit); per-round facts of node 1 and their medians over rounds 2..R."""
    name = f"q{quota:g}"
    work = tmpd / f"fed-{name}"
    out = tmpd / f"run-{name}"
    overrides: dict[str, Any] = {
        "algorithm": "lgfedavg",
        "num-server-rounds": rounds,
        "fraction-evaluate": 0.0,  # training rounds only: the round is node 1's training
        "data.partition": "iid",
        "train.num-threads": 1,
        "round-timeout": 900.0,
        "out-dir": str(out),
        "data.cache-dir": str(cache),
        **data_overrides(fraction),
    }
    printer = print if echo else None
    limit_q = None if quota >= 1 else quota
    with (
        CpuLimit(limit_q, period_us=period_us, shares=shares) as limit,
        Federation(work, node_configs(work, host, quota), ROOT, secure=True, echo=printer) as fed,
    ):
        supernode = fed.procs.procs[f"supernode-{THROTTLED}"].pid
        executor = fed.procs.procs[f"superexec-{THROTTLED}"].pid
        limit.add([supernode, *descendants(supernode), executor, *descendants(executor)])
        sampler = CgroupSampler(limit)
        sampler.sample()
        stat0 = limit.stat()
        sampler.start()
        t0 = time.perf_counter()
        try:
            outcome = fed.run(overrides, timeout=1800, echo=printer)
        finally:
            sampler.finish()
        run_s = time.perf_counter() - t0
        stat = {k: v - stat0.get(k, 0) for k, v in limit.stat().items()}
        roles = sampler.cpu_by_role(supernode, executor)
        tasks = sampler.tasks(executor)
        task_pids = {t.pid for t in tasks}
        others = {pid for pid in sampler.seen if pid not in task_pids}
    if not outcome.ok:
        log = outcome.log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"q={quota:g}: run {outcome.status}; end of its log:\n{log}")
    res = json.loads((out / "results.json").read_text())
    rows = res["rounds"]
    # node 1's task processes: the run's first messages (profile query, ...), then
    # one training task per round (no evaluation)
    train_tasks = tasks[-rounds:] if len(tasks) >= rounds else []
    key = str(THROTTLED)
    per_round = []
    for i, row in enumerate(rows):
        reply, ref = row["client-train"][key], row["client-train"]["0"]
        task = train_tasks[i] if train_tasks else None
        per_round.append(
            {
                "round": row["round"],
                "predicted-s": row["client-virtual-time-s"][key],
                "virtual-compute-s": reply["virtual-compute-s"],
                "train-cpu-s": reply["train-cpu-s"],
                "cpu-over-quota-s": reply["train-cpu-s"] / quota,
                "host-speed-task": reply["host-speed"],
                "host-speed-ratio": reply["host-speed"] / host,
                "train-time-s": reply["train-time-s"],
                "task-wall-s": task.last_seen_s - task.start_s if task else None,
                "task-cpu-s": task.cpu_last if task else None,
                "task-cpu-outside-clock-s": task.cpu_last - reply["train-cpu-s"] if task else None,
                "node-others-cpu-s": sampler.cpu_between(task.start_s, task.last_seen_s, others)
                if task
                else None,
                "round-time-s": row["round-time-s"],
                "reference-train-time-s": ref["train-time-s"],
                "reference-train-cpu-s": ref["train-cpu-s"],
                "reference-host-speed-ratio": ref["host-speed"] / host,
                "reference-predicted-s": row["client-virtual-time-s"]["0"],
            }
        )
    later = per_round[1:] or per_round

    def med(k: str) -> float | None:
        return median([r[k] for r in later if r[k] is not None])

    summary = {k: med(k) for k in per_round[0] if k != "round"}

    def ratio(a: str, b: str) -> float | None:
        x, y = summary[a], summary[b]
        return x / y if x is not None and y else None

    task_cpu = summary["task-cpu-s"]
    return {
        "quota": quota,
        "cfs-quota-us": None if limit_q is None else round(limit_q * period_us),
        "cfs-period-us": period_us,
        "node-speed": host * quota,
        "rounds": per_round,
        "median": summary,
        # the check: the virtual clock's prediction over the measured training time
        "ratio-predicted-over-train-time": ratio("predicted-s", "train-time-s"),
        "ratio-per-round-median": median(
            [r["predicted-s"] / r["train-time-s"] for r in later if r["train-time-s"]]
        ),
        # its two factors: the quota arithmetic, and the task's host speed measurement
        "ratio-cpu-over-quota-over-train-time": ratio("cpu-over-quota-s", "train-time-s"),
        # the whole task process: does its CPU / q explain its wall time, and how much
        # of it does the virtual clock (training only) cover
        "ratio-task-cpu-over-quota-over-task-wall": task_cpu / quota / summary["task-wall-s"]
        if task_cpu is not None and summary["task-wall-s"]
        else None,
        "ratio-predicted-over-task-wall": ratio("predicted-s", "task-wall-s"),
        "ratio-predicted-over-round-time": ratio("predicted-s", "round-time-s"),
        # CPU share of one core the node's training got (train-cpu-s / train-time-s;
        # the quota's arithmetic holds when it is q) and node 0's (1: no contention)
        "achieved-share": ratio("train-cpu-s", "train-time-s"),
        "reference-achieved-share": ratio("reference-train-cpu-s", "reference-train-time-s"),
        "cpu-shares": shares,
        "node-cpu-s-by-role": roles,
        "node-cpu-share-of-quota": sum(roles.values()) / run_s / quota,
        "run-wall-s": run_s,
        "cpu-stat": stat,
        "task-processes": [
            {"wall-s": t.last_seen_s - t.start_s, "cpu-s": t.cpu_last} for t in tasks
        ],
        "training-tasks-found": len(train_tasks),
    }


# ---------------------------------------------------------------------- the benchmark
FIELDS = {
    "predicted-s": "node 1's client-virtual-time-s: virtual-compute-s + transfers + latency",
    "virtual-compute-s": "train-cpu-s x host-speed-task / node speed (host speed here x q)",
    "train-cpu-s": "process CPU time of install + train + upload in the task (its reply)",
    "cpu-over-quota-s": "train-cpu-s / q: the prediction with the task's host speed "
    "equal to the one measured here",
    "host-speed-task": "the host speed the task used (its reply; FEDHET_HOST_SPEED)",
    "host-speed-ratio": "host-speed-task / host speed measured here (1: as intended)",
    "train-time-s": "wall time of node 1's training loop (its reply): the measurement",
    "task-wall-s": "node 1's training task process, start to last seen alive (sampled "
    "every 0.05 s from the cgroup)",
    "task-cpu-s": "that process's CPU time (last sample)",
    "task-cpu-outside-clock-s": "task-cpu-s - train-cpu-s: the task process's start, "
    "imports, data, model, reply (outside the virtual clock)",
    "node-others-cpu-s": "CPU time of node 1's SuperNode, executor and fork server while "
    "the training task ran (they share the quota)",
    "round-time-s": "the server's round time (training only; node 1 is the slowest)",
    "reference-*": "node 0 (no limit, speed = host speed), the same quantities",
}
"""What each per-round entry (and its median) is."""


def measure(
    quotas: Sequence[float],
    rounds: int = 5,
    fraction: float = 0.05,
    period_us: int = PERIOD_US,
    shares: int | None = SHARES,
    echo: bool = False,
) -> dict[str, Any]:
    """Every quota in its own federation; the host speed measured once, here, and
    given to every process of the federations (``FEDHET_HOST_SPEED``)."""
    reason = cgroup_unavailable()
    if reason is not None:
        raise RuntimeError(reason)
    if shutil.which("flower-superlink") is None:  # run without an activated venv
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    from models.workload import measure_speed

    host = measure_speed(threads=1)
    results = []
    before = os.environ.get(HOST_SPEED_ENV)
    os.environ[HOST_SPEED_ENV] = repr(host)  # the Federation's processes inherit it
    try:
        with tempfile.TemporaryDirectory(prefix="fedhet-throttled-") as tmp:
            tmpd = Path(tmp)
            for q in quotas:
                results.append(
                    run_quota(
                        q, host, rounds, fraction, tmpd, tmpd / "cache", period_us, shares, echo
                    )
                )
    finally:
        if before is None:
            os.environ.pop(HOST_SPEED_ENV, None)
        else:
            os.environ[HOST_SPEED_ENV] = before
    return {
        "workload": f"lgfedavg, 2 nodes, {data_overrides(fraction)['data.name']} "
        f"data.fraction={fraction} iid, {rounds} rounds, train.num-threads=1, no evaluation; "
        "loopback deployment with TLS + node auth, warm executors; node 1's SuperNode + "
        "executor + ClientApp tasks in one cgroup v1 cpu group "
        f"(cfs period {period_us} us, cpu.shares {shares or 1024})",
        "host-speed-gflops": host,
        "load-average-1min": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        "predicted": "node 1's client-virtual-time-s (virtual-compute-s + transfers)",
        "measured": "node 1's train-time-s (wall time of its training loop, from its reply); "
        "also its whole training task process's wall time (task-wall-s) and the round time",
        "medians-over": f"rounds 2..{rounds}" if rounds > 1 else "round 1",
        "fields": FIELDS,
        "quotas": results,
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        "| quota | predicted s (virtual clock) | measured s (train-time-s) | pred / meas "
        "| CPU share got (node 0) | task wall s | task CPU / q s | clock / task wall "
        "| round s | throttled periods |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(x: float | None, digits: int = 2) -> str:
        return "-" if x is None else f"{x:.{digits}f}"

    for r in result["quotas"]:
        m = r["median"]
        task_cpu_q = None if m["task-cpu-s"] is None else m["task-cpu-s"] / r["quota"]
        st = r["cpu-stat"]
        lines.append(
            f"| {r['quota']:g} | {f(m['predicted-s'])} | {f(m['train-time-s'])} | "
            f"{f(r['ratio-predicted-over-train-time'])} | {f(r['achieved-share'])} "
            f"({f(r['reference-achieved-share'])}) | {f(m['task-wall-s'])} | {f(task_cpu_q)} | "
            f"{f(r['ratio-predicted-over-task-wall'])} | {f(m['round-time-s'])} | "
            f"{st.get('nr_throttled', 0)}/{st.get('nr_periods', 0)} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quotas", default="1,0.5,0.25", help="shares of one core, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fraction", type=float, default=0.05, help="data.fraction")
    ap.add_argument("--period-us", type=int, default=PERIOD_US, help="cpu.cfs_period_us")
    ap.add_argument(
        "--shares", type=int, default=SHARES, help="cpu.shares of the node's group (1024: default)"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/out/throttled.json")
    ap.add_argument(
        "--archive", action="store_true", help="also copy the JSON to docs/results/throttled.json"
    )
    ap.add_argument("--verbose", action="store_true", help="print the federation's output")
    args = ap.parse_args()
    quotas = [float(q) for q in args.quotas.split(",") if q.strip()]
    if any(not 0 < q <= 1 for q in quotas):
        raise SystemExit("--quotas: each a share of one core in (0, 1]")
    try:
        result = measure(
            quotas, args.rounds, args.fraction, args.period_us, args.shares, args.verbose
        )
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.archive:
        archived = ROOT / "docs/results/throttled.json"
        archived.write_text(json.dumps(result, indent=1) + "\n")
        print(f"archived: {archived}")
    print(table(result))
    print(f"\n{args.out}")


if __name__ == "__main__":
    main()
