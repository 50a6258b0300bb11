"""Whole datasets in memory: :func:`load_arrays` and its sources.

Every source yields a :class:`Dataset` with ``int64`` labels and either ``uint8``
images ``[N, H, W, C]`` (C = 1 or 3; readers in :mod:`data.builtin` and
:mod:`data.images`) or ``float32`` feature vectors ``[N, F]`` (tabular or sensor
data, from ``npz``), standardised per feature with the mean and std of the training
samples (:func:`feature_stats`).
"""

from __future__ import annotations

import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from common.errors import ConfigError
from data.builtin import load_cifar, load_fashion_mnist
from data.images import load_image_folder, load_tiny_imagenet

if TYPE_CHECKING:
    from common.config import DataConfig

DEFAULT_DATA_ROOT = Path("~/.cache/fedhet/datasets")
"""Where datasets are looked up (and downloaded to) when ``data.root`` is empty."""

Stats = tuple[tuple[float, ...], tuple[float, ...]]
FASHION_MNIST_STATS: Stats = ((0.2860,), (0.3530,))
CIFAR10_STATS: Stats = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
CIFAR100_STATS: Stats = ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))
TINY_IMAGENET_STATS: Stats = ((0.4802, 0.4481, 0.3975), (0.2302, 0.2265, 0.2262))


@dataclass(frozen=True, eq=False)
class Dataset:
    """A whole dataset in memory.

    Attributes
    ----------
    x_train, y_train : numpy.ndarray
        ``uint8`` images ``[N, H, W, C]`` or ``float32`` features ``[N, F]``, and
        ``int64`` labels ``[N]``.
    x_test, y_test : numpy.ndarray or None
        The official test split; ``None`` when the source has none.
    num_classes : int
        Number of classes (labels lie in ``0 .. num_classes - 1``).
    mean, std : tuple of float
        Per-channel normalisation statistics on the ``[0, 1]`` scale (images), or
        per-feature ones in the features' own units (features).
    """

    x_train: NDArray[Any]
    y_train: NDArray[np.int64]
    x_test: NDArray[Any] | None
    y_test: NDArray[np.int64] | None
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @property
    def tabular(self) -> bool:
        """Whether the samples are feature vectors ``[N, F]`` rather than images."""
        return self.x_train.ndim == 2

    @property
    def input_shape(self) -> tuple[int, ...]:
        """``(H, W, C)`` of every image, or ``(F,)`` of every feature vector."""
        return tuple(int(v) for v in self.x_train.shape[1:])


def data_root(cfg: DataConfig) -> Path:
    """``data.root`` with ``~`` expanded, or :data:`DEFAULT_DATA_ROOT` when empty."""
    return Path(cfg.root or DEFAULT_DATA_ROOT).expanduser()


def channel_stats(x: NDArray[np.uint8], block: int = 1 << 20) -> Stats:
    """Per-channel mean and std of ``uint8`` images ``[N, H, W, C]``, on ``[0, 1]``.

    Computed in pixel blocks of ``block`` rows to bound memory. A channel with
    zero variance gets std 1.
    """
    pixels = x.reshape(-1, x.shape[-1])
    total = np.zeros(pixels.shape[1])
    squares = np.zeros(pixels.shape[1])
    for start in range(0, len(pixels), block):
        part = pixels[start : start + block].astype(np.float64) / 255.0
        total += part.sum(axis=0)
        squares += np.square(part).sum(axis=0)
    count = max(len(pixels), 1)
    mean = total / count
    std = np.sqrt(np.maximum(squares / count - np.square(mean), 0.0))
    std = np.where(std < 1e-6, 1.0, std)
    return tuple(float(v) for v in mean), tuple(float(v) for v in std)


def feature_stats(x: NDArray[np.floating[Any]]) -> Stats:
    """Per-feature mean and std of feature vectors ``[N, F]`` (float64 sums).

    A feature with zero variance (or std below 1e-6 of its own units) gets std 1,
    so standardising leaves it at 0.
    """
    values = np.asarray(x, dtype=np.float64)
    mean = values.mean(axis=0) if len(values) else np.zeros(values.shape[1])
    std = values.std(axis=0) if len(values) else np.ones(values.shape[1])
    std = np.where(std < 1e-6, 1.0, std)
    return tuple(float(v) for v in mean), tuple(float(v) for v in std)


