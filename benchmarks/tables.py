"""README tables and plots from the runs of ``benchmarks/accuracy.py``.

    python benchmarks/tables.py            # print the tables, write docs/results/*.png
    python benchmarks/tables.py --readme   # also replace the README's results sections

Only complete runs are used; a row says how many seeds it has.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.accuracy import OUT, REGIMES, ROUNDS, complete  # noqa: E402
from common.report import Run, plot_accuracy  # noqa: E402

DOCS = ROOT / "docs" / "results"
SUITE_ROWS = {
    "fedre": ["fedre", "fedgh", "fedproto", "lgfedavg", "local"],
    "fedara": ["fedara", "fedara-star", "lgfedavg", "local"],
    "fedlora": ["fedlora", "lgfedavg", "local"],
}
ABLATIONS = {
    "fedara": (
        "λ, and all clients at full rank (scarce)",
        ["fedara-lambda0", "fedara-lambda1", "fedara", "fedara-lambda10", "fedara-tiers1"],
    ),
    "fedlora": ("rank (scarce)", ["fedlora-rank2", "fedlora", "fedlora-rank32"]),
}
LABELS = {
    "fedara": "fedara (tiers 1…1/16, λ=2)",
    "fedara-star": "FedARA* (fedavgcnn, r=0.5, λ=10)",
    "fedara-lambda0": "fedara λ=0",
    "fedara-lambda1": "fedara λ=1",
    "fedara-lambda10": "fedara λ=10",
    "fedara-tiers1": "fedara, every client at rank ratio 1 (no factorisation), λ=2",
    "fedlora": "fedlora (r=8)",
    "fedlora-rank2": "fedlora r=2",
    "fedlora-rank32": "fedlora r=32",
}
COMMAND = {
    suite: f"python benchmarks/accuracy.py --suite {suite} && python benchmarks/tables.py --readme"
    for suite in ("fedre", "fedara", "fedlora")
}


ARCHIVE = DOCS / "archive"
SUMMARY = DOCS / "accuracy-summary.json"


@dataclass(frozen=True)
class Entry:
    """One seed of one row: from an archived ``results.json`` or, failing that, its summary."""

    seed: int
    summary: dict[str, Any]
    up: float
    down: float
    train_time: float | None
    run: Run | None


def archive() -> int:
    """Copy complete runs from ``benchmarks/out`` into ``docs/results/archive`` (committed).

    Gzipped: Flower packs every ``.json`` under the app folder into each run's bundle.
    """
    copied = 0
    for path in sorted(OUT.glob("*/*/seed*")):
        if not complete(path):
            continue
        doc = json.loads((path / "results.json").read_text())
        keep = {k: doc[k] for k in ("config", "versions", "rounds", "summary") if k in doc}
        dest = ARCHIVE / path.parent.relative_to(OUT) / f"{path.name}.json.gz"
        data = json.dumps(keep, indent=1).encode()
        if dest.exists() and gzip.decompress(dest.read_bytes()) == data:
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(gzip.compress(data, mtime=0))
        copied += 1
    return copied


@functools.cache
def archived(regime: str, name: str) -> list[Run]:
    runs = []
    for path in sorted((ARCHIVE / regime / name).glob("seed*.json.gz")):
        doc = json.loads(gzip.decompress(path.read_bytes()))
        runs.append(Run(path, doc["config"], doc["rounds"], doc["summary"]))
    return runs


def mean_of_rounds(run: Run, key: str) -> float:
    vals = [r[key] for r in run.rounds if r.get(key) is not None]
    return statistics.fmean(vals) if vals else 0.0


@functools.cache
def previous_summaries() -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Per-seed summaries kept by an earlier call, for runs whose raw files are gone."""
    if not SUMMARY.exists():
        return {}
    found: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for per_regime in json.loads(SUMMARY.read_text()).values():
        for regime, rows in per_regime.items():
            for name, items in rows.items():
                if items and (regime, name) not in found:
                    found[(regime, name)] = items
    return found


def entries(regime: str, name: str) -> list[Entry]:
    """Every seed of a row; an archived run wins over a kept summary of the same seed."""
    out: dict[int, Entry] = {}
    seeds = REGIMES[regime]["seeds"]
    per_round = ROUNDS * REGIMES[regime]["clients"]
    kept = previous_summaries().get((regime, name), [])
    for i, item in enumerate(kept):
        if "seed" in item:
            seed = int(item["seed"])
        elif len(kept) == len(seeds):  # written in seed order, one per seed
            seed = seeds[i]
        else:
            continue
        up = item.get("bytes-up-per-client-round", item["bytes-up-total"] / per_round)
        down = item.get("bytes-down-per-client-round", item["bytes-down-total"] / per_round)
        summary = {k: v for k, v in item.items() if k != "seed" and "per-client" not in k}
        tt = item.get("client-train-time-s")
        out[seed] = Entry(seed, summary, up, down, tt, None)
    for run in archived(regime, name):
        seed = int(run.config["seed"])
        out[seed] = Entry(
            seed,
            run.summary,
            mean_of_rounds(run, "bytes-up-per-client"),
            mean_of_rounds(run, "bytes-down-per-client"),
            mean_of_rounds(run, "client-train-time-s"),
            run,
        )
    return [out[s] for s in sorted(out)]


