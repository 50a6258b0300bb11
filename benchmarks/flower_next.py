"""fedhet on the next Flower: the gate, a simulation and `fedhet federation` warm and
cold, on the pinned Flower and on a newer one, in one table.

    python -m benchmarks.flower_next                       # newest flwr-nightly on the index
    python -m benchmarks.flower_next --flower 1.43.0.dev20261026
    python -m benchmarks.flower_next --flower 1.43.0 --release   # a release (flwr==)

The newer Flower goes into ``.venv-flower-next``: a copy of the project's ``.venv``
(hard links: no second 5 GB of torch) with only Flower replaced, as a user who upgrades
Flower has it. For each environment: ``python -m common.flower_gate`` (which parts of
fedhet's runtime changes fit), ``fedhet simulate``, ``fedhet federation`` (the warm
executor, the default) and ``fedhet federation --cold``, each 2 rounds of lgfedavg on 2
nodes (``data.fraction=0.1``); whether each completed (a bounded wait: a run that hangs
is stopped and reported), its median round time, and whether its per-round accuracies
equal the simulation's. Not part of ``.ci/run``: a Flower nightly must not stop
unrelated work from landing (``tests/test_flower_gate.py`` covers the gate itself).
Writes ``benchmarks/out/flower-next.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PINNED = ROOT / ".venv"
NEXT = ROOT / ".venv-flower-next"
CONFIG = "algorithm='lgfedavg' num-server-rounds=2 data.fraction=0.1"
NODES = 2
LIMIT_S = 600


def newest_nightly(python: Path) -> str:
    """The newest ``flwr-nightly`` the package index serves."""
    out = subprocess.run(
        [str(python), "-m", "pip", "index", "versions", "flwr-nightly"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for line in out.splitlines():
        if line.startswith("flwr-nightly ("):
            return line.split("(", 1)[1].split(")", 1)[0]
    raise SystemExit(f"no flwr-nightly version in `pip index versions`: {out[-500:]}")


def copy_venv(src: Path, dest: Path) -> None:
    """``src`` copied to ``dest`` with hard links (a copy where links fail), its
    scripts pointing at ``dest``."""
    if dest.exists():
        shutil.rmtree(dest)
    if subprocess.run(["cp", "-al", str(src), str(dest)]).returncode != 0:
        shutil.copytree(src, dest, symlinks=True)
    for path in [dest / "pyvenv.cfg", *(dest / "bin").iterdir()]:
        if path.is_symlink() or not path.is_file():
            continue
        data = path.read_bytes()
        if str(src).encode() in data[:4096]:
            path.unlink()  # a new file: the source's hard-linked one stays as it was
            path.write_bytes(data.replace(str(src).encode(), str(dest).encode()))
            path.chmod(0o755)


def make_next(version: str, release: bool) -> Path:
    """``.venv-flower-next`` with Flower ``version`` (nightly, or a release)."""
    copy_venv(PINNED, NEXT)
    python = NEXT / "bin" / "python"
    pip = [str(python), "-m", "pip", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, "uninstall", "-y", "flwr", "flwr-nightly"], check=False)
    name = "flwr" if release else "flwr-nightly"
    subprocess.run([*pip, "install", f"{name}[simulation]=={version}"], check=True)
    return python


def env_for(venv: Path, home: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        "VIRTUAL_ENV": str(venv),
        "FLWR_HOME": str(home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    }


def run_path(venv: Path, path: str, work: Path) -> dict[str, Any]:
    """One path (``simulation``, ``warm``, ``cold``) in ``venv``: completed, rounds."""
    out = work / f"out-{path}"
    config = f"{CONFIG} out-dir='{out}'"
    fedhet = str(venv / "bin" / "fedhet")
    if path == "simulation":
        cmd = [fedhet, "simulate", "-c", config, "--num-supernodes", str(NODES)]
    else:
        cmd = [fedhet, "federation", "--nodes", str(NODES), "--workdir", str(work / path)]
        cmd += ["-c", config] + (["--cold"] if path == "cold" else [])
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env_for(venv, work / f"flwr-home-{path}"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        text, _ = proc.communicate(timeout=LIMIT_S)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 15)
        try:
            text, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            text, _ = proc.communicate()
        code = None
    row: dict[str, Any] = {
        "path": path,
        "completed": code == 0,
        "exit": "hung (stopped)" if code is None else code,
        "wall-s": round(time.monotonic() - start, 1),
        "fedhet-lines": [line for line in text.splitlines() if line.startswith("fedhet:")],
    }
    results = out / "results.json"
    if results.exists():
        rounds = json.loads(results.read_text())["rounds"]
        row["round-time-s"] = statistics.median(r["round-time-s"] for r in rounds)
        row["accuracy"] = [r.get("accuracy") for r in rounds]
    if code != 0:
        row["tail"] = text.splitlines()[-15:]
    return row


def measure(venv: Path, paths: list[str]) -> dict[str, Any]:
    python = venv / "bin" / "python"
    gate = subprocess.run(
        [str(python), "-m", "common.flower_gate"], cwd=ROOT, capture_output=True, text=True
    )
    version = gate.stdout.splitlines()[0].removeprefix("flwr ") if gate.stdout else "?"
    with tempfile.TemporaryDirectory(prefix="fedhet-flower-next-") as tmp:
        rows = [run_path(venv, p, Path(tmp)) for p in paths]
    sim = next((r for r in rows if r["path"] == "simulation"), None)
    for row in rows:
        if sim is not None and "accuracy" in row and "accuracy" in sim:
            row["same-accuracy-as-simulation"] = row["accuracy"] == sim["accuracy"]
    return {"flower": version, "gate": gate.stdout.splitlines()[1:], "paths": rows}


def table(envs: list[dict[str, Any]]) -> str:
    lines = [
        "| Flower | path | completed | median round (s) | accuracy per round | = simulation |",
        "|---|---|---|---|---|---|",
    ]
    for env in envs:
        for r in env["paths"]:
            acc = ", ".join(f"{a:.4f}" for a in r.get("accuracy", []) if a is not None)
            same = {True: "yes", False: "no"}.get(r.get("same-accuracy-as-simulation"), "")
            done = "yes" if r["completed"] else f"no ({r['exit']})"
            rt = f"{r['round-time-s']:.1f}" if "round-time-s" in r else ""
            lines.append(f"| {env['flower']} | {r['path']} | {done} | {rt} | {acc} | {same} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flower", help="Flower version (default: newest flwr-nightly)")
    parser.add_argument("--release", action="store_true", help="--flower is a release (flwr==)")
    parser.add_argument("--reuse", action="store_true", help="keep .venv-flower-next as it is")
    parser.add_argument("--no-pinned", action="store_true", help="skip the pinned Flower")
    parser.add_argument("--paths", default="simulation,warm,cold")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/out/flower-next.json")
    args = parser.parse_args()
    paths = [p for p in args.paths.split(",") if p]
    if not (PINNED / "bin" / "python").exists():
        raise SystemExit("no .venv: run `bash scripts/test.sh` (or source scripts/setup.sh) first")
    if not args.reuse:
        version = args.flower or newest_nightly(PINNED / "bin" / "python")
        print(f"building {NEXT.name} with Flower {version} ...", flush=True)
        make_next(version, args.release)
    envs = [] if args.no_pinned else [measure(PINNED, paths)]
    envs.append(measure(NEXT, paths))
    print(table(envs))
    for env in envs:
        print(f"\ngate, flwr {env['flower']}:")
        print("\n".join(env["gate"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"date": time.strftime("%Y-%m-%d"), "config": CONFIG, "nodes": NODES, "envs": envs}
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    sys.exit(0 if all(r["completed"] for e in envs for r in e["paths"]) else 1)


if __name__ == "__main__":
    main()
