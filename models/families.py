"""Model families: registries of extractor architectures and model construction.

A family is a tuple of architecture names; client ``k`` (partition id) gets the
architecture at position ``k mod len(family)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial

import torch
from torch import nn

from models.nets import (
    TORCHVISION_OUT_FEATURES,
    HetNet,
    cnn_extractor,
    cnn_flat_features,
    fedavgcnn_extractor,
    mlp_extractor,
    torchvision_extractor,
)

__all__ = [
    "ARCHITECTURES",
    "FAMILIES",
    "NATURAL_DIM",
    "arch_for_partition",
    "build_model",
    "extractor_out_features",
    "family_archs",
    "natural_dim",
]

_CNN_SHAPES: dict[str, tuple[int, int]] = {
    # arch -> (width of fc1, output channels of conv2)
    "cnn-1": (2000, 32),
    "cnn-2": (2000, 16),
    "cnn-3": (1000, 32),
    "cnn-4": (800, 32),
    "cnn-5": (500, 32),
}


_MLP_SHAPES: dict[str, tuple[int, ...]] = {
    # arch -> output width of each fully connected layer (the last: the family's d)
    "mlp-1": (512, 512, 128),
    "mlp-2": (512, 256, 128),
    "mlp-3": (256, 128),
    "mlp-4": (128, 128),
    "mlp-5": (64, 128),
}
MLP_DIM = 128
"""Output size of every ``mlp`` extractor (the family's natural ``d``)."""


def _takes_images(arch: str, image_size: int) -> None:
    if image_size == 0:
        raise ValueError(
            f"{arch} takes images, but the data are feature vectors [n, F]; "
            "use model.family=mlp for tabular or sensor data"
        )


def _mlp(in_channels: int, image_size: int, small_stem: bool = True, *, arch: str) -> nn.Module:
    if image_size != 0:
        raise ValueError(
            f"{arch} takes feature vectors [n, F], but the data are {image_size}x"
            f"{image_size} images; use an image family (model.family=cnn, htfe, ...)"
        )
    return mlp_extractor(in_channels, _MLP_SHAPES[arch])


def _cnn(in_channels: int, image_size: int, small_stem: bool = True, *, arch: str) -> nn.Module:
    _takes_images(arch, image_size)
    hidden, conv2 = _CNN_SHAPES[arch]
    return cnn_extractor(in_channels, image_size, hidden=hidden, conv2_channels=conv2)


def _fedavgcnn(in_channels: int, image_size: int, small_stem: bool = True) -> nn.Module:
    _takes_images("fedavgcnn", image_size)
    return fedavgcnn_extractor(in_channels, image_size)


def _torchvision(
    in_channels: int, image_size: int, small_stem: bool = True, *, arch: str
) -> nn.Module:
    _takes_images(arch, image_size)
    return torchvision_extractor(arch, in_channels, small_stem)


ARCHITECTURES: dict[str, Callable[..., nn.Module]] = {
    **{arch: partial(_cnn, arch=arch) for arch in _CNN_SHAPES},
    "fedavgcnn": _fedavgcnn,
    **{arch: partial(_torchvision, arch=arch) for arch in TORCHVISION_OUT_FEATURES},
    **{arch: partial(_mlp, arch=arch) for arch in _MLP_SHAPES},
}
"""Architecture name -> extractor builder ``(in_channels, image_size, small_stem)``.

``small_stem`` only affects the torchvision architectures. The ``mlp-*``
architectures take feature vectors (``image_size`` 0, ``in_channels`` = features);
every other one takes images.
"""

FAMILIES: dict[str, tuple[str, ...]] = {
    "cnn": tuple(_CNN_SHAPES),
    "fedavgcnn": ("fedavgcnn",),
    "htfe": ("fedavgcnn", "resnet18", "mobilenet_v2", "shufflenet_v2"),
    "htfe8": (
        "fedavgcnn",
        "googlenet",
        "mobilenet_v2",
        "resnet18",
        "resnet34",
        "resnet50",
        "resnet101",
        "resnet152",
    ),
    "mlp": tuple(_MLP_SHAPES),
}
"""Family name -> architectures, assigned round-robin by partition id."""

NATURAL_DIM: dict[str, int] = {
    "cnn": 500,
    "fedavgcnn": 512,
    "htfe": 512,
    "htfe8": 512,
    "mlp": MLP_DIM,
}
"""Family name -> natural unified representation size ``d``."""


_OUT_FEATURES: dict[str, int] = {
    **dict.fromkeys(_CNN_SHAPES, 500),
    "fedavgcnn": 512,
    **TORCHVISION_OUT_FEATURES,
    **dict.fromkeys(_MLP_SHAPES, MLP_DIM),
}
"""Architecture name -> flattened extractor output size (independent of inputs)."""


def family_archs(family: str) -> tuple[str, ...]:
    """Resolve ``model.family`` to its architectures.

    Parameters
    ----------
    family : str
        A family name (a key of ``FAMILIES``) or a comma-separated list of
        architecture names, e.g. ``"cnn-1,cnn-3"``.

    Returns
    -------
    tuple of str
        The architectures, in round-robin order.

    Raises
    ------
    ValueError
        If ``family`` is neither a family nor a list of known architectures.
    """
    if family in FAMILIES:
        return FAMILIES[family]
    archs = tuple(name.strip() for name in family.split(","))
    unknown = [name for name in archs if name not in ARCHITECTURES]
    if unknown or not family.strip():
        raise ValueError(
            f"model.family={family!r} is neither a model family nor a "
            f"comma-separated list of architectures (unknown: {unknown}); "
            f"families: {sorted(FAMILIES)}; architectures: {sorted(ARCHITECTURES)}"
        )
    return archs


def arch_for_partition(family: str, partition_id: int) -> str:
    """Return the architecture of the client with ``partition_id`` (round-robin)."""
    if partition_id < 0:
        raise ValueError(f"partition_id must be non-negative, got {partition_id}")
    archs = family_archs(family)
    return archs[partition_id % len(archs)]


def natural_dim(family: str) -> int:
    """Natural ``d`` of a family; for an architecture list 500 if all are CNN-k.

    Parameters
    ----------
    family : str
        A family name or a comma-separated list of architecture names.

    Returns
    -------
    int
        The natural unified representation size.
    """
    if family in NATURAL_DIM:
        return NATURAL_DIM[family]
    archs = family_archs(family)
    if all(a in _MLP_SHAPES for a in archs):
        return MLP_DIM
    return NATURAL_DIM["cnn"] if all(a in _CNN_SHAPES for a in archs) else 512


def extractor_out_features(
    arch: str, in_channels: int, image_size: int, small_stem: bool = True
) -> int:
    """Flattened extractor output size ``n`` (before ``RM``).

    Parameters
    ----------
    arch : str
        Architecture name (a key of ``ARCHITECTURES``).
    in_channels : int
        Number of input channels (does not change ``n``).
    image_size : int
        Side of the square input images (checked, does not change ``n``: every
        extractor ends in a fully connected layer or a global pooling).
    small_stem : bool, optional
        Small-input stem of the torchvision nets (does not change ``n``).

    Returns
    -------
    int
        The output size ``n`` of the extractor.
    """
    _check_arch(arch)
    if arch in _MLP_SHAPES:
        if image_size != 0:
            _mlp(in_channels, image_size, arch=arch)  # raises: mlp takes feature vectors
        return _OUT_FEATURES[arch]
    _takes_images(arch, image_size)
    if arch in FAMILIES["cnn"] or arch == "fedavgcnn":
        conv2 = _CNN_SHAPES[arch][1] if arch in _CNN_SHAPES else 64
        cnn_flat_features(image_size, conv2)  # raises if the image is too small
    return _OUT_FEATURES[arch]


def _check_arch(arch: str) -> None:
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; architectures: {sorted(ARCHITECTURES)}")


def build_model(
    arch: str,
    *,
    in_channels: int,
    num_classes: int,
    image_size: int,
    feature_dim: int,
    small_stem: bool = True,
    seed: int | None = None,
) -> HetNet:
    """Build a client model ``extractor -> RM to feature_dim -> head``.

    Parameters
    ----------
    arch : str
        Architecture name (a key of ``ARCHITECTURES``).
    in_channels : int
        Number of input image channels (1 or 3).
    num_classes : int
        Number of classes ``C``.
    image_size : int
        Side of the square input images.
    feature_dim : int
        Unified representation size ``d`` (resolve "natural" with ``natural_dim``).
    small_stem : bool, optional
        Small-input stem for the torchvision nets (default True).
    seed : int or None, optional
        If given, initialise deterministically from this seed without
        changing the global random state; otherwise use the global RNG.

    Returns
    -------
    HetNet
        The randomly initialised model.
    """
    _check_arch(arch)
    if in_channels < 1:
        raise ValueError(f"in_channels must be positive, got {in_channels}")
    builder = ARCHITECTURES[arch]
    rng = nullcontext() if seed is None else torch.random.fork_rng(devices=[])
    with rng:
        if seed is not None:
            torch.manual_seed(seed)
        extractor = builder(in_channels=in_channels, image_size=image_size, small_stem=small_stem)
        return HetNet(extractor, feature_dim, num_classes, arch=arch)


@functools.lru_cache(maxsize=16)
def smallest_arch(family: str, in_channels: int, image_size: int, small_stem: bool = True) -> str:
    """The architecture of ``family`` with the fewest extractor parameters for this
    input (ties: the earlier one); the default shared model of ``fedkd`` / ``fml``."""

    def size(arch: str) -> int:
        with torch.random.fork_rng(devices=[]):
            extractor = ARCHITECTURES[arch](
                in_channels=in_channels, image_size=image_size, small_stem=small_stem
            )
        return sum(p.numel() for p in extractor.parameters())

    return min(family_archs(family), key=size)
