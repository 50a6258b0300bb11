"""How large honest uploads are against their round's median: the distribution that
``robust.max-norm-ratio``'s default is chosen from.

Every algorithm that uploads something the server screens (all but ``local``) runs
on Fashion-MNIST in the accuracy benchmark's regimes (``benchmarks/suites.py``:
scarce, 50 clients with 20 % of the data, Dirichlet 0.5; practical, 20 clients with
all of it, Dirichlet 0.1), seed 0, with no fault and screening off, through the
in-process grid (``server_app/inprocess.py``: the real ClientApp and ServerApp code,
no Ray). Each round's results row holds every upload's size over the round's median
(``upload-size-ratio``: the update to what was served for parameter uploads, FedARA's
reconstructed one included; the largest prototype or representation norm for the
prototype family). Printed and written: per algorithm and regime, the number of
uploads, the median, 99th percentile and largest ratio, and the largest per round.

    python -m benchmarks.honest_ratios [--scarce-rounds 10] [--practical-rounds 3]
        [--regimes scarce,practical] [--algorithms fedavg,...] [--append] [--archive]
        [--out benchmarks/out/honest_ratios.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.probe import archive_rows, save_rows, task_identity
from benchmarks.suites import REGIMES

ROOT = Path(__file__).resolve().parent.parent
MODEL: dict[str, dict[str, Any]] = {"fedavg": {"model.family": "fedavgcnn"}}
"""What an algorithm needs beyond the regime (fedavg: one architecture for all)."""
CANDIDATES = (3.0, 5.0, 10.0, 20.0, 50.0, 100.0)
MARGIN = 2.0
"""The default threshold: the smallest candidate at least this many times the largest
honest ratio measured (a workload not measured here may spread more)."""


def algorithms() -> list[str]:
    from common.methods import METHODS

    return [name for name in METHODS if name != "local"]


def run(tmp: Path, algorithm: str, regime: str, rounds: int) -> dict[str, Any]:
    from client_app.app import app as client_app
    from common.config import parse_run_config
    from server_app.app import serve
    from server_app.inprocess import FakeGrid, small_config

    spec = REGIMES[regime]
    run_config = small_config(
        tmp,
        **{
            "algorithm": algorithm,
            "num-server-rounds": rounds,
            "seed": 0,
            "data.name": "fashion-mnist",
            "data.cache-dir": str(tmp / "cache"),
            "train.batch-size": 10,
            **spec["config"],
            **MODEL.get(algorithm, {}),
            "out-dir": str(tmp / regime / algorithm),
        },
    )
    grid = FakeGrid(client_app, run_config, spec["clients"])
    path = serve(grid, parse_run_config(run_config), simulation=True)  # type: ignore[arg-type]
    doc = json.loads(path.read_text())
    per_round = [list(r.get("upload-size-ratio", {}).values()) for r in doc["rounds"]]
    ratios = np.array([v for r in per_round for v in r], dtype=np.float64)
    return {
        "algorithm": algorithm,
        "regime": regime,
        "rounds": rounds,
        "clients": spec["clients"],
        "uploads": int(ratios.size),
        "median": float(np.median(ratios)) if ratios.size else None,
        "p99": float(np.percentile(ratios, 99)) if ratios.size else None,
        "max": float(ratios.max()) if ratios.size else None,
        "max-per-round": [max(r) if r else None for r in per_round],
        "accuracy-last": doc["summary"]["accuracy-last"],
    }


def default_threshold(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """(the largest honest ratio, the smallest candidate >= MARGIN x it)."""
    worst = max(r["max"] for r in rows if r["max"] is not None)
    return worst, next((c for c in CANDIDATES if c >= MARGIN * worst), CANDIDATES[-1])


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| algorithm | regime | rounds | uploads | median | p99 | max |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['algorithm']} | {r['regime']} | {r['rounds']} | {r['uploads']} "
            f"| {r['median']:.2f} | {r['p99']:.2f} | {r['max']:.2f} |"
        )
    worst, pick = default_threshold(rows)
    lines.append("")
    lines.append(
        f"Largest honest ratio: {worst:.2f}; default robust.max-norm-ratio: {pick:g} "
        f"(the smallest of {', '.join(f'{c:g}' for c in CANDIDATES)} at least "
        f"{MARGIN:g}x it)."
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scarce-rounds", type=int, default=10)
    ap.add_argument("--practical-rounds", type=int, default=3)
    ap.add_argument("--algorithms", default="")
    ap.add_argument("--regimes", default="scarce,practical")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of this process")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/out/honest_ratios.json")
    ap.add_argument("--archive", action="store_true", help="also docs/results/honest_ratios.*")
    ap.add_argument(
        "--append", action="store_true", help="keep --out's rows of the regimes not run now"
    )
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    task_identity()
    names = [a for a in args.algorithms.split(",") if a] or algorithms()
    rounds = {"scarce": args.scarce_rounds, "practical": args.practical_rounds}
    regimes = [r for r in args.regimes.split(",") if r]
    rows: list[dict[str, Any]] = []
    if args.append and args.out.exists():
        rows = [r for r in json.loads(args.out.read_text())["rows"] if r["regime"] not in regimes]
    with tempfile.TemporaryDirectory(prefix="fedhet-ratios-") as tmp:
        for regime in regimes:
            for algorithm in names:
                row = run(Path(tmp), algorithm, regime, rounds[regime])
                rows.append(row)
                print(json.dumps(row), flush=True)
                save_rows(args.out, rows)
    text = table(rows)
    print(text)
    if args.archive:
        archive_rows("honest_ratios", rows, text)


if __name__ == "__main__":
    main()
