"""Text table and heatmap of a partition's per-client class counts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def _counts(summary: dict[str, Any], split: str) -> np.ndarray:
    return np.asarray(summary[f"{split}_class_counts"], dtype=np.int64)


def table(summary: dict[str, Any]) -> str:
    """One row per client: train/test samples and train count per class."""
    train, test = _counts(summary, "train"), _counts(summary, "test")
    classes = train.shape[1]
    head = "client  train  test  | " + " ".join(f"{c:>5d}" for c in range(classes))
    rows = [head, "-" * len(head)]
    for cid in range(train.shape[0]):
        rows.append(
            f"{cid:>6d} {train[cid].sum():>6d} {test[cid].sum():>5d}  | "
            + " ".join(f"{v:>5d}" for v in train[cid])
        )
    rows.append(f" total {train.sum():>6d} {test.sum():>5d}")
    return "\n".join(rows)


def heatmap_png(summary: dict[str, Any], path: Path, title: str = "") -> Path:
    """Clients x classes heatmap of training-sample counts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = _counts(summary, "train")
    fig, ax = plt.subplots(
        figsize=(max(5, train.shape[1] * 0.45 + 2), max(3, train.shape[0] * 0.25 + 1.5))
    )
    im = ax.imshow(train, aspect="auto", cmap="viridis")
    ax.set_xlabel("class")
    ax.set_ylabel("client (partition id)")
    ax.set_title(title or "training samples per client and class", fontsize=9)
    fig.colorbar(im, ax=ax, label="samples")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