def pm(values: list[float], fmt: str = "{:.4f}") -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.fmean(values))} ± {fmt.format(statistics.stdev(values))}"


def kb(n: float) -> str:
    return f"{n / 1024:.1f} KB" if n < 1024**2 else f"{n / 1024**2:.2f} MB"


def row(name: str, es: list[Entry], train_time: bool = False) -> str:
    last = [e.summary["accuracy-last"] for e in es]
    best = [e.summary["accuracy-best"] for e in es]
    up = statistics.fmean(e.up for e in es)
    down = statistics.fmean(e.down for e in es)
    cells = [LABELS.get(name, name), str(len(es)), pm(last), pm(best), kb(up), kb(down)]
    if train_time:
        times = [e.train_time for e in es if e.train_time is not None]
        note = "" if len(times) in (0, len(es)) else f" (seeds {len(times)})"
        cells.append(pm(times, "{:.2f}") + note)
    cells.append(pm([e.summary["wall-time-s"] for e in es], "{:.0f}"))
    return "| " + " | ".join(cells) + " |"


def table(regime: str, names: list[str], train_time: bool = False) -> str:
    head = [
        "method",
        "seeds",
        "accuracy (last)",
        "accuracy (best)",
        "up / client / round",
        "down / client / round",
    ]
    if train_time:
        head.append("client train time / round (s)")
    head.append("wall time (s)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in names:
        es = entries(regime, name)
        if es:
            lines.append(row(name, es, train_time))
    return "\n".join(lines)


def regime_title(regime: str) -> str:
    r = REGIMES[regime]
    cfg = r["config"]
    return (
        f"*{regime}*: Fashion-MNIST, `data.fraction={cfg['data.fraction']}`, "
        f"{r['clients']} clients, Dirichlet α={cfg['data.alpha']}, `cnn` family, "
        f"30 rounds, seeds {', '.join(map(str, r['seeds']))}"
    )


def plot(suite: str, regime: str, names: list[str]) -> tuple[Path | None, list[str]]:
    """The suite's accuracy-vs-round plot from the archived runs, and the rows it lacks.

    A plot is kept as it is when the suite's own method has no archived run (its
    curves could not be drawn again)."""
    path = DOCS / f"{suite}-{regime}.png"
    rows = {n: entries(regime, n) for n in names}
    if not any(e.run for e in rows[names[0]]):
        return (path if path.exists() else None), []
    selected = [e.run for es in rows.values() for e in es if e.run is not None]
    plot_accuracy(selected, path, title=f"{suite} suite, {regime} regime")
    missing = [n for n, es in rows.items() if es and any(e.run is None for e in es)]
    return path, missing


def ratios() -> list[str]:
    """FedLoRA against LG-FedAvg: upload from the accuracy runs (exact byte counts),
    client computation from ``benchmarks/fedlora_cost.py`` (interleaved, one process)."""
    lines = []
    for regime in REGIMES:
        lo, lg = entries(regime, "fedlora"), entries(regime, "lgfedavg")
        if lo and lg:
            up = statistics.fmean(e.up for e in lo) / statistics.fmean(e.up for e in lg)
            lines.append(
                f"- upload per client per round, {regime}: fedlora / lgfedavg = **{up:.3f}×**"
            )
    doc = load("fedlora-cost.json")
    if isinstance(doc, dict):
        lines += [
            f"- client computation per round (`python benchmarks/fedlora_cost.py`: "
            f"{doc['workload']}; the two algorithms' training messages alternate, median of "
            f"{doc['repeats']}): fedlora / lgfedavg = **{doc['train-ratio-all']:.2f}×** over "
            "CNN-1..5; per architecture: "
            + ", ".join(
                f"{r['arch']} {r['train-s']['lgfedavg']:.2f} s → {r['train-s']['fedlora']:.2f} s"
                for r in doc["rows"]
            ),
        ]
    return lines


def section(suite: str) -> str:
    out = [
        f"#### {suite} suite",
        "",
        f"Produced by `{COMMAND[suite]}` (each run is a real "
        "`flwr run` simulation on 2 CPU cores; identical partitions for every method; no "
        "per-method tuning: every method runs with the defaults of the run-config table).",
        "",
    ]
    for regime in REGIMES:
        out += [regime_title(regime), "", table(regime, SUITE_ROWS[suite], suite == "fedlora"), ""]
        path, missing = plot(suite, regime, SUITE_ROWS[suite])
        if path:
            out += [f"![{suite} {regime}]({path.relative_to(ROOT)})", ""]
        if missing:
            out += [
                "The plot draws archived runs only; without (some of) their seeds: "
                + ", ".join(f"`{n}`" for n in missing)
                + " (runs made before runs were archived; their table rows come from the "
                "kept summaries).",
                "",
            ]
    if suite in ABLATIONS:
        title, names = ABLATIONS[suite]
        out += [f"Ablation, {title}:", "", table("scarce", names, suite == "fedlora"), ""]
    if suite == "fedlora":
        out += [
            "Against LG-FedAvg (the paper's claims are about these ratios):",
            "",
            *ratios(),
            "",
        ]
    return "\n".join(out).rstrip() + "\n"


TIMINGS = (
    "overhead.json",
    "fedara-cost.json",
    "fedlora-cost.json",
    "deployment.json",
    "profiles.json",
)


def archive_timings() -> None:
    """Copy the timing benchmarks' JSON from ``benchmarks/out`` to ``docs/results``."""
    for name in TIMINGS:
        if (OUT / name).exists():
            (DOCS / name).write_text((OUT / name).read_text())


def load(name: str) -> dict | list | None:
    path = DOCS / name
    return json.loads(path.read_text()) if path.exists() else None


def overhead_section() -> str:
    doc = load("overhead.json")
    if not isinstance(doc, dict):
        return ""
    med = doc["median-excluding-round-1"]
    return "\n".join(
        [
            "#### Simulation overhead",
            "",
            f"`python benchmarks/overhead.py --rounds {doc['rounds']}`: {doc['workload']}; "
            "seconds per round, median with round 1 (start-up) excluded. The bare loop is the "
            "same model, data and training functions in one process with no Flower.",
            "",
            "| run | s / round |",
            "|---|---|",
            f"| bare PyTorch loop, 1 thread | {med['bare-1-thread']:.2f} |",
            f"| bare PyTorch loop, 2 threads | {med['bare-2-thread']:.2f} |",
            f"| fedhet simulation (`flwr run`, 2 Ray actors, 1 thread each) | "
            f"{med['simulation']:.2f} |",
            "",
            f"Ratio simulation / best bare loop: **{doc['ratio-simulation-over-best-bare']:.2f}** "
            f"(target ≤ 1.15); against the 1-thread loop: "
            f"{doc['ratio-simulation-over-bare-1-thread']:.2f}. The simulation is faster than "
            "the bare loop because two clients train at once on the two cores (one thread "
            "each), while a single process with two threads gains little on these small "
            "models and batches of 10.",
            "",
        ]
    )


def fedara_cost_section() -> str:
    doc = load("fedara-cost.json")
    if not isinstance(doc, dict):
        return ""
    lines = [
        "#### FedARA costs",
        "",
        "`python benchmarks/fedara_cost.py`: server time per round (configure_train "
        "with the decompositions + aggregate_train with reconstruction and the "
        "weighted mean), replies spread round-robin over the 5 default tiers "
        "(CNN-1 extractor, fc1 and fc2 decomposed), median of 3, 2 cores.",
        "",
        "| client replies | server s / round | decompose (configure) s | "
        "reconstruct + aggregate s |",
        "|---|---|---|---|",
    ]
    for r in doc["server"]:
        lines.append(
            f"| {r['clients']} | {r['server-s']:.2f} | {r['configure-s']:.2f} | "
            f"{r['aggregate-s']:.2f} |"
        )
    lines += [
        "",
        "Per tier (Fashion-MNIST partition 0 of 20, 2,625 training samples, batch "
        "10, 1 thread; epoch times are medians of 3 with every tier interleaved in one "
        "process; bytes and peak RSS from one fresh ClientApp process per row). `epoch s`: "
        "the default, Frobenius decay applied as one closed-form step per epoch; `decay "
        "every step`: `fedara.decay-every=1`:",
        "",
        "| rank ratio | extractor parameters | upload bytes measured | upload bytes "
        "analytic | epoch s | epoch / full-rank epoch | epoch s, decay every step | "
        "peak RSS MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in doc["tiers"]:
        lines.append(
            f"| {t['rank-ratio']:g} | {t['params']:,} | {t['bytes-up-measured']:,} | "
            f"{t['bytes-up-analytic']:,} | {t['epoch-s']:.2f} | "
            f"{t['epoch-ratio-to-full-rank']:.2f} | {t['epoch-s-decay-every-step']:.2f} | "
            f"{t['peak-rss-mb']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def profiles_section() -> str:
    rows = load("profiles.json")
    if not isinstance(rows, list):
        return ""
    lines = [
        "| profile | algorithm | architecture | FedARA rank ratio | batch | threads | "
        "device | peak RSS of one training round (MB) | of which imports (MB) | round s here |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = "–" if r.get("rank-ratio") is None else f"{r['rank-ratio']:g}"
        lines.append(
            f"| `{r['profile']}` | {r['algorithm']} | {r['arch']} | {ratio} | "
            f"{r['batch-size']} | {r['threads'] or 'torch default'} | {r['device']} | "
            f"{r['peak-rss-mb']:.0f} | {r.get('rss-after-imports-mb', float('nan')):.0f} | "
            f"{r['round-s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def small(seconds: float) -> str:
    """A cost measured as a difference of process wall times: below 0.1 s it is noise."""
    if seconds < 0.1:
        return "too small to measure this way (under 0.1 s)"
    return f"{seconds:.2f} s"


def deployment_section() -> str:
    doc = load("deployment.json")
    if not isinstance(doc, dict):
        return ""
    med, pp = doc["median-excluding-round-1"], doc["per-process"]
    return "\n".join(
        [
            "#### Deployment vs simulation",
            "",
            f"`python benchmarks/deployment.py`: {doc['workload']}. Median seconds per round "
            "(round 1 excluded):",
            "",
            "| mode | s / round |",
            "|---|---|",
            f"| simulation (Ray actors stay alive) | {med['simulation']:.2f} |",
            f"| deployment (TLS + node auth) | {med['deployment']:.2f} |",
            "",
            f"Deployment / simulation: **{doc['ratio-deployment-over-simulation']:.1f}×**. Where "
            "it goes: Flower 1.42 starts a fresh ClientApp process for every message (train and "
            "evaluate, per node), so each message pays, measured in fresh processes: "
            f"Python start-up {pp['python-start-s'] * 1000:.0f} ms, imports of the ClientApp "
            f"{pp['import-client-app-s']:.2f} s (of which torch {pp['import-torch-s']:.2f} s, "
            f"flwr {pp['import-flwr-s']:.2f} s), loading the "
            f"cached data share {small(pp['load-data-share-s'])}, building CNN-1 "
            f"{small(pp['build-cnn1-s'])}; the rest is the SuperNode/SuperExec polling "
            "and the TLS round trips. Reduced here: torchvision is imported only when a "
            f"torchvision architecture is built (it cost {pp['import-torchvision-extra-s']:.2f} s "
            "per message), matplotlib only when plotting, partitions are cached on disk. "
            "`--isolation process` (read in Flower 1.42's source, not measured) would not "
            "remove the per-message process either: SuperExec's subprocess executor starts "
            "one per task; its warm pools exist only for the Kubernetes executor.",
            "",
        ]
    )


def replace_block(text: str, tag: str, body: str) -> str:
    pattern = re.compile(rf"(<!-- results:{tag} -->\n).*?(<!-- /results:{tag} -->)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"README has no <!-- results:{tag} --> block")
    return pattern.sub(lambda m: m.group(1) + body + m.group(2), text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--readme", action="store_true")
    args = ap.parse_args()
    DOCS.mkdir(parents=True, exist_ok=True)
    previous_summaries()  # read before this call rewrites the file
    print(f"archived {archive()} new or changed runs under {ARCHIVE.relative_to(ROOT)}")
    archive_timings()
    sections = {suite: section(suite) for suite in SUITE_ROWS}
    names = {n for rows in SUITE_ROWS.values() for n in rows} | {
        n for _, rows in ABLATIONS.values() for n in rows
    }
    summary = {
        reg: {
            n: [
                {
                    **{k: v for k, v in e.summary.items() if k != "nodes"},
                    "seed": e.seed,
                    "bytes-up-per-client-round": e.up,
                    "bytes-down-per-client-round": e.down,
                    "client-train-time-s": e.train_time,
                }
                for e in entries(reg, n)
            ]
            for n in sorted(names)
        }
        for reg in REGIMES
    }
    SUMMARY.write_text(json.dumps({"all": summary}, indent=1))
    sections["overhead"] = overhead_section()
    sections["fedara-cost"] = fedara_cost_section()
    sections["deployment"] = deployment_section()
    sections["profiles"] = profiles_section()
    for tag, text in sections.items():
        print(text or f"({tag}: no measurement archived; README block left as it is)\n")
    if args.readme:
        readme = ROOT / "README.md"
        text = readme.read_text()
        for tag, body in sections.items():
            if body:
                text = replace_block(text, tag, body)
        readme.write_text(text)


if __name__ == "__main__":
    main()
