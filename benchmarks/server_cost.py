"""What a connected node costs the server and the device: CPU and requests per node.

A loopback federation (``cli.federation.Federation``: SuperLink with TLS + node auth,
N SuperNodes) runs a tiny workload (``algorithm='local'``, Fashion-MNIST
``data.fraction``, so that the protocol dominates) for N = 2, 4, 8, 16, in each of
the modes of :data:`MODES`:

* ``fedhet``: the defaults (``fedhet supernode`` + the warm executor, the ServerApp's
  informed reply polling);
* ``fast``: fixed fast polling (the SuperNode and executor at 0.05 s from every
  reply, the ServerApp every 0.1 s), what fedhet shipped before its polls knew the
  round;
* ``stock``: Flower's own SuperNode and SuperExec (a process per message) and its
  grid interval (3 s).

Measured per federation, first idle (every node online, no run, :data:`IDLE_S`), then
over one run of ``--rounds`` rounds:

* CPU seconds of each role, exactly, from cgroup v1 ``cpuacct`` groups that every
  process is moved into as it appears (the SuperLink; the ServerApp with the
  SuperExec that starts it; the SuperNodes; the executors with their fork servers;
  the ClientApp task processes);
* requests the SuperLink received, by path (a counting middleware in the SuperLink
  process: ``python -m benchmarks.server_cost superlink`` is ``fedhet superlink`` with
  that middleware);
* each round's latency overhead: its wall time minus the slowest client's training;
* the steady state: CPU and requests from the end of round 1 (when results.json first
  has a row) to the end of the run, per node-round over the rounds after the first
  (start-up, the profile query, the executors' first task and round 1 excluded).

From these: CPU cores per connected node (idle and active), requests per node and
round by kind, and the nodes one server core carries at 30 s and 300 s rounds
(``1 / (per-node idle cores + per-node active CPU s per round / round length)``; the
ServerApp counted with the SuperLink).

    python -m benchmarks.server_cost [--nodes 2,4,8,16] [--modes fedhet,fast,stock]
        [--rounds 5] [--out benchmarks/out/server_cost.json] [--archive] [--append]
    python -m benchmarks.server_cost --tables-only --archive   # from --out's rows

Needs the cgroup v1 ``cpuacct`` controller writable (root) and Flower's commands on
PATH (an activated ``.venv``).
"""

from __future__ import annotations

import argparse
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
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from benchmarks.probe import archive_rows, save_rows
from cli.federation import Federation
from cli.launch import children_map
from cli.superlink import URGENT_PATHS

ROOT = Path(__file__).resolve().parent.parent
CPUACCT = Path("/sys/fs/cgroup/cpuacct")
ROLES = ("superlink", "serverapp", "supernode", "executor", "tasks")
IDLE_S = 30.0
SETTLE_S = 110.0
"""Wait after every node is online before the idle window: the nodes' polls slow
down to their idle pace (``cli/pacing.py``: 10 s after 100 s idle)."""
MODES: dict[str, dict[str, Any]] = {
    "fedhet": {"warm": True, "env": {}, "config": {}},
    "memory": {"warm": True, "env": {}, "config": {}, "durable": False},
    "separate": {"warm": True, "env": {}, "config": {"eval-mode": "separate"}},
    "fast": {
        "warm": True,
        "env": {"FEDHET_NODE_POLL": "fast"},
        "config": {"reply-poll": "fixed"},
    },
    "stock": {"warm": False, "env": {}, "config": {"reply-poll": "flower"}},
}
"""How each mode starts its federation (``warm``: the warm executor and ``fedhet
supernode``; ``durable``: the SuperLink's state in a database file, the default of
``fedhet federation``, else in memory), the environment of its processes and its
run-config. ``memory``: the defaults with the SuperLink's state in memory;
``separate``: the defaults with ``eval-mode = separate`` (a training and an
evaluation message per node-round)."""
ROUND_LENGTHS_S = (30.0, 300.0)


