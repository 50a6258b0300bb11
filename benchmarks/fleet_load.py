"""One server, many devices: a fleet of emulated nodes on the real protocol.

A real SuperLink (TLS, SuperNode authentication, its requests counted by path), the real
ServerApp with the real strategy, and N emulated SuperNodes in a few processes
(``benchmarks.fleet_node``: each node its own key, registered as ``flwr supernode
register`` registers it, Flower's own Fleet API client and node loop with fedhet's node
policy; no torch: replies of the method's real shapes from templates captured here from
fedhet's real ClientApp on five nodes, node i as partition i mod 5, after ``--delay``
seconds). Every node is sampled every round.

Measured: the registration time of N keys and the time until N nodes are online; each
round's time and its overhead beyond the slowest node's delay; CPU seconds of the
SuperLink and the ServerApp (cgroup ``cpuacct``, exact) and of the emulator processes,
per node-round, over the whole run and from the end of round 1 (steady state); the
SuperLink's requests per node-round by kind; the SuperLink's peak memory and open
sockets, and each role's peak summed resident memory (``peak-rss-mb-by-role``: the
SuperLink, the ServerApp with its SuperExec, the emulators as ``supernode``); replies
aggregated and lost (results.json's ``valid-replies``; the emulators'
errors). A run that would exhaust the machine's memory (``--memory-floor-mb``) is
stopped and recorded as broken there: ``"broke": "memory"``, when, each role's memory
and the rounds it completed.

    python -m benchmarks.fleet_load --nodes 100 --algorithm lgfedavg --rounds 5
    python -m benchmarks.fleet_load --nodes 8 --real     # real fedhet supernodes instead
    python -m benchmarks.fleet_load --nodes 3 --rounds 2 --delay 0.2   # the fast test's size

Rows are appended to ``--out`` (JSON list). Needs root (cgroup v1 ``cpuacct``) and the
project's ``.venv`` activated (Flower's commands on PATH).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.server_cost import (
    CountingFederation,
    FirstRound,
    RoleGroups,
    carry_path,
    latency_path,
    minus,
    read_counts,
    request_kind,
)
from cli.federation import CONNECTION
from cli.main import parse_overrides

ROOT = Path(__file__).resolve().parent.parent
DATA = {
    "data.name": "fashion-mnist",
    "data.fraction": 0.05,
    "data.alpha": 0.5,
    "train.batch-size": 10,
}
"""The run's data settings (the ServerApp builds its models from the nodes' profiles;
the templates are captured with the same settings)."""


# ------------------------------------------------------------------ templates
CAPTURE_NODES = 5
"""Nodes whose replies are captured: the defaults' heterogeneity repeats every five
partitions (a model family's five architectures, FedARA's five rank tiers), and
emulated node i answers as captured partition i mod 5 did (its tier, its model's
shapes)."""


def capture_templates(
    algorithm: str, config: dict[str, Any], work: Path, nodes: int = CAPTURE_NODES
) -> list[dict[str, Any]]:
    """Run fedhet's real ClientApp in-process for 2 rounds on ``nodes`` nodes and
    describe one reply of each kind (profile, train, train with the previous round's
    evaluation, evaluate) of each node, by partition."""
    from flwr.supercore.task_identity import TaskIdentity

    from benchmarks.fleet_node import describe, template_key
    from client_app.app import app as client_app
    from server_app.inprocess import run_inprocess

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
    templates: list[dict[str, Any]] = [{} for _ in range(nodes)]

    def capturing(message: Any, context: Any) -> Any:
        reply = client_app(message, context)
        key = template_key(message)
        own = templates[int(context.node_config["partition-id"])]
        if key not in own and not reply.has_error():
            own[key] = describe(reply, message)
        return reply

    run_inprocess(
        work / "capture",
        nodes,
        app=capturing,  # type: ignore[arg-type]
        algorithm=algorithm,
        **{"num-server-rounds": 2, **config},
    )
    return templates


# ------------------------------------------------------------------ the federation
class EmulatedFederation(CountingFederation):
    """A :class:`CountingFederation` whose N nodes are emulated (``fleet_node``
    processes) unless ``real``: keys registered in one client session (what ``flwr
    supernode register`` sends, N times), timed."""

    processes: int = 2
    templates: Path = Path()
    delay: float = 1.0
    jitter: float = 0.0
    real: bool = False
    timings: dict[str, float]

    def start(self) -> None:
        from cli.launch import write_connection
        from cli.security import make_certificates, make_node_keys, make_superexec_secrets

        self.timings = {}
        n = len(self.node_configs)
        assert self.certs is not None, "the fleet runs with TLS and node authentication"
        make_certificates(self.certs, ["localhost", "127.0.0.1"])
        t0 = time.monotonic()
        make_node_keys(self.keys, n)
        self.timings["keygen-s"] = time.monotonic() - t0
        if self.real:
            make_superexec_secrets(self.keys, n)
        self.start_superlink()
        write_connection(
            self.home, CONNECTION, f"127.0.0.1:{self.port}", root_certificates=self.certs / "ca.crt"
        )
        t0 = time.monotonic()
        self.register_all(n)
        self.timings["registration-s"] = time.monotonic() - t0
        t0 = time.monotonic()
        if self.real:
            for i in range(n):
                self.start_node(i)
        else:
            per = -(-n // self.processes)
            for p, first in enumerate(range(0, n, per)):
                self.procs.start(
                    f"emulator-{p}", self.emulator_command(first, min(per, n - first), p)
                )
        self.wait_online(n, timeout=120 + 0.5 * n)
        self.timings["online-s"] = time.monotonic() - t0

    def register_all(self, n: int) -> None:
        from flwr.cli.flower_config import read_superlink_connection
        from flwr.cli.supernode.register import try_load_public_key
        from flwr.cli.utils import init_http_client_from_connection
        from flwr.proto.control_pb2 import RegisterNodeRequest

        old = os.environ.get("FLWR_HOME")
        os.environ["FLWR_HOME"] = str(self.home)
        try:
            client = init_http_client_from_connection(read_superlink_connection(CONNECTION))
            try:
                for i in range(n):
                    key = try_load_public_key(self.keys / f"node-{i}.pub")
                    self.node_ids[i] = int(
                        client.RegisterNode(RegisterNodeRequest(public_key=key)).node_id
                    )
            finally:
                client.close()
        finally:
            if old is None:
                os.environ.pop("FLWR_HOME", None)
            else:
                os.environ["FLWR_HOME"] = old

    def emulator_command(self, first: int, count: int, p: int) -> list[str]:
        assert self.certs is not None
        return [
            sys.executable,
            "-m",
            "benchmarks.fleet_node",
            "--superlink",
            f"127.0.0.1:{self.port}",
            "--ca",
            str(self.certs / "ca.crt"),
            "--keys",
            str(self.keys),
            "--first",
            str(first),
            "--count",
            str(count),
            "--num-partitions",
            str(len(self.node_configs)),
            "--templates",
            str(self.templates),
            "--stats",
            str(self.stats_path(p)),
            "--delay",
            str(self.delay),
            "--jitter",
            str(self.jitter),
        ]

    def stats_path(self, p: int) -> Path:
        return self.workdir / "logs" / f"emulator-{p}.json"

    def emulator_stats(self) -> dict[str, Any]:
        total: dict[str, Any] = {
            "handled": {},
            "errors": [],
            "online": 0,
            "connections": 0,
            "polls": {},
        }
        for path in sorted((self.workdir / "logs").glob("emulator-*.json")):
            with contextlib.suppress(OSError, ValueError):
                data = json.loads(path.read_text())
                for k, v in data["handled"].items():
                    total["handled"][k] = total["handled"].get(k, 0) + v
                total["errors"] += data["errors"]
                total["online"] += data["online"]
                total["connections"] += data.get("connections", 0)
                for k, v in data.get("polls", {}).items():
                    total["polls"][k] = total["polls"].get(k, 0) + v
                beats = total.setdefault("heartbeats", {})
                for k, v in data.get("heartbeats", {}).items():  # counts add, times: the max
                    beats[k] = max(beats.get(k, 0), v) if k.endswith("-s") else beats.get(k, 0) + v
        return total


RSS_FIELDS = ("VmRSS", "RssAnon", "RssFile")


def rss_mb(pid: int) -> dict[str, float]:
    """A process's resident memory, MB, from one read of its status: ``VmRSS`` (all),
    ``RssAnon`` (its own pages), ``RssFile`` (mapped files', e.g. SQLite's
    memory-mapped database); empty once it has ended."""
    out = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            field = line.split(":", 1)[0]
            if field in RSS_FIELDS:
                out[field] = int(line.split()[1]) / 1024
    return out


class LowMemory(Exception):
    """Raised in the main thread when :class:`SuperLinkProbe` saw the machine's
    available memory fall below its floor."""


@contextlib.contextmanager
def stopped_on_low_memory() -> Iterator[None]:
    """While inside, the probe's signal (``SIGUSR1``) raises :class:`LowMemory` in
    the main thread. Its own signal, not SIGINT: a process started in the background
    by a shell ignores SIGINT, and Python then never raises KeyboardInterrupt."""

    def stop(signum: int, frame: Any) -> None:
        raise LowMemory

    previous = signal.signal(signal.SIGUSR1, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, previous)


def available_mb() -> float | None:
    """The machine's available memory (``MemAvailable``), MB."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return None


