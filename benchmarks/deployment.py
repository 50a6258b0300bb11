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


def timed(code: str, repeats: int = 5) -> float:
    """Median wall time of ``python -c code`` in fresh processes (start-up included)."""
    runs = []
    for _ in range(repeats):
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                "import time; t=time.perf_counter();" + code + ";print(time.perf_counter()-t)",
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=300,
        )
        if out.returncode != 0:
            raise SystemExit(out.stderr[-2000:])
        runs.append(float(out.stdout.strip().splitlines()[-1]))
    return statistics.median(runs)


def startup_breakdown(cache: Path) -> dict:
    load = (
        "import torch; from common.config import parse_run_config;"
        "from data import load_client_data;"
        "c=parse_run_config({'data.fraction':0.05,'data.alpha':0.1,"
        f"'data.cache-dir':'{cache}'}}).data;"
        "t0=time.perf_counter(); load_client_data(c,0,3,0); t=t0"
    )
    build = (
        "import torch; from models import build_model; t0=time.perf_counter();"
        "build_model('cnn-1',in_channels=1,num_classes=10,image_size=28,feature_dim=500,"
        "seed=0); t=t0"
    )
    return {
        "python-start-s": timed("pass"),
        "import-torch-s": timed("import torch"),
        "import-flwr-s": timed("import flwr.app, flwr.clientapp"),
        "import-client-app-s": timed("import client_app.app"),
        "import-torchvision-extra-s": timed("import client_app.app; import torchvision.models")
        - timed("import client_app.app"),
        "load-data-share-s": timed("import time;" + load),
        "build-cnn1-s": timed("import time;" + build),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/out/deployment.json")
    args = ap.parse_args()
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
