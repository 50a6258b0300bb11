"""Accuracy tables and plots from the archived runs of ``benchmarks/accuracy.py``:
the all-methods summary for the README and the generated ``docs/results/README.md``.
"""

from __future__ import annotations

import functools
import gzip
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.suites import BASELINES, OUT, REGIMES, ROOT, ROUNDS, SUITES, Spec, complete
from common.config import FedARAConfig, flatten, parse_run_config
from common.report import Run, plot_accuracy

DOCS = ROOT / "docs" / "results"
ARCHIVE = DOCS / "archive"
SUMMARY = DOCS / "accuracy-summary.json"
RESULTS_PAGE = DOCS / "README.md"

MAIN = [
    "local",
    "lgfedavg",
    "fedproto",
    "fedgh",
    "fedre",
    "fedre-reps10-e100-b10-rsr",
    "fedtgp",
    "fedkd",
    "fml",
    "fd",
    "fedmrl",
    "fedgen",
    "fedl2g",
    "fedl2gl",
    "fedlora",
    "fedara",
    "fedara-tracked-star",
]
"""The rows of the all-methods tables (each with its run-config defaults, but the one
FedRE variant that is FedRE's best measured setting, labelled as such)."""

LABELS = {
    "fedara": "fedara (tiers 1…1/16: coverage, energy, tracked, λ=2 mean, η=3)",
    "fedara-svd": "fedara, truncation=svd (the earlier default)",
    "fedara-tracked-lambda0": "fedara λ=0 (tracked)",
    "fedara-tracked-slr1": "fedara, η=1 (tracked)",
    "fedara-tracked-lambda0.5": "fedara λ=0.5 (tracked)",
    "fedara-tracked-lambda10": "fedara λ=10 (tracked)",
    "fedara-tracked-star": "FedARA* (fedavgcnn, r=0.5, λ=10, tracked)",
    "fedara-tracked-paper-regime": "fedara, 5 epochs / batch 16 / lr 0.005 (tracked)",
    "fedara-slr1": "fedara, server step η=1 (the paper)",
    "fedara-slr2": "fedara, η=2",
    "fedara-slr5": "fedara, η=5",
    "fedara-delta-slr1": "fedara, aggregation=delta, η=1",
    "fedara-reconstruct-slr1": "fedara, reconstruct, served-scale=none, η=1 (paper-literal)",
    "fedre-reps10-e100-b10-rsr": "fedre variant: 10 raw-sample mixtures per client, 100 "
    "server epochs, batch 10",
    "fedara-delta": "fedara, aggregation=delta",
    "fedara-reconstruct": "fedara, aggregation=reconstruct, served-scale=none",
    "fedara-noscale": "fedara, served-scale=none",
    "fedara-star": "FedARA* (fedavgcnn, r=0.5, λ=10, truncation=svd)",
    "fedara-tiers1": "fedara, every client at rank ratio 1",
    "fedara-lambda0": "fedara λ=0",
    "fedara-lambda0.5": "fedara λ=0.5",
    "fedara-lambda10": "fedara λ=10",
    "fedara-paper-regime": "fedara, 5 epochs / batch 16 / lr 0.005",
    "local-paper-regime": "local, 5 epochs / batch 16 / lr 0.005",
    "lgfedavg-paper-regime": "lgfedavg, 5 epochs / batch 16 / lr 0.005",
    "fedgh": "fedgh (100 server epochs, batch 10)",
    "fedgh-e1-b32": "fedgh, 1 server epoch, batch 32 (earlier default)",
    "fedlora": "fedlora (head, r=8)",
    "fedproto-proto": "fedproto, nearest-prototype inference",
    "fedproto-proto-shared": "fedproto, nearest-prototype inference, model.init=shared",
}
SUITE_TITLES = {
    "baselines": "The strongest heterogeneous baselines: FedTGP, FedKD, FML",
    "fedara": "FedARA",
    "fedre": "FedRE, FedGH, FedProto",
    "fedlora": "FedLoRA",
    "init": "Initial weights: model.init=shared",
}
COMMAND = "python -m benchmarks.accuracy && python -m benchmarks.tables --readme"