class SuperLinkProbe(threading.Thread):
    """The SuperLink's peak resident memory and open sockets, and the peak of each
    role's summed resident memory (``groups``' roles: the ServerApp, the emulators as
    ``supernode``), every 0.5 s. With ``floor_mb`` > 0, the machine's available memory
    falling below it stops the run (the main thread is interrupted, the federation
    shut down) before the kernel's OOM killer picks a process: :attr:`low_memory`
    says when and what each role held."""

    def __init__(self, pid: int, groups: RoleGroups | None = None, floor_mb: float = 0) -> None:
        super().__init__(daemon=True)
        self.pid, self.groups, self.stop = pid, groups, threading.Event()
        self.floor_mb = floor_mb
        self.low_memory: dict[str, Any] | None = None
        self.peak_rss_mb = 0.0
        self.peak_sockets = 0
        self.peak_role_rss_mb: dict[str, float] = {}
        self.peak_split_mb: dict[str, float] = {}
        """The SuperLink's peak ``RssAnon`` and ``RssFile`` (each its own peak)."""
        self.timeline: list[list[int]] = []
        """Every 2 s: [seconds, SuperLink, ServerApp, emulators] resident MB."""

    def run(self) -> None:
        t0, ticks = time.monotonic(), 0
        while not self.stop.wait(0.5):
            ticks += 1
            if self.groups is not None:
                now: dict[str, float] = {}
                for pid, role in list(self.groups.placed.items()):
                    now[role] = now.get(role, 0.0) + rss_mb(pid).get("VmRSS", 0.0)
                for role, mb in now.items():
                    self.peak_role_rss_mb[role] = max(self.peak_role_rss_mb.get(role, 0.0), mb)
                if ticks % 4 == 0:
                    self.timeline.append(
                        [round(time.monotonic() - t0)]
                        + [round(now.get(r, 0.0)) for r in ("superlink", "serverapp", "supernode")]
                    )
                free = available_mb() if self.floor_mb > 0 else None
                if free is not None and free < self.floor_mb and self.low_memory is None:
                    self.low_memory = {
                        "at-s": round(time.monotonic() - t0, 1),
                        "available-mb": round(free),
                        "rss-mb-by-role": {k: round(v) for k, v in sorted(now.items())},
                    }
                    # a signal, not interrupt_main(): it also ends a blocking wait
                    os.kill(os.getpid(), signal.SIGUSR1)  # the run stops; the federation too
            mine = rss_mb(self.pid)
            self.peak_rss_mb = max(self.peak_rss_mb, mine.get("VmRSS", 0.0))
            for field in ("RssAnon", "RssFile"):
                mb = mine.get(field, 0.0)
                self.peak_split_mb[field] = max(self.peak_split_mb.get(field, 0.0), mb)
            with contextlib.suppress(OSError):
                fds = Path(f"/proc/{self.pid}/fd")
                sockets = sum(1 for fd in fds.iterdir() if os.readlink(fd).startswith("socket:"))
                self.peak_sockets = max(self.peak_sockets, sockets)


