"""Simulations of many clients: peak memory of the whole process tree, seconds per round.

Two workloads, ``lgfedavg`` on IID Fashion-MNIST, ``cnn`` family (CNN-1..5), 2 rounds:
1,000 clients all training, and 5,000 clients with ``fraction-train = 0.2`` (and
``fraction-evaluate = 0.2``). The memory of everything the run starts (SuperLink,
SuperExec, the simulation, Ray and its workers) is sampled every 0.5 s from /proc: the
sum of PSS (each shared page split among the processes sharing it, so libraries
mapped by every Ray worker are not counted once per worker) and, for reference, the
sum of RSS.

    python -m benchmarks.scale --out benchmarks/out/scale.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from cli.launch import descendants, run_simulation

ROOT = Path(__file__).resolve().parent.parent

WORKLOADS: dict[str, tuple[int, float]] = {"1000-all": (1000, 1.0), "5000-fifth": (5000, 0.2)}
"""Name -> (clients, share of them sampled for training and for evaluation)."""


def process_name(pid: int) -> str:
    """A short name of what the process runs (its executable or script)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return "?"
    words = [Path(a).name for a in argv[:3] if not a.startswith("-")]
    name = next((w for w in words if w not in ("python", "python3", "python3.11")), "?")
    return name.split("::")[-1][:40]


def memory_mb(pids: list[int]) -> tuple[float, float, dict[str, float]]:
    """(Σ PSS, Σ RSS, PSS by process name) in MB of ``pids`` (vanished ones count 0)."""
    pss = rss = 0
    by: dict[str, float] = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as fh:
                for line in fh:
                    key, _, rest = line.partition(":")
                    if key == "Pss":
                        kb = int(rest.split()[0])
                        pss += kb
                        name = process_name(pid)
                        by[name] = by.get(name, 0.0) + kb / 1024
                    elif key == "Rss":
                        rss += int(rest.split()[0])
        except OSError:
            continue
    return pss / 1024, rss / 1024, by


class Sampler(threading.Thread):
    """Peak memory of this process's descendants, every ``interval`` s."""

    def __init__(self, interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.interval, self.peak_pss, self.peak_rss = interval, 0.0, 0.0
        self.processes = 0
        self.breakdown: dict[str, float] = {}
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            pids = descendants(os.getpid())
            pss, rss, by = memory_mb(pids)
            if pss > self.peak_pss:
                self.peak_pss, self.processes, self.breakdown = pss, len(pids), by
            self.peak_rss = max(self.peak_rss, rss)
            self._done.wait(self.interval)

    def stop(self) -> None:
        self._done.set()
        self.join()


def measure(name: str, tmp: Path) -> dict:
    clients, share = WORKLOADS[name]
    overrides: dict[str, bool | int | float | str] = {
        "algorithm": "lgfedavg",
        "num-server-rounds": 2,
        "data.partition": "iid",
        "data.min-train-samples": 5,
        "data.min-test-samples": 1,
        "data.cache-dir": str(tmp / "cache"),
        "out-dir": str(tmp / name),
        "min-available-nodes": clients,
        "round-timeout": 7200.0,
        "fraction-train": share,
        "fraction-evaluate": share,
    }
    sampler = Sampler()
    sampler.start()
    start = time.perf_counter()
    outcome = run_simulation(
        ROOT, overrides, num_supernodes=clients, flwr_home=tmp / "home", timeout=4 * 3600
    )
    wall = time.perf_counter() - start
    sampler.stop()
    if not outcome.ok:
        raise SystemExit(f"{name}: {outcome.status} ({outcome.log_path})")
    rounds = json.loads((tmp / name / "results.json").read_text())["rounds"]
    return {
        "workload": name,
        "clients": clients,
        "sampled-share": share,
        "train-clients-per-round": statistics.fmean(r["train-clients"] for r in rounds),
        "eval-clients-per-round": statistics.fmean(r["eval-clients"] for r in rounds),
        "round-time-s": [r["round-time-s"] for r in rounds],
        "peak-pss-mb": sampler.peak_pss,
        "peak-rss-mb": sampler.peak_rss,
        "processes-at-peak": sampler.processes,
        "pss-mb-at-peak-by-process": dict(sorted(sampler.breakdown.items(), key=lambda kv: -kv[1])),
        "wall-s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/out/scale.json")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.workloads.split(","):
            rows.append(measure(name, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