@dataclass(frozen=True)
class Entry:
    """One seed of one row: an archived ``results.json``."""

    seed: int
    run: Run
    versions: dict[str, Any] = field(default_factory=dict)
    """What the run recorded of its code and machine (``source``, ``git-commit``,
    ``machine``), if anything."""

    @property
    def summary(self) -> dict[str, Any]:
        return self.run.summary

    @property
    def up(self) -> float:
        return mean_of_rounds(self.run, "bytes-up-per-client")

    @property
    def down(self) -> float:
        return mean_of_rounds(self.run, "bytes-down-per-client")


def spec_of(name: str) -> Spec:
    for spec in [s for rows in SUITES.values() for s in rows]:
        if spec.name == name:
            return spec
    return next(s for s in BASELINES if s.name == name)


def expected_config(regime: str, name: str, seed: int) -> dict[str, Any]:
    """The full run config a current run of this row has (``out-dir`` aside)."""
    flat = {
        **REGIMES[regime]["config"],
        **spec_of(name).overrides,
        "num-server-rounds": ROUNDS,
        "seed": seed,
    }
    cfg = flatten(parse_run_config(flat))
    cfg.pop("out-dir")
    return cfg


IGNORED = (
    "out-dir",
    "resume",
    "round-timeout",
    "min-valid-replies",
    "reply-poll",
    "eval-mode",
    "pack-messages",
)
"""Keys that cannot change a benchmark run's numbers: every reply is valid in every
round of these runs (checked), so how many valid replies a round needs does not
matter; ``reply-poll`` only decides when the server looks for replies; ``eval-mode``
only decides which message carries an evaluation (the same per-round metrics in both
modes: tests/test_eval_mode.py; the tables' bytes are the training messages');
``pack-messages`` only decides how a deployment's messages cross the network (a
simulation never packs; packed and unpacked deployments give equal metrics:
tests/test_deployment.py)."""
ADDED = {
    "max-weight-share": 1.0,
    "model.init": "per-client",
    "fedre.server-loss": "mean",
    "fedre.reps-per-client": 1,
    "fedlora.lr": 0.0,
    "fedara.server-lr": 1.0,
    "fedara.truncation": "svd",
    "fedara.server-step": "fixed",
    # images of 16 px and more (Fashion-MNIST's 28) were never resized: the default
    "data.image-size": 0,
    "server-threads": 0,
    # a simulation keeps personal models under its own out-dir: nothing to carry over
    "carry-personal-state": False,
    # the virtual clock's keys: off in every archived run
    "round-deadline-s": 0.0,
    "fleet": "",
    "model.policy": "profile",
    "fedara.rank-policy": "profile",
    # robust aggregation: off in every archived run
    "robust.aggregate": "mean",
    "robust.trim": 0.1,
    "robust.max-norm-ratio": 0.0,
    "robust.min-cosine": -1.0,
    # FedMRL predicted with the server's shared model before the key existed
    "fedmrl.predict-with": "sent",
    "fedmrl.predict-head": "own",
}
"""Keys added after some archived runs, with the value that is what those runs did."""
SECTIONS = ("data.", "model.", "train.")


def relevant(config: dict[str, Any]) -> dict[str, Any]:
    """The keys that decide a run's numbers: top-level ones, data/model/train and the
    run's own algorithm's section (other algorithms' settings do not touch it)."""
    algorithm = config.get("algorithm", "")
    return {
        k: v
        for k, v in {**ADDED, **config}.items()
        if k not in IGNORED and ("." not in k or k.startswith((*SECTIONS, f"{algorithm}.")))
    }


def current(run: Run, regime: str, name: str) -> bool:
    """A run belongs to a row only if it ran with every setting the row has now
    (runs of older code or other defaults stay archived but are not shown)."""
    want = relevant(expected_config(regime, name, int(run.config.get("seed", -1))))
    full = all(r.get("valid-replies") == r.get("train-clients") for r in run.rounds)
    return full and relevant(run.config) == want


