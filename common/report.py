"""Tables and plots from ``results.json`` files (server app and ``fedhet report``)."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Run:
    """One ``results.json``, loaded."""

    path: Path
    config: dict[str, Any]
    rounds: list[dict[str, Any]]
    summary: dict[str, Any]

    @classmethod
    def load(cls, path: Path) -> Run:
        """A ``results.json``, or the run folder holding one (what a run prints)."""
        path = Path(path).expanduser()
        if path.is_dir():
            if not (path / "results.json").is_file():
                raise ValueError(f"{path}: a folder without results.json (not a fedhet run folder)")
            path = path / "results.json"
        try:
            doc = json.loads(path.read_text())
            return cls(Path(path), doc["config"], doc["rounds"], doc["summary"])
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"{path}: not a fedhet results.json ({exc})") from None

    @property
    def label(self) -> str:
        return str(self.config.get("algorithm", self.path.parent.name))

    def group_key(self) -> tuple[tuple[str, Any], ...]:
        """Everything but ``seed`` and ``out-dir``: runs differing only in seed fold."""
        return tuple(sorted((k, v) for k, v in self.config.items() if k not in ("seed", "out-dir")))

    def curve(self) -> tuple[list[int], list[float]]:
        pts = [(r["round"], r["accuracy"]) for r in self.rounds if r.get("accuracy") is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    def virtual_curve(self) -> tuple[list[float], list[float]]:
        """(cumulative virtual seconds, accuracy) at every evaluated round; empty when
        the run has no virtual clock (no ``fleet`` or device classes)."""
        clock, xs, ys = 0.0, [], []
        for r in self.rounds:
            if r.get("virtual-time-s") is None:
                return [], []
            clock += r["virtual-time-s"]
            if r.get("accuracy") is not None:
                xs.append(clock)
                ys.append(r["accuracy"])
        return xs, ys

    @property
    def timed(self) -> bool:
        return self.summary.get("virtual-time-total-s") is not None

    def per_client_round(self, key: str) -> float:
        vals = [r[key] for r in self.rounds]
        return statistics.fmean(vals) if vals else 0.0


def _pm(values: Sequence[float], fmt: str = "{:.4f}") -> str:
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.fmean(values))} ± {fmt.format(statistics.stdev(values))}"


def group_runs(runs: Sequence[Run]) -> list[list[Run]]:
    """Runs grouped by config without seed (order of first appearance)."""
    groups: dict[tuple[tuple[str, Any], ...], list[Run]] = {}
    for run in runs:
        groups.setdefault(run.group_key(), []).append(run)
    return list(groups.values())


def distinguishing_label(group: list[Run], groups: list[list[Run]]) -> str:
    """Algorithm name plus the config keys that set this group apart from others."""
    base = group[0]
    same_algo = [g[0] for g in groups if g[0].label == base.label and g is not group]
    diffs = sorted(
        {
            k
            for other in same_algo
            for k, v in base.config.items()
            if k not in ("seed", "out-dir") and other.config.get(k) != v
        }
    )
    extra = ", ".join(f"{k}={base.config[k]}" for k in diffs)
    return f"{base.label} ({extra})" if extra else base.label


def markdown_table(runs: Sequence[Run]) -> str:
    """Algorithm, last/best accuracy, bytes per client per round, wall time."""
    groups = group_runs(runs)
    timed = any(r.timed for r in runs)
    lines = [
        "| algorithm | seeds | accuracy (last) | accuracy (best) | "
        "up / client / round | down / client / round | wall time (s) |"
        + (" virtual time (s) |" if timed else ""),
        "|---|---|---|---|---|---|---|" + ("---|" if timed else ""),
    ]
    for group in groups:
        last = [
            r.summary["accuracy-last"] for r in group if r.summary.get("accuracy-last") is not None
        ]
        best = [
            r.summary["accuracy-best"] for r in group if r.summary.get("accuracy-best") is not None
        ]
        up = statistics.fmean(r.per_client_round("bytes-up-per-client") for r in group)
        down = statistics.fmean(r.per_client_round("bytes-down-per-client") for r in group)
        wall = [r.summary["wall-time-s"] for r in group]
        virtual = [r.summary["virtual-time-total-s"] for r in group if r.timed]
        lines.append(
            f"| {distinguishing_label(group, groups)} | {len(group)} | "
            f"{_pm(last) if last else '-'} | {_pm(best) if best else '-'} | "
            f"{_fmt_bytes(up)} | {_fmt_bytes(down)} | {_pm(wall, '{:.0f}')} |"
            + (f" {_pm(virtual, '{:.1f}') if virtual else '-'} |" if timed else "")
        )
    return "\n".join(lines)


def _fmt_bytes(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    if n < 1024**2:
        return f"{n / 1024:.1f} KB"
    return f"{n / 1024**2:.2f} MB"


def plot_accuracy(runs: Sequence[Run], path: Path, title: str = "", virtual: bool = False) -> Path:
    """One accuracy-vs-round plot (``virtual``: against cumulative virtual seconds,
    runs without a virtual clock left out); seed groups drawn as mean with a
    min–max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = group_runs(runs)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for group in groups:
        curves = [r.virtual_curve() if virtual else r.curve() for r in group]
        xs: list[float] = [statistics.fmean(x) for x in zip(*(c[0] for c in curves), strict=False)]
        n = min(len(c[1]) for c in curves)
        if n == 0:
            continue
        ys = [[c[1][i] for c in curves] for i in range(n)]
        mean = [statistics.fmean(v) for v in ys]
        line = ax.plot(xs[:n], mean, label=distinguishing_label(group, groups))[0]
        if len(group) > 1:
            ax.fill_between(
                xs[:n],
                [min(v) for v in ys],
                [max(v) for v in ys],
                color=line.get_color(),
                alpha=0.2,
            )
    priors = [r.summary["accuracy-prior"] for r in runs if r.summary.get("accuracy-prior")]
    if priors:
        ax.axhline(
            statistics.fmean(priors),
            linestyle="--",
            color="gray",
            linewidth=1,
            label="accuracy-prior (each client predicts its majority class)",
        )
    ax.set_xlabel("virtual time (s)" if virtual else "round")
    ax.set_ylabel("personalized accuracy (Σcorrect/Σsamples)")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
