"""Per-round wall time: simulation, deployment cold (Flower's stock executor: a fresh
process per message) and deployment warm (``fedhet superexec`` + short polling).

Same small workload in all three: fedre, 3 nodes, Fashion-MNIST ``data.fraction=0.05``,
Dirichlet 0.1, 6 rounds, TLS + node auth in both deployments; and what each idle
deployment burns in polling (CPU of the SuperLink, SuperNodes and executors over 20 s,
once every node is online). Then where a cold
message's time goes (Python start-up, imports, data share, model; fresh processes,
medians), what the warm executor pays instead (the warm parent once; a fork per
message), and the resident memory of a cold ClientApp process against the warm
parent + one child (copy-on-write shares the imported libraries).

    python -m benchmarks.deployment --out benchmarks/out/deployment.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from cli.federation import Federation
from cli.launch import children_map, descendants, run_simulation

ROOT = Path(__file__).resolve().parent.parent

NODES = 3
ROUNDS = 6
POLLING = (
    "the node holds the executor's requests for a task until a message arrives, the "
    "executor waits on a running task's child, each SuperNode pulls when its next message "
    "is due by the gaps it has seen (at most every 10 s idle), and the ServerApp polls "
    "for replies when the phase's last reply is due (docs/deployment.md, \"How many "
    'devices per server").'
)
"""How the deployments of this run poll (written with the results: the table text
describes the code that made them)."""
IDLE_S = 20.0


def overrides(out: Path, cache: Path) -> dict:
    return {
        "algorithm": "fedre",
        "num-server-rounds": ROUNDS,
        "data.fraction": 0.05,
        "data.alpha": 0.1,
        "out-dir": str(out),
        "data.cache-dir": str(cache),
        "round-timeout": 600.0,
    }


def round_times(out: Path) -> list[float]:
    return [r["round-time-s"] for r in json.loads((out / "results.json").read_text())["rounds"]]


def wall(code: str, repeats: int = 5) -> float:
    """Median wall time of a fresh ``python -c code`` process, start-up included."""
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300
        )
        runs.append(time.perf_counter() - t0)
        if out.returncode != 0:
            raise SystemExit(out.stderr[-2000:])
    return statistics.median(runs)


def startup_breakdown(cache: Path) -> dict:
    """What one ClientApp process pays before training, as wall-time differences."""
    base = wall("pass")
    torch = wall("import torch")
    app = wall("import client_app.app")
    cfg = (
        "import torch; from common.config import parse_run_config;"
        "from data import load_client_data; from models import build_model;"
        "c = parse_run_config({'data.fraction': 0.05, 'data.alpha': 0.1,"
        f"'data.cache-dir': '{cache}'}}).data"
    )
    with_data = wall(cfg + "; load_client_data(c, 0, 3, 0)")
    with_model = wall(
        cfg + "; build_model('cnn-1', in_channels=1, num_classes=10, "
        "image_size=28, feature_dim=500, seed=0)"
    )
    without = wall(cfg)
    return {
        "python-start-s": base,
        "import-torch-s": torch - base,
        "import-flwr-s": wall("import flwr.app, flwr.clientapp") - base,
        "import-client-app-s": app - base,
        "import-torchvision-extra-s": wall("import client_app.app; import torchvision.models")
        - app,
        "load-data-share-s": with_data - without,
        "build-cnn1-s": with_model - without,
    }


WARM_PROBE = r"""
import json, multiprocessing, os, sys, time
from cli.warm import PRELOAD

def mem(pid):
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in ("Rss", "Private_Clean", "Private_Dirty"):
                out[key] = int(rest.split()[0]) / 1024
    return {"rss-mb": out["Rss"], "private-mb": out["Private_Clean"] + out["Private_Dirty"]}

def nothing():
    pass

def ready(cache, queue):
    t = time.perf_counter()
    import client_app.app  # noqa: F401  the app, as a task's child imports it
    from common.config import parse_run_config
    from data import load_client_data
    from models import build_model
    c = parse_run_config({"data.fraction": 0.05, "data.alpha": 0.1, "data.cache-dir": cache})
    load_client_data(c.data, 0, 3, 0)
    build_model("cnn-1", in_channels=1, num_classes=10, image_size=28, feature_dim=500, seed=0)
    queue.put(time.perf_counter() - t)
    queue.put(mem(os.getpid()))
    time.sleep(1)