def archive() -> int:
    """Copy complete runs from ``benchmarks/out`` into ``docs/results/archive`` (committed).

    Gzipped, to keep the repository small.
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
def entries(regime: str, name: str) -> list[Entry]:
    """The row's current archived runs, by seed."""
    out = []
    for path in sorted((ARCHIVE / regime / name).glob("seed*.json.gz")):
        doc = json.loads(gzip.decompress(path.read_bytes()))
        run = Run(path, doc["config"], doc["rounds"], doc["summary"])
        if current(run, regime, name):
            out.append(Entry(int(run.config["seed"]), run, doc.get("versions") or {}))
    return sorted(out, key=lambda e: e.seed)


def mean_of_rounds(run: Run, key: str) -> float:
    vals = [r[key] for r in run.rounds if r.get(key) is not None]
    return statistics.fmean(vals) if vals else 0.0


def pm(values: list[float], fmt: str = "{:.4f}") -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.fmean(values))} ± {fmt.format(statistics.stdev(values))}"


def kb(n: float) -> str:
    return f"{n / 1024:.1f} KB" if n < 1024**2 else f"{n / 1024**2:.2f} MB"


def last(es: list[Entry], key: str = "accuracy") -> list[float]:
    """``key`` of each seed's last evaluated round."""
    vals = []
    for e in es:
        rows = [r for r in e.run.rounds if r.get(key) is not None]
        if rows:
            vals.append(rows[-1][key])
    return vals


COMPUTE_COST = ("compute-cost.json", "compute-cost-fedl2g.json", "compute-cost-added.json")
"""``benchmarks.compute_cost`` runs, each with its own ``lgfedavg`` reference: the
methods of the first, then those added after it (``--algorithms lgfedavg,...
--out benchmarks/out/<name>``); a method's ratio is from the first run that has it."""


def compute_ratio() -> dict[str, float]:
    ratios: dict[str, float] = {}
    for name in COMPUTE_COST:
        doc = load(name)
        if isinstance(doc, dict):
            ratios = dict(doc["ratio-to-lgfedavg"]) | ratios
    return ratios


def table(regime: str, names: list[str], extra: tuple[str, ...] = (), sort: bool = False) -> str:
    """Rows: accuracy last/best (mean ± std over seeds), bytes, and ``extra`` columns."""
    head = ["method", "seeds", "accuracy (last)", "accuracy (best)", "up / client / round",
            "down / client / round"]  # fmt: skip
    columns = {
        "delta-local": "last − local (same seeds)",
        "compute": "client computation × lgfedavg",
        "without-shared": "accuracy without the shared part (last)",
        "round5": "accuracy round 5",
        "prior": "accuracy-prior",
        "server": "server loss before → after, ‖Δhead‖/‖head‖ (last round)",
        "adapter": "logit share / ‖ΔW‖/‖W‖ of the adapter (last round)",
        "grad-ratio": "anchor / CE gradient (last round, mean over clients)",
        "code": "code: archived in; rerun",
    }
    head += [columns[c] for c in extra]
    rows = [(n, entries(regime, n)) for n in names]
    rows = [(n, es) for n, es in rows if es]
    if sort:
        rows.sort(key=lambda r: -statistics.fmean(e.summary["accuracy-last"] for e in r[1]))
    base = {e.seed: e.summary["accuracy-last"] for e in entries(regime, "local")}
    ratios = compute_ratio()
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, es in rows:
        cells = [
            LABELS.get(name, name),
            str(len(es)),
            pm([e.summary["accuracy-last"] for e in es]),
            pm([e.summary["accuracy-best"] for e in es]),
            kb(statistics.fmean(e.up for e in es)),
            kb(statistics.fmean(e.down for e in es)),
        ]
        for c in extra:
            cells.append(cell(c, name, es, base, ratios))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cell(column: str, name: str, es: list[Entry], base: dict[int, float], ratios: dict) -> str:
    algorithm = es[0].run.config["algorithm"]
    if column == "delta-local":  # paired by seed: the same partitions
        pairs = [e.summary["accuracy-last"] - base[e.seed] for e in es if e.seed in base]
        return "–" if not pairs or name == "local" else f"{statistics.fmean(pairs):+.4f}"
    if column == "compute":
        return f"{ratios[algorithm]:.2f}×" if algorithm in ratios else "–"
    if column == "without-shared":
        return pm(last(es, "accuracy-without-shared"))
    if column == "code":
        return code_cell(es)
    if column == "round5":
        return pm([e.run.rounds[4]["accuracy"] for e in es if len(e.run.rounds) > 4])
    if column == "prior":
        return pm([e.summary["accuracy-prior"] for e in es if e.summary.get("accuracy-prior")])
    last_round = [e.run.rounds[-1] for e in es]
    if column == "server":
        diag = [r.get("server-diagnostics") or {} for r in last_round]
        if not all("server-loss-before" in d for d in diag):
            return "–"
        b = statistics.fmean(d["server-loss-before"] for d in diag)
        a = statistics.fmean(d["server-loss-after"] for d in diag)
        h = statistics.fmean(d.get("head-change", float("nan")) for d in diag)
        return f"{b:.3f} → {a:.3f}, {h:.3f}"
    if column == "adapter":
        diag = [r.get("eval-diagnostics") or {} for r in last_round]
        if not all("logit-share" in d for d in diag):
            return "–"
        share = statistics.fmean(d["logit-share"] for d in diag)
        ratio = statistics.fmean(d["adapter-weight-ratio"] for d in diag)
        return f"{share:.4f} / {ratio:.4f}"
    if column == "grad-ratio":
        vals = [
            m["anchor-grad-ratio"]
            for r in last_round
            for m in r.get("client-train", {}).values()
            if "anchor-grad-ratio" in m
        ]
        return f"{statistics.fmean(vals):.3f}" if vals else "–"
    raise ValueError(column)


