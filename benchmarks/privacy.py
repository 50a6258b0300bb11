"""What the server could reconstruct, per knowledge form, and the privacy/utility curve.

FedRE runs in the scarce regime (Fashion-MNIST ``data.fraction=0.2``, 50 clients,
Dirichlet 0.5, ``cnn`` family, 30 rounds, seeds 0-2), each audited with
``fedhet audit`` (``cli/audit.py``) on its first 20 clients: a white-box inversion of
each knowledge form (a raw representation, a class prototype, FedRE's entangled
representation, one sample's head gradient), PSNR / SSIM against the client's closest
training image and its class-mean image. Rows: no protection, then every uploaded
vector clipped to L2 norm ``CLIP`` with Gaussian noise σ = z·``CLIP``, z in {0, 0.5, 1, 2}
(``privacy.clip`` / ``privacy.noise``); accuracy against the reconstructions' PSNR.

    python -m benchmarks.privacy --out benchmarks/out/privacy.json
    python -m benchmarks.privacy --rows none,z1 --seeds 0   # a subset (runs are kept;
                                                            # other rows stay in --out)
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

from benchmarks.probe import task_identity
from benchmarks.suites import OUT, REGIMES, ROOT, ROUNDS, complete
from cli.launch import run_simulation

CLIP = 10.0
"""L2 bound of an uploaded vector: trained CNN prototypes here have norms of 10-21."""
ROWS: dict[str, dict[str, float]] = {
    "none": {},
    "z0": {"privacy.clip": CLIP},
    "z0.5": {"privacy.clip": CLIP, "privacy.noise": 0.5},
    "z1": {"privacy.clip": CLIP, "privacy.noise": 1.0},
    "z2": {"privacy.clip": CLIP, "privacy.noise": 2.0},
}
SEEDS = (0, 1, 2)
CLIENTS = 20


def run_dir(row: str, seed: int) -> Path:
    return OUT / "privacy" / row / f"seed{seed}"


def run(row: str, seed: int) -> Path:
    """The row's FedRE run (skipped when complete and its personal models are kept)."""
    out = run_dir(row, seed)
    if complete(out) and ((out / "audit.json").exists() or (out / "clients").is_dir()):
        return out  # audited, or its personal models kept for the audit
    regime = REGIMES["scarce"]
    overrides = {
        "algorithm": "fedre",
        "num-server-rounds": ROUNDS,
        "seed": seed,
        "out-dir": str(out),
        **regime["config"],
        **ROWS[row],
    }
    outcome = run_simulation(
        ROOT, overrides, num_supernodes=regime["clients"], flwr_home=OUT / ".flwr", timeout=4 * 3600
    )
    if not outcome.ok:
        raise SystemExit(f"privacy {row} seed {seed}: {outcome.status} ({outcome.log_path})")
    return out


def audit_run(out: Path, grid: Path | None) -> dict:
    """Audit a run's first clients (``<out>/audit.json``, ``audit.png``), then drop
    its personal models."""
    from cli.audit import audit, write_audit

    audit_file = out / "audit.json"
    if not audit_file.exists():
        _, png = write_audit(out, audit(out, clients=CLIENTS))
        if grid is not None:
            shutil.copyfile(png, grid)
        shutil.rmtree(out / "clients", ignore_errors=True)
    return dict(json.loads(audit_file.read_text()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=OUT / "privacy.json")
    ap.add_argument("--grid", type=Path, default=OUT / "privacy-grid.png")
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows")
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="comma-separated seeds")
    args = ap.parse_args()
    rows = [r for r in args.rows.split(",") if r]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown or "none" not in rows:
        raise SystemExit(f"--rows: unknown {unknown} (known {list(ROWS)}; 'none' is required)")
    task_identity()
    result: dict[str, dict] = {}
    for row in rows:
        seeds = []
        for seed in (int(s) for s in args.seeds.split(",") if s):
            out = run(row, seed)
            doc = audit_run(out, args.grid if (row, seed) == ("none", 0) else None)
            summary = json.loads((out / "results.json").read_text())["summary"]
            seeds.append({"seed": seed, "accuracy-last": summary["accuracy-last"], **doc})
            print(row, seed, summary["accuracy-last"], json.dumps(doc["summary"]), flush=True)
        forms = seeds[0]["summary"].keys()
        result[row] = {
            "overrides": ROWS[row],
            "seeds": [s["seed"] for s in seeds],
            "accuracy-last": [s["accuracy-last"] for s in seeds],
            "forms": {
                form: {
                    key: statistics.fmean(s["summary"][form][key] for s in seeds)
                    for key in ("psnr_closest", "ssim_closest", "psnr_class_mean")
                }
                | {"n": sum(s["summary"][form]["n"] for s in seeds)}
                for form in forms
            },
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.out.exists():  # rows not asked for this time keep what they had
        earlier = json.loads(args.out.read_text())
        if earlier.get("clip") == CLIP and earlier.get("clients") == CLIENTS:
            merged = {**earlier["rows"], **result}
            result = {k: merged[k] for k in ROWS if k in merged}
    args.out.write_text(json.dumps({"clip": CLIP, "clients": CLIENTS, "rows": result}, indent=1))


if __name__ == "__main__":
    main()
