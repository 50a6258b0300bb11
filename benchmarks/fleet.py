"""Time to accuracy on a simulated fleet: 100 devices of four classes, virtual time.

Fashion-MNIST, the scarce partition (``data.fraction=0.2``, Dirichlet α=0.5) over
100 simulated devices, ``fleet = rpi4:8,rpi5:6,jetson-orin-nano:4,server:2`` (40 %
Raspberry Pi 4, 30 % Pi 5, 20 % Jetson Orin Nano, 10 % servers), 20 % of the devices
sampled per round. Every run is a real ``flwr run`` simulation; the virtual clock
(docs/fleet.md) times each client as its device.

    python -m benchmarks.fleet                  # every row, seeds 0 1 2 (skips done runs)
    python -m benchmarks.fleet --seeds 0 --only fedara-deadline,fedara-full
    python -m benchmarks.fleet --table          # docs/results/fleet.json + table + plot

Rows: FedARA with deadline-adaptive tiers; FedARA with every node at full rank
(waits for the slowest); FedARA at its classes' tiers; FedAvg with one model for
all, the smallest (cnn-5) and the largest (cnn-1), waiting for the slowest;
LG-FedAvg, FedGH, FedRE and local with each class's model; LG-FedAvg with the
largest model that meets the deadline (``model.policy = deadline``); FD, FedGen,
FedMRL, FedL2G and FedL2G-l with each class's model and their defaults.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.suites import ROOT
from cli.launch import Scalar, run_simulation
from common.devices import DEVICES as CLASSES

OUT = ROOT / "benchmarks" / "out" / "fleet"
DOCS = ROOT / "docs" / "results"
ARCHIVE = DOCS / "archive" / "fleet"
FLEET = "rpi4:8,rpi5:6,jetson-orin-nano:4,server:2"
DEVICES = 100
ROUNDS = 30
DEADLINE = round(1.95 + CLASSES["rpi4"].transfer_seconds(0.0, 0.0), 1)
"""Virtual seconds: what a Pi 4 needs for a round of FedARA at rank ratio 1/8: 1.95 s
of training and arrays (2.0 s under the clock that charged one 50 ms latency per
round instead of a message's task and protocol) plus what its message costs beyond
them (:meth:`common.devices.Device.transfer_seconds` with no arrays)."""
BASE: dict[str, Scalar] = {
    "data.fraction": 0.2,
    "data.alpha": 0.5,
    "fleet": FLEET,
    "fraction-train": 0.2,
    "min-train-nodes": 2,
    "eval-every": 3,
    "num-server-rounds": ROUNDS,
}
ROWS: dict[str, dict[str, Scalar]] = {
    "fedara-deadline": {
        "algorithm": "fedara",
        "fedara.rank-policy": "deadline",
        "round-deadline-s": DEADLINE,
    },
    # everything fits a deadline this long: every node is served rank 1, nobody drops
    "fedara-full": {
        "algorithm": "fedara",
        "fedara.rank-policy": "deadline",
        "round-deadline-s": 1e9,
    },
    "fedara-profile": {"algorithm": "fedara"},
    "fedavg-small": {"algorithm": "fedavg", "model.family": "cnn-5"},
    "fedavg-large": {"algorithm": "fedavg", "model.family": "cnn-1"},
    "lgfedavg": {"algorithm": "lgfedavg"},
    "lgfedavg-deadline": {
        "algorithm": "lgfedavg",
        "model.policy": "deadline",
        "round-deadline-s": DEADLINE,
    },
    "fedgh": {"algorithm": "fedgh"},
    "fedre": {"algorithm": "fedre"},
    "local": {"algorithm": "local"},
    "fd": {"algorithm": "fd"},
    "fedgen": {"algorithm": "fedgen"},
    "fedmrl": {"algorithm": "fedmrl"},
    "fedl2g": {"algorithm": "fedl2g"},
    "fedl2gl": {"algorithm": "fedl2gl"},
}
SEEDS = (0, 1, 2)


def run_dir(name: str, seed: int) -> Path:
    return OUT / name / f"seed{seed}"


def complete(path: Path) -> bool:
    try:
        doc = json.loads((path / "results.json").read_text())
        return len(doc["rounds"]) == ROUNDS
    except (OSError, ValueError, KeyError):
        return False


def archived(name: str, seed: int) -> Path:
    return ARCHIVE / name / f"seed{seed}.json.gz"


def host_speed_for_runs() -> float:
    """One speed of this machine for every run (``FEDHET_HOST_SPEED`` in their
    environment), so that rows and seeds are scaled by the same number: the median of
    three 2-second measurements, kept in ``benchmarks/out/fleet/host-speed.json``."""
    from models.workload import measure_speed

    path = OUT / "host-speed.json"
    if path.exists():
        return float(json.loads(path.read_text())["speed"])
    runs = [measure_speed(seconds=2.0, threads=1) for _ in range(3)]
    speed = statistics.median(runs)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"speed": speed, "runs": runs}))
    return speed


def run(names: list[str], seeds: list[int]) -> int:
    failures = 0
    env = {"FEDHET_HOST_SPEED": f"{host_speed_for_runs():.4f}"}
    for seed in seeds:
        for name in names:
            out = run_dir(name, seed)
            if complete(out) or archived(name, seed).exists():
                continue
            overrides = {**BASE, **ROWS[name], "seed": seed, "out-dir": str(out)}
            print(f"{time.strftime('%H:%M:%S')} {name:18s} seed {seed}", flush=True)
            outcome = run_simulation(
                ROOT,
                overrides,
                num_supernodes=DEVICES,
                flwr_home=OUT / ".flwr",
                timeout=4 * 3600,
                extra_env=env,
            )
            if not outcome.ok:
                failures += 1
                print(f"  FAILED: {outcome.status} (log: {outcome.log_path})", flush=True)
                continue
            shutil.rmtree(out / "clients", ignore_errors=True)
            keep = json.loads((out / "results.json").read_text())
            dest = archived(name, seed)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(gzip.compress(json.dumps(keep, indent=1).encode(), mtime=0))
    return 1 if failures else 0


# ------------------------------------------------------------------------- the table
def load(name: str) -> list[dict[str, Any]]:
    docs = []
    for path in sorted((ARCHIVE / name).glob("seed*.json.gz")):
        docs.append(json.loads(gzip.decompress(path.read_bytes())))
    return docs


def timeline(doc: dict[str, Any]) -> list[tuple[float, float]]:
    """(cumulative virtual seconds, accuracy) at every evaluated round."""
    clock, out = 0.0, []
    for row in doc["rounds"]:
        clock += row.get("virtual-time-s") or 0.0
        if row.get("accuracy") is not None:
            out.append((clock, row["accuracy"]))
    return out


def time_to(points: list[tuple[float, float]], target: float) -> float | None:
    """Virtual seconds until the accuracy first reaches ``target`` (None: never)."""
    return next((t for t, acc in points if acc >= target), None)


def at_budget(points: list[tuple[float, float]], budget: float) -> float | None:
    """The accuracy of the last evaluation within ``budget`` virtual seconds."""
    within = [acc for t, acc in points if t <= budget]
    return within[-1] if within else None


def summarise() -> dict[str, Any]:
    docs = {name: load(name) for name in ROWS}
    docs = {k: v for k, v in docs.items() if v}
    target = (
        statistics.fmean(d["summary"]["accuracy-last"] for d in docs["local"])
        if "local" in docs
        else None
    )
    totals = [timeline(d)[-1][0] for ds in docs.values() for d in ds if timeline(d)]
    budget = min(totals) if totals else 0.0
    rows = {}
    for name, ds in docs.items():
        lines = [timeline(d) for d in ds]
        reach = [time_to(pts, target) for pts in lines] if target is not None else []
        rows[name] = {
            "seeds": [d["config"]["seed"] for d in ds],
            "accuracy-last": [d["summary"]["accuracy-last"] for d in ds],
            "virtual-time-total-s": [d["summary"]["virtual-time-total-s"] for d in ds],
            "time-to-local-s": reach,
            "accuracy-at-budget": [at_budget(pts, budget) for pts in lines],
            "bytes-per-round": [
                (d["summary"]["bytes-up-total"] + d["summary"]["bytes-down-total"]) / ROUNDS
                for d in ds
            ],
            "deadline-dropped": [sum(r["deadline-dropped"] for r in d["rounds"]) for d in ds],
            "curve": lines,
        }
    return {
        "fleet": FLEET,
        "devices": DEVICES,
        "rounds": ROUNDS,
        "deadline-s": DEADLINE,
        "local-final-accuracy": target,
        "budget-s": budget,
        "host-speed": _host_speed(docs),
        "rows": rows,
    }


def _host_speed(docs: dict[str, list[dict[str, Any]]]) -> list[float]:
    """The host speeds the runs' clients reported (one value when all agree)."""
    speeds = {
        round(m["host-speed"], 4)
        for ds in docs.values()
        for d in ds
        for r in d["rounds"]
        for m in r.get("client-train", {}).values()
        if "host-speed" in m
    }
    return sorted(speeds)


def _mean(values: list[float | None], fmt: str) -> str:
    got = [v for v in values if v is not None]
    if not got:
        return "never"
    text = fmt.format(statistics.fmean(got))
    if len(got) > 1:
        text += " ± " + fmt.format(statistics.stdev(got))
    missed = len(values) - len(got)
    return text + (f" ({missed} never)" if missed else "")


def table(summary: dict[str, Any]) -> str:
    lines = [
        f"| row | seeds | virtual s to local's final accuracy "
        f"({summary['local-final-accuracy'] or 0:.4f}) | accuracy at "
        f"{summary['budget-s']:.0f} virtual s | final accuracy | virtual s, 30 rounds | "
        "MB per round | replies past the deadline |",
        "|---|---|---|---|---|---|---|---|",
    ]
    order = sorted(
        summary["rows"].items(),
        key=lambda kv: statistics.fmean(kv[1]["accuracy-last"]),
        reverse=True,
    )
    for name, r in order:
        lines.append(
            f"| {name} | {len(r['seeds'])} | {_mean(r['time-to-local-s'], '{:.0f}')} | "
            f"{_mean(r['accuracy-at-budget'], '{:.4f}')} | {_mean(r['accuracy-last'], '{:.4f}')} | "
            f"{_mean(r['virtual-time-total-s'], '{:.0f}')} | "
            f"{_mean([b / 2**20 for b in r['bytes-per-round']], '{:.2f}')} | "
            f"{_mean([float(x) for x in r['deadline-dropped']], '{:.0f}')} |"
        )
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, r in sorted(summary["rows"].items()):
        curves = r["curve"]
        n = min(len(c) for c in curves)
        xs = [statistics.fmean(c[i][0] for c in curves) for i in range(n)]
        ys = [statistics.fmean(c[i][1] for c in curves) for i in range(n)]
        ax.plot(xs, ys, marker=".", label=name)
    if summary["local-final-accuracy"]:
        ax.axhline(summary["local-final-accuracy"], color="gray", ls="--", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("virtual time (s, log scale)")
    ax.set_ylabel("personalized accuracy")
    ax.set_title(f"{DEVICES} devices ({FLEET}), 20 % per round, mean over seeds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="comma list of rows")
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    ap.add_argument("--table", action="store_true", help="only write the table and plot")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or list(ROWS)
    unknown = set(names) - set(ROWS)
    if unknown:
        raise SystemExit(f"unknown rows {sorted(unknown)}; rows: {', '.join(ROWS)}")
    status = 0
    if not args.table:
        status = run(names, [int(s) for s in args.seeds.split(",") if s])
    summary = summarise()
    if summary["rows"]:
        DOCS.mkdir(parents=True, exist_ok=True)
        (DOCS / "fleet.json").write_text(json.dumps(summary, indent=1))
        (DOCS / "fleet.md").write_text(table(summary))
        plot(summary, DOCS / "fleet.png")
        write_block(summary)
        print(table(summary))
    return status


PAGE = ROOT / "docs" / "fleet.md"
BLOCK = re.compile(r"(<!-- fleet-results -->\n).*?(<!-- /fleet-results -->)", re.S)


def block(summary: dict[str, Any]) -> str:
    """What docs/fleet.md shows between its fleet-results markers."""
    return (
        table(summary)
        + "\nVirtual seconds to reach local's final accuracy (mean over local's seeds), "
        f"accuracy at {summary['budget-s']:.0f} virtual seconds (the shortest row's whole "
        "run), final accuracy, the 30 rounds' virtual time, array bytes per round (both "
        "ways, all clients), replies past the deadline; mean ± std over the seeds. Host "
        f"speed of every run: {', '.join(f'{s:g}' for s in summary['host-speed'])} "
        "GFLOP/s.\n\n![accuracy against virtual time](results/fleet.png)\n"
    )


README = ROOT / "README.md"
SUMMARY_BLOCK = re.compile(r"(<!-- fleet-summary -->\n).*?(<!-- /fleet-summary -->)", re.S)
SUMMARY_ROWS = ("fedara-deadline", "fedara-full", "fedavg-small", "fedgh", "local")


def readme_block(summary: dict[str, Any]) -> str:
    """The README's short version: a few rows, time to local's accuracy and final."""
    rows = summary["rows"]
    lines = [
        f"| {DEVICES} devices, `{FLEET}` | seeds | virtual s to local's final accuracy | "
        "final accuracy |",
        "|---|---|---|---|",
    ]
    for name in SUMMARY_ROWS:
        if name in rows:
            r = rows[name]
            lines.append(
                f"| {name} | {len(r['seeds'])} | {_mean(r['time-to-local-s'], '{:.0f}')} | "
                f"{_mean(r['accuracy-last'], '{:.4f}')} |"
            )
    return "\n".join(lines) + "\n"


def write_block(summary: dict[str, Any]) -> None:
    for path, pattern, body in (
        (PAGE, BLOCK, block(summary)),
        (README, SUMMARY_BLOCK, readme_block(summary)),
    ):
        text = path.read_text()
        if not pattern.search(text):
            raise SystemExit(f"{path} has no results block ({pattern.pattern})")
        m = pattern.search(text)
        assert m is not None
        path.write_text(text[: m.end(1)] + body + text[m.start(2) :])


if __name__ == "__main__":
    raise SystemExit(main())
