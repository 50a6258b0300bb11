"""Per-round wall time: deployment (SuperLink + SuperNodes, TLS + auth) vs simulation.

Same small workload both ways: fedre, 3 nodes, Fashion-MNIST ``data.fraction=0.05``,
Dirichlet 0.1, 4 rounds. Then where the difference goes: in deployment every message
starts a fresh ClientApp process (Flower 1.42's subprocess isolation), so each round
pays, per node and per message (train + evaluate), Python start-up + imports + loading
the data share + building the model. Those are measured in fresh processes, medians.

    python benchmarks/deployment.py --out benchmarks/out/deployment.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cli.federation import Federation  # noqa: E402
from cli.launch import run_simulation  # noqa: E402

NODES = 3


def overrides(out: Path, cache: Path) -> dict:
    return {
        "algorithm": "fedre",
        "num-server-rounds": 4,
        "data.fraction": 0.05,
        "data.alpha": 0.1,
        "out-dir": str(out),
        "data.cache-dir": str(cache),
        "round-timeout": 600.0,
    }


def round_times(out: Path) -> list[float]:
    return [r["round-time-s"] for r in json.loads((out / "results.json").read_text())["rounds"]]


def wall(code: str, repeats: int = 5) -> float:
    """Median wall time of a fresh ``python -c code`` process, start-up included."""
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300
        )
        runs.append(time.perf_counter() - t0)
        if out.returncode != 0:
            raise SystemExit(out.stderr[-2000:])
    return statistics.median(runs)


def startup_breakdown(cache: Path) -> dict:
    """What one ClientApp process pays before training, as wall-time differences."""
    base = wall("pass")
    torch = wall("import torch")
    app = wall("import client_app.app")
    cfg = (
        "import torch; from common.config import parse_run_config;"
        "from data import load_client_data; from models import build_model;"
        "c = parse_run_config({'data.fraction': 0.05, 'data.alpha': 0.1,"
        f"'data.cache-dir': '{cache}'}}).data"
    )
    with_data = wall(cfg + "; load_client_data(c, 0, 3, 0)")
    with_model = wall(
        cfg + "; build_model('cnn-1', in_channels=1, num_classes=10, "
        "image_size=28, feature_dim=500, seed=0)"
    )
    without = wall(cfg)
    return {
        "python-start-s": base,
        "import-torch-s": torch - base,
        "import-flwr-s": wall("import flwr.app, flwr.clientapp") - base,
        "import-client-app-s": app - base,
        "import-torchvision-extra-s": wall("import client_app.app; import torchvision.models")
        - app,
        "load-data-share-s": with_data - without,
        "build-cnn1-s": with_model - without,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/out/deployment.json")
    ap.add_argument(
        "--breakdown-only",
        action="store_true",
        help="only the per-process costs (needs a prepared partition cache)",
    )
    ap.add_argument("--cache", type=Path, default=None)
    args = ap.parse_args()
    if args.breakdown_only:
        print(
            json.dumps(
                startup_breakdown(args.cache or Path.home() / ".cache/fedhet/partitions"), indent=1
            )
        )
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmpd = Path(tmp)
        cache = tmpd / "cache"
        sim = run_simulation(
            ROOT,
            overrides(tmpd / "sim", cache),
            num_supernodes=NODES,
            flwr_home=tmpd / "sim-home",
            timeout=1800,
        )
        if not sim.ok:
            raise SystemExit(f"simulation: {sim.status} ({sim.log_path})")
        configs = [{"partition-id": i, "num-partitions": NODES} for i in range(NODES)]
        with Federation(tmpd / "fed", configs, ROOT, secure=True) as fed:
            dep = fed.run(overrides(tmpd / "dep", cache), timeout=1800)
        if not dep.ok:
            raise SystemExit(f"deployment: {dep.status} ({dep.log_path})")
        sim_t, dep_t = round_times(tmpd / "sim"), round_times(tmpd / "dep")
        result: dict[str, Any] = {
            "workload": "fedre, 3 nodes, fashion-mnist data.fraction=0.05, dirichlet 0.1, "
            "4 rounds; deployment with TLS + node auth, subprocess isolation",
            "round-time-s": {"simulation": sim_t, "deployment": dep_t},
            "median-excluding-round-1": {
                "simulation": statistics.median(sim_t[1:]),
                "deployment": statistics.median(dep_t[1:]),
            },
            "per-process": startup_breakdown(cache),
        }
    med = result["median-excluding-round-1"]
    result["ratio-deployment-over-simulation"] = med["deployment"] / med["simulation"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
