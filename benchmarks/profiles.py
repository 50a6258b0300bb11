"""Peak memory and time of one training round per device profile.

Each measurement is a fresh Python process that does what a SuperNode's ClientApp
process does for one ``train.<algorithm>`` message (imports, data share, model,
training, upload) and reports its peak RSS (``VmHWM``). Fashion-MNIST, Dirichlet
0.1 over 20 partitions, partition 0 (2,625 training samples).

    python -m benchmarks.profiles --out benchmarks/out/profiles.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from benchmarks.probe import peak_mb, task_identity
task_identity()
from flwr.app import ConfigRecord, Context, Message, RecordDict
from client_app.app import app
from client_app import profiles
from common.config import flatten, parse_run_config
t_import = time.perf_counter() - t0
rss_imports = peak_mb()
algorithm, profile = sys.argv[1], sys.argv[2]
if profile == "jetson-orin-nano":  # no CUDA here: same settings on the CPU
    p = profiles.PROFILES[profile]
    profiles.PROFILES[profile] = type(p)(**{**p.__dict__, "device": "cpu", "needs_cuda": False})
run_config = flatten(parse_run_config({"algorithm": algorithm}))
node_config = {"partition-id": 0, "num-partitions": 20, "profile": profile}
ctx = Context(run_id=1, node_id=5, node_config=node_config, state=RecordDict(),
              run_config=run_config)
ask = Message(RecordDict({"config": ConfigRecord()}), dst_node_id=5,
              message_type="query.profile")
info = app(ask, ctx).content["profile"]
rss_ready = peak_mb()
from strategies import make_strategy
from strategies.base import NodeInfo
strategy = make_strategy(parse_run_config({"algorithm": algorithm}))
strategy.nodes = {5: NodeInfo.from_metrics(5, info)}
strategy.global_arrays = strategy.init_global()
from common.records import to_record
msg = Message(RecordDict({"arrays": to_record(strategy.payload(1, strategy.nodes[5])),
                          "config": ConfigRecord({"server-round": 2})}),
              dst_node_id=5, message_type=f"train.{algorithm}")
t1 = time.perf_counter()
reply = app(msg, ctx)
t_round = time.perf_counter() - t1
assert not reply.has_error(), reply.error
print(json.dumps({
    "arch": info["arch"], "rank-ratio": info.get("rank-ratio"),
    "import-s": t_import, "round-s": t_round,
    "train-s": reply.content["metrics"]["train-time-s"],
    "peak-rss-mb": peak_mb(),
    "rss-before-training-mb": rss_ready,
    "rss-after-imports-mb": rss_imports,
}))
"""


def measure(algorithm: str, profile: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, algorithm, profile],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,  # the child imports the app from the repository root
    )
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from client_app.profiles import PROFILES

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/out/profiles.json")
    ap.add_argument("--algorithms", default="fedre,fedara")
    args = ap.parse_args()
    rows = []
    for algorithm in args.algorithms.split(","):
        for name, p in PROFILES.items():
            m = measure(algorithm, name)
            rows.append(
                {
                    "profile": name,
                    "algorithm": algorithm,
                    "batch-size": p.batch_size,
                    "threads": p.threads,
                    "device": p.device,
                    **m,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