def code_cell(es: list[Entry]) -> str:
    """Which code made the row's runs, and whether this code gives them again.

    A run that recorded its code shows its commit (or source hash) and the kernels it
    ran on; one from before shows the commit that archived it (``reproduced.json``, made
    by ``python -m benchmarks.reproduce``) and, if one of the row's runs was rerun, what
    the rerun found, by the CPU kernels it ran on: "AVX512 1-5 same" (every client's
    accuracy of rounds 1-5 equal) or "AVX512 from round R (n clients, ≤ d)" (the first
    round that differs, how many clients, the largest difference)."""
    runs = reproduced_runs()
    made: list[str] = []
    checks: list[str] = []
    for e in es:
        info: dict[str, Any] = {}
        if e.versions.get("source"):
            commit = e.versions.get("git-commit")
            dirty = "+dirty" if e.versions.get("git-dirty") else ""
            text = f"`{commit[:7]}`{dirty}" if commit else f"source `{e.versions['source'][:8]}`"
            kernels = (e.versions.get("machine") or {}).get("cpu-capability")
            made.append(f"{text} ({kernels})" if kernels else text)
        else:
            info = runs.get(archive_key(e.run.path), {})
            commit = info.get("archived-in")
            made.append(f"`{commit[:7]}`" if commit else "not recorded")
        found: dict[str, list[str]] = {}  # by the commit the rerun ran at
        for check in (info.get("check"), info.get("check-avx2")):
            if not check or "error" in check:
                continue
            at = f"`{(check.get('git-commit') or check.get('source') or '?')[:7]}`"
            kernels = (check.get("machine") or {}).get("cpu-capability", "?")
            diff = check.get("first-difference")
            if diff is None:
                found.setdefault(at, []).append(f"{kernels} 1-{check['same-rounds']} same")
            else:
                clients = f"{diff['clients']} client" + ("s" if diff["clients"] != 1 else "")
                found.setdefault(at, []).append(
                    f"{kernels} from round {diff['round']} ({clients}, ≤ {diff['max-abs']:.3f})"
                )
        if found:
            checks.append(
                "rerun " + "; ".join(f"at {at}: " + ", ".join(t) for at, t in found.items())
            )
    text = ", ".join(dict.fromkeys(made))
    if checks:
        return text + "; " + "; ".join(checks)
    unrecorded = any(not e.versions.get("source") for e in es)
    return text + ("; not rerun" if unrecorded else "")


def archive_key(path: Path | str) -> str:
    """An archived run's key in ``reproduced.json``: its path under the archive."""
    return str(Path(path).relative_to(ARCHIVE))


def reproduced_runs() -> dict[str, dict[str, Any]]:
    """``reproduced.json``'s runs (``python -m benchmarks.reproduce``), {} without it."""
    record = load("reproduced.json")
    return dict(record.get("runs", {})) if isinstance(record, dict) else {}


