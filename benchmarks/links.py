"""Rounds over real links: round trips per node-round, rounds limited by bytes, requests.

A loopback federation (``cli.federation.Federation``: SuperLink + 2 SuperNodes with
their warm executors, TLS + node authentication) whose nodes each reach the SuperLink
through a link proxy (``cli/linkproxy.py``): a one-way delay each way and, for the
bytes rows, a rate. Workloads: ``fedavg`` (the whole CNN-1 goes down and comes back
up every round) and ``lgfedavg`` (only the head), Fashion-MNIST ``data.fraction``
(iid), ``--rounds`` rounds, every node trains and is evaluated every round.

* **Round trips per node-round**: the median round time (rounds 2..R) at round-trip
  times 0, 100 and 400 ms (no rate limit); the slope of a least-squares line through
  them (seconds of round per second of round-trip time) is the number of round trips
  on a round's critical path. Both nodes work in parallel, so it is one node's count.
* **Bytes**: the same at 10 Mbit/s each way (no delay) against the unlimited row at
  the same delay: the seconds a round's bytes take, against the bytes each node's
  proxy carried per node-round (both ways, TLS and HTTP included) at that rate.
* **Requests**: the SuperLink's requests per node-round by kind (its counting
  middleware from ``benchmarks/server_cost.py``), and the TCP connections each node
  opened per node-round (its proxy's count).

Variants (``--variants``) set the environment of the federation's processes: how the
SuperNodes and the ServerApp move objects and when a task starts (``VARIANTS``), to
measure what each cut gives. ``--eval-modes`` runs each with ``eval-mode`` set.

    python -m benchmarks.links [--algorithms lgfedavg,fedavg] [--rtts 0,100,400]
        [--rate-mbps 10] [--rounds 6] [--variants fedhet] [--eval-modes with-train]
        [--out benchmarks/out/links.json] [--append] [--archive] [--tables-only]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.cgroups import CpuLimit
from benchmarks.probe import archive_rows, save_rows
from benchmarks.server_cost import CountingFederation, read_counts, request_kind
from cli.launch import descendants
from cli.linkproxy import Link

ROOT = Path(__file__).resolve().parent.parent
FASHION = Path("/usr/share/datasets/fashion-mnist")
NODES = 2
SHARES = 8192
"""``cpu.shares`` of the cgroup every process of the federation runs in (the kernel's
default is 1024): other work on the machine must not decide the round times."""
BEFORE = {
    "FEDHET_OBJECT_CONCURRENCY": "flower",
    "FEDHET_EARLY_TASK": "0",
    "FEDHET_CONFIRM_ALONG": "0",
    "FEDHET_WARM_CONNECTIONS": "0",
}
VARIANTS: dict[str, dict[str, str]] = {
    # fedhet before the cuts: Flower's object transfers (2 at once, at most the cores),
    # the confirmation before the task, the task once the objects are in, connections
    # opened by the requests that need them
    "before": BEFORE,
    "objects": {**BEFORE, "FEDHET_OBJECT_CONCURRENCY": ""},
    "confirm": {**BEFORE, "FEDHET_OBJECT_CONCURRENCY": "", "FEDHET_CONFIRM_ALONG": ""},
    "early": {"FEDHET_WARM_CONNECTIONS": "0"},
    "fedhet": {},
}
"""Environment of each variant's processes (an empty value: the default)."""


def data_overrides(fraction: float) -> dict[str, Any]:
    name = "fashion-mnist" if FASHION.exists() else "synthetic"
    return {"data.name": name, "data.fraction": fraction, "data.partition": "iid"}


def has_eval_mode() -> bool:
    """Whether this tree's run-config knows ``eval-mode``."""
    import tomllib

    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return "eval-mode" in doc["tool"]["flwr"]["app"]["config"]


