"""Readers for the published files of Fashion-MNIST and CIFAR-10/100.

Both are parsed directly with numpy (IDX and python-pickle batches, in
torchvision's folder layout); torchvision is imported only to download them.
"""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from common.errors import ConfigError

DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
"""Where the Debian package ``dataset-fashion-mnist`` installs the IDX files."""

FASHION_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)

Arrays = tuple[NDArray[np.uint8], NDArray[np.int64]]


def read_idx(path: Path) -> NDArray[np.uint8]:
    """Parse an IDX file (``.gz`` or raw) holding unsigned bytes."""
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    if len(raw) < 4 or raw[:2] != b"\x00\x00" or raw[2] != 0x08:
        raise ConfigError(f"{path} is not an IDX file of unsigned bytes")
    ndim = raw[3]
    dims = [raw[4 + 4 * i : 8 + 4 * i] for i in range(ndim)]
    shape = tuple(int.from_bytes(d, "big") for d in dims)
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def download(name: str, root: Path) -> None:
    """Download a torchvision dataset class ``name`` (train and test) into ``root``."""
    import torchvision.datasets

    try:
        dataset_class = getattr(torchvision.datasets, name)
        for train in (True, False):
            dataset_class(str(root), train=train, download=True)
    except Exception as exc:  # network, disk and checksum errors alike
        reason = " ".join(str(exc).split())
        raise ConfigError(
            f"downloading {name} into {root} failed ({reason}); place the files "
            "there yourself and set data.download=false"
        ) from None


def fashion_mnist_dirs(root: Path) -> list[Path]:
    """Folders searched, in order, for the Fashion-MNIST IDX files."""
    return [root, root / "FashionMNIST" / "raw", DEBIAN_FASHION_MNIST]


def _find_fashion_mnist(root: Path) -> list[Path] | None:
    """The four IDX files (``.gz`` or raw) from the first folder holding all."""
    for folder in fashion_mnist_dirs(root):
        found = []
        for stem in FASHION_FILES:
            names = [folder / (stem + ".gz"), folder / stem]
            found += [p for p in names if p.is_file()][:1]
        if len(found) == len(FASHION_FILES):
            return found
    return None


def load_fashion_mnist(root: Path, allow_download: bool) -> tuple[Arrays, Arrays]:
    """Fashion-MNIST as ``uint8 [N, 28, 28, 1]`` images and ``int64`` labels.

    Looks in ``root``, ``root/FashionMNIST/raw`` and :data:`DEBIAN_FASHION_MNIST`;
    downloads into ``root`` with torchvision when allowed and not found.

    Returns
    -------
    tuple
        ``((x_train, y_train), (x_test, y_test))``.
    """
    files = _find_fashion_mnist(root)
    if files is None and allow_download:
        download("FashionMNIST", root)
        files = _find_fashion_mnist(root)
    if files is None:
        looked = ", ".join(str(d) for d in fashion_mnist_dirs(root))
        raise ConfigError(
            f"Fashion-MNIST IDX files not found (looked in {looked}); run "
            "'apt-get install dataset-fashion-mnist', set data.root to a folder "
            "with train-images-idx3-ubyte.gz etc., or set data.download=true"
        )
    x_train, y_train, x_test, y_test = (read_idx(p) for p in files)
    return (
        (x_train[..., None], y_train.astype(np.int64)),
        (x_test[..., None], y_test.astype(np.int64)),
    )


def _cifar_batches(folder: Path, names: list[str], key: str) -> Arrays:
    images, labels = [], []
    for name in names:
        path = folder / name
        try:
            with path.open("rb") as handle:
                batch = pickle.load(handle, encoding="latin1")
        except (OSError, pickle.UnpicklingError, EOFError) as exc:
            raise ConfigError(f"cannot read CIFAR batch {path}: {exc}") from None
        images.append(np.asarray(batch["data"], dtype=np.uint8))
        labels.append(np.asarray(batch[key], dtype=np.int64))
    x = np.concatenate(images).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(x), np.concatenate(labels)


def load_cifar(root: Path, classes: int, allow_download: bool) -> tuple[Arrays, Arrays]:
    """CIFAR-10 (``classes=10``) or CIFAR-100 as ``uint8 [N, 32, 32, 3]`` arrays.

    ``root`` is the folder holding ``cifar-10-batches-py`` / ``cifar-100-python``
    (or that folder itself). CIFAR-100 uses the 100 fine labels.

    Returns
    -------
    tuple
        ``((x_train, y_train), (x_test, y_test))``.
    """
    folder_name = "cifar-10-batches-py" if classes == 10 else "cifar-100-python"
    folder = root if root.name == folder_name else root / folder_name
    if not folder.is_dir() and allow_download:
        download("CIFAR10" if classes == 10 else "CIFAR100", root)
    if not folder.is_dir():
        raise ConfigError(
            f"CIFAR-{classes} not found at {folder}; set data.root to the folder "
            f"that contains {folder_name}/, or set data.download=true"
        )
    if classes == 10:
        train_files = [f"data_batch_{i}" for i in range(1, 6)]
        test_files, key = ["test_batch"], "labels"
    else:
        train_files, test_files, key = ["train"], ["test"], "fine_labels"
    train = _cifar_batches(folder, train_files, key)
    return train, _cifar_batches(folder, test_files, key)