if __name__ == "__main__":
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    t = time.perf_counter()
    p = ctx.Process(target=nothing); p.start(); p.join()
    parent_s = time.perf_counter() - t
    forks = []
    for _ in range(5):
        t = time.perf_counter()
        p = ctx.Process(target=nothing); p.start(); p.join()
        forks.append(time.perf_counter() - t)
    q = ctx.Queue()
    p = ctx.Process(target=ready, args=(sys.argv[1], q)); p.start()
    child_s, child_mem = q.get(), q.get()
    from multiprocessing import forkserver
    parent_mem = mem(forkserver._forkserver._forkserver_pid)
    p.join()
    forks.sort()
    print(json.dumps({"warm-parent-start-s": parent_s, "fork-s": forks[2],
                      "child-imports-data-model-s": child_s, "child": child_mem,
                      "parent": parent_mem}))
"""

COLD_PROBE = r"""
import json, os, sys, time
t = time.perf_counter()
import numpy, torch, flwr.app, flwr.clientapp, flwr.supernode.cli  # what a cold process imports
import client_app.app  # noqa: F401
from common.config import parse_run_config
from data import load_client_data
from models import build_model
c = parse_run_config({"data.fraction": 0.05, "data.alpha": 0.1, "data.cache-dir": sys.argv[1]})
load_client_data(c.data, 0, 3, 0)
build_model("cnn-1", in_channels=1, num_classes=10, image_size=28, feature_dim=500, seed=0)
out = {}
with open("/proc/self/smaps_rollup") as fh:
    for line in fh:
        key, _, rest = line.partition(":")
        if key == "Rss":
            out["rss-mb"] = int(rest.split()[0]) / 1024
out["ready-s"] = time.perf_counter() - t
print(json.dumps(out))
"""


def probe(code: str, cache: Path) -> dict:
    """Run ``code`` as a script file in a fresh process (a fork server's children
    import the main module by its path) that imports the app from the repository root
    (``PYTHONPATH``)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "probe.py"
        script.write_text(code)
        out = subprocess.run(
            [sys.executable, str(script), str(cache)],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": path},
        )
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def idle_cpu(fed: Federation) -> float:
    """Share of one core the idle federation's processes use (polling), over IDLE_S."""
    time.sleep(5)  # the SuperNodes' start-up
    pids = [p for proc in fed.procs.procs.values() for p in (proc.pid, *descendants(proc.pid))]
    before = cpu_seconds(pids)
    time.sleep(IDLE_S)
    return (cpu_seconds(pids) - before) / IDLE_S


def process_tree(pid: int, children: dict[int, list[int]]) -> list[tuple[int, int]]:
    """(depth, pid) of ``pid`` and every process below it."""
    out, todo = [], [(0, pid)]
    while todo:
        depth, p = todo.pop()
        out.append((depth, p))
        todo += [(depth + 1, c) for c in children.get(p, [])]
    return out