# ------------------------------------------------------------------ one measurement
def answer_times(counts: Path) -> dict[str, Any]:
    """The SuperLink's answer times (:class:`benchmarks.server_cost.CountRequests`):
    the slowest answer by kind; the task heartbeats each (seconds since the SuperLink
    started, seconds to the answer, status) and the longest gap between two; the node
    heartbeats' count, median, slowest and how many took over 10 s; the longest
    turns at the SuperLink's database lock and whose they were."""
    try:
        times = json.loads(latency_path(counts).read_text())
    except (OSError, ValueError):
        return {}
    beats = times.get("heartbeats", {})
    tasks = beats.get("/v1/runtime/send-task-heartbeat", [])
    nodes = [took for _, took, _ in beats.get("/v1/fleet/send-node-heartbeat", [])]
    arrivals = [at for at, _, _ in tasks]
    return {
        "slowest-s": {request_kind(k): round(v, 3) for k, v in sorted(times["slowest-s"].items())},
        "longest-database-turns": times.get("longest-database-turns", []),
        "task-heartbeats": tasks,
        "task-heartbeat-longest-gap-s": max(
            (b - a for a, b in zip(arrivals, arrivals[1:], strict=False)), default=None
        ),
        "node-heartbeats": {
            "count": len(nodes),
            "median-s": statistics.median(nodes) if nodes else None,
            "slowest-s": max(nodes, default=None),
            "over-10-s": sum(took > 10 for took in nodes),
        },
    }