DEFAULT_TIERS = FedARAConfig().tiers()
"""The default rank tiers, assigned round-robin by partition id."""


def tier_accuracy(es: list[Entry], round_index: int = -1) -> dict[float, float]:
    """Mean client accuracy in one round (over seeds) of the clients of each default
    tier (partition id mod the number of tiers), whatever rank they ran at: the same
    clients compare across rows (local, every client at full rank, the tiers)."""
    by: dict[float, list[float]] = {}
    for e in es:
        for pid, acc in e.run.rounds[round_index].get("client-accuracy", {}).items():
            by.setdefault(DEFAULT_TIERS[int(pid) % len(DEFAULT_TIERS)], []).append(acc)
    return {r: statistics.fmean(v) for r, v in sorted(by.items(), reverse=True)}


def tier_table(regime: str, names: list[str]) -> str:
    rows = [(n, entries(regime, n)) for n in names if entries(regime, n)]
    tiers = sorted({t for _, es in rows for t in tier_accuracy(es)}, reverse=True)
    if not tiers:
        return ""
    head = ["method", "seeds", *[f"clients of tier {t:g}" for t in tiers], "round 5 (all)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, es in rows:
        acc = tier_accuracy(es)
        cells = [LABELS.get(name, name), str(len(es))]
        cells += [f"{acc[t]:.3f}" if t in acc else "–" for t in tiers]
        cells.append(pm([e.run.rounds[4]["accuracy"] for e in es if len(e.run.rounds) > 4]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def regime_title(regime: str) -> str:
    r = REGIMES[regime]
    cfg = r["config"]
    return (
        f"*{regime}*: Fashion-MNIST, `data.fraction={cfg['data.fraction']}`, "
        f"{r['clients']} clients, Dirichlet α={cfg['data.alpha']}, `cnn` family, "
        f"{ROUNDS} rounds, seeds {', '.join(map(str, r['seeds']))}"
    )


def plot(tag: str, regime: str, names: list[str], title: str) -> Path | None:
    """Accuracy vs round of the rows' archived runs (mean over seeds, min-max band),
    the accuracy-prior dashed."""
    runs = [e.run for n in names for e in entries(regime, n)]
    if not runs:
        return None
    return plot_accuracy(runs, DOCS / f"{tag}-{regime}.png", title=title)


def figure():  # type: ignore[no-untyped-def]
    """A new accuracy-vs-round figure: ``(fig, ax)``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(7, 4.5))


def finish(fig, ax, ylabel: str, title: str, path: Path) -> Path:  # type: ignore[no-untyped-def]
    """Label, legend and save a figure of :func:`figure`."""
    import matplotlib.pyplot as plt

    ax.set_xlabel("round")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_without_shared(tag: str, regime: str, names: list[str]) -> Path | None:
    """Accuracy with (solid) and without (dashed) the shared part, mean over seeds."""
    fig, ax = figure()
    drawn = False
    for name in names:
        es = entries(regime, name)
        if not es:
            continue
        for key, style in (("accuracy", "-"), ("accuracy-without-shared", "--")):
            curves = [[r.get(key) for r in e.run.rounds] for e in es]
            if any(v is None for c in curves for v in c):
                continue
            ys = [statistics.fmean(v) for v in zip(*curves, strict=True)]
            label = LABELS.get(name, name) + ("" if key == "accuracy" else ", without shared")
            ax.plot(range(1, len(ys) + 1), ys, style, label=label)
            drawn = True
    if not drawn:
        import matplotlib.pyplot as plt

        plt.close(fig)
        return None
    priors = [e.summary["accuracy-prior"] for n in names for e in entries(regime, n)
              if e.summary.get("accuracy-prior")]  # fmt: skip
    if priors:
        ax.axhline(statistics.fmean(priors), linestyle=":", color="gray", label="accuracy-prior")
    title = f"{tag}: with and without the shared part ({regime})"
    path = DOCS / f"{tag}-without-shared-{regime}.png"
    return finish(fig, ax, "personalized accuracy", title, path)


def plot_tiers(regime: str, name: str = "fedara") -> Path | None:
    """Per-tier accuracy vs round (mean over seeds) against the accuracy-prior."""
    es = entries(regime, name)
    if not es:
        return None
    fig, ax = figure()
    curves = [tier_accuracy(es, i) for i in range(ROUNDS)]
    for tier in curves[-1]:
        ax.plot(range(1, ROUNDS + 1), [c.get(tier, float("nan")) for c in curves],
                label=f"rank ratio {tier:g}")  # fmt: skip
    ax.plot(range(1, ROUNDS + 1), [statistics.fmean(r) for r in zip(
        *[[x["accuracy"] for x in e.run.rounds] for e in es], strict=True)],
        color="black", label="all clients (Σcorrect/Σsamples)")  # fmt: skip
    ax.axhline(statistics.fmean(e.summary["accuracy-prior"] for e in es), linestyle="--",
               color="gray", label="accuracy-prior")  # fmt: skip
    title = f"{LABELS.get(name, name)}: accuracy per tier ({regime})"
    return finish(fig, ax, "mean client accuracy", title, DOCS / f"{name}-tiers-{regime}.png")


def image(path: Path | None, alt: str, base: Path) -> list[str]:
    return [f"![{alt}]({path.relative_to(base)})", ""] if path else []


def suite_section(suite: str) -> str:
    """One suite's tables and plots for docs/results/README.md."""
    names = [s.name for s in SUITES[suite]]
    out = [f"## {SUITE_TITLES[suite]}", ""]
    extra: tuple[str, ...] = ("delta-local", "round5", "prior")
    if suite == "fedre":
        extra += ("without-shared", "server")
    if suite == "fedlora":
        extra += ("without-shared", "adapter")
    if suite == "fedara":
        extra += ("grad-ratio",)
    for regime in REGIMES:
        rows = [n for n in ["local", "lgfedavg", *names] if entries(regime, n)]
        if not rows:
            continue
        out += [regime_title(regime), "", table(regime, rows, (*extra, "code")), ""]
        out += image(plot(suite, regime, rows[: 2 + 4], f"{suite}, {regime}"), suite, DOCS)
        if suite in ("fedre", "fedlora"):
            shared = [n for n in rows if n not in ("local",)][:4]
            out += image(plot_without_shared(suite, regime, shared), suite, DOCS)
        if suite == "fedara":
            tiered = [n for n in rows if n.startswith("fedara") and not n.endswith("-star")]
            tiers = tier_table(regime, ["local", *tiered])
            if tiers:
                out += ["Accuracy of the clients of each tier (partition id mod 5; last round, "
                        "mean client accuracy over clients and seeds), in every row, whatever "
                        "rank they ran at:", "", tiers, ""]  # fmt: skip
                out += image(plot_tiers(regime), "fedara tiers", DOCS)
    return "\n".join(out).rstrip() + "\n"


def results_page() -> str:
    parts = [
        "# Benchmark results",
        "",
        f"Generated by `python -m benchmarks.tables` from the archived runs under "
        f"`docs/results/archive/` (produced by `{COMMAND}`; each run is a real `flwr run` "
        "simulation on 2 CPU cores, identical partitions for every method). A row shows only "
        "runs made with every setting it has now; `accuracy-prior` is what every client "
        "predicting its majority training class scores. Column `last − local`: the row's "
        "mean minus `local`'s.",
        "",
        reproduction_note(),
        "",
    ]
    for suite in SUITE_TITLES:
        parts.append(suite_section(suite))
    return "\n".join(parts)


def reproduction_note() -> str:
    """What reruns of the archived rows found (``reproduced.json``), for the page's head."""
    runs = reproduced_runs()
    checks = [  # rows' runs (seed<k>), not the older runs kept beside them
        info["check"]
        for key, info in runs.items()
        if Path(key).name.startswith("seed") and "error" not in info.get("check", {"error": 1})
    ]
    if not checks:
        return ""
    same = sum(c["first-difference"] is None for c in checks)
    first = (
        statistics.median(
            c["first-difference"]["round"] for c in checks if c["first-difference"] is not None
        )
        if same < len(checks)
        else None
    )
    commits = sorted({(c.get("git-commit") or "?")[:7] for c in checks})
    kernels = sorted({(c.get("machine") or {}).get("cpu-capability", "?") for c in checks})
    rounds = sorted({c["rounds"] for c in checks})
    return (
        "**Which code made each row** (column `code`). A run that recorded its code shows "
        "its commit and CPU kernels. For the runs archived before results recorded their "
        "code and machine, the column shows the commit that archived "
        "them (`reproduced.json`, from git history: the code of that time, committed or "
        "not, on the machine of that session) and what rerunning the row's first seed with "
        f"its recorded configuration for {'/'.join(map(str, rounds))} rounds found "
        f"(`python -m benchmarks.reproduce`, at {', '.join(f'`{c}`' for c in commits)}, "
        f"{'/'.join(kernels)} kernels): {same} of {len(checks)} rows give every client's "
        "accuracy of those rounds again"
        + (f"; the others differ from round {first:g} on (median)" if first is not None else "")
        + ". The last digits depend on the code and on the CPU kernels torch runs (the same "
        "run with AVX2 kernels instead of AVX512 moves a few clients by one test sample): a "
        "row that differs was made by other code or on another machine. Found so far: "
        "numbers a rerun on another machine gave (FedGH round 2 0.5618 for 0.5627, LG-FedAvg "
        "partition 36 round 1 0.3649 for 0.3514, FedARA round 3 0.4794 for 0.4788) are "
        "exactly what this code gives here with AVX2 kernels (`--avx2`, shown as AVX2): "
        "that machine's kernels, not a change of code. On one machine, FedGH's rounds 4-5 "
        "(mean accuracy 0.6692, 0.7005) move at `134c13d` (0.6695, 0.7011), which trains "
        "the server-side head (and FedTGP's generator) on one thread: another order of "
        "floating-point sums (found by rerunning 6 rounds at successive commits, each of "
        "which repeats its own numbers). FedARA's default row is given neither by AVX512 "
        "kernels at any commit tested nor by AVX2 kernels at the current code: made on "
        "other kernels or by uncommitted code. FedGH's and FedTGP's scarce rows were rerun "
        "at the current code, 3 seeds each: seeds 1 and 2 equal the archived runs in every "
        "client of every round; the archived seed 0 of both, made before `134c13d`, is kept "
        "as `before-134c13d-seed0.json.gz` (final accuracy FedGH 0.8338, now 0.8301; "
        "FedTGP 0.7997, now 0.7991). The other rows are kept as archived and marked, not "
        "rerun; new runs record their code and machine, and `tests/test_reference.py` "
        "makes a change of numerics a visible decision."
    )


def summary_section() -> str:
    lines = [
        "#### All methods",
        "",
        f"Produced by `{COMMAND}`; every row runs with the run-config defaults "
        "([docs/configuration.md](docs/configuration.md)) "
        "(the one labelled `fedre variant` is FedRE's best measured setting, not its default); "
        "per-suite tables, variants, ablations and plots: [docs/results/README.md]"
        "(docs/results/README.md). Client computation: the whole training message relative "
        "to `lgfedavg`'s (`python -m benchmarks.compute_cost`, interleaved in one process; "
        "methods added later in runs of their own, each with its own `lgfedavg`: FD and "
        "FedL2G in `compute-cost-fedl2g.json`, FedMRL and FedGen in "
        "`compute-cost-added.json`, measured while accuracy runs shared the cores, "
        "where the same run's FD and FedL2G ratios were 0.72 / 0.93 / 0.97 against "
        "1.01 / 1.09 / 1.03 quiet: ± 0.3).",
        "",
    ]
    for regime in REGIMES:
        lines += [
            regime_title(regime) + ", sorted by mean accuracy",
            "",
            table(regime, MAIN, ("delta-local", "compute", "code"), sort=True),
            "",
        ]
        es = entries(regime, "local")
        if es:
            prior = statistics.fmean(e.summary.get("accuracy-prior") or 0.0 for e in es)
            lines += [f"accuracy-prior (every client predicts its majority class): {prior:.4f}", ""]
    return "\n".join(lines).rstrip() + "\n"


def load(name: str) -> dict | list | None:
    path = DOCS / name
    return json.loads(path.read_text()) if path.exists() else None
