"""Defaults for small fleets: the methods with a server-side step at N = 2 ... 50 nodes.

A home or lab fleet is 2-8 devices; fedhet's defaults were tuned on 20 and 50 clients.
For each method variant, N and seed, a short in-process run (every node every round,
fedhet's ClientApp through ``server_app.inprocess``) on Fashion-MNIST, on the same
partitions for every variant: ``scarce`` (20 % of the data, Dirichlet α = 0.5, the
scarce regime's partition) and ``practical`` (the same 20 %, α = 0.1: the practical
regime's label skew on the scarce regime's amount of data, so that N = 2 stays a short
run). Per (variant, partition, N): the last round's accuracy (mean ± std over seeds),
the worst drop between two rounds (the largest over seeds), and the same for
``local``. A variant fails the small-fleet rule where it drops by more than
:data:`DROP` between two rounds while ``local`` does not.

    python -m benchmarks.small_fleets --out benchmarks/out/small-fleets.json
    python -m benchmarks.small_fleets --variants fedara,fedara-bounded --nodes 4 --seeds 0
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

VARIANTS: dict[str, dict[str, Any]] = {
    "local": {"algorithm": "local"},
    "fedara": {"algorithm": "fedara"},
    "fedara-bounded": {"algorithm": "fedara", "fedara.server-step": "bounded"},
    "fedara-fixed": {"algorithm": "fedara", "fedara.server-step": "fixed"},
    "fedgh": {"algorithm": "fedgh"},
    "fedre": {"algorithm": "fedre"},
    "fedtgp": {"algorithm": "fedtgp"},
    "fedkd": {"algorithm": "fedkd"},
    "fd": {"algorithm": "fd"},
    "fd-mse": {"algorithm": "fd", "fd.loss": "mse"},
    "fedgen": {"algorithm": "fedgen"},
    "fedgen-lr3e-4": {"algorithm": "fedgen", "fedgen.server-lr": 0.0003},
    "fedmrl": {"algorithm": "fedmrl"},
    "fedl2g": {"algorithm": "fedl2g"},
    "fedl2g-lr1000": {"algorithm": "fedl2g", "fedl2g.server-lr": 1000.0},
    "fedl2gl": {"algorithm": "fedl2gl"},
    "fedl2gl-lr100": {"algorithm": "fedl2gl", "fedl2gl.server-lr": 100.0},
    "lgfedavg": {"algorithm": "lgfedavg"},
}
PARTITIONS = {"scarce": 0.5, "practical": 0.1}
NODES = (2, 4, 8, 20, 50)
SEEDS = (0, 1, 2)
ROUNDS = 4
FRACTION = 0.2
DROP = 0.03
"""A drop of accuracy between two rounds beyond this counts (a few points)."""


def one_run(job: dict[str, Any]) -> dict[str, Any]:
    """One run in this (worker) process; its per-round accuracy and train loss."""
    import torch
    from flwr.supercore.task_identity import TaskIdentity

    from server_app.inprocess import run_inprocess

    torch.set_num_threads(1)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
    overrides = {
        **VARIANTS[job["variant"]],
        "data.name": "fashion-mnist",
        "data.fraction": FRACTION,
        "data.alpha": PARTITIONS[job["partition"]],
        "data.cache-dir": job["cache"],
        "train.batch-size": 10,
        "num-server-rounds": job["rounds"],
        "seed": job["seed"],
    }
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        results, _ = run_inprocess(Path(tmp), job["nodes"], **overrides)
    rounds = results["rounds"]
    diag = [r.get("server-diagnostics") or {} for r in rounds]
    return {
        **{k: job[k] for k in ("variant", "partition", "nodes", "seed")},
        "accuracy": [r["accuracy"] for r in rounds],
        "train-loss": [r.get("train-loss") for r in rounds],
        "server-lr": [d.get("server-lr") for d in diag],
        "update-coherence": [d.get("update-coherence") for d in diag],
        "guide-change": [d.get("guide-change") for d in diag],
        "wall-s": round(time.perf_counter() - start, 1),
    }


def worst_drop(acc: list[float]) -> float:
    return max([a - b for a, b in zip(acc, acc[1:], strict=False)], default=0.0)


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (variant, partition, N): last accuracy over seeds, worst drop, vs local."""
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["variant"], run["partition"], run["nodes"]), []).append(run)
    rows = []
    for (variant, partition, nodes), group in sorted(groups.items()):
        last = [g["accuracy"][-1] for g in group]
        local = groups.get(("local", partition, nodes), [])
        row = {
            "variant": variant,
            "partition": partition,
            "nodes": nodes,
            "seeds": len(group),
            "last-mean": statistics.mean(last),
            "last-std": statistics.pstdev(last),
            "worst-drop": max(worst_drop(g["accuracy"]) for g in group),
        }
        if local:
            row["local-last-mean"] = statistics.mean(g["accuracy"][-1] for g in local)
            row["local-worst-drop"] = max(worst_drop(g["accuracy"]) for g in local)
            row["collapses"] = row["worst-drop"] > DROP and row["local-worst-drop"] <= DROP
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| variant | partition | N | last accuracy | worst drop | local: last / worst drop |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["variant"] == "local":
            continue
        local = (
            f"{r['local-last-mean']:.3f} / {r['local-worst-drop']:+.3f}"
            if "local-last-mean" in r
            else ""
        )
        flag = " **collapse**" if r.get("collapses") else ""
        lines.append(
            f"| {r['variant']} | {r['partition']} | {r['nodes']} | {r['last-mean']:.3f} ± "
            f"{r['last-std']:.3f} | {r['worst-drop']:+.3f}{flag} | {local} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="local,fedara-fixed,fedara-bounded")
    parser.add_argument("--partitions", default="scarce,practical")
    parser.add_argument("--nodes", default=",".join(map(str, NODES)))
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/small-fleets.json"))
    args = parser.parse_args()
    cache = str(Path(tempfile.gettempdir()) / "fedhet-small-fleets-cache")
    jobs = [
        {"variant": v, "partition": p, "nodes": int(n), "seed": int(s), "rounds": args.rounds}
        | {"cache": cache}
        for p in args.partitions.split(",")
        for n in args.nodes.split(",")
        for s in args.seeds.split(",")
        for v in args.variants.split(",")
    ]
    done: list[dict[str, Any]] = []
    if args.out.exists():  # resume: keep runs already made with the same rounds
        old = json.loads(args.out.read_text())
        if old.get("rounds") == args.rounds:
            done = old["runs"]
    have = {(r["variant"], r["partition"], r["nodes"], r["seed"]) for r in done}
    todo = [j for j in jobs if (j["variant"], j["partition"], j["nodes"], j["seed"]) not in have]
    print(f"{len(todo)} runs to make ({len(jobs) - len(todo)} kept)", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(args.workers) as pool:
        for run in pool.map(one_run, todo):
            done.append(run)
            print(
                json.dumps({k: run[k] for k in ("variant", "partition", "nodes", "seed")})
                + f" {[round(a, 3) for a in run['accuracy']]} {run['wall-s']} s",
                flush=True,
            )
            record = {"rounds": args.rounds, "fraction": FRACTION, "drop": DROP, "runs": done}
            args.out.write_text(json.dumps(record, indent=1) + "\n")
    rows = summarise(done)
    record = {
        "rounds": args.rounds,
        "fraction": FRACTION,
        "drop": DROP,
        "runs": done,
        "summary": rows,
        "date": time.strftime("%Y-%m-%d"),
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(table(rows))
    sys.exit(0)


if __name__ == "__main__":
    main()