DROPPED = re.compile(r"round (\d+): dropped reply of .*?\): (?:error reply: )?([^—\n]*)")


def dropped_replies(log: Path) -> dict[str, int]:
    """The replies the strategy dropped, by round and cause (its log's "dropped
    reply" lines: ``"1: Error"`` -> count)."""
    counts: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for found in DROPPED.finditer(log.read_text(errors="replace")):
            key = f"{found.group(1)}: {found.group(2).strip()}"
            counts[key] = counts.get(key, 0) + 1
    return counts


def ended_tasks(database: Path) -> list[dict[str, Any]]:
    """The tasks in the SuperLink's state file (``[]`` with the state in memory):
    how each ended and why (a task whose heartbeats stopped is ended "FAILED" with
    "No heartbeat received from the task")."""
    if not database.exists():
        return []
    try:
        with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as db:
            rows = db.execute(
                "SELECT type, running_at, finished_at, sub_status, details FROM task"
            ).fetchall()
    except sqlite3.Error as exc:
        return [{"error": str(exc)}]
    keys = ("type", "running-at", "finished-at", "sub-status", "details")
    return [dict(zip(keys, row, strict=True)) for row in rows]


def run_facts(args: argparse.Namespace) -> dict[str, Any]:
    """What a row says of the run it measured, whatever its outcome."""
    return {
        "nodes": args.nodes,
        "algorithm": args.algorithm,
        "state": "memory" if args.memory_state else "database",
        "nodes-kind": "real" if args.real else "emulated",
        "config": parse_overrides(args.config),
        "rounds": args.rounds,
        "delay-s": args.delay,
        "jitter-s": args.jitter,
        "processes": args.processes,
    }


def peaks_by_role(probe: SuperLinkProbe) -> dict[str, int]:
    return {k: round(v) for k, v in sorted(probe.peak_role_rss_mb.items())}


