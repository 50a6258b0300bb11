"""Accuracy benchmarks on Fashion-MNIST in the two regimes of the README.

Every run is a real ``flwr run`` simulation (the same path as ``fedhet simulate``).
Runs are resumable: a run whose ``results.json`` is complete is skipped.

    python benchmarks/accuracy.py --suite fedre            # FedRE / FedGH / FedProto
    python benchmarks/accuracy.py --suite all --dry-run    # list what would run
    python benchmarks/tables.py                            # tables + plots from the runs
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cli.launch import Scalar, run_simulation  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
ROUNDS = 30

REGIMES: dict[str, dict] = {
    "scarce": {
        "clients": 50,
        "seeds": (0, 1, 2),
        "config": {"data.fraction": 0.2, "data.alpha": 0.5},
    },
    "practical": {
        "clients": 20,
        "seeds": (0,),
        "config": {"data.fraction": 1.0, "data.alpha": 0.1},
    },
}


@dataclass(frozen=True)
class Spec:
    """One benchmark row: a name, its overrides, the regimes it runs in."""

    name: str
    overrides: dict[str, Scalar] = field(default_factory=dict)
    regimes: tuple[str, ...] = ("scarce", "practical")


BASELINES = [Spec("local", {"algorithm": "local"}), Spec("lgfedavg", {"algorithm": "lgfedavg"})]
SUITES: dict[str, list[Spec]] = {
    "fedre": [
        Spec("fedre", {"algorithm": "fedre"}),
        Spec("fedgh", {"algorithm": "fedgh"}),
        Spec("fedproto", {"algorithm": "fedproto"}),
    ],
    "fedara": [
        Spec("fedara", {"algorithm": "fedara"}),
        Spec(
            "fedara-star",
            {
                "algorithm": "fedara",
                "model.family": "fedavgcnn",
                "fedara.rank-tiers": "0.5",
                "fedara.lambda": 10.0,
            },
        ),
        *(
            Spec(
                f"fedara-lambda{lam:g}", {"algorithm": "fedara", "fedara.lambda": lam}, ("scarce",)
            )
            for lam in (0.0, 1.0, 10.0)
        ),
        # the same without low-rank tiers: what the factorisation itself costs
        Spec("fedara-tiers1", {"algorithm": "fedara", "fedara.rank-tiers": "1"}, ("scarce",)),
    ],
    "fedlora": [
        Spec("fedlora", {"algorithm": "fedlora"}),
        *(
            Spec(f"fedlora-rank{r}", {"algorithm": "fedlora", "fedlora.rank": r}, ("scarce",))
            for r in (2, 32)
        ),
    ],
}


def run_dir(regime: str, name: str, seed: int) -> Path:
    return OUT / regime / name / f"seed{seed}"


def complete(path: Path) -> bool:
    try:
        doc = json.loads((path / "results.json").read_text())
        return len(doc["rounds"]) == ROUNDS and doc["summary"]["wall-time-s"] > 0
    except (OSError, ValueError, KeyError):
        return False


def plan(suites: list[str], regimes: list[str]) -> list[tuple[str, Spec, int]]:
    specs = list(BASELINES)
    for suite in suites:
        specs += SUITES[suite]
    todo = []
    for regime in regimes:
        for seed in REGIMES[regime]["seeds"]:
            todo += [(regime, s, seed) for s in specs if regime in s.regimes]
    return todo


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--suite", default="all", choices=["all", *SUITES])
    ap.add_argument("--regime", default="all", choices=["all", *REGIMES])
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    suites = list(SUITES) if args.suite == "all" else [args.suite]
    regimes = list(REGIMES) if args.regime == "all" else [args.regime]
    failures = 0
    for regime, spec, seed in plan(suites, regimes):
        out = run_dir(regime, spec.name, seed)
        if complete(out):
            continue
        overrides: dict[str, Scalar] = {
            "num-server-rounds": ROUNDS,
            "seed": seed,
            "out-dir": str(out),
            **REGIMES[regime]["config"],
            **spec.overrides,
        }
        print(f"{time.strftime('%H:%M:%S')} {regime:9s} {spec.name:18s} seed {seed}", flush=True)
        if args.dry_run:
            continue
        outcome = run_simulation(
            ROOT,
            overrides,
            num_supernodes=REGIMES[regime]["clients"],
            flwr_home=OUT / ".flwr",
            timeout=4 * 3600,
        )
        if not outcome.ok:
            failures += 1
            print(f"  FAILED: {outcome.status} (log: {outcome.log_path})", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