# ---------------------------------------------------------------------- SuperLink
class CountRequests:
    """ASGI middleware: counts requests by path into :attr:`counts`; times each one
    from its arrival to its answer's start: the slowest by path in :attr:`slowest`,
    each heartbeat (:data:`cli.superlink.URGENT_PATHS`: seconds since the process
    started, the time to its answer, its status) in :attr:`heartbeats`: a task or node
    whose heartbeats are answered late is ended or called unavailable."""

    counts: dict[str, int] = {}
    slowest: dict[str, float] = {}
    heartbeats: dict[str, list[tuple[float, float, int]]] = {}
    lock = threading.Lock()
    started = time.monotonic()

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        path = str(scope.get("path", ""))
        with self.lock:
            self.counts[path] = self.counts.get(path, 0) + 1
        arrived = time.monotonic()

        async def timed(message: Any) -> None:
            if message.get("type") == "http.response.start":
                self.answered(path, arrived, int(message.get("status", 0)))
            await send(message)

        await self.app(scope, receive, timed)

    @classmethod
    def answered(cls, path: str, arrived: float, status: int) -> None:
        took = time.monotonic() - arrived
        with cls.lock:
            cls.slowest[path] = max(cls.slowest.get(path, 0.0), took)
            if path in URGENT_PATHS:
                cls.heartbeats.setdefault(path, []).append(
                    (round(arrived - cls.started, 3), round(took, 3), status)
                )


def _write_counts(path: Path) -> None:
    """Every 0.2 s, for as long as the process runs: a failed write (e.g. the folder
    removed) is tried again, and the file never holds a partial write."""
    from cli.superlink import DATABASE_LOCK, INCOMING, INFLIGHT

    carried, timed = carry_path(path), latency_path(path)
    while True:
        with CountRequests.lock:
            text = json.dumps(CountRequests.counts)
            times = json.dumps(
                {
                    "slowest-s": CountRequests.slowest,
                    "heartbeats": CountRequests.heartbeats,
                    "longest-database-turns": [
                        [round(held, 3), what] for held, what in DATABASE_LOCK.longest
                    ],
                }
            )
        with INFLIGHT.lock:
            carry = {
                "inflight-peak-bytes": INFLIGHT.peak,
                "inflight-now-bytes": INFLIGHT.used,
                "refused-objects": INFLIGHT.refused,
            }
        carry.update(  # changed on the server's event loop only
            {
                "incoming-peak-bytes": INCOMING.peak,
                "incoming-now-bytes": INCOMING.used,
                "incoming-waits": INCOMING.waits,
            }
        )
        for target, content in ((path, text), (carried, json.dumps(carry)), (timed, times)):
            tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            try:
                tmp.write_text(content)
                tmp.replace(target)
            except OSError as exc:
                print(f"server_cost: {target} not written: {exc}", file=sys.stderr)
        time.sleep(0.2)


def latency_path(counts: Path) -> Path:
    """Where the counting SuperLink writes its answer times (:class:`CountRequests`:
    the slowest by path, every heartbeat)."""
    return counts.with_name(counts.stem + "-latency.json")


def carry_path(counts: Path) -> Path:
    """Where the counting SuperLink writes its carried bytes in flight, out
    (:class:`cli.superlink.InFlight`: peak, now, objects not carried) and in
    (:class:`cli.superlink.Incoming`: peak, now, pushes that waited)."""
    return counts.with_name(counts.stem + "-carry.json")


def run_counting_superlink(counts: Path, argv: list[str]) -> None:
    """``fedhet superlink argv`` (:mod:`cli.superlink`) with :class:`CountRequests`
    outermost, its counts written to ``counts`` (JSON) every 0.2 s."""
    from starlette.middleware import Middleware

    from cli.superlink import run_superlink

    threading.Thread(target=_write_counts, args=(counts,), daemon=True).start()
    run_superlink(argv, outermost=[Middleware(CountRequests)])


