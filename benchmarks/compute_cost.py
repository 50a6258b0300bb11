"""Client computation and upload per round of every algorithm, against LG-FedAvg.

One process, one thread, the real ClientApp: for Fashion-MNIST partitions 0..4 of 20
(Dirichlet 0.1; CNN-1..5 round-robin, FedARA: CNN-1 at its five rank tiers), one
``train.<algorithm>`` message per algorithm is sent in turn, ``--repeats`` times, to
the same node data (round 2, so every algorithm's round-2 work runs: anchors,
prototype losses, installed global parts). The time of the whole message (install,
local training, computing the upload) is compared as a ratio of medians to
``lgfedavg``'s. Alternating the algorithms keeps the ratios fair on a machine that
other work shares; the accuracy runs' per-round times are not (they ran at
different times).

    python -m benchmarks.compute_cost --out benchmarks/out/compute-cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.probe import task_identity

ROOT = Path(__file__).resolve().parent.parent

REFERENCE = "lgfedavg"


def measure(pid: int, repeats: int, algorithms: list[str]) -> dict:
    import torch
    from flwr.app import ConfigRecord, Context, Message, RecordDict

    from client_app.app import app
    from common.config import flatten, parse_run_config
    from common.records import payload_bytes, to_record
    from strategies import make_strategy
    from strategies.base import NodeInfo

    torch.set_num_threads(1)
    times: dict[str, list[float]] = {a: [] for a in algorithms}
    upload: dict[str, int] = {}
    archs: dict[str, str] = {}
    contexts, messages = {}, {}
    for algo in algorithms:
        cfg = parse_run_config({"algorithm": algo, "data.alpha": 0.1})
        contexts[algo] = Context(
            run_id=1,
            node_id=5,
            node_config={"partition-id": pid, "num-partitions": 20},
            state=RecordDict(),
            run_config=flatten(cfg),
        )
        query = Message(
            RecordDict({"config": ConfigRecord()}), dst_node_id=5, message_type="query.profile"
        )
        info = app(query, contexts[algo]).content.config_records["profile"]
        strategy = make_strategy(cfg)
        strategy.nodes = {5: NodeInfo.from_metrics(5, info)}
        archs[algo] = strategy.nodes[5].arch
        strategy.global_arrays = strategy.init_global()
        if not strategy.global_arrays and algo in ("fedproto", "fedtgp"):
            # round 2: the global prototypes exist (any values: the cost is what counts)
            d, c = strategy.nodes[5].feature_dim, strategy.nodes[5].num_classes
            strategy.global_arrays = {f"proto.{k}": np.zeros(d, np.float32) for k in range(c)}
        content = {
            "arrays": to_record(strategy.payload(2, strategy.nodes[5])),
            "config": ConfigRecord({"server-round": 2}),
        }
        messages[algo] = lambda c=content, a=algo: Message(
            RecordDict(c), dst_node_id=5, message_type=f"train.{a}"
        )
    for algo in algorithms:  # warm-up: data share, imports and caches, not timed
        app(messages[algo](), contexts[algo])
    for _ in range(repeats):
        for algo in algorithms:
            start = time.perf_counter()
            out = app(messages[algo](), contexts[algo])
            times[algo].append(time.perf_counter() - start)
            assert not out.has_error(), out.error
            upload[algo] = payload_bytes(out.content.array_records["arrays"])
    med = {a: statistics.median(t) for a, t in times.items()}
    return {
        "partition": pid,
        "archs": archs,
        "message-s": med,
        "message-s-all": times,
        "upload-bytes": upload,
    }


def main() -> None:
    from common.methods import names

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/out/compute-cost.json")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--algorithms", default=",".join(a for a in names() if a != "fedavg"))
    args = ap.parse_args()
    algorithms = [a for a in args.algorithms.split(",") if a]
    if REFERENCE not in algorithms:
        algorithms.insert(0, REFERENCE)
    task_identity()
    rows = []
    for pid in range(5):
        rows.append(measure(pid, args.repeats, algorithms))
        print(json.dumps({k: rows[-1][k] for k in ("partition", "message-s")}), flush=True)
    total = {a: sum(r["message-s"][a] for r in rows) for a in algorithms}
    doc = {
        "workload": "Fashion-MNIST partitions 0-4 of 20 (Dirichlet 0.1), round 2, one local "
        "epoch (fedlora: E1 = E2 = 1), batch 10, 1 thread; the whole training message",
        "repeats": args.repeats,
        "rows": rows,
        "seconds": total,
        "ratio-to-lgfedavg": {a: total[a] / total[REFERENCE] for a in algorithms},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    for a, r in doc["ratio-to-lgfedavg"].items():
        print(f"{a}: {total[a]:.2f} s over CNN-1..5, {r:.2f}x lgfedavg")


if __name__ == "__main__":
    main()