class CpuByRole(threading.Thread):
    """CPU seconds of a federation's processes by role while it runs, sampled every
    0.2 s (a process that lives shorter than that is missed): the SuperLink with the
    ServerApp it starts; the SuperNodes; the executors (the warm executor and its
    fork server, or the SuperExec a stock SuperNode starts); the ClientApp tasks
    (the processes below those)."""

    def __init__(self, fed: Federation) -> None:
        super().__init__(daemon=True)
        self.fed, self.stop = fed, threading.Event()
        self.first: dict[int, float] = {}
        self.last: dict[int, tuple[str, float]] = {}

    @staticmethod
    def role(root: str, depth: int) -> str:
        if root == "superlink":
            return "superlink+serverapp"
        if depth == 0:
            return "executor" if root.startswith("superexec") else "supernode"
        return "executor" if depth == 1 else "tasks"

    def sample(self) -> None:
        children = children_map()
        for root, proc in list(self.fed.procs.procs.items()):
            for depth, pid in process_tree(proc.pid, children):
                used = cpu_seconds([pid])
                # a process started during the run counts from 0
                self.first.setdefault(pid, used if not self.is_alive() else 0.0)
                self.last[pid] = (self.role(root, depth), used)

    def run(self) -> None:
        while not self.stop.wait(0.2):
            self.sample()

    def totals(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for pid, (role, used) in self.last.items():
            out[role] = out.get(role, 0.0) + used - self.first[pid]
        return out


def deployment(
    tmpd: Path, cache: Path, warm: bool, durable: bool = True
) -> tuple[list[float], float, dict]:
    configs = [{"partition-id": i, "num-partitions": NODES} for i in range(NODES)]
    name = ("warm" if warm else "cold") + ("" if durable else "-memory")
    with Federation(
        tmpd / f"fed-{name}", configs, ROOT, secure=True, warm=warm, durable=durable
    ) as fed:
        meter = CpuByRole(fed)
        meter.sample()
        meter.start()
        outcome = fed.run(overrides(tmpd / name, cache), timeout=1800)
        meter.stop.set()
        meter.join()
        idle = idle_cpu(fed)  # after the run: every node has been through a run's rounds
    if not outcome.ok:
        raise SystemExit(f"deployment {name}: {outcome.status} ({outcome.log_path})")
    per_round = {k: v / ROUNDS for k, v in sorted(meter.totals().items())}
    return round_times(tmpd / name), idle, per_round


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/out/deployment.json")
    ap.add_argument(
        "--breakdown-only",
        action="store_true",
        help="only the per-process costs (needs a prepared partition cache)",
    )
    ap.add_argument("--cache", type=Path, default=None)
    args = ap.parse_args()
    if args.breakdown_only:
        print(
            json.dumps(
                startup_breakdown(args.cache or Path.home() / ".cache/fedhet/partitions"), indent=1
            )
        )
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmpd = Path(tmp)
        cache = tmpd / "cache"
        sim = run_simulation(
            ROOT,
            overrides(tmpd / "sim", cache),
            num_supernodes=NODES,
            flwr_home=tmpd / "sim-home",
            timeout=1800,
        )
        if not sim.ok:
            raise SystemExit(f"simulation: {sim.status} ({sim.log_path})")
        warm, warm_idle, warm_cpu = deployment(tmpd, cache, warm=True)
        mem, mem_idle, mem_cpu = deployment(tmpd, cache, warm=True, durable=False)
        cold, cold_idle, cold_cpu = deployment(tmpd, cache, warm=False)
        times = {
            "simulation": round_times(tmpd / "sim"),
            "deployment-warm": warm,
            "deployment-warm-memory-state": mem,
            "deployment-cold": cold,
        }
        result: dict[str, Any] = {
            "workload": f"fedre, {NODES} nodes, fashion-mnist data.fraction=0.05, dirichlet "
            f"0.1, {ROUNDS} rounds; deployments with TLS + node auth",
            "round-time-s": times,
            "idle-cpu-cores": {
                "deployment-warm": warm_idle,
                "deployment-warm-memory-state": mem_idle,
                "deployment-cold": cold_idle,
            },
            "cpu-s-per-round": {
                "deployment-warm": warm_cpu,
                "deployment-warm-memory-state": mem_cpu,
                "deployment-cold": cold_cpu,
            },
            "median-excluding-round-1": {k: statistics.median(v[1:]) for k, v in times.items()},
            "polling": POLLING,
            "per-process": startup_breakdown(cache),
            "warm": probe(WARM_PROBE, cache),
            "cold-process": probe(COLD_PROBE, cache),
        }
    med = result["median-excluding-round-1"]
    result["ratio-warm-over-simulation"] = med["deployment-warm"] / med["simulation"]
    result["ratio-warm-memory-state-over-simulation"] = (
        med["deployment-warm-memory-state"] / med["simulation"]
    )
    result["ratio-cold-over-simulation"] = med["deployment-cold"] / med["simulation"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