def check_features(x: NDArray[np.generic], where: str) -> NDArray[np.float32]:
    """Validate feature vectors ``[N, F]`` (any real dtype); return them as float32.

    Raises
    ------
    ConfigError
        Naming ``where``: not 2-D, empty, not numeric, or holding NaN / infinity
        (the first such row is named).
    """
    if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
        raise ConfigError(
            f"{where} has dtype {x.dtype}; expected numbers (float32 features [N, F])"
        )
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise ConfigError(f"{where} has shape {x.shape}; expected features [N, F] with N, F >= 1")
    features = x.astype(np.float32, copy=False)
    finite = np.isfinite(features).all(axis=1)
    if not finite.all():
        bad = np.flatnonzero(~finite)
        raise ConfigError(
            f"{where} holds NaN or infinite values in {len(bad)} row(s), the first at "
            f"row {int(bad[0])}; fill or drop them before federating"
        )
    return features


def is_feature_array(x: NDArray[np.generic]) -> bool:
    """Whether an ``x`` array is read as feature vectors: 2-D ``[N, F]`` of numbers."""
    return x.ndim == 2


def _fashion_mnist(cfg: DataConfig) -> Dataset:
    train, test = load_fashion_mnist(data_root(cfg), cfg.download)
    return Dataset(*train, *test, 10, *FASHION_MNIST_STATS)


def _cifar(cfg: DataConfig, classes: int) -> Dataset:
    train, test = load_cifar(data_root(cfg), classes, cfg.download)
    stats = CIFAR10_STATS if classes == 10 else CIFAR100_STATS
    return Dataset(*train, *test, classes, *stats)


def _tiny_imagenet(cfg: DataConfig) -> Dataset:
    (x_train, y_train), (x_test, y_test) = load_tiny_imagenet(data_root(cfg))
    return Dataset(x_train, y_train, x_test, y_test, 200, *TINY_IMAGENET_STATS)


def _check_images(x: NDArray[np.generic], where: str) -> NDArray[np.uint8]:
    """Validate ``uint8`` images ``[N, H, W]`` or ``[N, H, W, C]``; return 4-D."""
    if x.dtype != np.uint8:
        raise ConfigError(f"{where} has dtype {x.dtype}; expected uint8 pixels in 0..255")
    if x.ndim == 3:
        x = x[..., None]
    if x.ndim != 4 or x.shape[-1] not in (1, 3) or len(x) == 0:
        raise ConfigError(
            f"{where} has shape {x.shape}; expected [N, H, W] or [N, H, W, C] "
            "with N >= 1 and C = 1 or 3"
        )
    return x.astype(np.uint8, copy=False)


def _check_labels(y: NDArray[np.generic], count: int, where: str) -> NDArray[np.int64]:
    """Validate non-negative integer labels ``[count]``."""
    if not np.issubdtype(y.dtype, np.integer) or y.shape != (count,):
        raise ConfigError(
            f"{where} has dtype {y.dtype} and shape {y.shape}; expected "
            f"{count} integer labels (one per image)"
        )
    if count and y.min() < 0:
        raise ConfigError(f"{where} holds negative labels")
    return y.astype(np.int64)


