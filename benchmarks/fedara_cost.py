"""FedARA costs: server time per round, and per tier parameters, bytes, time, memory.

1. Server: ``configure_train`` (one decomposition per distinct tier) + ``aggregate_train``
   (decoding and checking the replies, each reply's update to its tier with its size
   and their sample-weighted mean, the per-direction normalisation, the step) with
   10, 100 and 1000 simulated client replies spread round-robin over the 5 default
   tiers (cnn-1 extractor), rounds 1 and 2, under each ``fedara.truncation``. Median
   of 5 repetitions (3 for 1000 clients), torch with 2 threads (the machine's cores,
   the default), and at 100 replies with 1 (``server-threads = 1``); the time of
   each phase as the strategy reports it.
2. Per tier: extractor parameters, upload bytes measured from a real ClientApp reply
   vs the analytic count Σ r·(m+n) (+ the unfactorised layers), one local epoch's time
   (Fashion-MNIST partition 0 of 20, Dirichlet 0.1, 2,625 samples, batch 10, 1 thread;
   median of 3, all tiers interleaved in one process) with the Frobenius decay
   amortised (the default) and applied every step, and the peak RSS (VmHWM) of a
   fresh process doing that round.

    python -m benchmarks.fedara_cost --out benchmarks/out/fedara-cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TIERS = (1.0, 0.5, 0.25, 0.125, 0.0625)


def server_time(
    num_clients: int, truncation: str = "svd", repeats: int = 0, threads: int = 2
) -> dict:
    """Two rounds of the server (the second is where ``fedara.truncation=tracked``
    iterates from the first round's basis instead of computing an SVD), with
    ``threads`` torch threads (``server-threads``; 2 = every core here, the default);
    the phases of each round as the strategy times them (``server-phases-s``: the
    ``updates`` pass runs while the replies are screened), and what is left of
    aggregate_train: decoding and checking the replies."""
    import numpy as np
    import torch
    from flwr.app import ArrayRecord, ConfigRecord
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
    repeats = repeats or (5 if num_clients <= 100 else 3)

    from common.config import parse_run_config
    from strategies.base import NodeInfo
    from strategies.fedara import FedARA
    from strategies.testing import reply

    torch.set_num_threads(threads)
    nodes = [
        NodeInfo(
            node_id=100 + i,
            partition_id=i,
            arch="cnn-1",
            num_train=100 + i,
            num_test=30,
            num_classes=10,
            feature_dim=500,
            class_counts=(10,) * 10,
            extras={
                "in-channels": 1,
                "image-size": 28,
                "small-stem": 1,
                "rank-ratio": TIERS[i % 5],
                "layers": "fc1,fc2",
            },
        )
        for i in range(num_clients)
    ]

    class Grid:
        def get_node_ids(self) -> list[int]:
            return [n.node_id for n in nodes]

    times: dict[int, list[float]] = {1: [], 2: []}
    configure: dict[int, list[float]] = {1: [], 2: []}
    aggregate: dict[int, list[float]] = {1: [], 2: []}
    svds = []
    phases: dict[int, list[dict[str, float]]] = {1: [], 2: []}
    rng = np.random.default_rng(0)
    cfg: dict[str, str | int] = {
        "algorithm": "fedara",
        "min-available-nodes": 2,
        "fedara.truncation": truncation,
    }
    for _ in range(repeats):
        s = FedARA.from_config(parse_run_config(cfg))
        s.nodes = {n.node_id: n for n in nodes}
        s.global_arrays = s.init_global()
        for rnd in (1, 2):
            t0 = time.perf_counter()
            msgs = list(s.configure_train(rnd, ArrayRecord(), ConfigRecord(), Grid()))  # type: ignore[arg-type]
            t1 = time.perf_counter()
            replies = []
            for m in msgs:
                arrays = {
                    k: v.numpy() + rng.normal(0, 1e-3, v.shape).astype(np.float32)
                    for k, v in m.content.array_records["arrays"].items()
                }
                dst = m.metadata.dst_node_id
                replies.append(reply(dst, arrays, s.nodes[dst].num_train))
            t2 = time.perf_counter()
            s.aggregate_train(rnd, replies)
            t3 = time.perf_counter()
            if s.rejected:  # a benchmark of a round that aggregated nothing is no benchmark
                raise SystemExit(f"fedara_cost: replies rejected: {s.rejected[:3]}")
            configure[rnd].append(t1 - t0)
            aggregate[rnd].append(t3 - t2)
            timed = dict(s.diagnostics["server-phases-s"])
            timed["decode-check"] = (t3 - t2) - sum(v for k, v in timed.items() if k != "decompose")
            phases[rnd].append(timed)
            times[rnd].append((t1 - t0) + (t3 - t2))
        svds.append(s.decompositions.get(0, 0))
    med = statistics.median
    return {
        "clients": num_clients,
        "truncation": truncation,
        "threads": threads,
        "phases-s": {k: med(p[k] for p in phases[1]) for k in phases[1][0]},
        "phases-s-round2": {k: med(p[k] for p in phases[2]) for k in phases[2][0]},
        "server-s": med(times[1]),
        "configure-s": med(configure[1]),
        "aggregate-s": med(aggregate[1]),
        "server-s-round2": med(times[2]),
        "configure-s-round2": med(configure[2]),
        "aggregate-s-round2": med(aggregate[2]),
        "decompositions": svds[0],
    }


CHILD = r"""
import json, sys, time
from benchmarks.probe import peak_mb, task_identity
task_identity()
from flwr.app import ConfigRecord, Context, Message, RecordDict
from client_app.app import app
from common.config import flatten, parse_run_config
from common.records import payload_bytes, to_record
from strategies.base import NodeInfo
from strategies.fedara import FedARA
runs, repeats = json.loads(sys.argv[1]), int(sys.argv[2])

def one_round(ratio, every):
    cfg = {"algorithm": "fedara", "fedara.rank-tiers": str(ratio), "data.alpha": 0.1,
           "fedara.decay-every": every}
    run_config = flatten(parse_run_config(cfg))
    ctx = Context(run_id=1, node_id=5, node_config={"partition-id": 0, "num-partitions": 20},
                  state=RecordDict(), run_config=run_config)
    info = app(Message(RecordDict({"config": ConfigRecord()}), dst_node_id=5,
                       message_type="query.profile"), ctx).content["profile"]
    s = FedARA.from_config(parse_run_config(cfg))
    s.nodes = {5: NodeInfo.from_metrics(5, info)}
    s.global_arrays = s.init_global()
    payload = s.payload(2, s.nodes[5])
    content = {"arrays": to_record(payload), "config": ConfigRecord({"server-round": 2})}
    msg = Message(RecordDict(content), dst_node_id=5, message_type="train.fedara")
    out = app(msg, ctx)
    return {"params": int(sum(v.size for v in payload.values())),
            "bytes-up-measured": payload_bytes(out.content["arrays"]),
            "epoch-s": out.content["metrics"]["train-time-s"]}

times = {json.dumps(r): [] for r in runs}
last = {}
for _ in range(repeats):  # interleaved: machine noise hits every configuration alike
    for ratio, every in runs:
        last = one_round(ratio, every)
        times[json.dumps([ratio, every])].append(last["epoch-s"])
print(json.dumps({"times": times, "last": last, "peak-rss-mb": peak_mb()}))
"""


def analytic_params(ratio: float) -> int:
    from models import build_model
    from models.lowrank import factorisable_layers, layer_rank, param_count

    model = build_model("cnn-1", in_channels=1, num_classes=10, image_size=28, feature_dim=500)
    total = sum(p.numel() for p in model.extractor.parameters())
    if ratio < 1:
        shapes = factorisable_layers(model.extractor)
        for layer in ("fc1", "fc2"):
            sh = shapes[layer]
            total += param_count(sh, layer_rank(sh, ratio)) - sh[0] * sh[1]
    return total


def child(runs: list[tuple[float, int]], repeats: int) -> dict:
    """Epoch times of ``(rank ratio, fedara.decay-every)`` runs, one fresh ClientApp
    context each, interleaved ``repeats`` times in one fresh process (in the
    repository root, which it imports from)."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(runs), str(repeats)],
        capture_output=True,
        text=True,
        timeout=3600,
        cwd=ROOT,
    )
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def per_tier(repeats: int = 3) -> list[dict]:
    """Per tier: epoch time with the default amortised Frobenius decay (one step per
    epoch) and with the decay applied every step (``decay-every = 1``: what an
    O((m + n) r²) term per step costs), medians of ``repeats`` interleaved runs; then
    bytes, parameters and peak RSS from one fresh process per tier."""
    runs = [(r, every) for r in TIERS for every in (0, 1)]
    times = child(runs, repeats)["times"]
    rows = []
    for ratio in TIERS:
        alone = child([(ratio, 0)], 1)
        m = {
            **alone["last"],
            "peak-rss-mb": alone["peak-rss-mb"],
            "rank-ratio": ratio,
            "epoch-s": statistics.median(times[json.dumps([ratio, 0])]),
            "epoch-s-decay-every-step": statistics.median(times[json.dumps([ratio, 1])]),
            "params-analytic": analytic_params(ratio),
            "bytes-up-analytic": analytic_params(ratio) * 4,
        }
        rows.append(m)
        print(json.dumps(m), flush=True)
    full = rows[0]["epoch-s"]
    for m in rows:
        m["epoch-ratio-to-full-rank"] = m["epoch-s"] / full
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/out/fedara-cost.json")
    ap.add_argument("--clients", default="10,100,1000")
    ap.add_argument(
        "--threads",
        default="2,1",
        help="server torch threads to time (2: every core here, the default; 1: "
        "server-threads=1); the second and later only at 100 replies",
    )
    ap.add_argument(
        "--server-only",
        action="store_true",
        help="time the server only; keep the per-tier rows of an existing --out file",
    )
    args = ap.parse_args()
    doc = {}
    if args.server_only:
        if not args.out.exists():
            raise SystemExit(f"--server-only: {args.out} does not exist (run without it first)")
        doc = json.loads(args.out.read_text())
    server = []
    threads = [int(t) for t in args.threads.split(",")]
    for th in threads:
        for n in (int(c) for c in args.clients.split(",")):
            if th != threads[0] and n != 100:
                continue
            for truncation in ("svd", "tracked"):
                server.append(server_time(n, truncation, threads=th))
                print(json.dumps(server[-1]), flush=True)
    doc["server"] = server
    doc["server-measured"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if not args.server_only:
        doc["tiers"] = per_tier()
        doc["tiers-measured"] = doc["server-measured"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