def read_counts(path: Path) -> dict[str, int]:
    time.sleep(0.5)  # the writer's next pass
    try:
        return {k: int(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError):
        return {}


def request_kind(path: str) -> str:
    """``/v1/fleet/pull-messages`` -> ``fleet/pull-messages``."""
    parts = path.strip("/").split("/")
    return "/".join(parts[1:]) if parts and parts[0].startswith("v") else path.strip("/")


class CountingFederation(Federation):
    """A :class:`Federation` whose SuperLink counts its requests (see
    :func:`run_counting_superlink`)."""

    counts_path: Path

    def start_superlink(self) -> None:
        self.counts_path = self.workdir / "superlink-requests.json"
        real = self.procs.start
        argv_counts = [sys.executable, "-m", "benchmarks.server_cost", "superlink"]

        def start(name: str, cmd: list[str], cwd: Path | None = None) -> Any:
            if name == "superlink" and cmd[:2] == ["fedhet", "superlink"]:
                cmd = [*argv_counts, "--counts", str(self.counts_path), *cmd[2:]]
                cwd = ROOT
            return real(name, cmd, cwd)

        self.procs.start = start  # type: ignore[method-assign]
        try:
            super().start_superlink()
        finally:
            self.procs.start = real  # type: ignore[method-assign]


# ---------------------------------------------------------------------- CPU by role
class RoleGroups(threading.Thread):
    """One ``cpuacct`` group per role; every process of the federation is moved into
    its role's group as it appears (every 0.05 s); a child forked since starts in its
    parent's group until then. Exact CPU of processes that have ended is kept."""

    def __init__(self, fed: Federation, root: Path = CPUACCT) -> None:
        super().__init__(daemon=True)
        self.fed, self.stop = fed, threading.Event()
        tag = f"fedhet-cost-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.paths = {role: root / f"{tag}-{role}" for role in ROLES}
        self.root = root
        self.placed: dict[int, str] = {}

    def __enter__(self) -> RoleGroups:
        for path in self.paths.values():
            path.mkdir()
        self.place()
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.join()
        for path in self.paths.values():
            deadline = time.monotonic() + 15
            while path.exists():
                with contextlib.suppress(OSError):
                    for pid in (path / "cgroup.procs").read_text().split():
                        with contextlib.suppress(OSError):
                            (self.root / "cgroup.procs").write_text(pid)
                    path.rmdir()
                if time.monotonic() > deadline:
                    print(f"warning: could not remove {path}", file=sys.stderr)
                    break
                time.sleep(0.1)

    @staticmethod
    def role(root: str, depth: int) -> str:
        if root == "superlink":
            return "superlink" if depth == 0 else "serverapp"
        if root.startswith("superexec"):  # the warm executor: fork server, then tasks
            return "executor" if depth <= 1 else "tasks"
        # a SuperNode; a stock one starts its SuperExec, which starts the tasks
        return ("supernode", "executor")[depth] if depth < 2 else "tasks"

    def place(self) -> None:
        children = children_map()
        for name, proc in list(self.fed.procs.procs.items()):
            todo = [(0, proc.pid)]
            while todo:
                depth, pid = todo.pop()
                todo += [(depth + 1, c) for c in children.get(pid, [])]
                role = self.role(name, depth)
                if self.placed.get(pid) != role:
                    with contextlib.suppress(OSError):
                        (self.paths[role] / "cgroup.procs").write_text(str(pid))
                        self.placed[pid] = role

    def run(self) -> None:
        while not self.stop.wait(0.05):
            self.place()

    def usage(self) -> dict[str, float]:
        """CPU seconds per role so far."""
        return {
            role: int((path / "cpuacct.usage").read_text()) / 1e9
            for role, path in self.paths.items()
        }


def minus(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
    return {k: a.get(k, 0) - b.get(k, 0) for k in set(a) | set(b)}


# ---------------------------------------------------------------------- one federation
def run_overrides(out: Path, cache: Path, rounds: int, config: Mapping[str, Any]) -> dict:
    return {
        "algorithm": "local",
        "num-server-rounds": rounds,
        "data.fraction": 0.05,
        "out-dir": str(out),
        "data.cache-dir": str(cache),
        "round-timeout": 600.0,
        **config,
    }


def round_overheads(results: dict) -> list[float]:
    """Each round's wall time minus its slowest client's training time."""
    out = []
    for row in results["rounds"]:
        trains = [c.get("train-time-s") or 0.0 for c in row.get("client-train", {}).values()]
        out.append(row["round-time-s"] - max(trains, default=0.0))
    return out


def measure(mode: str, nodes: int, rounds: int, work: Path, cache: Path) -> dict[str, Any]:
    spec = MODES[mode]
    configs = [{"partition-id": i, "num-partitions": nodes} for i in range(nodes)]
    saved = {k: os.environ.get(k) for k in spec["env"]}
    os.environ.update(spec["env"])
    try:
        fed = CountingFederation(
            work / f"fed-{mode}-{nodes}",
            configs,
            ROOT,
            warm=spec["warm"],
            durable=spec.get("durable", True),
        )
        with fed, RoleGroups(fed) as groups:
            time.sleep(SETTLE_S)
            c0, r0 = groups.usage(), read_counts(fed.counts_path)
            time.sleep(IDLE_S)
            c1, r1 = groups.usage(), read_counts(fed.counts_path)
            out = work / f"run-{mode}-{nodes}"
            first = FirstRound(out / "results.json", groups, fed.counts_path)
            first.start()
            t0 = time.monotonic()
            outcome = fed.run(run_overrides(out, cache, rounds, spec["config"]), timeout=1800)
            wall = time.monotonic() - t0
            c2, r2 = groups.usage(), read_counts(fed.counts_path)
            first.stop.set()
            first.join()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if not outcome.ok:
        tail = outcome.log_path.read_text(errors="replace")[-3000:]
        raise SystemExit(f"{mode} N={nodes}: run {outcome.status}:\n{tail}")
    results = json.loads((out / "results.json").read_text())
    idle_cpu, active_cpu = minus(c1, c0), minus(c2, c1)
    idle_req, active_req = minus(r1, r0), minus(r2, r1)
    overheads = round_overheads(results)
    steady = {}
    if first.at is not None:
        cpu_1, req_1, t_1 = first.at
        steady = {
            "steady-cpu-s": minus(c2, cpu_1),
            "steady-requests": {
                request_kind(k): v for k, v in sorted(minus(r2, req_1).items()) if v
            },
            "steady-wall-s": t0 + wall - t_1,
        }
    return {
        **steady,
        "mode": mode,
        "nodes": nodes,
        "rounds": rounds,
        "idle-s": IDLE_S,
        "settle-s": SETTLE_S,
        "run-wall-s": wall,
        "round-time-s": [r["round-time-s"] for r in results["rounds"]],
        "round-overhead-s": overheads,
        "median-round-overhead-s": statistics.median(overheads[1:] or overheads),
        "idle-cpu-s": idle_cpu,
        "active-cpu-s": active_cpu,
        "idle-requests": {request_kind(k): v for k, v in sorted(idle_req.items()) if v},
        "active-requests": {request_kind(k): v for k, v in sorted(active_req.items()) if v},
    }


class FirstRound(threading.Thread):
    """Watches a run's results.json; when its first row appears (round 1 ended),
    keeps the CPU per role, the SuperLink's request counts and the time (:attr:`at`)."""

    def __init__(self, results: Path, groups: RoleGroups, counts: Path) -> None:
        super().__init__(daemon=True)
        self.results, self.groups, self.counts = results, groups, counts
        self.stop = threading.Event()
        self.at: tuple[dict[str, float], dict[str, int], float] | None = None

    def run(self) -> None:
        while not self.stop.wait(0.05):
            with contextlib.suppress(OSError, ValueError):
                if json.loads(self.results.read_text())["rounds"]:
                    usage, now = self.groups.usage(), time.monotonic()
                    self.at = (usage, read_counts(self.counts), now)
                    return


# ---------------------------------------------------------------------- summary
def per_node(row: dict[str, Any]) -> dict[str, Any]:
    """Cores per node (idle, active), CPU s per node-round, requests per node-round."""
    n, rounds, wall, idle_s = row["nodes"], row["rounds"], row["run-wall-s"], row["idle-s"]
    idle, active = row["idle-cpu-s"], row["active-cpu-s"]
    server_idle = idle["superlink"] + idle["serverapp"]
    server_active = active["superlink"] + active["serverapp"]
    node_idle = idle["supernode"] + idle["executor"] + idle["tasks"]
    node_active = active["supernode"] + active["executor"] + active["tasks"]
    return {
        "superlink-cpu-ms-per-request": {
            "idle": 1000 * idle["superlink"] / max(1, sum(row["idle-requests"].values())),
            "active": 1000 * active["superlink"] / max(1, sum(row["active-requests"].values())),
        },
        "superlink-idle-core-per-node": idle["superlink"] / idle_s / n,
        "superlink-active-core-per-node": active["superlink"] / wall / n,
        "server-idle-core-per-node": server_idle / idle_s / n,
        "server-active-core-per-node": server_active / wall / n,
        "server-cpu-s-per-node-round": server_active / n / rounds,
        "node-idle-core": node_idle / idle_s / n,
        "node-active-core": node_active / wall / n,
        "node-protocol-active-core": (active["supernode"] + active["executor"]) / wall / n,
        "node-protocol-idle-core": (idle["supernode"] + idle["executor"]) / idle_s / n,
        "task-cpu-s-per-node-round": active["tasks"] / n / rounds,
        "node-cpu-s-per-round": node_active / n / rounds,
        "requests-per-node-round": {k: v / n / rounds for k, v in row["active-requests"].items()},
        "idle-requests-per-node-s": {k: v / n / idle_s for k, v in row["idle-requests"].items()},
        **steady_per_node(row),
    }


def steady_per_node(row: dict[str, Any]) -> dict[str, Any]:
    """CPU s and requests per node-round after round 1 (start-up excluded)."""
    steady = row.get("steady-cpu-s")
    if not steady or row["rounds"] < 2:
        return {}
    node_rounds = row["nodes"] * (row["rounds"] - 1)
    return {
        "steady-server-cpu-s-per-node-round": (steady["superlink"] + steady["serverapp"])
        / node_rounds,
        "steady-superlink-cpu-s-per-node-round": steady["superlink"] / node_rounds,
        "steady-node-cpu-s-per-node-round": (steady["supernode"] + steady["executor"])
        / node_rounds,
        "steady-task-cpu-s-per-node-round": steady["tasks"] / node_rounds,
        "steady-requests-per-node-round": sum(row["steady-requests"].values()) / node_rounds,
        "steady-requests-by-kind": {k: v / node_rounds for k, v in row["steady-requests"].items()},
    }


def carried(
    summary: dict[str, Any], round_s: float, cpu: str = "server-cpu-s-per-node-round"
) -> float:
    """Nodes one server core carries at rounds of ``round_s`` seconds: the per-node
    idle cost all the time plus the per-node active CPU of a round (``cpu``: the whole
    run's, or ``steady-server-cpu-s-per-node-round``) once per round."""
    per = summary["server-idle-core-per-node"] + summary[cpu] / round_s
    return 1.0 / per if per > 0 else float("inf")


def table(rows: Iterable[dict[str, Any]]) -> str:
    head = (
        "| mode | nodes | SuperLink core/node active | idle | ServerApp+SuperLink CPU s "
        "per node-round | node cores active (protocol) | idle | round overhead s (median) "
        "| Fleet requests per node-round | nodes per server core at 30 s / 300 s rounds |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for row in rows:
        s = row["per-node"]
        fleet = sum(v for k, v in s["requests-per-node-round"].items() if k.startswith("fleet/"))
        lines.append(
            f"| {row['mode']} | {row['nodes']} | {s['superlink-active-core-per-node']:.4f} "
            f"| {s['superlink-idle-core-per-node']:.4f} | {s['server-cpu-s-per-node-round']:.3f} "
            f"| {s['node-active-core']:.3f} ({s['node-protocol-active-core']:.3f}) "
            f"| {s['node-idle-core']:.4f} | {row['median-round-overhead-s']:.2f} | {fleet:.1f} "
            f"| {row['carried'][0]:.0f} / {row['carried'][1]:.0f} |"
        )
    return head + "\n".join(lines) + "\n"


STEADY_CPU = "steady-server-cpu-s-per-node-round"


def steady_table(rows: Iterable[dict[str, Any]]) -> str:
    """CPU and requests per node-round in the steady state (after round 1)."""
    head = (
        "| mode | nodes | SuperLink + ServerApp CPU s per node-round (SuperLink alone) "
        "| SuperNode + executor CPU s per node-round | ClientApp tasks CPU s per node-round "
        "| SuperLink requests per node-round | nodes per server core at 30 s / 300 s rounds "
        "|\n|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for row in rows:
        s = row["per-node"]
        if STEADY_CPU not in s:
            continue
        lines.append(
            f"| {row['mode']} | {row['nodes']} | {s[STEADY_CPU]:.3f} "
            f"({s['steady-superlink-cpu-s-per-node-round']:.3f}) "
            f"| {s['steady-node-cpu-s-per-node-round']:.3f} "
            f"| {s['steady-task-cpu-s-per-node-round']:.3f} "
            f"| {s['steady-requests-per-node-round']:.1f} "
            f"| {carried(s, ROUND_LENGTHS_S[0], STEADY_CPU):.0f} / "
            f"{carried(s, ROUND_LENGTHS_S[1], STEADY_CPU):.0f} |"
        )
    return head + "\n".join(lines) + "\n" if lines else ""


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in MODES:
        pts = sorted((r["nodes"], r["per-node"]) for r in rows if r["mode"] == mode)
        if not pts:
            continue
        xs = [n for n, _ in pts]
        ax.plot(
            xs,
            [s["server-active-core-per-node"] * n for n, s in pts],
            marker="o",
            label=f"{mode}: active",
        )
        ax.plot(
            xs,
            [s["server-idle-core-per-node"] * n for n, s in pts],
            marker="x",
            linestyle="--",
            label=f"{mode}: idle",
        )
    ax.set_xlabel("connected SuperNodes")
    ax.set_ylabel("SuperLink + ServerApp CPU (cores)")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    if sys.argv[1:2] == ["superlink"]:
        ap = argparse.ArgumentParser(prog="server_cost superlink")
        ap.add_argument("--counts", type=Path, required=True)
        known, rest = ap.parse_known_args(sys.argv[2:])
        run_counting_superlink(known.counts, rest)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="2,4,8,16")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--idle", type=float, default=IDLE_S, help="seconds of the idle window")
    ap.add_argument(
        "--settle", type=float, default=SETTLE_S, help="seconds idle before the idle window"
    )
    ap.add_argument(
        "--append", action="store_true", help="keep the rows already in --out (others replaced)"
    )
    ap.add_argument(
        "--tables-only",
        action="store_true",
        help="run nothing: print (and with --archive write) the table of --out's rows",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/out/server_cost.json")
    ap.add_argument(
        "--archive",
        action="store_true",
        help="also write docs/results/server_cost.{json,md,png}",
    )
    args = ap.parse_args()
    if args.tables_only:
        saved = json.loads(args.out.read_text())["rows"]
        print(table(saved))
        if args.archive:
            plot(saved, archive_rows("server_cost", saved, table(saved)) / "server_cost.png")
        return
    if not (CPUACCT / "cgroup.procs").exists():
        raise SystemExit(f"needs the cgroup v1 cpuacct controller at {CPUACCT}")
    if shutil.which("flower-superlink") is None:
        raise SystemExit("flower-superlink is not on PATH: activate the project's .venv")
    globals()["IDLE_S"], globals()["SETTLE_S"] = args.idle, args.settle
    modes = [m for m in args.modes.split(",") if m]
    if unknown := [m for m in modes if m not in MODES]:
        raise SystemExit(f"--modes: unknown {unknown}; choose from {list(MODES)}")
    rows: list[dict[str, Any]] = []
    if args.append and args.out.exists():
        todo = {(m, int(n)) for m in modes for n in args.nodes.split(",")}
        rows = [
            r
            for r in json.loads(args.out.read_text())["rows"]
            if (r["mode"], r["nodes"]) not in todo
        ]
    with tempfile.TemporaryDirectory(prefix="fedhet-cost-") as tmp:
        work, cache = Path(tmp), Path(tmp) / "cache"
        for nodes in [int(n) for n in args.nodes.split(",")]:
            for mode in modes:
                row = measure(mode, nodes, args.rounds, work, cache)
                row["per-node"] = per_node(row)
                row["carried"] = [carried(row["per-node"], s) for s in ROUND_LENGTHS_S]
                rows.append(row)
                print(table([row]).splitlines()[-1], flush=True)
                print(steady_table([row]).splitlines()[-1:], flush=True)
                save_rows(args.out, rows)
    text = table(rows) + "\n" + steady_table(rows)
    print(text)
    if args.archive:
        plot(rows, archive_rows("server_cost", rows, text) / "server_cost.png")


if __name__ == "__main__":
    main()
