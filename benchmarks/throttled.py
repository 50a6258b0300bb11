"""The virtual clock against a real slow node: one SuperNode under a CPU quota.

A loopback federation (``cli.federation.Federation``: SuperLink + 2 SuperNodes with
their warm executors, TLS + node auth) runs ``lgfedavg``; node 1's SuperNode and
executor (and so every ClientApp task process they fork) run in a cgroup v1 ``cpu``
group limited to ``q`` of one core (``cpu.cfs_quota_us = q × cpu.cfs_period_us``;
``cpu.shares`` raised so that other work on the machine does not push it below q);
the rest of the federation runs in a group of the same shares without a quota.
Both nodes get a device through node-config: node 0 ``speed = host speed``, node 1
``speed = host speed × q``, 1000 Mbit/s links, no latency, so compute dominates. The
host speed is :data:`REFERENCE_HOST_SPEED` (``--host-speed``; 0: measured here with
:func:`models.workload.measure_speed`, one thread), given to all the federations'
processes (``FEDHET_HOST_SPEED``): the training's prediction does not depend on it
(``train-cpu-s × host / (host × q)``), the task's cost does (its GFLOP in
``common/devices.py`` are CPU seconds × this speed).

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
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.cgroups import PERIOD_US, CgroupSampler, CpuLimit, cgroup_unavailable
from cli.federation import Federation
from cli.launch import descendants
from cli.linkproxy import Link

ROOT = Path(__file__).resolve().parent.parent
FASHION = Path("/usr/share/datasets/fashion-mnist")
THROTTLED = 1
"""The node (index and partition id) that runs under the quota."""
LINK_MBPS = 1000.0
SHARES: int | None = 8192
"""``cpu.shares`` of node 1's group (the kernel's default is 1024): the quota is the
node's ceiling, these shares make it its floor too when other work shares the
machine's cores (a real slow device does not compete with them). None: 1024."""
REFERENCE_HOST_SPEED = 18.5309
"""This machine's speed on the reference workload (GFLOP/s, one thread) as the fleet
runs use it (docs/results/fleet.json): measured with nothing else running, where a
measurement on a busy machine reads 15 to 23. The task costs of ``common/devices.py``
are CPU seconds measured here × this speed."""
HOST_SPEED_ENV = "FEDHET_HOST_SPEED"
"""The federation's processes take the host speed from it (``models.workload.host_speed``)."""


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
    *,
    link: Link | None = None,
    device_class: str | None = None,
    evaluate: bool = False,
) -> dict[str, Any]:
    """One federation with node 1 under ``quota`` of a core (1.0: in the group, no
    limit); per-round facts of node 1 and their medians over rounds 2..R.

    ``link``: node 1 reaches the SuperLink over it (its node-config says so too);
    ``device_class``: node 1 runs that class's model (run-config ``fleet``; node 0 a
    Pi 4's, the lightest, so that the round waits for node 1); ``evaluate``: the run
    evaluates every round (inside the training messages, ``eval-mode``'s default)
    instead of training only."""
    name = f"q{quota:g}" + (f"-link{link.rtt_ms:g}" if link else "")
    name += f"-{device_class}" if device_class else ""
    name += "-eval" if evaluate else ""
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
    if evaluate:
        del overrides["fraction-evaluate"]
    if device_class:  # node 0 the lightest model (CNN-5): node 1 is the slowest
        overrides["fleet"] = f"rpi4:1,{device_class}:1"
    configs = node_configs(work, host, quota)
    if link is not None:
        configs[THROTTLED].update(
            {
                "latency-ms": link.rtt_ms,
                "uplink-mbps": link.up_mbps or LINK_MBPS,
                "downlink-mbps": link.down_mbps or LINK_MBPS,
            }
        )
    printer = print if echo else None
    limit_q = None if quota >= 1 else quota
    with (
        CpuLimit(limit_q, period_us=period_us, shares=shares) as limit,
        CpuLimit(None, shares=shares) as rest,
        Federation(
            work,
            configs,
            ROOT,
            secure=True,
            echo=printer,
            links=[None, link] if link else (),
        ) as fed,
    ):
        supernode = fed.procs.procs[f"supernode-{THROTTLED}"].pid
        executor = fed.procs.procs[f"superexec-{THROTTLED}"].pid
        node = [supernode, *descendants(supernode), executor, *descendants(executor)]
        limit.add(node)
        # the rest of the federation (SuperLink, its ServerApp, node 0, the link) in a
        # group of the same shares and no quota: other work on the machine must not
        # make node 0 or the server the round's slowest part
        rest.add(
            p
            for proc in fed.procs.procs.values()
            for p in (proc.pid, *descendants(proc.pid))
            if p not in node
        )
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
        raise RuntimeError(f"{name}: run {outcome.status}; end of its log:\n{log}")
    res = json.loads((out / "results.json").read_text())
    rows = res["rounds"]
    # node 1's task processes: the run's first messages (profile query, ...), then
    # one training task per round, and with evaluation the last round's closing one
    last = len(tasks) - (1 if evaluate else 0)
    train_tasks = tasks[last - rounds : last] if last >= rounds else []
    starts = [t.start_s for t in train_tasks] + [time.clock_gettime(time.CLOCK_BOOTTIME)]
    key = str(THROTTLED)
    per_round = []
    for i, row in enumerate(rows):
        reply, ref = row["client-train"][key], row["client-train"]["0"]
        task = train_tasks[i] if train_tasks else None
        eval_cpu = float(reply.get("eval-cpu-s") or 0.0)
        # the node's SuperNode, executor and fork server from this task's start to
        # the next one's: what the node spends per message beyond the task process
        daemons = sampler.cpu_between(starts[i], starts[i + 1], others) if task else None
        overhead = (
            task.cpu_last - reply["train-cpu-s"] - eval_cpu + (daemons or 0.0) if task else None
        )
        wall = task.last_seen_s - task.start_s if task else None
        per_round.append(
            {
                "round": row["round"],
                "predicted-s": row["client-virtual-time-s"][key],
                "predicted-round-s": row["virtual-time-s"],
                "eval-cpu-s": eval_cpu,
                "node-daemons-cpu-per-round-s": daemons,
                "task-overhead-cpu-s": overhead,
                "round-beyond-task-s": (
                    row["round-time-s"] - wall - row["server-time-s"] - (daemons or 0.0) / quota
                    if wall is not None
                    else None
                ),
                "server-time-s": row["server-time-s"],
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
    run: dict[str, Any] = {
        "quota": quota,
        "cfs-quota-us": None if limit_q is None else round(limit_q * period_us),
        "cfs-period-us": period_us,
        "node-speed": host * quota,
        "rounds": per_round,
        "link": None
        if link is None
        else {"rtt-ms": link.rtt_ms, "up-mbps": link.up_mbps, "down-mbps": link.down_mbps},
        "device-class": device_class,
        "evaluate": evaluate,
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
    run.update(summarise_quota(run))
    return run


def summarise_quota(run: dict[str, Any]) -> dict[str, Any]:
    """Medians of a federation's rounds 2..R (with evaluation 2..R-1: the last round
    also carries the closing evaluation message), and the ratios the tables show."""
    per_round, quota = run["rounds"], run["quota"]
    later = per_round[1:-1] if run.get("evaluate") and len(per_round) > 2 else per_round[1:]
    later = later or per_round

    def med(k: str) -> float | None:
        return median([r[k] for r in later if r.get(k) is not None])

    summary = {k: med(k) for k in per_round[0] if k != "round"}

    def ratio(a: str, b: str) -> float | None:
        x, y = summary.get(a), summary.get(b)
        return x / y if x is not None and y else None

    task_cpu = summary["task-cpu-s"]
    return {
        "median": summary,
        "medians-over-rounds": [r["round"] for r in later],
        # the clock's training part over the measured training time
        "ratio-predicted-over-train-time": ratio("virtual-compute-s", "train-time-s"),
        "ratio-per-round-median": median(
            [r["virtual-compute-s"] / r["train-time-s"] for r in later if r["train-time-s"]]
        ),
        # the check: the clock's round (the slowest node's message + the server step)
        # over the round the server measured
        "ratio-predicted-round-over-round-time": ratio("predicted-round-s", "round-time-s"),
        # its two factors: the quota arithmetic, and the task's host speed measurement
        "ratio-cpu-over-quota-over-train-time": ratio("cpu-over-quota-s", "train-time-s"),
        # the whole task process: does its CPU / q explain its wall time, and how much
        # of it does the virtual clock cover
        "ratio-task-cpu-over-quota-over-task-wall": task_cpu / quota / summary["task-wall-s"]
        if task_cpu is not None and summary["task-wall-s"]
        else None,
        "ratio-predicted-over-task-wall": ratio("predicted-s", "task-wall-s"),
        "ratio-predicted-over-round-time": ratio("predicted-s", "round-time-s"),
        # CPU share of one core the node's training got (train-cpu-s / train-time-s;
        # the quota's arithmetic holds when it is q) and node 0's (1: no contention)
        "achieved-share": ratio("train-cpu-s", "train-time-s"),
        "reference-achieved-share": ratio("reference-train-cpu-s", "reference-train-time-s"),
    }


# ---------------------------------------------------------------------- the benchmark
FIELDS = {
    "predicted-s": "node 1's client-virtual-time-s: its training and evaluation on its "
    "device + the task, the protocol and the transfers of its message (the virtual clock)",
    "predicted-round-s": "the round's virtual-time-s: the slowest node's "
    "client-virtual-time-s + the server step",
    "eval-cpu-s": "CPU seconds of the evaluation node 1's training message carried",
    "node-daemons-cpu-per-round-s": "CPU of node 1's SuperNode, executor and fork "
    "server from this round's task start to the next one's",
    "task-overhead-cpu-s": "task-cpu-s - train-cpu-s - eval-cpu-s + the daemons' CPU of "
    "the round: the work of a message beyond training and evaluation",
    "round-beyond-task-s": "round-time-s - task-wall-s - server-time-s - the daemons' "
    "CPU / q: the protocol's time at this link",
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
    "round-time-s": "the server's round time (node 1 is the slowest)",
    "reference-*": "node 0 (no limit, speed = host speed), the same quantities",
}
"""What each per-round entry (and its median) is."""


@dataclass(frozen=True)
class Row:
    """One federation of the benchmark: node 1's quota, its link, its device class,
    and whether the run evaluates (inside its training messages)."""

    quota: float
    link: Link | None = None
    device_class: str | None = None
    evaluate: bool = False


CHECK_ROWS = (
    Row(0.3, evaluate=True),
    Row(0.5, link=Link(delay_ms=50.0, up_mbps=10.0, down_mbps=10.0), evaluate=True),
)
"""``--check``: a node at 0.3 of a core, and a node at half a core behind a 100 ms /
10 Mbit/s link; the clock's round time against the server's. The link's node has a
quota too: a node without one gets what the machine's other work leaves it (0.65 of
a core in one run under a load average of 8), which the clock cannot know."""


def task_cost_rows() -> list[Row]:
    """``--task-cost``: node 1 at half a core (the slowest node, so the round waits
    for it) with each device class's model, evaluating every round."""
    from common.devices import DEVICES

    return [Row(0.5, device_class=name, evaluate=True) for name in DEVICES]


def measure(
    quotas: Sequence[float] | Sequence[Row],
    rounds: int = 5,
    fraction: float = 0.05,
    period_us: int = PERIOD_US,
    shares: int | None = SHARES,
    echo: bool = False,
    host_speed: float | None = REFERENCE_HOST_SPEED,
) -> dict[str, Any]:
    """Every row (a quota, or a :class:`Row`) in its own federation; the host speed
    (None: measured once, here) given to every process of the federations
    (``FEDHET_HOST_SPEED``)."""
    reason = cgroup_unavailable()
    if reason is not None:
        raise RuntimeError(reason)
    if shutil.which("flower-superlink") is None:  # run without an activated venv
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    from models.workload import measure_speed

    rows = [q if isinstance(q, Row) else Row(float(q)) for q in quotas]
    host = host_speed or measure_speed(threads=1)
    results = []
    before = os.environ.get(HOST_SPEED_ENV)
    os.environ[HOST_SPEED_ENV] = repr(host)  # the Federation's processes inherit it
    try:
        with tempfile.TemporaryDirectory(prefix="fedhet-throttled-") as tmp:
            tmpd = Path(tmp)
            for row in rows:
                results.append(
                    run_quota(
                        row.quota,
                        host,
                        rounds,
                        fraction,
                        tmpd,
                        tmpd / "cache",
                        period_us,
                        shares,
                        echo,
                        link=row.link,
                        device_class=row.device_class,
                        evaluate=row.evaluate,
                    )
                )
    finally:
        if before is None:
            os.environ.pop(HOST_SPEED_ENV, None)
        else:
            os.environ[HOST_SPEED_ENV] = before
    return {
        "workload": f"lgfedavg, 2 nodes, {data_overrides(fraction)['data.name']} "
        f"data.fraction={fraction} iid, {rounds} rounds, train.num-threads=1, evaluation "
        "where a row says so (inside the training messages); loopback deployment with "
        "TLS + node auth, warm executors; node 1's SuperNode + executor + ClientApp tasks "
        f"in one cgroup v1 cpu group (cfs period {period_us} us, cpu.shares "
        f"{shares or 1024}), the rest of the federation in another (cpu.shares "
        f"{shares or 1024}, no quota)",
        "host-speed-gflops": host,
        "load-average-1min": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        "predicted": "node 1's virtual-compute-s (its training) and the round's "
        "virtual-time-s (the slowest node's client-virtual-time-s + the server step)",
        "measured": "node 1's train-time-s (wall time of its training loop, from its reply) "
        "and the server's round-time-s; also its training task process's wall time",
        "medians-over": f"rounds 2..{rounds} (2..{rounds - 1} when evaluating)"
        if rounds > 1
        else "round 1",
        "fields": FIELDS,
        "quotas": results,
    }


def task_cost(result: dict[str, Any]) -> dict[str, Any]:
    """Per device class (``--task-cost`` rows): a task's CPU beyond training and
    evaluation (median), as reference-workload GFLOP (x this machine's speed), and
    the round's time beyond the task at no round-trip time."""
    host = result["host-speed-gflops"]
    out: dict[str, Any] = {}
    for r in result["quotas"]:
        if not r.get("device-class"):
            continue
        m = r["median"]
        cpu = m["task-overhead-cpu-s"]
        out[r["device-class"]] = {
            "task-overhead-cpu-s": cpu,
            "task-gflop": None if cpu is None else cpu * host,
            "round-beyond-task-s": m["round-beyond-task-s"],
            "eval-cpu-s": m["eval-cpu-s"],
            "train-cpu-s": m["train-cpu-s"],
        }
    return out


def row_name(r: dict[str, Any]) -> str:
    name = f"q={r['quota']:g}"
    if r.get("link"):
        link = r["link"]
        name += f", link {link['rtt-ms']:g} ms / {link['up-mbps']:g} Mbit/s"
    if r.get("device-class"):
        name += f", {r['device-class']}"
    return name + (", evaluating" if r.get("evaluate") else "")


def table(result: dict[str, Any]) -> str:
    lines = [
        "| node 1 | training: predicted s (virtual clock) | measured s (train-time-s) "
        "| pred / meas | CPU share got (node 0) | task wall s | task CPU / q s "
        "| round: predicted s | measured s (round-time-s) | pred / meas | throttled periods |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(x: float | None, digits: int = 2) -> str:
        return "-" if x is None else f"{x:.{digits}f}"

    for r in result["quotas"]:
        m = r["median"]
        task_cpu_q = None if m["task-cpu-s"] is None else m["task-cpu-s"] / r["quota"]
        st = r["cpu-stat"]
        lines.append(
            f"| {row_name(r)} | {f(m['virtual-compute-s'])} | {f(m['train-time-s'])} | "
            f"{f(r['ratio-predicted-over-train-time'])} | {f(r['achieved-share'])} "
            f"({f(r['reference-achieved-share'])}) | {f(m['task-wall-s'])} | {f(task_cpu_q)} | "
            f"{f(m['predicted-round-s'])} | {f(m['round-time-s'])} | "
            f"{f(r.get('ratio-predicted-round-over-round-time'))} | "
            f"{st.get('nr_throttled', 0)}/{st.get('nr_periods', 0)} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quotas", default="1,0.5,0.25", help="shares of one core, comma-separated")
    ap.add_argument(
        "--check",
        action="store_true",
        help="instead: the round checks (q=0.3; a 100 ms / 10 Mbit/s link), evaluating",
    )
    ap.add_argument(
        "--task-cost",
        action="store_true",
        help="instead: a task's cost beyond training per device class (q=0.5, evaluating)",
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fraction", type=float, default=0.05, help="data.fraction")
    ap.add_argument("--period-us", type=int, default=PERIOD_US, help="cpu.cfs_period_us")
    ap.add_argument(
        "--shares", type=int, default=SHARES, help="cpu.shares of the node's group (1024: default)"
    )
    ap.add_argument(
        "--host-speed",
        type=float,
        default=REFERENCE_HOST_SPEED,
        help="GFLOP/s given to the federations' processes (0: measure it here)",
    )
    ap.add_argument("--out", type=Path, default=None, help="default benchmarks/out/<mode>.json")
    ap.add_argument(
        "--archive", action="store_true", help="also copy the JSON to docs/results/<mode>.json"
    )
    ap.add_argument("--verbose", action="store_true", help="print the federation's output")
    ap.add_argument(
        "--resummarise",
        type=Path,
        default=None,
        help="run nothing: recompute the medians (and task cost) of this JSON's rounds",
    )
    args = ap.parse_args()
    if args.resummarise is not None:
        result = json.loads(args.resummarise.read_text())
        for run in result["quotas"]:
            run.update(summarise_quota(run))
        if any(r.get("device-class") for r in result["quotas"]):
            result["task-cost"] = task_cost(result)
        args.resummarise.write_text(json.dumps(result, indent=1) + "\n")
        print(table(result))
        print(json.dumps(result.get("task-cost", {}), indent=1))
        return
    rows: list[Row]
    if args.task_cost:
        mode, rows = "throttled-task-cost", task_cost_rows()
    elif args.check:
        mode, rows = "throttled-check", list(CHECK_ROWS)
    else:
        mode = "throttled"
        rows = [Row(float(q)) for q in args.quotas.split(",") if q.strip()]
        if any(not 0 < r.quota <= 1 for r in rows):
            raise SystemExit("--quotas: each a share of one core in (0, 1]")
    try:
        result = measure(
            rows,
            args.rounds,
            args.fraction,
            args.period_us,
            args.shares,
            args.verbose,
            host_speed=args.host_speed or None,
        )
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from None
    if args.task_cost:
        result["task-cost"] = task_cost(result)
    out = args.out or ROOT / f"benchmarks/out/{mode}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    if args.archive:
        archived = ROOT / f"docs/results/{mode}.json"
        archived.write_text(json.dumps(result, indent=1) + "\n")
        print(f"archived: {archived}")
    print(table(result))
    if args.task_cost:
        print(json.dumps(result["task-cost"], indent=1))
    print(f"\n{out}")


if __name__ == "__main__":
    main()
