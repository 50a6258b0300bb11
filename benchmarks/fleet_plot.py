"""The fleet emulator's rows against N: a table and a plot for docs/deployment.md.

Reads the rows ``benchmarks.fleet_load`` appended (``--rows``), keeps the emulated
runs of one algorithm with every gate part on, and writes
``docs/results/fleet-scale.json`` (every row, for the record) and
``docs/results/fleet-scale.png``: the median round overhead beyond the slowest node's
delay, and the SuperLink + ServerApp CPU seconds per node-round from round 2, against
N, a line per SuperLink state (in memory, in its database; the latest row of each N).

    python -m benchmarks.fleet_plot --rows benchmarks/out/fleet-scale.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| N | state | registration | all online | replies aggregated / lost | SuperLink + "
        "ServerApp CPU s per node-round, whole run / from round 2 | requests per node-round, "
        "from round 2 | median round overhead | SuperLink CPU share of the run | SuperLink "
        "peak RSS / sockets |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        n = r["nodes"]
        superlink = r["cpu-s"].get("superlink", 0.0) / r["run-wall-s"]
        lines.append(
            f"| {n} | {r['state']} | {r['registration-s']:.1f} s | {r['online-s']:.1f} s | "
            f"{sum(v or 0 for v in r['valid-replies'])} / {r['lost-replies']} | "
            f"{r['server-cpu-s-per-node-round']:.2f} / "
            f"{r.get('steady-server-cpu-s-per-node-round', float('nan')):.2f} | "
            f"{r.get('steady-requests-per-node-round', float('nan')):.1f} | "
            f"{r['median-round-overhead-s']:.0f} s | {superlink:.0%} of a core | "
            f"{r['superlink-peak-rss-mb']:.0f} MB / {r['superlink-peak-sockets']} |"
        )
    return "\n".join(lines)


def plot(series: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """One line per state (its rows sorted by N) in each panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    for state, rows in series.items():
        n = [r["nodes"] for r in rows]
        label = f"state in {state}" if state == "memory" else f"state in its {state}"
        left.plot(n, [r["median-round-overhead-s"] for r in rows], "o-", label=label)
        right.plot(
            n, [r.get("steady-server-cpu-s-per-node-round") for r in rows], "o-", label=label
        )
    left.set(xscale="log", xlabel="nodes N", ylabel="s", title="median round overhead")
    right.set(
        xscale="log",
        xlabel="nodes N",
        ylabel="CPU s",
        title="SuperLink + ServerApp per node-round, from round 2",
    )
    right.set_ylim(bottom=0)
    left.set_ylim(bottom=0)
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def latest_by_n(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The latest row of each N, by N."""
    latest: dict[int, dict[str, Any]] = {}
    for r in rows:
        latest[r["nodes"]] = r
    return [latest[n] for n in sorted(latest)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=Path, default=ROOT / "benchmarks/out/fleet-scale.json")
    parser.add_argument("--algorithm", default="lgfedavg")
    parser.add_argument(
        "--state", action="append", help="memory, database (default: both, a line each)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs/results/fleet-scale")
    args = parser.parse_args()
    every = json.loads(args.rows.read_text())
    series = {}
    for state in args.state or ["memory", "database"]:
        rows = [
            r
            for r in every
            if r["nodes-kind"] == "emulated"
            and r["algorithm"] == args.algorithm
            and r["state"] == state
            and not r.get("parts-off")
        ]
        if rows:
            series[state] = latest_by_n(rows)
    args.out.with_suffix(".json").write_text(json.dumps(every, indent=1) + "\n")
    plot(series, args.out.with_suffix(".png"))
    print(table([r for rows in series.values() for r in rows]))


if __name__ == "__main__":
    main()