def out_of_memory(args: argparse.Namespace, probe: SuperLinkProbe, results: Path) -> dict:
    """The row of a run stopped for memory (see :class:`SuperLinkProbe`): where it
    broke, each role's peak and the rounds it completed."""
    done = []
    with contextlib.suppress(OSError, ValueError, KeyError):
        done = json.loads(results.read_text())["rounds"]
    print(f"N={args.nodes}: stopped, memory below {args.memory_floor_mb} MB: {probe.low_memory}")
    return {
        **run_facts(args),
        "broke": "memory",
        "low-memory": probe.low_memory,
        "rounds-done": len(done),
        "round-time-s": [r["round-time-s"] for r in done],
        "valid-replies": [r.get("valid-replies") for r in done],
        "superlink-peak-rss-mb": probe.peak_rss_mb,
        "peak-rss-mb-by-role": peaks_by_role(probe),
        "rss-timeline-mb": probe.timeline,
    }


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    config = {**DATA, "eval-mode": args.eval_mode}
    templates = work / "templates.json"
    if not args.real:
        templates.write_text(json.dumps(capture_templates(args.algorithm, config, work)))
    n = args.nodes
    fed = EmulatedFederation(
        work / "fed",
        [{"partition-id": i, "num-partitions": n} for i in range(n)],
        ROOT,
        durable=not args.memory_state,
    )
    fed.processes, fed.templates, fed.delay, fed.jitter = (
        args.processes,
        templates,
        args.delay,
        args.jitter,
    )
    fed.real = args.real
    if args.tracemalloc:  # a diagnostic: every Python process traces its allocations
        fed.env["FEDHET_TRACEMALLOC"] = str(Path(args.tracemalloc).resolve())
        site = str(Path(__file__).resolve().parent / "memtrace")
        fed.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (site, fed.env.get("PYTHONPATH", "")) if p
        )
    out = work / "run"
    overrides = {
        "algorithm": args.algorithm,
        "num-server-rounds": args.rounds,
        "min-available-nodes": n,
        "out-dir": str(out),
        "data.cache-dir": str(work / "cache"),
        "round-timeout": args.round_timeout,
        **config,
        **parse_overrides(args.config),
    }
    with fed, RoleGroups(fed) as groups:
        probe = SuperLinkProbe(fed.procs.procs["superlink"].pid, groups, args.memory_floor_mb)
        probe.start()
        first = FirstRound(out / "results.json", groups, fed.counts_path)
        first.start()
        c0, r0, t0 = groups.usage(), read_counts(fed.counts_path), time.monotonic()
        try:
            with stopped_on_low_memory():
                outcome = fed.run(overrides, timeout=args.round_timeout * (args.rounds + 2))
        except LowMemory:
            probe.stop.set()
            return out_of_memory(args, probe, out / "results.json")
        wall = time.monotonic() - t0
        c1, r1 = groups.usage(), read_counts(fed.counts_path)
        first.stop.set()
        probe.stop.set()
        emulated = fed.emulator_stats()
        carried = {}
        with contextlib.suppress(OSError, ValueError):
            carried = json.loads(carry_path(fed.counts_path).read_text())
        timings = dict(fed.timings)
    answers = answer_times(fed.counts_path)
    if not outcome.ok:
        tail = outcome.log_path.read_text(errors="replace")[-3000:]
        errors = "\n".join(emulated["errors"][:5])
        tasks = json.dumps(ended_tasks(fed.workdir / "superlink.db"), indent=1)
        raise SystemExit(
            f"N={n}: run {outcome.status}:\n{tail}\nemulators: {errors}\n"
            f"the SuperLink's tasks: {tasks}\nits answer times: {json.dumps(answers)}\n"
            f"node heartbeats as the nodes saw them: {emulated.get('heartbeats')}"
        )
    results = json.loads((out / "results.json").read_text())
    rounds = results["rounds"]
    slowest = args.delay + args.jitter
    cpu, req = minus(c1, c0), minus(r1, r0)
    row: dict[str, Any] = {
        **run_facts(args),
        **timings,
        "run-wall-s": wall,
        "round-time-s": [r["round-time-s"] for r in rounds],
        "round-overhead-s": [r["round-time-s"] - (0 if args.real else slowest) for r in rounds],
        "valid-replies": [r.get("valid-replies") for r in rounds],
        "lost-replies": sum(n - (r.get("valid-replies") or 0) for r in rounds),
        "dropped-replies-by-round-and-cause": dropped_replies(outcome.log_path),
        "emulator-errors": emulated["errors"][:20],
        "emulator-error-count": len(emulated["errors"]),
        "node-heartbeats-as-nodes-saw-them": emulated.get("heartbeats", {}),
        "server-cpu-s": cpu.get("superlink", 0) + cpu.get("serverapp", 0),
        "cpu-s": cpu,
        "requests": {request_kind(k): v for k, v in sorted(req.items()) if v},
        "superlink-peak-rss-mb": probe.peak_rss_mb,
        "superlink-peak-sockets": probe.peak_sockets,
        "superlink-peak-rss-anon-file-mb": [
            round(probe.peak_split_mb.get(k, 0.0)) for k in ("RssAnon", "RssFile")
        ],
        "peak-rss-mb-by-role": peaks_by_role(probe),
        "carry": carried,
        "answer-times": answers,
        "rss-timeline-mb": probe.timeline,
    }
    node_rounds = n * args.rounds
    row["server-cpu-s-per-node-round"] = row["server-cpu-s"] / node_rounds
    row["requests-per-node-round"] = sum(row["requests"].values()) / node_rounds
    if not args.real:  # connections the emulated nodes opened, each a TCP + TLS handshake
        row["node-connections-per-node-round"] = emulated["connections"] / node_rounds
        polls = emulated["polls"]  # the nodes' polls by outcome (whole run)
        count = sum(v for k, v in polls.items() if k != "held-s")
        row["node-polls-per-node-round"] = {
            k: v / node_rounds for k, v in sorted(polls.items()) if k != "held-s"
        }
        row["node-poll-mean-held-s"] = polls.get("held-s", 0.0) / count if count else None
    row["requests-per-node-round-by-kind"] = {
        k: v / node_rounds for k, v in row["requests"].items()
    }
    if first.at is not None and args.rounds >= 2:
        cpu_1, req_1, _ = first.at
        steady_cpu, steady_req = minus(c1, cpu_1), minus(r1, req_1)
        steady_rounds = n * (args.rounds - 1)
        row["steady-server-cpu-s-per-node-round"] = (
            steady_cpu.get("superlink", 0) + steady_cpu.get("serverapp", 0)
        ) / steady_rounds
        row["steady-requests-per-node-round"] = sum(steady_req.values()) / steady_rounds
        row["steady-requests-by-kind"] = {
            request_kind(k): v / steady_rounds for k, v in sorted(steady_req.items()) if v
        }
    trains = [
        c.get("train-time-s") or 0.0 for r in rounds for c in (r.get("client-train") or {}).values()
    ]
    row["median-client-train-s"] = statistics.median(trains) if trains else None
    if args.real and trains:  # beyond the slowest node's training, as for emulated nodes
        row["round-overhead-s"] = [
            r["round-time-s"]
            - max((c.get("train-time-s") or 0.0 for c in (r.get("client-train") or {}).values()),
                  default=0.0)
            for r in rounds
        ]  # fmt: skip
    overheads = row["round-overhead-s"][1:] or row["round-overhead-s"]
    row["median-round-overhead-s"] = statistics.median(overheads)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--algorithm", default="lgfedavg")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--delay", type=float, default=1.0, help="seconds a node 'trains'")
    parser.add_argument("--jitter", type=float, default=0.0)
    parser.add_argument("--processes", type=int, default=2, help="emulator processes")
    parser.add_argument("--memory-state", action="store_true")
    parser.add_argument("--real", action="store_true", help="real fedhet supernodes")
    parser.add_argument("--eval-mode", default="with-train")
    parser.add_argument(
        "-c",
        "--config",
        action="append",
        default=[],
        help="extra run-config key=value (TOML value)",
    )
    parser.add_argument("--round-timeout", type=float, default=600.0)
    parser.add_argument(
        "--memory-floor-mb",
        type=float,
        default=1024.0,
        help="stop the run when the machine's available memory falls below this, and "
        "record where (0: never)",
    )
    parser.add_argument(
        "--tracemalloc",
        metavar="PREFIX",
        help="a diagnostic: each process writes PREFIX-<program>-<pid>.txt, its Python "
        "allocations at its peak (benchmarks/memtrace; costs CPU: not for quoted figures)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/out/fleet-load.json")
    parser.add_argument("--workdir", type=Path, help="keep everything here (default: a temp dir)")
    args = parser.parse_args()
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        row = measure(args, args.workdir.resolve())
    else:
        with tempfile.TemporaryDirectory(prefix="fedhet-fleet-load-") as tmp:
            try:
                row = measure(args, Path(tmp))
            except SystemExit:  # a failed run: its logs outlive the temporary folder
                logs = Path(tmp) / "fed" / "logs"
                kept = args.out.parent / f"fleet-load-logs-{time.strftime('%Y%m%d-%H%M%S')}"
                if logs.is_dir():
                    shutil.copytree(logs, kept, dirs_exist_ok=True)
                    print(f"the run's logs: {kept}", file=sys.stderr)
                raise
    rows = json.loads(args.out.read_text()) if args.out.exists() else []
    parts_off = os.environ.get("FEDHET_FLOWER_PARTS_OFF", "")
    rows.append({**row, "parts-off": parts_off, "date": time.strftime("%Y-%m-%d %H:%M")})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    show = {k: v for k, v in row.items() if k not in ("cpu-s", "requests", "emulator-errors")}
    print(json.dumps(show, indent=1))


if __name__ == "__main__":
    main()
