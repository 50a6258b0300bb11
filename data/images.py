"""Image-file sources read with Pillow: Tiny-ImageNet and plain image folders.

Pillow (a torchvision dependency) is imported only inside the readers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from common.errors import ConfigError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")
GRAY_MODES = frozenset({"1", "L", "LA", "I", "I;16", "F"})
TINY_IMAGENET_SIZE = (64, 64)

Arrays = tuple[NDArray[np.uint8], NDArray[np.int64]]


def read_images(paths: Sequence[Path], size: tuple[int, int], mode: str) -> NDArray[np.uint8]:
    """Decode image files into one ``uint8`` array of shape ``[N, H, W, C]``.

    Parameters
    ----------
    paths : sequence of Path
        Image files.
    size : tuple of int
        Target ``(width, height)``; other sizes are resized (bilinear).
    mode : str
        Pillow mode to convert to: ``"RGB"`` (C=3) or ``"L"`` (C=1).

    Returns
    -------
    numpy.ndarray
        The decoded images.
    """
    from PIL import Image

    width, height = size
    channels = 3 if mode == "RGB" else 1
    out = np.empty((len(paths), height, width, channels), dtype=np.uint8)
    for i, path in enumerate(paths):
        try:
            with Image.open(path) as image:
                converted = image.convert(mode)
                if converted.size != size:
                    converted = converted.resize(size, Image.Resampling.BILINEAR)
                out[i] = np.asarray(converted).reshape(height, width, channels)
        except OSError as exc:
            raise ConfigError(f"cannot read image {path}: {exc}") from None
    return out


def tiny_imagenet_dir(root: Path) -> Path:
    """The ``tiny-imagenet-200`` folder: ``root`` itself or ``root/tiny-imagenet-200``.

    Raises
    ------
    ConfigError
        When neither holds ``wnids.txt``.
    """
    for candidate in (root, root / "tiny-imagenet-200"):
        if (candidate / "wnids.txt").is_file():
            return candidate
    raise ConfigError(
        f"Tiny-ImageNet not found: neither {root} nor {root / 'tiny-imagenet-200'} "
        "holds wnids.txt; download and unzip tiny-imagenet-200.zip there, or set "
        "data.root to its folder"
    )


def load_tiny_imagenet(root: Path) -> tuple[Arrays, Arrays]:
    """Read Tiny-ImageNet (train and val) as 64x64 RGB ``uint8`` arrays.

    Classes are the sorted WordNet ids of ``wnids.txt``; the official ``val``
    split (labels from ``val/val_annotations.txt``) is returned as the test set.

    Parameters
    ----------
    root : Path
        The ``tiny-imagenet-200`` folder or its parent.

    Returns
    -------
    tuple
        ``((x_train, y_train), (x_val, y_val))``.
    """
    base = tiny_imagenet_dir(root)
    wnids = sorted(set((base / "wnids.txt").read_text().split()))
    index = {wnid: i for i, wnid in enumerate(wnids)}
    train_files: list[Path] = []
    train_labels: list[int] = []
    for wnid in wnids:
        folder = base / "train" / wnid
        files = sorted((folder / "images").glob("*.JPEG")) or sorted(folder.glob("*.JPEG"))
        if not files:
            raise ConfigError(f"Tiny-ImageNet: no training images in {folder}")
        train_files += files
        train_labels += [index[wnid]] * len(files)
    annotations = base / "val" / "val_annotations.txt"
    if not annotations.is_file():
        raise ConfigError(f"Tiny-ImageNet: {annotations} is missing")
    val_files: list[Path] = []
    val_labels: list[int] = []
    for line in annotations.read_text().splitlines():
        fields = line.split("\t")
        if len(fields) >= 2 and fields[1] in index:
            val_files.append(base / "val" / "images" / fields[0])
            val_labels.append(index[fields[1]])
    return (
        (read_images(train_files, TINY_IMAGENET_SIZE, "RGB"), _labels(train_labels)),
        (read_images(val_files, TINY_IMAGENET_SIZE, "RGB"), _labels(val_labels)),
    )


def _labels(values: list[int]) -> NDArray[np.int64]:
    return np.asarray(values, dtype=np.int64)


def _list_image_folder(root: Path) -> tuple[list[Path], list[int], list[str]]:
    """Image files, their class indices and the sorted class names."""
    try:
        folders = sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
        files: list[Path] = []
        labels: list[int] = []
        names: list[str] = []
        for folder in folders:
            images = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
            if images:
                files += images
                labels += [len(names)] * len(images)
                names.append(folder.name)
    except OSError as exc:
        raise ConfigError(f"cannot list image folder {root}: {exc}") from None
    if not files:
        raise ConfigError(
            f"data.root={root} holds no images; expected class_name/*.png "
            f"(or {', '.join(IMAGE_SUFFIXES[1:])}) sub-folders"
        )
    return files, labels, names


def load_image_folder(root: Path) -> tuple[Arrays, list[str]]:
    """Read a ``class_name/*.{png,jpg,jpeg,bmp}`` tree.

    Classes are the sub-folder names in sorted order (sub-folders without images
    are ignored). Images are converted to grayscale (``L``, C=1) when every
    image is grayscale, else to RGB (C=3), and every image is resized
    (bilinear) to the most common image size (ties: the size seen first).

    Parameters
    ----------
    root : Path
        The folder holding one sub-folder per class.

    Returns
    -------
    tuple
        ``((x, y), class_names)``.
    """
    from PIL import Image

    files, labels, names = _list_image_folder(root)
    modes: set[str] = set()
    sizes: Counter[tuple[int, int]] = Counter()
    for path in files:
        try:
            with Image.open(path) as image:
                modes.add(image.mode)
                sizes[image.size] += 1
        except OSError as exc:
            raise ConfigError(f"cannot read image {path}: {exc}") from None
    mode = "L" if modes <= GRAY_MODES else "RGB"
    size = sizes.most_common(1)[0][0]
    return (read_images(files, size, mode), _labels(labels)), names
