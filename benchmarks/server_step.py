"""Every strategy's server step at N replies: ServerApp CPU seconds per node-round.

For each algorithm of the registry, the strategy is built from the default run
config (``algorithm = <name>``; FedAvg with its family, ``fedavgcnn``), knowing N
nodes of one shape (28x28 single channel, d = 500, 10 classes with 100 + i training
samples; CNN-1, FedAvg's ``fedavgcnn``; FedARA's nodes round-robin over its five
default tiers with fc1 and fc2 factorised). Each round is ``configure_train`` (every
node sampled) and ``aggregate_train`` of N replies with the keys and shapes the
method's clients send (:func:`fake_upload`): what the node was sent plus noise where
the reply has the sent keys, class prototypes around one centre per class, FedRE's
mixtures of them with soft labels, FedKD's mentee update as factors of a quarter of
the smaller side, FedGen's label counts (each node's own: :func:`label_counts`), FD's
mean logits (the class' own logit the largest), FedL2G's guide-gradient rows (one per
class the node has, small noise).
Distinct uploads are drawn once per payload (:data:`POOL` of them), and nodes share
their records (FedGen's but for the counts), so that the fake replies do not hold N
copies in memory; the server decodes each reply, as it always does.

Timed: CPU seconds of the process (``time.process_time``, every thread) and wall
seconds of configure_train + aggregate_train (making the replies is not timed),
rounds 1 to 3 of one strategy, the median round; per node-round: that over N.
Torch threads as ``--threads`` (2: every core here; the server's default). At N = 1000
it takes about 8 minutes here, 6 of them FedTGP's server training.

    python -m benchmarks.server_step [--nodes 1000] [--methods fedavg,fedara]
        [--out benchmarks/out/server-step.json] [--merge]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.fedara_cost import TIERS

ROOT = Path(__file__).resolve().parent.parent

POOL = 4
"""Distinct fake uploads per distinct payload."""
NOISE = 1e-3
"""Standard deviation of the noise added to what a node was sent."""


def make_nodes(name: str, n: int) -> list[Any]:
    """N nodes as their profile replies describe them (see the module docstring)."""
    from strategies.testing import node

    arch = "fedavgcnn" if name == "fedavg" else "cnn-1"
    tiers: list[dict[str, Any]] = [
        {"rank-ratio": TIERS[i % 5], "layers": "fc1,fc2"} for i in range(n)
    ]
    return [
        node(100 + i, i, arch=arch, num_train=100 + i, **(tiers[i] if name == "fedara" else {}))
        for i in range(n)
    ]


def fake_upload(s: Any, info: Any, sent: dict[str, np.ndarray], rng: np.random.Generator) -> dict:
    """One reply's arrays, as the method's client would shape them."""
    from common.messages import GUIDE_GRAD, LABEL_COUNTS, LOGIT, PROTO, REP, SOFT_LABEL
    from strategies.fedl2g import FedL2G
    from strategies.fedproto import present_classes

    expected = s.expected_upload(info)
    if isinstance(s, FedL2G):  # a gradient row per class it has (expected_upload: None)
        expected = {f"{GUIDE_GRAD}{c}": (s.width(info),) for c in present_classes(info)}
    if expected is None:  # FedKD: the mentee's update, whole or as factors
        return mentee_update(s.global_arrays, rng)
    centres = class_centres(info.feature_dim, info.num_classes)
    out = {}
    for key, shape in expected.items():
        if key == LABEL_COUNTS:  # FedGen: set per node in replies()
            out[key] = np.zeros(shape)
        elif key in sent and sent[key].shape == shape:
            out[key] = sent[key] + rng.normal(0, NOISE, shape)
        elif key.startswith(PROTO):
            out[key] = centres[int(key.removeprefix(PROTO))] + rng.normal(0, 0.3, shape)
        elif key.startswith(LOGIT):  # FD: a mean logit vector, its class' the largest
            c = int(key.removeprefix(LOGIT))
            out[key] = 4.0 * (np.arange(shape[0]) == c) + rng.normal(0, 1.0, shape)
        elif key.startswith(GUIDE_GRAD):  # FedL2G: a quiz-loss gradient row
            out[key] = rng.normal(0, 0.01, shape)
        elif key == SOFT_LABEL:
            out[key] = rng.dirichlet(np.ones(shape[1]), size=shape[0])
        elif key == REP:
            continue  # below, from the soft label
        else:
            raise ValueError(f"{s.name}: no fake for {key!r} {shape}")
    if REP in expected:
        out[REP] = out[SOFT_LABEL] @ centres + rng.normal(0, 0.3, expected[REP])
    return {k: np.asarray(v, dtype=np.float32) for k, v in out.items()}


def label_counts(info: Any) -> np.ndarray:
    """A node's training samples per class as float32, summing to its ``num_train``
    (the profile's counts, the remainder in class 0)."""
    counts = np.asarray(info.class_counts, np.float32)
    counts[0] += info.num_train - counts.sum()
    return counts


def class_centres(d: int, classes: int) -> np.ndarray:
    """One fixed prototype centre per class (unit norm)."""
    centres = np.random.default_rng(1).normal(size=(classes, d))
    return centres / np.linalg.norm(centres, axis=1, keepdims=True)


def mentee_update(mentee: dict[str, np.ndarray], rng: np.random.Generator) -> dict:
    """A FedKD reply: per key the update whole, or its rank-r factors ``.us``/``.vt``
    with r a quarter of the matrix's smaller side where the factors are smaller."""
    from common.messages import FACTOR_US, FACTOR_VT

    out = {}
    for key, value in mentee.items():
        rows, cols = value.shape[0], int(np.prod(value.shape[1:]))
        rank = max(1, min(rows, cols) // 4)
        if value.ndim < 2 or rank * (rows + cols) >= rows * cols:
            out[key] = rng.normal(0, NOISE, value.shape)
        else:
            out[key + FACTOR_US] = rng.normal(0, NOISE, (rows, rank))
            out[key + FACTOR_VT] = rng.normal(0, 1.0, (rank, cols))
    return {k: v.astype(np.float32) for k, v in out.items()}


def replies(s: Any, msgs: list[Any], rng: np.random.Generator) -> list[Any]:
    """A training reply to every message: :data:`POOL` fake uploads per distinct
    payload record, shared by the nodes sent it."""
    from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

    from common.messages import LABEL_COUNTS
    from common.records import to_numpy, to_record

    pools: dict[int, list[Any]] = {}
    out = []
    for i, msg in enumerate(msgs):
        record = msg.content.array_records["arrays"]
        info = s.nodes[msg.metadata.dst_node_id]
        if id(record) not in pools:
            sent = to_numpy(record)
            pools[id(record)] = [fake_upload(s, info, sent, rng) for _ in range(POOL)]
            pools[id(record)] = [
                u if LABEL_COUNTS in u else to_record(u) for u in pools[id(record)]
            ]
        arrays = pools[id(record)][i % POOL]
        if isinstance(arrays, dict):  # FedGen: each node's own counts, summing to its samples
            arrays = to_record({**arrays, LABEL_COUNTS: label_counts(info)})
        sent_msg = Message(
            RecordDict({"config": ConfigRecord()}),
            dst_node_id=info.node_id,
            message_type=msg.metadata.message_type,
        )
        metrics = {"num-examples": info.num_train, "train-loss": 1.0, "train-time-s": 0.1}
        content = RecordDict({"arrays": arrays, "metrics": MetricRecord(metrics)})
        out.append(Message(content, reply_to=sent_msg))
    return out


def time_method(name: str, n: int, rounds: int = 3) -> dict[str, Any]:
    """Rounds 1..``rounds`` of ``name``'s server with ``n`` replies each."""
    from flwr.app import ArrayRecord, ConfigRecord

    from common.methods import get
    from common.records import content_bytes
    from strategies.testing import strategy

    nodes = make_nodes(name, n)
    family = {"model.family": "fedavgcnn"} if name == "fedavg" else {}
    s = strategy(get(name).strategy_class(), nodes, algorithm=name, **family)
    s.global_arrays = s.init_global()
    ids = [x.node_id for x in nodes]

    class Grid:
        def get_node_ids(self) -> list[int]:
            return ids

    rng = np.random.default_rng(0)
    cpu, wall, rejected, upload = [], [], [], 0.0
    for rnd in range(1, rounds + 1):
        c0, t0 = time.process_time(), time.perf_counter()
        msgs = list(s.configure_train(rnd, ArrayRecord(), ConfigRecord(), Grid()))  # type: ignore[arg-type]
        c1, t1 = time.process_time(), time.perf_counter()
        answers = replies(s, msgs, rng)
        c2, t2 = time.process_time(), time.perf_counter()
        s.aggregate_train(rnd, answers)
        c3, t3 = time.process_time(), time.perf_counter()
        upload = sum(content_bytes(a.content) for a in answers) / n
        del answers
        cpu.append((c1 - c0) + (c3 - c2))
        wall.append((t1 - t0) + (t3 - t2))
        rejected.append(len([r for r in s.rejected if r[0] == rnd]))
    med_cpu, med_wall = statistics.median(cpu), statistics.median(wall)
    return {
        "algorithm": name,
        "nodes": n,
        "cpu-s": cpu,
        "wall-s": wall,
        "rejected": rejected,
        "cpu-s-per-round": med_cpu,
        "wall-s-per-round": med_wall,
        "cpu-s-per-node-round": med_cpu / n,
        "wall-s-per-node-round": med_wall / n,
        "upload-bytes-per-reply": upload,
    }


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of :func:`time_method` rows (also the docs' block)."""
    lines = [
        "| algorithm | nodes | ServerApp CPU s / round | wall s / round "
        "| CPU ms / node-round | upload MB / reply | replies dropped |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['algorithm']} | {r['nodes']:,} | {r['cpu-s-per-round']:.2f} "
            f"| {r['wall-s-per-round']:.2f} | {1e3 * r['cpu-s-per-node-round']:.2f} "
            f"| {r['upload-bytes-per-reply'] / 1e6:.3f} | {sum(r['rejected'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
    import torch

    from common.methods import BUILTIN

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--methods", default=",".join(m.name for m in BUILTIN))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/out/server-step.json")
    ap.add_argument(
        "--merge",
        action="store_true",
        help="keep --out's rows of other algorithms (same nodes and threads), in registry order",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = []
    for name in args.methods.split(","):
        rows.append({**time_method(name, args.nodes, args.rounds), "measured": now})
        print(json.dumps(rows[-1]), flush=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.merge and args.out.exists():
        old = json.loads(args.out.read_text())
        if old["threads"] != args.threads or any(r["nodes"] != args.nodes for r in old["rows"]):
            raise SystemExit(f"--merge: {args.out} was measured with other --nodes / --threads")
        by_name = {r["algorithm"]: {"measured": old["measured"], **r} for r in old["rows"]}
        by_name |= {r["algorithm"]: r for r in rows}
        order = [m.name for m in BUILTIN]
        rows = sorted(by_name.values(), key=lambda r: order.index(r["algorithm"]))
        peak = max(peak, old["peak-rss-mb"])
    doc = {
        "measured": min(r["measured"] for r in rows) + " to " + max(r["measured"] for r in rows)
        if len({r["measured"] for r in rows}) > 1
        else now,
        "threads": args.threads,
        "peak-rss-mb": peak,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