def run_overrides(
    algorithm: str, rounds: int, fraction: float, out: Path, cache: Path, eval_mode: str
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "algorithm": algorithm,
        "num-server-rounds": rounds,
        "round-timeout": 900.0,
        "out-dir": str(out),
        "data.cache-dir": str(cache),
        "train.num-threads": 1,
        **data_overrides(fraction),
    }
    if algorithm == "fedavg":
        config["model.family"] = "cnn-1"  # one model for all: CNN-1 whole, both ways
    if eval_mode:
        config["eval-mode"] = eval_mode
    return config


class LinkFederation(CountingFederation):
    """A counting federation whose link proxies also trace each request and response
    line into ``<workdir>/logs/link-<i>.trace`` (with ``trace``; plain HTTP only)."""

    trace = False

    def link_command(self, i: int) -> list[str]:
        cmd = super().link_command(i)
        if self.trace:
            cmd += ["--trace", str(self.workdir / "logs" / f"link-{i}.trace")]
        return cmd


def read_link(path: Path) -> dict[str, int]:
    try:
        return {k: int(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError):
        return {}


def links_total(fed: LinkFederation) -> dict[str, int]:
    """What every node's proxy carried so far (its stats file is written every 0.5 s)."""
    time.sleep(0.7)
    out: dict[str, int] = {}
    for i in fed.link_ports:
        for k, v in read_link(fed.workdir / "logs" / f"link-{i}.json").items():
            out[k] = out.get(k, 0) + v
    return out


def measure(
    *,
    variant: str,
    eval_mode: str,
    algorithm: str,
    rtt_ms: float,
    rate_mbps: float | None,
    rounds: int,
    fraction: float,
    work: Path,
    cache: Path,
    trace: Path | None = None,
    shares: int | None = SHARES,
) -> dict[str, Any]:
    """One federation, one run; per-round times and per node-round counts. With
    ``trace`` (a folder): no TLS, and the proxies' request traces are copied there."""
    env = VARIANTS[variant]
    tag = f"{variant}-{eval_mode or 'default'}-{algorithm}-{rtt_ms:g}-{rate_mbps or 0:g}"
    link = Link(rtt_ms / 2, rate_mbps, rate_mbps)
    configs = [{"partition-id": i, "num-partitions": NODES} for i in range(NODES)]
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        fed = LinkFederation(
            work / f"fed-{tag}", configs, ROOT, secure=trace is None, links=[link] * NODES
        )
        fed.trace = trace is not None
        out = work / f"run-{tag}"
        with CpuLimit(None, shares=shares) as group, fed:
            # every process of the federation (its children inherit the group)
            group.add(
                p for proc in fed.procs.procs.values() for p in (proc.pid, *descendants(proc.pid))
            )
            l0, r0 = links_total(fed), read_counts(fed.counts_path)
            t0 = time.monotonic()
            outcome = fed.run(
                run_overrides(algorithm, rounds, fraction, out, cache, eval_mode), timeout=3600
            )
            wall = time.monotonic() - t0
            l1, r1 = links_total(fed), read_counts(fed.counts_path)
        if trace is not None:
            trace.mkdir(parents=True, exist_ok=True)
            for i in fed.link_ports:
                path = fed.workdir / "logs" / f"link-{i}.trace"
                if path.exists():
                    shutil.copy(path, trace / f"{tag}-node{i}.trace")
            shutil.copy(out / "results.json", trace / f"{tag}-results.json")
            shutil.copytree(fed.workdir / "logs", trace / f"{tag}-logs", dirs_exist_ok=True)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if not outcome.ok:
        tail = outcome.log_path.read_text(errors="replace")[-3000:]
        raise SystemExit(f"{tag}: run {outcome.status}:\n{tail}")
    res = json.loads((out / "results.json").read_text())
    times = [r["round-time-s"] for r in res["rounds"]]
    overheads = [
        r["round-time-s"]
        - max((c.get("train-time-s") or 0.0 for c in r["client-train"].values()), default=0.0)
        for r in res["rounds"]
    ]
    node_rounds = NODES * rounds
    requests = {
        request_kind(k): (r1.get(k, 0) - r0.get(k, 0)) / node_rounds
        for k in sorted(set(r1) | set(r0))
        if r1.get(k, 0) - r0.get(k, 0)
    }
    return {
        "variant": variant,
        "env": env,
        "eval-mode": eval_mode or None,
        "algorithm": algorithm,
        "rtt-ms": rtt_ms,
        "rate-mbps": rate_mbps,
        "rounds": rounds,
        "nodes": NODES,
        "run-wall-s": wall,
        "cpu-shares": shares,
        "load-average-1min": os.getloadavg()[0],
        "round-time-s": times,
        "median-round-s": statistics.median(times[1:] or times),
        "round-overhead-s": overheads,
        "median-overhead-s": statistics.median(overheads[1:] or overheads),
        "array-bytes-per-node-round": {
            "up": res["summary"]["bytes-up-total"] / node_rounds,
            "down": res["summary"]["bytes-down-total"] / node_rounds,
        },
        "wire-per-node-round": {k: (l1.get(k, 0) - l0.get(k, 0)) / node_rounds for k in l1},
        "requests-per-node-round": requests,
    }


# ---------------------------------------------------------------------- summary
def slope(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of y against x (None: fewer than two distinct x)."""
    xs = [x for x, _ in points]
    if len(set(xs)) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(y for _, y in points)
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)


def summarise(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per (variant, eval-mode, algorithm): round trips per node-round (the slope),
    the bytes-limited round against its prediction, requests per node-round."""
    groups: dict[tuple[str, str, str], list[Mapping[str, Any]]] = {}
    for row in rows:
        key = (row["variant"], row["eval-mode"] or "", row["algorithm"])
        groups.setdefault(key, []).append(row)
    out = []
    for (variant, mode, algorithm), group in groups.items():
        free = sorted(
            (r for r in group if r["rate-mbps"] is None), key=lambda r: float(r["rtt-ms"])
        )
        points = [(r["rtt-ms"] / 1e3, r["median-round-s"]) for r in free]
        beyond = [(r["rtt-ms"] / 1e3, r["median-overhead-s"]) for r in free]
        item: dict[str, Any] = {
            "variant": variant,
            "eval-mode": mode or None,
            "algorithm": algorithm,
            "median-round-s-by-rtt-ms": {f"{r['rtt-ms']:g}": r["median-round-s"] for r in free},
            "median-overhead-s-by-rtt-ms": {
                f"{r['rtt-ms']:g}": r["median-overhead-s"] for r in free
            },
            "round-trips-per-node-round": slope(beyond),
            "round-trips-from-round-times": slope(points),
        }
        zero = next((r for r in free if r["rtt-ms"] == 0), None)
        if zero is not None:
            item["requests-per-node-round"] = zero["requests-per-node-round"]
            item["connections-per-node-round"] = zero["wire-per-node-round"].get("connections")
        for r in group:
            rate = r["rate-mbps"]
            same = next((f for f in free if f["rtt-ms"] == r["rtt-ms"]), None)
            if rate is None or same is None:
                continue
            wire = r["wire-per-node-round"]
            item["bytes-limited"] = {
                "rate-mbps": rate,
                "rtt-ms": r["rtt-ms"],
                "median-round-s": r["median-round-s"],
                "unlimited-round-s": same["median-round-s"],
                "extra-s": r["median-round-s"] - same["median-round-s"],
                "wire-bytes-up": wire.get("bytes-up", 0),
                "wire-bytes-down": wire.get("bytes-down", 0),
                "wire-s-at-rate": (wire.get("bytes-up", 0) + wire.get("bytes-down", 0))
                * 8
                / (rate * 1e6),
                "array-bytes": r["array-bytes-per-node-round"],
            }
        out.append(item)
    order = list(VARIANTS)
    out.sort(
        key=lambda i: (
            order.index(i["variant"]) if i["variant"] in order else len(order),
            i["eval-mode"] or "",
            i["algorithm"],
        )
    )
    return out


def describe(rows: Sequence[Mapping[str, Any]]) -> str:
    """What the rows were measured on (the text above the tables)."""
    first = rows[0]
    loads = [r["load-average-1min"] for r in rows if r.get("load-average-1min") is not None]
    load = f" (load average {min(loads):.1f}-{max(loads):.1f})" if loads else ""
    variants = sorted({r["variant"] for r in rows})
    return (
        "`python -m benchmarks.links`: a loopback federation (TLS + node auth, warm "
        f"executors) of {first['nodes']} SuperNodes, each behind a link proxy "
        "(`cli/linkproxy.py`); `lgfedavg` (the head goes down and up) and `fedavg` with "
        "CNN-1 (the whole model, 8.2 MB each way), Fashion-MNIST `data.fraction=0.05` "
        f"iid, {first['rounds']} rounds, every node trains and is evaluated every round; "
        "the federation's processes in a cgroup with `cpu.shares` "
        f"{first.get('cpu-shares') or 1024} on this 2-core machine{load}. Round trips per "
        "node-round: the slope of the median round time beyond the slowest node's "
        "training (rounds 2..R) against the round-trip time (0, 100, 400 ms; the slope of "
        "the whole round time next to it); bytes: the round at 10 Mbit/s each way against "
        "the unlimited one, and what the proxies carried per node-round. Variants: "
        + ", ".join(f"`{v}`" for v in variants)
        + " (`before`: Flower's object transfers, 2 at once, and the task after its "
        "message's confirmation; `objects`: 16 objects at once; `confirm`: and the "
        "confirmation sent along with the task; `early`: and the task started as soon "
        "as its message is stored; `fedhet`: and the connections opened ahead, the "
        "defaults)."
    )


def table(summary: Sequence[Mapping[str, Any]]) -> str:
    rtts = sorted({k for i in summary for k in i["median-round-s-by-rtt-ms"]}, key=float)
    head = (
        "| variant | eval-mode | algorithm | median round s at RTT " + " / ".join(rtts) + " ms "
        "| round trips per node-round (from the round's time beyond training; from the "
        "round time) | at 10 Mbit/s: round s (extra) | bytes per "
        "node-round, down / up (wire) | their time at the rate | connections per "
        "node-round | SuperLink requests per node-round |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for s in summary:
        by = s["median-round-s-by-rtt-ms"]
        times = " / ".join(f"{by[k]:.2f}" if k in by else "-" for k in rtts)
        trips = s["round-trips-per-node-round"]
        whole = s.get("round-trips-from-round-times")
        b = s.get("bytes-limited")
        limited = f"{b['median-round-s']:.2f} (+{b['extra-s']:.2f})" if b else "-"
        sizes = (
            f"{b['wire-bytes-down'] / 1e6:.2f} / {b['wire-bytes-up'] / 1e6:.2f} MB" if b else "-"
        )
        at_rate = f"{b['wire-s-at-rate']:.2f} s" if b else "-"
        conns = s.get("connections-per-node-round")
        reqs = s.get("requests-per-node-round") or {}
        lines.append(
            f"| {s['variant']} | {s['eval-mode'] or '-'} | {s['algorithm']} | {times} | "
            f"{'-' if trips is None else f'{trips:.1f}'}; "
            f"{'-' if whole is None else f'{whole:.1f}'} | {limited} | {sizes} | {at_rate} | "
            f"{'-' if conns is None else f'{conns:.1f}'} | "
            f"{sum(v for k, v in reqs.items() if k.startswith('fleet/')):.1f} |"
        )
    return head + "\n".join(lines) + "\n"


def requests_table(summary: Sequence[Mapping[str, Any]]) -> str:
    """Fleet requests per node-round by kind, one column per summary row (RTT 0)."""
    kinds = sorted(
        {k for s in summary for k in s.get("requests-per-node-round", {}) if k.startswith("fleet/")}
    )
    names = [f"{s['variant']} {s['eval-mode'] or ''} {s['algorithm']}".strip() for s in summary]
    lines = ["| kind | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for kind in kinds:
        cells = [f"{s.get('requests-per-node-round', {}).get(kind, 0):.2f}" for s in summary]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--algorithms", default="lgfedavg,fedavg")
    ap.add_argument("--rtts", default="0,100,400", help="round-trip times, ms")
    ap.add_argument("--rate-mbps", type=float, default=10.0, help="0: no bytes rows")
    ap.add_argument("--rate-rtt-ms", type=float, default=0.0, help="the bytes rows' RTT")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--fraction", type=float, default=0.05, help="data.fraction")
    ap.add_argument("--variants", default="fedhet", help=f"of {', '.join(VARIANTS)}")
    ap.add_argument(
        "--eval-modes", default="", help="comma list of eval-mode values (empty: the default)"
    )
    ap.add_argument(
        "--shares",
        type=int,
        default=SHARES,
        help="cpu.shares of the federation's cgroup (0: the kernel's default group)",
    )
    ap.add_argument(
        "--trace", type=Path, default=None, help="no TLS; keep request traces in this folder"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/out/links.json")
    ap.add_argument("--append", action="store_true", help="keep --out's other rows")
    ap.add_argument("--tables-only", action="store_true", help="run nothing: --out's tables")
    ap.add_argument(
        "--archive", action="store_true", help="also write docs/results/<--out's name>.{json,md}"
    )
    args = ap.parse_args()
    if args.tables_only:
        rows = json.loads(args.out.read_text())["rows"]
    else:
        if shutil.which("flower-superlink") is None:
            os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
        variants = [v for v in args.variants.split(",") if v]
        if unknown := [v for v in variants if v not in VARIANTS]:
            raise SystemExit(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
        modes = [m for m in args.eval_modes.split(",") if m] or [""]
        if modes != [""] and not has_eval_mode():
            raise SystemExit("--eval-modes: this tree's run-config has no eval-mode")
        rtts = [float(r) for r in args.rtts.split(",") if r]
        plan: list[tuple[float, float | None]] = [(r, None) for r in rtts]
        if args.rate_mbps > 0:
            plan.append((args.rate_rtt_ms, args.rate_mbps))
        rows = []
        if args.append and args.out.exists():
            rows = json.loads(args.out.read_text())["rows"]
        with tempfile.TemporaryDirectory(prefix="fedhet-links-") as tmp:
            work = Path(tmp)
            for variant in variants:
                for mode in modes:
                    for algorithm in [a for a in args.algorithms.split(",") if a]:
                        for rtt, rate in plan:
                            row = measure(
                                variant=variant,
                                eval_mode=mode,
                                algorithm=algorithm,
                                rtt_ms=rtt,
                                rate_mbps=rate,
                                rounds=args.rounds,
                                fraction=args.fraction,
                                work=work,
                                cache=work / "cache",
                                trace=args.trace,
                                shares=args.shares or None,
                            )
                            same = (variant, mode or None, algorithm, rtt, rate)
                            rows = [
                                r
                                for r in rows
                                if (
                                    r["variant"],
                                    r["eval-mode"],
                                    r["algorithm"],
                                    r["rtt-ms"],
                                    r["rate-mbps"],
                                )
                                != same
                            ]
                            rows.append(row)
                            save_rows(args.out, rows)
                            print(
                                f"{time.strftime('%H:%M:%S')} {variant} {mode or '-'} "
                                f"{algorithm} rtt {rtt:g} ms rate {rate or '-'}: median round "
                                f"{row['median-round-s']:.2f} s {row['round-time-s']}",
                                flush=True,
                            )
    summary = summarise(rows)
    text = describe(rows) + "\n\n" + table(summary) + "\n" + requests_table(summary)
    print(text)
    if args.archive:  # docs/results/<the --out file's name>.{json,md}
        archive_rows(args.out.stem, rows, text)


if __name__ == "__main__":
    main()
