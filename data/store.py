"""The on-disk partition cache, in the *clients-npz* layout (see :mod:`data.layout`).

Client files written here hold ``x``: ``uint8 [n, H, W, C]`` and ``y``: ``int64
[n]``; ``global_test.npz`` is written only for ``data.protocol = official``.
:func:`prepare_partition` computes such a folder once per setting (keyed by
:func:`partition_key`) under ``data.cache-dir``; concurrent callers are
serialised with ``fcntl.flock`` and the folder appears atomically (written to a
temporary folder, then renamed). :func:`export_partition` copies it elsewhere so
the same split can be used with ``data.name = clients-npz``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from common.errors import ConfigError
from data.datasets import Dataset, feature_stats, load_arrays
from data.layout import GLOBAL_TEST_FILE, META_FILE, clients_npz_dir
from data.layout import partition_summary as partition_summary
from data.partition import (
    IndexArray,
    dirichlet,
    iid,
    pathological,
    split_train_test,
    stratified_fraction,
)

if TYPE_CHECKING:
    from common.config import DataConfig

FORMAT_VERSION = 1
DEFAULT_CACHE_DIR = Path("~/.cache/fedhet/partitions")
COMPLETE_MARKER = ".complete"

# Independent random streams derived from the run seed.
_STREAM_FRACTION, _STREAM_PARTITION, _STREAM_SPLIT, _STREAM_GLOBAL_TEST = 0, 1, 2, 3


def _rng(seed: int, *stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, *stream])


def cache_dir(cfg: DataConfig) -> Path:
    """``data.cache-dir`` with ``~`` expanded, or :data:`DEFAULT_CACHE_DIR`."""
    return Path(cfg.cache_dir or DEFAULT_CACHE_DIR).expanduser()


def _root_identity(cfg: DataConfig) -> str:
    """The resolved data root; for a file root also its size and mtime."""
    if cfg.name == "synthetic" or not cfg.root:
        return ""
    path = Path(cfg.root).expanduser().resolve()
    if path.is_file():
        stat = path.stat()
        return f"{path}:{stat.st_size}:{stat.st_mtime_ns}"
    return str(path)


def split_settings(cfg: DataConfig, num_partitions: int, seed: int) -> dict[str, Any]:
    """Exactly the settings that determine a partition (and nothing else)."""
    settings: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "name": cfg.name,
        "root": _root_identity(cfg),
        "partition": cfg.partition,
        "protocol": cfg.protocol,
        "fraction": cfg.fraction,
        "train_fraction": cfg.train_fraction,
        "min_train_samples": cfg.min_train_samples,
        "min_test_samples": cfg.min_test_samples,
        "num_partitions": num_partitions,
        "seed": seed,
    }
    if cfg.partition == "dirichlet":
        settings["alpha"] = cfg.alpha
    if cfg.partition == "pathological":
        settings["classes_per_client"] = cfg.classes_per_client
    return settings


def partition_key(cfg: DataConfig, num_partitions: int, seed: int) -> str:
    """A short, stable name for a partition: ``<dataset>-<16 hex digits>``."""
    text = json.dumps(split_settings(cfg, num_partitions, seed), sort_keys=True)
    return f"{cfg.name}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def _pool(ds: Dataset, cfg: DataConfig) -> tuple[NDArray[np.uint8], NDArray[np.int64], bool]:
    """The samples to partition, and whether a global test set is written."""
    if cfg.protocol == "official":
        if ds.x_test is None:
            raise ConfigError(
                f"data.protocol = official needs an official test split, but "
                f"{cfg.name} has none; use data.protocol = merge"
            )
        return ds.x_train, ds.y_train, True
    if ds.x_test is None or ds.y_test is None:
        return ds.x_train, ds.y_train, False
    return (
        np.concatenate([ds.x_train, ds.x_test]),
        np.concatenate([ds.y_train, ds.y_test]),
        False,
    )


def _client_shares(
    cfg: DataConfig, labels: NDArray[np.int64], num_partitions: int, seed: int
) -> list[IndexArray]:
    """Indices into ``labels`` of every client's whole share (before 75/25)."""
    keep = np.arange(len(labels), dtype=np.int64)
    if cfg.fraction < 1:
        keep = stratified_fraction(labels, cfg.fraction, _rng(seed, _STREAM_FRACTION))
    rng = _rng(seed, _STREAM_PARTITION)
    min_size = cfg.min_train_samples + cfg.min_test_samples
    kept = labels[keep]
    if cfg.partition == "dirichlet":
        parts = dirichlet(kept, num_partitions, cfg.alpha, rng, min_size)
    elif cfg.partition == "pathological":
        parts = pathological(kept, num_partitions, cfg.classes_per_client, rng, min_size)
    else:
        parts = iid(kept, num_partitions, rng, min_size)
    return [keep[part] for part in parts]


def _save(path: Path, x: NDArray[Any], y: NDArray[np.int64]) -> None:
    with path.open("wb") as handle:
        np.savez(handle, x=x, y=y)


