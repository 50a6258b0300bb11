"""Does this code still give the archived rows? Rerun each archived run's recorded
config for a few rounds and compare every client's accuracy with the archive's.

    python -m benchmarks.reproduce                       # every shown row, its first seed
    python -m benchmarks.reproduce --rounds 2 --only fedgh,fedara --regime scarce
    python -m benchmarks.reproduce --provenance-only     # only the archiving commits
    python -m benchmarks.reproduce --avx2 scarce/fedgh/seed1.json.gz  # one run, AVX2

A key added after a run was made takes the value that run had (``ADDED`` of
``benchmarks/results_page.py``, as the tables assume). Writes
``docs/results/reproduced.json`` (merged with what it holds):

- ``runs[path]["archived-in"]``: for every archived run that did not record its code
  (``versions.source``), the last commit that added or changed its file (git history,
  following renames): the run was made by the code of that time, committed or not;
- ``runs[path]["check"]``: for the runs rerun here, the code that reran them
  (``source``, ``git-commit``) and the machine (``machine``), how many rounds were
  compared, ``same-rounds`` (the leading rounds whose every client accuracy equals the
  archive's to the last digit) and ``first-difference`` (round, how many clients
  differ, the largest difference, the round's accuracy archived and now), or ``null``;
  ``runs[path]["check-avx2"]``: the same with ``--avx2``, AVX2 kernels on this machine.

The last digits depend on the code and on the CPU kernels torch runs (see
``tests/test_reference.py``): a rerun that differs says "not this code on this
machine", not which of the two moved. The tables (``python -m benchmarks.tables``)
say for every row what was found.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.results_page import ADDED, ARCHIVE, DOCS, archive_key, entries, spec_of
from benchmarks.suites import REGIMES, ROOT
from cli.launch import Scalar, run_simulation
from common.provenance import code_identity, recorded

REPRODUCED = DOCS / "reproduced.json"
AVX2 = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}
"""Environment that makes torch (and oneDNN, MKL) run AVX2 kernels on an AVX512 machine:
another machine's last digits, emulated (``--avx2``)."""


