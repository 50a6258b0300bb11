"""Per-round time of fedhet's simulation against a bare single-process PyTorch loop.

Same workload both ways: Fashion-MNIST, Dirichlet 0.1, 20 clients, the ``cnn``
family, LG-FedAvg (heads averaged), 1 local epoch, evaluation every round. The bare
loop calls the same model, data and training functions in one process, one client
after the other, with no Flower at all. Reported: median seconds per round with
round 1 (start-up) excluded, and the ratio simulation / bare.

    python -m benchmarks.overhead --rounds 6 --out benchmarks/out/overhead.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from cli.launch import Scalar
from client_app.base import derive_seed
from common.config import parse_run_config
from common.records import weighted_mean
from data import load_client_data
from models import arch_for_partition, build_model
from models.train import SGDSettings, evaluate, train

ROOT = Path(__file__).resolve().parent.parent

CLIENTS = 20


def bare_loop(rounds: int, threads: int) -> list[float]:
    """LG-FedAvg in one process; returns seconds per round."""
    torch.set_num_threads(threads)
    cfg = parse_run_config({"data.alpha": 0.1})
    t = cfg.train
    sgd = SGDSettings(epochs=1, batch_size=t.batch_size, lr=t.lr)
    datas = [load_client_data(cfg.data, pid, CLIENTS, cfg.seed) for pid in range(CLIENTS)]
    models = [
        build_model(
            arch_for_partition("cnn", pid),
            in_channels=1,
            num_classes=10,
            image_size=28,
            feature_dim=500,
            seed=derive_seed(0, pid),
        )
        for pid in range(CLIENTS)
    ]
    head = {k: v.clone() for k, v in models[0].head.state_dict().items()}
    times = []
    for rnd in range(1, rounds + 1):
        start = time.perf_counter()
        heads, weights = [], []
        for pid, (model, d) in enumerate(zip(models, datas, strict=True)):
            model.head.load_state_dict(head)
            gen = torch.Generator().manual_seed(derive_seed(0, rnd, pid, 0))
            train(model, d.x_train, d.y_train, sgd, gen)
            heads.append({k: v.numpy() for k, v in model.head.state_dict().items()})
            weights.append(len(d.y_train))
        head = {k: torch.from_numpy(v) for k, v in weighted_mean(heads, weights, heads[0]).items()}
        for model, d in zip(models, datas, strict=True):
            model.head.load_state_dict(head)
            evaluate(model, d.x_test, d.y_test)
        times.append(time.perf_counter() - start)
        print(
            f"bare ({threads} thread{'s' * (threads > 1)}) round {rnd}: {times[-1]:.2f} s",
            flush=True,
        )
    return times


def simulation(rounds: int, out_dir: Path) -> list[float]:
    from cli.launch import run_simulation

    overrides: dict[str, Scalar] = {
        "algorithm": "lgfedavg",
        "num-server-rounds": rounds,
        "data.alpha": 0.1,
        "out-dir": str(out_dir),
    }
    outcome = run_simulation(
        ROOT, overrides, num_supernodes=CLIENTS, flwr_home=out_dir / ".flwr", timeout=3600
    )
    if not outcome.ok:
        raise SystemExit(f"simulation failed: {outcome.status} ({outcome.log_path})")
    rows = json.loads((out_dir / "results.json").read_text())["rounds"]
    for r in rows:
        print(
            f"simulation round {r['round']}: {r['round-time-s']:.2f} s "
            f"(client train {r['client-train-time-s']:.2f} s each)",
            flush=True,
        )
    return [r["round-time-s"] for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/out/overhead.json")
    args = ap.parse_args()
    sim = simulation(args.rounds, args.out.parent / "overhead-sim")
    bare = {n: bare_loop(args.rounds, n) for n in (1, 2)}
    med = {f"bare-{n}-thread": statistics.median(v[1:]) for n, v in bare.items()}
    med["simulation"] = statistics.median(sim[1:])
    best_bare = min(med["bare-1-thread"], med["bare-2-thread"])
    result = {
        "workload": f"{CLIENTS} clients, fashion-mnist, dirichlet 0.1, cnn family, lgfedavg, "
        "1 local epoch, batch 10, evaluation every round",
        "rounds": args.rounds,
        "seconds-per-round": {
            "simulation": sim,
            **{f"bare-{n}-thread": v for n, v in bare.items()},
        },
        "median-excluding-round-1": med,
        "ratio-simulation-over-best-bare": med["simulation"] / best_bare,
        "ratio-simulation-over-bare-1-thread": med["simulation"] / med["bare-1-thread"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(
        json.dumps(
            {
                k: result[k]
                for k in (
                    "median-excluding-round-1",
                    "ratio-simulation-over-best-bare",
                    "ratio-simulation-over-bare-1-thread",
                )
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
