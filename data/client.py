"""One client's data as normalised tensors: :class:`ClientData` and its loaders.

:func:`load_client_data` reads a client's two files from a partition folder
(the cache of :func:`data.store.prepare_partition`, or a ``clients-npz``
folder); :func:`load_local_data` reads a device's own dataset without any
global partition. torch is imported only when tensors are built.

Client files hold ``uint8`` images ``[n, H, W]`` / ``[n, H, W, C]`` (normalised
here with the folder's mean and std), ``float32`` images ``[n, C, H, W]`` as PFLlib
exports them, which are taken as already normalised (mean 0, std 1), or feature
vectors ``[n, F]`` (tabular or sensor data; any real dtype, read as float32),
standardised per feature with the folder's mean and std: ``(x - mean) / std``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from logging import INFO
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray
from pydantic import ValidationError

from common.config import DataConfig
from common.errors import ConfigError
from data.datasets import channel_stats, check_features, feature_stats, load_arrays
from data.layout import (
    GLOBAL_TEST_FILE,
    client_files,
    count_clients,
    partition_summary,
    read_meta,
)
from data.partition import split_train_test
from data.store import prepare_partition

if TYPE_CHECKING:
    import torch

CACHE_ENTRIES = 64
CACHE_BYTES = 2 << 30
"""Per-process cache bounds for :func:`load_client_data` (entries, tensor bytes)."""

Stats = tuple[tuple[float, ...], tuple[float, ...]]


@dataclass(frozen=True, eq=False)
class ClientData:
    """A client's local train and test data, ready for a model.

    Tensors may be shared with a per-process cache: do not modify them in place.

    Attributes
    ----------
    x_train, x_test : torch.Tensor
        ``float32`` images ``[n, C, H, W]``, normalised with the dataset's
        per-channel mean and std, or standardised features ``[n, F]``.
    y_train, y_test : torch.Tensor
        ``int64`` labels ``[n]``.
    num_classes : int
        Number of classes of the whole dataset (not only this client's).
    in_channels : int
        ``C`` (images) or ``F`` (features).
    image_size : int
        ``H`` (images); 0 for feature vectors.
    train_class_counts : numpy.ndarray
        ``int64`` ``[num_classes]``: training samples per class.
    """

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    in_channels: int
    image_size: int
    train_class_counts: NDArray[np.int64]
    resized_from: int = 0
    """The images' own side when they were resized to ``image_size`` (0: not resized)."""
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()
    """The normalisation the samples got: per channel on the [0, 1] pixel scale
    (images), or per feature in the features' units (``(x - mean) / std``)."""

    @property
    def tabular(self) -> bool:
        """Whether the samples are feature vectors ``[n, F]`` (``image_size`` 0)."""
        return self.image_size == 0

    @property
    def input_shape(self) -> tuple[int, ...]:
        """One sample's shape: ``(C, H, W)``, or ``(F,)`` for feature vectors."""
        return tuple(int(v) for v in self.x_train.shape[1:])


MIN_SIDE = 16
"""The smallest image side the model families' stems take (``models/nets.py``)."""


def target_side(side: int, requested: int = 0) -> int:
    """The side images of ``side`` px are used at: ``requested`` (``data.image-size``)
    when set, else :data:`MIN_SIDE` for smaller images, else their own."""
    if requested > 0:
        return requested
    return max(side, MIN_SIDE)


def resize(images: torch.Tensor, side: int) -> torch.Tensor:
    """``[n, C, H, W]`` to ``[n, C, side, side]``, bilinear, half-pixel centres (torch's
    ``interpolate(..., align_corners=False)``; ``cli/predict.py`` repeats it in numpy)."""
    import torch.nn.functional as F

    if images.shape[-1] == side and images.shape[-2] == side:
        return images
    return F.interpolate(images, size=(side, side), mode="bilinear", align_corners=False)


_said_resized: set[tuple[int, int]] = set()


def _say_resized(side: int, target: int) -> None:
    if (side, target) in _said_resized:
        return
    _said_resized.add((side, target))
    from flwr.common.logger import log

    log(
        INFO,
        "fedhet: images are %dx%d px; resized to %dx%d (bilinear) as they load "
        "(data.image-size chooses the side)",
        side,
        side,
        target,
        target,
    )


def to_tensor(x: NDArray[Any], mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """Samples as a ``float32`` tensor: images ``[n, C, H, W]`` or features ``[n, F]``.

    ``uint8 [n, H, W(, C)]`` is scaled to ``[0, 1]`` and normalised with the
    per-channel ``mean`` and ``std``; ``float32 [n, C, H, W]`` is taken as is;
    features ``[n, F]`` become ``(x - mean) / std`` per feature.
    """
    import torch

    if x.ndim == 2:
        centred = (x.astype(np.float64) - np.asarray(mean)) / np.asarray(std)
        return torch.from_numpy(np.ascontiguousarray(centred, dtype=np.float32))
    if x.dtype == np.float32:
        return torch.from_numpy(np.ascontiguousarray(x))
    images = x[..., None] if x.ndim == 3 else x
    tensor = torch.from_numpy(images).permute(0, 3, 1, 2).to(torch.float32).contiguous()
    shape = (1, -1, 1, 1)
    tensor.div_(255.0).sub_(torch.tensor(mean).view(shape)).div_(torch.tensor(std).view(shape))
    return tensor


def _read_client_file(path: Path) -> tuple[NDArray[Any], NDArray[np.int64]]:
    """``x`` and ``y`` of a client file, validated (see the module docstring)."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            x, y = archive["x"], archive["y"]
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"cannot read arrays 'x' and 'y' from {path}: {exc}") from None
    if x.ndim == 2:
        x = check_features(x, f"array 'x' in {path}")
    uint8_ok = x.dtype == np.uint8 and (x.ndim == 3 or (x.ndim == 4 and x.shape[-1] in (1, 3)))
    float_ok = x.dtype == np.float32 and x.ndim == 4 and x.shape[1] in (1, 3)
    if not (uint8_ok or float_ok or x.ndim == 2):
        raise ConfigError(
            f"array 'x' in {path} has dtype {x.dtype} and shape {x.shape}; expected "
            "uint8 [n, H, W(, C)] or float32 [n, C, H, W] with C = 1 or 3 (images), "
            "or float32 [n, F] (features)"
        )
    if not np.issubdtype(y.dtype, np.integer) or y.shape != (len(x),):
        raise ConfigError(f"array 'y' in {path} must hold {len(x)} integer labels")
    return x, y.astype(np.int64)


@lru_cache(maxsize=16)
def _folder_info(folder: str) -> tuple[int, Stats]:
    """``num_classes`` and ``(mean, std)`` of a partition folder.

    From ``meta.json`` when present; otherwise the classes are counted from all
    label arrays and ``uint8`` (per channel) or feature (per feature) statistics are
    computed over all training files (never the test files).
    """
    path = Path(folder)
    meta = read_meta(path)
    if meta is not None:
        return int(meta["num_classes"]), (tuple(meta["mean"]), tuple(meta["std"]))
    num_classes = int(partition_summary(path)["num_classes"])
    images = [_read_client_file(client_files(path, i)[0])[0] for i in range(count_clients(path))]
    if images[0].ndim == 2:
        return num_classes, feature_stats(np.concatenate(images))
    if images[0].dtype == np.float32:
        channels = images[0].shape[1]
        return num_classes, ((0.0,) * channels, (1.0,) * channels)
    pooled = np.concatenate([x[..., None] if x.ndim == 3 else x for x in images])
    return num_classes, channel_stats(pooled)


def _client_data(
    train: tuple[NDArray[Any], NDArray[np.int64]],
    test: tuple[NDArray[Any], NDArray[np.int64]],
    num_classes: int,
    stats: Stats,
    image_size: int = 0,
) -> ClientData:
    import torch

    x_train, x_test = to_tensor(train[0], *stats), to_tensor(test[0], *stats)
    side = target = resized_from = 0  # feature vectors: no image side
    if x_train.ndim == 2:
        if image_size:
            raise ConfigError(
                f"data.image-size = {image_size} resizes images, but the data are "
                f"feature vectors [n, {x_train.shape[1]}]; set data.image-size = 0"
            )
        if x_test.shape[1:] != x_train.shape[1:]:
            raise ConfigError(
                f"test samples have {x_test.shape[1]} features, training samples {x_train.shape[1]}"
            )
    else:
        side = int(x_train.shape[2])
        target = target_side(side, image_size)
        if target != side:
            _say_resized(side, target)
            x_train, x_test = resize(x_train, target), resize(x_test, target)
            resized_from = side
    return ClientData(
        x_train=x_train,
        y_train=torch.from_numpy(train[1]),
        x_test=x_test,
        y_test=torch.from_numpy(test[1]),
        num_classes=num_classes,
        in_channels=int(x_train.shape[1]),
        image_size=target,
        train_class_counts=np.bincount(train[1], minlength=num_classes).astype(np.int64),
        resized_from=resized_from,
        mean=tuple(stats[0]),
        std=tuple(stats[1]),
    )


_CACHE: OrderedDict[tuple[Any, ...], ClientData] = OrderedDict()


def _nbytes(data: ClientData) -> int:
    return sum(
        t.element_size() * t.nelement()
        for t in (data.x_train, data.y_train, data.x_test, data.y_test)
    )


def _remember(key: tuple[Any, ...], data: ClientData) -> None:
    """Insert into the LRU cache, evicting beyond the entry and byte bounds."""
    _CACHE[key] = data
    while len(_CACHE) > CACHE_ENTRIES or (
        len(_CACHE) > 1 and sum(_nbytes(d) for d in _CACHE.values()) > CACHE_BYTES
    ):
        _CACHE.popitem(last=False)


def load_client_data(
    cfg: DataConfig, partition_id: int, num_partitions: int, seed: int, own_only: bool = False
) -> ClientData:
    """Client ``partition_id``'s local train and test data.

    Prepares (or reuses) the cached partition, or reads the ``clients-npz``
    folder directly, then loads only this client's two files. Results are kept
    in a small per-process LRU cache.

    Parameters
    ----------
    cfg : DataConfig
        Dataset and split settings.
    partition_id : int
        Client index in ``0 .. num_partitions - 1``.
    num_partitions : int
        Number of clients.
    seed : int
        Run seed (see :func:`data.store.prepare_partition`).
    own_only : bool
        Keep only this client's files on disk (a folder of its own in the cache;
        the same files and normalisation as the whole partition's).

    Returns
    -------
    ClientData
        The client's normalised tensors and metadata.
    """
    if not 0 <= partition_id < num_partitions:
        raise ConfigError(f"partition id {partition_id} is outside 0 .. {num_partitions - 1}")
    key = (cfg, partition_id, num_partitions, seed)
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    folder = prepare_partition(cfg, num_partitions, seed, partition_id if own_only else None)
    train_file, test_file = client_files(folder, partition_id)
    num_classes, stats = _folder_info(str(folder.resolve()))
    data = _client_data(
        _read_client_file(train_file),
        _read_client_file(test_file),
        num_classes,
        stats,
        cfg.image_size,
    )
    _remember(key, data)
    return data


def load_global_test(
    cfg: DataConfig, num_partitions: int, seed: int, only: int | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The official test set of a ``data.protocol = official`` partition (``only``:
    of the folder that holds that client's files alone, see ``prepare_partition``).

    Returns
    -------
    tuple of torch.Tensor or None
        Normalised images ``[n, C, H, W]`` and labels; ``None`` when the
        partition has no global test set (``merge`` protocol).
    """
    import torch

    folder = prepare_partition(cfg, num_partitions, seed, only)
    path = folder / GLOBAL_TEST_FILE
    if not path.is_file():
        return None
    _, stats = _folder_info(str(folder.resolve()))
    x, y = _read_client_file(path)
    samples = to_tensor(x, *stats)
    if samples.ndim == 2:
        return samples, torch.from_numpy(y)
    return resize(samples, target_side(int(samples.shape[2]), cfg.image_size)), torch.from_numpy(y)


def load_local_data(
    name: str,
    root: str | Path,
    train_fraction: float = 0.75,
    seed: int = 0,
    min_train_samples: int = 1,
    min_test_samples: int = 1,
    image_size: int = 0,
) -> ClientData:
    """A device's own dataset, split locally; no global partition is involved.

    Parameters
    ----------
    name : str
        A ``data.name`` that :func:`data.load_arrays` reads, typically ``npz``
        or ``imagefolder``.
    root : str or Path
        The device's ``.npz`` file or image folder.
    train_fraction : float, optional
        Share used for training when the source has no test split of its own
        (an ``.npz`` with ``x_test`` / ``y_test`` uses those for testing).
    seed : int, optional
        Seed of the local train/test split.
    min_train_samples, min_test_samples : int, optional
        Smallest allowed local train and test sets.

    Returns
    -------
    ClientData
        The device's normalised tensors (statistics computed from its data).
    """
    path = Path(root).expanduser()
    if not path.exists():
        raise ConfigError(f"local data path {path} does not exist; check data.root")
    try:
        cfg = DataConfig.model_validate(
            {"name": name, "root": str(path), "train_fraction": train_fraction}
        )
    except ValidationError as exc:
        raise ConfigError(f"invalid local data settings: {exc.errors()[0]['msg']}") from None
    ds = load_arrays(cfg)
    stats = (ds.mean, ds.std)
    if ds.x_test is not None and ds.y_test is not None:
        train, test = (ds.x_train, ds.y_train), (ds.x_test, ds.y_test)
    else:
        train_idx, test_idx = split_train_test(
            np.arange(len(ds.y_train)), train_fraction, np.random.default_rng(seed),
            min_train_samples, min_test_samples,
        )  # fmt: skip
        train = (ds.x_train[train_idx], ds.y_train[train_idx])
        test = (ds.x_train[test_idx], ds.y_train[test_idx])
    if ds.tabular:
        stats = feature_stats(train[0])  # the local training samples only
    return _client_data(train, test, ds.num_classes, stats, image_size)
