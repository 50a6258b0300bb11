"""Reading partition folders in the *clients-npz* layout.

A partition folder holds, for every client ``i`` (``i = 0, 1, ...``)::

    train/<i>.npz    x: images, y: int64 labels (the client's local train share)
    test/<i>.npz     the client's local test share, same arrays
    global_test.npz  optional: the official test set (``data.protocol = official``)
    meta.json        optional: num_classes, mean, std, image_shape, settings and
                     per-client class counts (always written by this package)

Arrays are stored uncompressed and are read with ``allow_pickle=False``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from common.errors import ConfigError

if TYPE_CHECKING:
    from common.config import DataConfig

META_FILE = "meta.json"
GLOBAL_TEST_FILE = "global_test.npz"


def count_clients(folder: Path) -> int:
    """Number of ``train/<i>.npz`` files with an integer name ``i``."""
    return sum(1 for p in (folder / "train").glob("*.npz") if p.stem.isdigit())


def clients_npz_dir(cfg: DataConfig, num_partitions: int) -> Path:
    """Validate ``data.root`` as a clients-npz folder with enough clients."""
    folder = Path(cfg.root).expanduser()
    if not cfg.root or not (folder / "train").is_dir() or not (folder / "test").is_dir():
        raise ConfigError(
            f"data.root = {cfg.root!r} is not a clients-npz folder; it must hold "
            "train/<id>.npz and test/<id>.npz (id = 0, 1, ...)"
        )
    available = count_clients(folder)
    if num_partitions > available:
        raise ConfigError(
            f"{folder} holds {available} clients (train/<id>.npz) but "
            f"{num_partitions} partitions were requested; use at most {available}"
        )
    return folder


def client_files(folder: Path, partition_id: int) -> tuple[Path, Path]:
    """``train/<id>.npz`` and ``test/<id>.npz``; ConfigError naming a missing one."""
    files = (
        folder / "train" / f"{partition_id}.npz",
        folder / "test" / f"{partition_id}.npz",
    )
    for path in files:
        if not path.is_file():
            raise ConfigError(f"client file {path} is missing")
    return files


def read_meta(folder: Path) -> dict[str, Any] | None:
    """``meta.json`` of a partition folder, or ``None`` when there is none."""
    path = folder / META_FILE
    if not path.is_file():
        return None
    try:
        meta: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    return meta


def read_labels(path: Path) -> NDArray[np.int64]:
    """Only the ``y`` array of a client file."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            return np.asarray(archive["y"], dtype=np.int64)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"cannot read array 'y' from {path}: {exc}") from None


def partition_summary(path: str | Path) -> dict[str, Any]:
    """Per-client class counts of a partition folder (for printing and heatmaps).

    Returns
    -------
    dict
        ``meta.json`` (``num_clients``, ``num_classes``, ``train_class_counts``,
        ``test_class_counts`` as lists of per-class lists, ...). For folders
        without ``meta.json`` the counts are computed from the label arrays.
    """
    folder = Path(path).expanduser()
    meta = read_meta(folder)
    if meta is not None:
        return meta
    n = count_clients(folder)
    if n == 0:
        raise ConfigError(f"{folder} holds no train/<id>.npz client files")
    labels = {
        split: [read_labels(f) for f in (client_files(folder, i)[k] for i in range(n))]
        for k, split in enumerate(("train", "test"))
    }
    num_classes = 1 + max(int(y.max()) for ys in labels.values() for y in ys if len(y))
    summary: dict[str, Any] = {"num_clients": n, "num_classes": num_classes}
    for split, ys in labels.items():
        summary[f"{split}_class_counts"] = [
            np.bincount(y, minlength=num_classes).tolist() for y in ys
        ]
    return summary
