"""FedLoRA against LG-FedAvg: client computation and upload per round, per architecture.

One process, one thread, the real ClientApp: for each CNN-1..5 (Fashion-MNIST partitions
0..4 of 20, Dirichlet 0.1), a ``train.lgfedavg`` and a ``train.fedlora`` message are sent
alternately ``--repeats`` times to the same node data; the client's own training time
(``train-time-s``) is compared as a ratio of medians. Alternating the two keeps the
ratio fair on a machine that other work shares; the accuracy runs' per-round times are
not (they ran at different times).

    python benchmarks/fedlora_cost.py --out benchmarks/out/fedlora-cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.probe import task_identity  # noqa: E402

ALGORITHMS = ("lgfedavg", "fedlora")


def measure(pid: int, repeats: int) -> dict:
    import torch
    from flwr.app import ConfigRecord, Context, Message, RecordDict

    from client_app.app import app
    from common.config import flatten, parse_run_config
    from common.records import payload_bytes, to_record
    from strategies import STRATEGIES
    from strategies.base import NodeInfo

    torch.set_num_threads(1)
    times: dict[str, list[float]] = {a: [] for a in ALGORITHMS}
    upload: dict[str, int] = {}
    arch = ""
    contexts, messages = {}, {}
    for algo in ALGORITHMS:
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
        strategy = STRATEGIES[algo](cfg)
        strategy.nodes = {5: NodeInfo.from_metrics(5, info)}
        arch = strategy.nodes[5].arch
        strategy.global_arrays = strategy.init_global()
        content = {
            "arrays": to_record(strategy.payload(2, strategy.nodes[5])),
            "config": ConfigRecord({"server-round": 2}),
        }
        messages[algo] = lambda c=content, a=algo: Message(
            RecordDict(c), dst_node_id=5, message_type=f"train.{a}"
        )
    for _ in range(repeats):
        for algo in ALGORITHMS:
            out = app(messages[algo](), contexts[algo])
            seconds = out.content.metric_records["metrics"]["train-time-s"]
            assert isinstance(seconds, float)
            times[algo].append(seconds)
            upload[algo] = payload_bytes(out.content.array_records["arrays"])
    med = {a: statistics.median(t) for a, t in times.items()}
    return {
        "partition": pid,
        "arch": arch,
        "train-s": med,
        "train-s-all": times,
        "upload-bytes": upload,
        "train-ratio": med["fedlora"] / med["lgfedavg"],
        "upload-ratio": upload["fedlora"] / upload["lgfedavg"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/out/fedlora-cost.json")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    task_identity()
    rows = []
    for pid in range(5):
        rows.append(measure(pid, args.repeats))
        r = rows[-1]
        print(
            f"{r['arch']}: train s lgfedavg {r['train-s']['lgfedavg']:.2f} fedlora "
            f"{r['train-s']['fedlora']:.2f} ratio {r['train-ratio']:.2f}; upload ratio "
            f"{r['upload-ratio']:.3f}",
            flush=True,
        )
    total = {a: sum(r["train-s"][a] for r in rows) for a in ALGORITHMS}
    doc = {
        "workload": "Fashion-MNIST partitions 0-4 of 20 (Dirichlet 0.1), one local epoch "
        "(fedlora: E1 = E2 = 1), batch 10, 1 thread, default fedlora.rank",
        "repeats": args.repeats,
        "rows": rows,
        "train-ratio-all": total["fedlora"] / total["lgfedavg"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"all architectures: fedlora / lgfedavg train time = {doc['train-ratio-all']:.2f}")


if __name__ == "__main__":
    main()
