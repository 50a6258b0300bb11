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
    if args.readme:
        readme = ROOT / "README.md"
        text = readme.read_text()
        for suite, body in sections.items():
            text = replace_block(text, suite, body)
        readme.write_text(text)


if __name__ == "__main__":
    main()