def _npz(cfg: DataConfig) -> Dataset:
    """An ``.npz`` file with ``x``, ``y`` and optionally ``x_test``, ``y_test``.

    ``x``: ``uint8`` images ``[N, H, W]`` or ``[N, H, W, C]`` (C = 1 or 3), or
    feature vectors ``[N, F]`` (float32; any real dtype is read as float32, NaN and
    infinity refused); ``y``: one non-negative integer label per sample.
    ``num_classes`` is the largest label plus one; mean and std are computed from
    ``x`` (per channel for images, per feature for features).
    """
    path = Path(cfg.root).expanduser()
    if not cfg.root or not path.is_file():
        raise ConfigError(
            f"data.root = {cfg.root!r} is not a file; point it at an .npz file "
            "with arrays 'x' and 'y'"
        )
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise ConfigError(f"cannot read {path} as .npz: {exc}") from None
    missing = [n for n in ("x", "y") if n not in arrays]
    if missing or (("x_test" in arrays) != ("y_test" in arrays)):
        raise ConfigError(
            f"{path} must hold arrays 'x' and 'y' (and optionally both 'x_test' "
            f"and 'y_test'); it holds {sorted(arrays)}"
        )
    tabular = is_feature_array(arrays["x"])
    check: Callable[[NDArray[np.generic], str], NDArray[Any]]
    check = check_features if tabular else _check_images
    x: NDArray[Any] = check(arrays["x"], f"array 'x' in {path}")
    y = _check_labels(arrays["y"], len(x), f"array 'y' in {path}")
    x_test = y_test = None
    if "x_test" in arrays:
        x_test = check(arrays["x_test"], f"array 'x_test' in {path}")
        y_test = _check_labels(arrays["y_test"], len(x_test), f"array 'y_test' in {path}")
        if x_test.shape[1:] != x.shape[1:]:
            raise ConfigError(
                f"array 'x_test' in {path} has samples of shape {x_test.shape[1:]}, "
                f"but 'x' has {x.shape[1:]}"
            )
    top = max(int(y.max()), int(y_test.max()) if y_test is not None else 0)
    stats = feature_stats(x) if tabular else channel_stats(x)
    return Dataset(x, y, x_test, y_test, top + 1, *stats)


def _image_folder(cfg: DataConfig) -> Dataset:
    root = Path(cfg.root).expanduser()
    if not cfg.root or not root.is_dir():
        raise ConfigError(
            f"data.root = {cfg.root!r} is not a folder; point it at a folder with "
            "one sub-folder of images per class"
        )
    (x, y), names = load_image_folder(root)
    return Dataset(x, y, None, None, len(names), *channel_stats(x))


SYNTHETIC_SEED = 20_240_607


def synthetic(num_train: int = 2000, num_test: int = 500) -> Dataset:
    """A small, learnable, fully deterministic 10-class dataset (for tests).

    Each class has a fixed random 7x7 block pattern upscaled to 28x28; a sample
    is its class pattern plus Gaussian pixel noise, as ``uint8`` ``[N,28,28,1]``.
    """
    rng = np.random.default_rng(SYNTHETIC_SEED)
    patterns = np.kron(rng.uniform(0.0, 1.0, size=(10, 7, 7)), np.ones((4, 4)))

    def draw(count: int) -> tuple[NDArray[np.uint8], NDArray[np.int64]]:
        labels = rng.permutation(np.arange(count) % 10).astype(np.int64)
        pixels = 40.0 + 170.0 * patterns[labels] + rng.normal(0.0, 35.0, (count, 28, 28))
        return np.clip(pixels, 0, 255).astype(np.uint8)[..., None], labels

    x_train, y_train = draw(num_train)
    x_test, y_test = draw(num_test)
    return Dataset(x_train, y_train, x_test, y_test, 10, *channel_stats(x_train))


_SOURCES: dict[str, Callable[[DataConfig], Dataset]] = {
    "fashion-mnist": _fashion_mnist,
    "cifar10": lambda cfg: _cifar(cfg, 10),
    "cifar100": lambda cfg: _cifar(cfg, 100),
    "tiny-imagenet": _tiny_imagenet,
    "npz": _npz,
    "imagefolder": _image_folder,
    "synthetic": lambda cfg: synthetic(),
}


def load_arrays(cfg: DataConfig) -> Dataset:
    """Load the whole dataset named by ``data.name`` into memory.

    Parameters
    ----------
    cfg : DataConfig
        ``name`` picks the source, ``root`` where it lives (empty: the
        defaults: :data:`DEFAULT_DATA_ROOT`, and for Fashion-MNIST also
        :data:`data.builtin.DEBIAN_FASHION_MNIST`),
        ``download`` whether torchvision may fetch Fashion-MNIST / CIFAR.

    Returns
    -------
    Dataset
        All samples, with the official test split where the source has one.

    Raises
    ------
    ConfigError
        When files are missing or malformed, or for ``clients-npz`` (a finished
        partition, read per client by :func:`data.load_client_data`).
    """
    if cfg.name == "clients-npz":
        raise ConfigError(
            "data.name = clients-npz is an already partitioned folder, not a "
            "dataset; load it per client with load_client_data"
        )
    return _SOURCES[cfg.name](cfg)
