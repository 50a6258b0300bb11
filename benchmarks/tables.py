"""README tables and plots from the runs of ``benchmarks/accuracy.py``.

    python benchmarks/tables.py            # print the tables, write docs/results/*.png
    python benchmarks/tables.py --readme   # also replace the README's results sections

Only complete runs are used; a row says how many seeds it has.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.accuracy import OUT, REGIMES, complete  # noqa: E402
from common.report import Run, plot_accuracy  # noqa: E402

DOCS = ROOT / "docs" / "results"
SUITE_ROWS = {
    "fedre": ["fedre", "fedgh", "fedproto", "lgfedavg", "local"],
    "fedara": ["fedara", "fedara-star", "lgfedavg", "local"],
    "fedlora": ["fedlora", "lgfedavg", "local"],
}
ABLATIONS = {
    "fedara": ("λ (scarce)", ["fedara-lambda0", "fedara-lambda1", "fedara", "fedara-lambda10"]),
    "fedlora": ("rank (scarce)", ["fedlora-rank2", "fedlora", "fedlora-rank32"]),
}
LABELS = {
    "fedara": "fedara (tiers 1…1/16, λ=2)",
    "fedara-star": "FedARA* (fedavgcnn, r=0.5, λ=10)",
    "fedara-lambda0": "fedara λ=0",
    "fedara-lambda1": "fedara λ=1",
    "fedara-lambda10": "fedara λ=10",
    "fedlora": "fedlora (r=8)",
    "fedlora-rank2": "fedlora r=2",
    "fedlora-rank32": "fedlora r=32",
}
COMMAND = {
    suite: f"python benchmarks/accuracy.py --suite {suite} && python benchmarks/tables.py --readme"
    for suite in ("fedre", "fedara", "fedlora")
}


def runs(regime: str, name: str) -> list[Run]:
    folder = OUT / regime / name
    return [Run.load(p / "results.json") for p in sorted(folder.glob("seed*")) if complete(p)]


def pm(values: list[float], fmt: str = "{:.4f}") -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.fmean(values))} ± {fmt.format(statistics.stdev(values))}"


def kb(n: float) -> str:
    return f"{n / 1024:.1f} KB" if n < 1024**2 else f"{n / 1024**2:.2f} MB"


def mean_of_rounds(run: Run, key: str) -> float:
    vals = [r[key] for r in run.rounds if r.get(key) is not None]
    return statistics.fmean(vals) if vals else 0.0


def row(name: str, rs: list[Run], train_time: bool = False) -> str:
    last = [r.summary["accuracy-last"] for r in rs]
    best = [r.summary["accuracy-best"] for r in rs]
    up = statistics.fmean(mean_of_rounds(r, "bytes-up-per-client") for r in rs)
    down = statistics.fmean(mean_of_rounds(r, "bytes-down-per-client") for r in rs)
    cells = [LABELS.get(name, name), str(len(rs)), pm(last), pm(best), kb(up), kb(down)]
    if train_time:
        cells.append(pm([mean_of_rounds(r, "client-train-time-s") for r in rs], "{:.2f}"))
    cells.append(pm([r.summary["wall-time-s"] for r in rs], "{:.0f}"))
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
        rs = runs(regime, name)
        if rs:
            lines.append(row(name, rs, train_time))
    return "\n".join(lines)


def regime_title(regime: str) -> str:
    r = REGIMES[regime]
    cfg = r["config"]
    return (
        f"*{regime}*: Fashion-MNIST, `data.fraction={cfg['data.fraction']}`, "
        f"{r['clients']} clients, Dirichlet α={cfg['data.alpha']}, `cnn` family, "
        f"30 rounds, seeds {', '.join(map(str, r['seeds']))}"
    )


def plot(suite: str, regime: str, names: list[str]) -> Path | None:
    selected = [r for n in names for r in runs(regime, n)]
    if not selected:
        return None
    path = DOCS / f"{suite}-{regime}.png"
    plot_accuracy(selected, path, title=f"{suite} suite, {regime} regime")
    return path


def ratios(regime: str) -> str:
    """FedLoRA against LG-FedAvg: client computation and communication."""
    lo, lg = runs(regime, "fedlora"), runs(regime, "lgfedavg")
    if not lo or not lg:
        return ""
    t = statistics.fmean(mean_of_rounds(r, "client-train-time-s") for r in lo) / statistics.fmean(
        mean_of_rounds(r, "client-train-time-s") for r in lg
    )
    b = statistics.fmean(mean_of_rounds(r, "bytes-up-per-client") for r in lo) / statistics.fmean(
        mean_of_rounds(r, "bytes-up-per-client") for r in lg
    )
    return (
        f"- {regime}: client train time fedlora / lgfedavg = **{t:.2f}×**, "
        f"upload bytes fedlora / lgfedavg = **{b:.3f}×**"
    )


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
        path = plot(suite, regime, SUITE_ROWS[suite])
        if path:
            out += [f"![{suite} {regime}]({path.relative_to(ROOT)})", ""]
    if suite in ABLATIONS:
        title, names = ABLATIONS[suite]
        out += [f"Ablation, {title}:", "", table("scarce", names, suite == "fedlora"), ""]
    if suite == "fedlora":
        out += [
            "Against LG-FedAvg (the paper's claims are about these ratios):",
            "",
            *[x for x in (ratios(r) for r in REGIMES) if x],
            "",
        ]
    return "\n".join(out).rstrip() + "\n"


def load(name: str) -> dict | list | None:
    path = OUT / name
    return json.loads(path.read_text()) if path.exists() else None


def overhead_section() -> str:
    doc = load("overhead.json")
    if not isinstance(doc, dict):
        return "(not measured yet: `python benchmarks/overhead.py`)\n"
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
        "10, 1 thread; one fresh ClientApp process per row):",
        "",
        "| rank ratio | extractor parameters | upload bytes measured | upload bytes "
        "analytic | epoch s | epoch s without Frobenius decay | peak RSS MB |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in doc["tiers"]:
        lines.append(
            f"| {t['rank-ratio']:g} | {t['params']:,} | {t['bytes-up-measured']:,} | "
            f"{t['bytes-up-analytic']:,} | {t['epoch-s']:.2f} | "
            f"{t.get('epoch-s-without-frobenius', float('nan')):.2f} | "
            f"{t['peak-rss-mb']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def profiles_section() -> str:
    rows = load("profiles.json")
    if not isinstance(rows, list):
        return "(not measured yet: `python benchmarks/profiles.py`)\n"
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
            f"Python start-up {pp['python-start-s']:.2f} s, imports of the ClientApp "
            f"{pp['import-client-app-s']:.2f} s (of which torch {pp['import-torch-s']:.2f} s, "
            f"flwr {pp['import-flwr-s']:.2f} s), loading the "
            f"cached data share {pp['load-data-share-s'] * 1000:.0f} ms, building CNN-1 "
            f"{pp['build-cnn1-s'] * 1000:.0f} ms; the rest is the SuperNode/SuperExec polling "
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
    sections = {suite: section(suite) for suite in SUITE_ROWS}
    summary = {
        s: {reg: {n: [r.summary for r in runs(reg, n)] for n in SUITE_ROWS[s]} for reg in REGIMES}
        for s in SUITE_ROWS
    }
    (DOCS / "accuracy-summary.json").write_text(json.dumps(summary, indent=1))
    for text in sections.values():
        print(text)
    sections["overhead"] = overhead_section() + "\n" + fedara_cost_section()
    sections["deployment"] = deployment_section()
    sections["profiles"] = profiles_section()
    print(sections["overhead"], sections["deployment"], sections["profiles"], sep="\n")
    if args.readme:
        readme = ROOT / "README.md"
        text = readme.read_text()
        for suite, body in sections.items():
            text = replace_block(text, suite, body)
        readme.write_text(text)


if __name__ == "__main__":
    main()