def _stats_meta(ds: Dataset, x: NDArray[Any], trained: list[IndexArray]) -> dict[str, Any]:
    """meta.json's normalisation and input entries. Images keep the dataset's
    per-channel statistics; features are standardised with the per-feature mean and
    std of the clients' training samples only (no local test sample enters them)."""
    if not ds.tabular:
        return {"mean": list(ds.mean), "std": list(ds.std), "image_shape": list(ds.input_shape)}
    mean, std = feature_stats(x[np.concatenate(trained)])
    return {"mean": list(mean), "std": list(std), "features": int(x.shape[1])}


def write_partition(
    cfg: DataConfig, num_partitions: int, seed: int, out: Path, only: int | None = None
) -> None:
    """Compute the partition and write it in the clients-npz layout into ``out``.

    ``only``: write that client's two files alone (and only its class counts in
    ``meta.json``, with ``"only": id``); every share is still computed, so the files and
    the normalisation equal those of the whole partition."""
    ds = load_arrays(cfg)
    x, y, global_test = _pool(ds, cfg)
    counts: dict[str, list[list[int]]] = {"train": [], "test": []}
    (out / "train").mkdir(parents=True, exist_ok=True)
    (out / "test").mkdir(exist_ok=True)
    trained: list[IndexArray] = []
    for cid, share in enumerate(_client_shares(cfg, y, num_partitions, seed)):
        train, test = split_train_test(
            share, cfg.train_fraction, _rng(seed, _STREAM_SPLIT, cid),
            cfg.min_train_samples, cfg.min_test_samples,
        )  # fmt: skip
        trained.append(train)
        if only is not None and cid != only:
            continue
        for split, idx in (("train", train), ("test", test)):
            _save(out / split / f"{cid}.npz", x[idx], y[idx])
            counts[split].append(np.bincount(y[idx], minlength=ds.num_classes).tolist())
    if global_test and ds.x_test is not None and ds.y_test is not None:
        idx = np.arange(len(ds.y_test))
        if cfg.fraction < 1:
            rng = _rng(seed, _STREAM_GLOBAL_TEST)
            idx = stratified_fraction(ds.y_test, cfg.fraction, rng)
        _save(out / GLOBAL_TEST_FILE, ds.x_test[idx], ds.y_test[idx])
    meta = {
        "format": FORMAT_VERSION,
        "num_clients": num_partitions,
        "num_classes": ds.num_classes,
        **_stats_meta(ds, x, trained),
        "settings": split_settings(cfg, num_partitions, seed),
        "train_class_counts": counts["train"],
        "test_class_counts": counts["test"],
    }
    if only is not None:
        meta["only"] = only
    (out / META_FILE).write_text(json.dumps(meta))


def _build(cfg: DataConfig, num_partitions: int, seed: int, target: Path, only: int | None) -> None:
    """Write the partition to a temporary folder, then rename it to ``target``.

    Only called while holding the partition's lock.
    """
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if target.exists():
        shutil.rmtree(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        write_partition(cfg, num_partitions, seed, tmp, only)
        (tmp / COMPLETE_MARKER).write_text(target.name)
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def prepare_partition(
    cfg: DataConfig, num_partitions: int, seed: int, only: int | None = None
) -> Path:
    """The partition folder for these settings, computing it on first use.

    Safe to call from many processes at once: one computes, the others wait on
    a lock file and then reuse the result. For ``data.name = clients-npz`` the
    folder ``data.root`` is validated and returned as is. ``only``: a folder of its
    own that holds client ``only``'s files alone (a node that keeps no other node's
    data on its disk: node-config ``data-cache = "own"``).

    Parameters
    ----------
    cfg : DataConfig
        Dataset and split settings.
    num_partitions : int
        Number of clients.
    seed : int
        Run seed; drives the fraction, the partition and every local split.

    Returns
    -------
    Path
        A folder in the clients-npz layout.
    """
    if cfg.name == "clients-npz":
        return clients_npz_dir(cfg, num_partitions)
    if num_partitions < 1:
        raise ConfigError(f"the number of partitions must be >= 1, got {num_partitions}")
    if only is not None and not 0 <= only < num_partitions:
        raise ConfigError(f"partition id {only} is outside 0 .. {num_partitions - 1}")
    root = cache_dir(cfg)
    key = partition_key(cfg, num_partitions, seed)
    target = root / (key if only is None else f"{key}-only-{only}")
    if (target / COMPLETE_MARKER).is_file():
        return target
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = (root / f".{target.name}.lock").open("w")
    except OSError as exc:
        raise ConfigError(f"data.cache-dir {root} is not writable: {exc}") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not (target / COMPLETE_MARKER).is_file():
                _build(cfg, num_partitions, seed, target, only)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return target


def export_partition(cfg: DataConfig, num_partitions: int, seed: int, out_dir: str | Path) -> Path:
    """Write the partition for these settings to ``out_dir`` (clients-npz layout).

    The folder can then be used elsewhere with ``data.name = clients-npz`` and
    ``data.root = out_dir`` to run on exactly the same split.

    Raises
    ------
    ConfigError
        When ``out_dir`` exists and is not empty.
    """
    out = Path(out_dir).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"export folder {out} exists and is not empty; pick another")
    source = prepare_partition(cfg, num_partitions, seed)
    ignore = shutil.ignore_patterns(COMPLETE_MARKER)
    shutil.copytree(source, out, ignore=ignore, dirs_exist_ok=True)
    return out