def load_archived(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(gzip.decompress(path.read_bytes()))
    return doc


def recorded_code(path: Path) -> bool:
    """The archived run recorded the code that made it (``versions.source``)."""
    return bool(recorded(path).get("source"))


def archived_in(path: Path, root: Path = ROOT) -> str | None:
    """The last commit that added or changed ``path`` (renames followed), or None
    outside a git checkout."""
    try:
        done = subprocess.run(
            [
                "git",
                "-C",
                str(root),
                "log",
                "-1",
                "--follow",
                "--diff-filter=AM",
                "--format=%H",
                "--",
                str(path.relative_to(root)),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError:
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def compare(archived: list[dict[str, Any]], rerun: list[dict[str, Any]]) -> dict[str, Any]:
    """Leading rounds whose per-client accuracies are equal, and the first that is not."""
    same = 0
    for old, new in zip(archived, rerun, strict=False):
        a, b = old.get("client-accuracy") or {}, new.get("client-accuracy") or {}
        differ = sorted(set(a) ^ set(b)) + [k for k in a if k in b and a[k] != b[k]]
        if not differ:
            same += 1
            continue
        shared = [k for k in a if k in b]
        return {
            "same-rounds": same,
            "first-difference": {
                "round": old.get("round", same + 1),
                "clients": len(differ),
                "max-abs": max((abs(a[k] - b[k]) for k in shared), default=None),
                "accuracy": [old.get("accuracy"), new.get("accuracy")],
            },
        }
    return {"same-rounds": same, "first-difference": None}


def check(
    path: Path,
    regime: str,
    rounds: int,
    work: Path,
    keep: Path | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    doc = load_archived(path)
    # keys added after the run take the value that run had (what the tables assume)
    recorded = {**ADDED, **doc["config"]}
    cfg: dict[str, Scalar] = {k: v for k, v in recorded.items() if k not in ("out-dir", "resume")}
    cfg["num-server-rounds"] = rounds
    cfg["out-dir"] = str(work / "out")
    started = time.perf_counter()
    outcome = run_simulation(
        ROOT,
        cfg,
        num_supernodes=REGIMES[regime]["clients"],
        flwr_home=work / "flwr",
        timeout=3600,
        extra_env=env,
    )
    wall = round(time.perf_counter() - started, 1)
    result: dict[str, Any] = {"rounds": rounds, "wall-s": wall, "kernel-env": env or {}}
    if not outcome.ok:
        identity = code_identity()
        return {
            **result,
            **{k: identity.get(k) for k in ("source", "git-commit", "git-dirty")},
            "error": f"run {outcome.status} (log {outcome.log_path})",
        }
    rerun = json.loads((work / "out" / "results.json").read_text())
    if keep is not None:  # the rerun's results.json, for a closer look
        dest = keep / archive_key(path).removesuffix(".gz")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(work / "out" / "results.json", dest)
    versions = rerun.get("versions", {})  # the code that ran, as the ServerApp recorded it
    result.update({k: versions.get(k) for k in ("source", "git-commit", "git-dirty", "machine")})
    return {**result, **compare(doc["rounds"][:rounds], rerun["rounds"])}


def shown_runs(regimes: list[str], only: list[str] | None) -> list[tuple[str, Path]]:
    """(regime, path of the row's first shown seed) for every row in the tables."""
    todo = []
    for regime in regimes:
        for folder in sorted((ARCHIVE / regime).iterdir()):
            if only and folder.name not in only:
                continue
            try:
                spec_of(folder.name)
            except StopIteration:
                continue  # a row no suite has any more: not shown
            shown = entries(regime, folder.name)
            if shown:
                todo.append((regime, Path(shown[0].run.path)))
    return todo


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--regime", default="all", choices=["all", *REGIMES])
    ap.add_argument("--only", default="", help="comma list of row names")
    ap.add_argument("--provenance-only", action="store_true")
    ap.add_argument("--skip-checked", action="store_true", help="leave rows already rerun")
    ap.add_argument("--keep", type=Path, help="copy each rerun's results.json under this folder")
    ap.add_argument(
        "--avx2",
        action="store_true",
        help="rerun with AVX2 kernels (recorded as check-avx2): another machine, emulated",
    )
    ap.add_argument("--out", type=Path, default=REPRODUCED)
    ap.add_argument(
        "runs", nargs="*", help="archived runs to rerun (paths under docs/results/archive)"
    )
    args = ap.parse_args()
    doc: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}
    runs: dict[str, dict[str, Any]] = doc.setdefault("runs", {})
    unrecorded = set()
    for path in sorted(ARCHIVE.glob("*/*/*.json.gz")):
        if path.parts[-3] == "fleet" or recorded_code(path):
            continue
        key = archive_key(path)
        unrecorded.add(key)
        runs.setdefault(key, {})["archived-in"] = archived_in(path)
    for key in set(runs) - unrecorded:  # archived again with its code, or removed:
        del runs[key]  # what was found about the old file no longer applies
    args.out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    if args.provenance_only:
        return 0
    regimes = list(REGIMES) if args.regime == "all" else [args.regime]
    only = [n for n in args.only.split(",") if n] or None
    failures = 0
    todo = [(Path(r).parts[0], ARCHIVE / r) for r in args.runs] or shown_runs(regimes, only)
    for regime, path in todo:
        if recorded_code(path):
            continue  # a run that records its code needs no rerun to say which made it
        key = archive_key(path)
        slot = "check-avx2" if args.avx2 else "check"
        if args.skip_checked and slot in runs.get(key, {}):
            continue
        print(f"{time.strftime('%H:%M:%S')} {key}", flush=True)
        with tempfile.TemporaryDirectory(prefix="reproduce-") as tmp:
            result = check(
                path, regime, args.rounds, Path(tmp), args.keep, AVX2 if args.avx2 else None
            )
        print(f"  {json.dumps(result)}", flush=True)
        failures += "error" in result
        runs.setdefault(key, {})[slot] = result
        args.out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
