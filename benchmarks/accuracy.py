"""Accuracy benchmarks on Fashion-MNIST in the two regimes of the README.

Every run is a real ``flwr run`` simulation (the same path as ``fedhet simulate``).
A run whose ``results.json`` is complete, or whose archived copy under
``docs/results/archive`` was made with the row's current settings, is skipped
(``--rerun`` runs it again); an interrupted one (its checkpoint
and its clients' personal models on disk) is resumed where it stopped.

    python -m benchmarks.accuracy --suite fedre            # FedRE / FedGH / FedProto
    python -m benchmarks.accuracy --suite all --dry-run    # list what would run
    python -m benchmarks.accuracy --only fedara,local --seeds 0 --regime scarce
    python -m benchmarks.tables                            # tables + plots from the runs

The rows (regimes, suites) are in ``benchmarks/suites.py``.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

from benchmarks.suites import BASELINES, OUT, REGIMES, ROOT, ROUNDS, SUITES, Spec, complete
from cli.launch import Scalar, run_simulation


def run_dir(regime: str, name: str, seed: int, out: Path = OUT) -> Path:
    return out / regime / name / f"seed{seed}"


def resumable(path: Path) -> bool:
    """An interrupted run that can continue where it stopped: a checkpoint, and the
    clients' personal models (removed once a run completes)."""
    return (path / "checkpoint.pt").exists() and (path / "clients").is_dir()


def plan(
    suites: list[str],
    regimes: list[str],
    only: list[str] | None = None,
    seeds: list[int] | None = None,
) -> list[tuple[str, Spec, int]]:
    """(regime, row, seed) to run: seed-major, so every row gets seed 0 first."""
    specs = list(BASELINES)
    for suite in suites:
        specs += SUITES[suite]
    if only:
        specs = [s for s in specs if s.name in only]
        unknown = set(only) - {s.name for s in specs}
        if unknown:
            raise SystemExit(f"unknown rows {sorted(unknown)}")
    todo = []
    for regime in regimes:
        for seed in REGIMES[regime]["seeds"]:
            if seeds is None or seed in seeds:
                todo += [(regime, s, seed) for s in specs if regime in s.regimes]
    return todo


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--suite", default="all", choices=["all", *SUITES])
    ap.add_argument("--regime", default="all", choices=["all", *REGIMES])
    ap.add_argument("--only", default="", help="comma list of row names")
    ap.add_argument("--seeds", default="", help="comma list of seeds (default: the regime's)")
    ap.add_argument("--out", type=Path, default=OUT, help="where runs are written")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument(
        "--rerun", action="store_true", help="run rows whose current run is already archived"
    )
    args = ap.parse_args()
    from benchmarks.results_page import entries

    suites = list(SUITES) if args.suite == "all" else [args.suite]
    regimes = list(REGIMES) if args.regime == "all" else [args.regime]
    only = [n for n in args.only.split(",") if n] or None
    seeds = [int(x) for x in args.seeds.split(",") if x] or None
    failures = 0
    for regime, spec, seed in plan(suites, regimes, only, seeds):
        out = run_dir(regime, spec.name, seed, args.out)
        if complete(out):
            continue
        if not args.rerun and any(e.seed == seed for e in entries(regime, spec.name)):
            continue  # archived, with the settings the row has now
        overrides: dict[str, Scalar] = {
            "num-server-rounds": ROUNDS,
            "seed": seed,
            "out-dir": str(out),
            **REGIMES[regime]["config"],
            **spec.overrides,
        }
        resumed = resumable(out)
        if resumed:
            overrides["resume"] = str(out.resolve())
        print(
            f"{time.strftime('%H:%M:%S')} {regime:9s} {spec.name:18s} seed {seed}"
            + (" (resumed)" if resumed else ""),
            flush=True,
        )
        if args.dry_run:
            continue
        outcome = run_simulation(
            ROOT,
            overrides,
            num_supernodes=REGIMES[regime]["clients"],
            flwr_home=args.out / ".flwr",
            timeout=4 * 3600,
        )
        if not outcome.ok:
            failures += 1
            print(f"  FAILED: {outcome.status} (log: {outcome.log_path})", flush=True)
            continue  # its checkpoint and personal models let the next call resume it
        # the clients' personal models (hundreds of MB per run) are not needed any more
        shutil.rmtree(out / "clients", ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
