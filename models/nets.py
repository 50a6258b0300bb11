"""Network building blocks: the heterogeneous client model and its extractors.

A client model is ``extractor -> RM -> head``: an architecture-specific feature
extractor ``g_k``, the representation mapping ``RM`` that brings its flattened
output to the unified dimension ``d`` and a linear head ``h = Linear(d, C)``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "HetNet",
    "represent",
    "cnn_extractor",
    "fedavgcnn_extractor",
    "cnn_flat_features",
    "mlp_extractor",
    "input_shape",
    "torchvision_extractor",
    "TORCHVISION_OUT_FEATURES",
]


def represent(z: Tensor, d: int) -> Tensor:
    """Map flattened extractor outputs to the unified representation size.

    Parameters
    ----------
    z : Tensor
        Flattened extractor output of shape ``[B, n]`` (higher-rank inputs are
        flattened from dimension 1).
    d : int
        Unified representation size.

    Returns
    -------
    Tensor
        ``[B, d]``: ``z`` itself when ``n == d``, otherwise the 1-D adaptive
        average pooling of each row to ``d`` bins.
    """
    z = z.flatten(1)
    if z.shape[1] == d:
        return z
    return F.adaptive_avg_pool1d(z.unsqueeze(1), d).squeeze(1)


class HetNet(nn.Module):
    """Heterogeneous client model: ``extractor -> RM to d -> head``.

    The ``state_dict`` holds exactly the keys ``extractor.*``, ``head.weight``
    and ``head.bias``; ``RM`` is parameter-free.

    Parameters
    ----------
    extractor : nn.Module
        Feature extractor; its output is flattened from dimension 1.
    feature_dim : int
        Unified representation size ``d``.
    num_classes : int
        Number of classes ``C``.
    arch : str, optional
        Architecture name, kept for bookkeeping.
    """

    def __init__(
        self,
        extractor: nn.Module,
        feature_dim: int,
        num_classes: int,
        arch: str = "custom",
    ) -> None:
        super().__init__()
        if feature_dim < 1 or num_classes < 1:
            raise ValueError(
                f"feature_dim ({feature_dim}) and num_classes ({num_classes}) must be positive"
            )
        self.extractor = extractor
        self.head = nn.Linear(feature_dim, num_classes)
        self.feature_dim = feature_dim
        self.num_classes = num_classes
        self.arch = arch

    def features(self, x: Tensor) -> Tensor:
        """Return the unified representation ``RM(flatten(g(x)))`` of shape [B, d]."""
        return represent(self.extractor(x), self.feature_dim)

    def classify(self, reps: Tensor) -> Tensor:
        """Logits from representations; adapters extend this, never ``forward``."""
        return self.head(reps)

    def forward(self, x: Tensor) -> Tensor:
        """Return the logits ``h(RM(g(x)))`` of shape [B, C]."""
        return self.classify(self.features(x))

    def extra_repr(self) -> str:
        return f"arch={self.arch!r}, feature_dim={self.feature_dim}"


def input_shape(in_channels: int, image_size: int) -> tuple[int, ...]:
    """One sample's shape: ``(C, H, W)`` images, or ``(F,)`` feature vectors when
    ``image_size`` is 0 (``in_channels`` is then the number of features ``F``)."""
    if image_size == 0:
        return (in_channels,)
    return (in_channels, image_size, image_size)


# --------------------------------------------------------------------------- MLPs


def mlp_extractor(in_features: int, widths: tuple[int, ...]) -> nn.Sequential:
    """Extractor of the ``mlp`` family, for feature vectors ``[B, F]``.

    ``FC(F->widths[0])-ReLU, FC(widths[0]->widths[1])-ReLU, ...``; the output size
    is ``widths[-1]``. Every layer is a ``Linear`` named ``fc1``, ``fc2``, ... (so
    FedARA factorises them and FedLoRA can target them).

    Parameters
    ----------
    in_features : int
        Number of input features ``F``.
    widths : tuple of int
        Output width of each fully connected layer.
    """
    if in_features < 1 or not widths:
        raise ValueError(f"an MLP needs F >= 1 input features and a layer; got F={in_features}")
    layers: list[tuple[str, nn.Module]] = []
    previous = in_features
    for i, width in enumerate(widths, start=1):
        layers += [(f"fc{i}", nn.Linear(previous, width)), (f"relu{i}", nn.ReLU())]
        previous = width
    return nn.Sequential(OrderedDict(layers))


# --------------------------------------------------------------------------- CNNs


def _conv_pool_side(image_size: int) -> int:
    """Spatial side after two ``conv5x5 (no padding) -> maxpool2`` stages."""
    side = (image_size - 4) // 2
    side = (side - 4) // 2
    if side < 1:
        raise ValueError(f"image_size {image_size} is too small; need at least 16")
    return side


def cnn_flat_features(image_size: int, channels: int) -> int:
    """Flattened size after two conv5x5/maxpool2 stages ending in ``channels``."""
    return channels * _conv_pool_side(image_size) ** 2


def _two_conv_stages(in_channels: int, mid: int, out: int) -> list[tuple[str, nn.Module]]:
    """Layers ``conv1 .. pool2, flatten`` shared by the CNN extractors."""
    return [
        ("conv1", nn.Conv2d(in_channels, mid, kernel_size=5)),
        ("relu1", nn.ReLU()),
        ("pool1", nn.MaxPool2d(2)),
        ("conv2", nn.Conv2d(mid, out, kernel_size=5)),
        ("relu2", nn.ReLU()),
        ("pool2", nn.MaxPool2d(2)),
        ("flatten", nn.Flatten(1)),
    ]


def cnn_extractor(
    in_channels: int, image_size: int, *, hidden: int, conv2_channels: int = 32
) -> nn.Sequential:
    """Extractor of the CNN-1..CNN-5 family (natural output size 500).

    ``conv5x5(c_in->16)-ReLU-pool2, conv5x5(16->conv2_channels)-ReLU-pool2,
    flatten, FC(flat->hidden)-ReLU, FC(hidden->500)-ReLU``.

    Parameters
    ----------
    in_channels : int
        Number of input image channels.
    image_size : int
        Side of the (square) input images, at least 16.
    hidden : int
        Width of the first fully connected layer.
    conv2_channels : int, optional
        Output channels of the second convolution (16 for CNN-2, else 32).
    """
    flat = cnn_flat_features(image_size, conv2_channels)
    layers = _two_conv_stages(in_channels, 16, conv2_channels) + [
        ("fc1", nn.Linear(flat, hidden)),
        ("relu3", nn.ReLU()),
        ("fc2", nn.Linear(hidden, 500)),
        ("relu4", nn.ReLU()),
    ]
    return nn.Sequential(OrderedDict(layers))


def fedavgcnn_extractor(in_channels: int, image_size: int) -> nn.Sequential:
    """Extractor of the 4-layer FedAvgCNN (natural output size 512).

    ``conv5x5(c_in->32)-ReLU-pool2, conv5x5(32->64)-ReLU-pool2, flatten,
    FC(flat->512)-ReLU``.
    """
    flat = cnn_flat_features(image_size, 64)
    layers = _two_conv_stages(in_channels, 32, 64) + [
        ("fc1", nn.Linear(flat, 512)),
        ("relu3", nn.ReLU()),
    ]
    return nn.Sequential(OrderedDict(layers))


# ------------------------------------------------------------- torchvision nets

TORCHVISION_OUT_FEATURES: dict[str, int] = {
    "resnet18": 512,
    "resnet34": 512,
    "resnet50": 2048,
    "resnet101": 2048,
    "resnet152": 2048,
    "mobilenet_v2": 1280,
    "shufflenet_v2": 1024,
    "googlenet": 1024,
}
"""Flattened (globally pooled) output size of each torchvision extractor."""


def _new_conv(old: nn.Conv2d, in_channels: int, small_stem: bool) -> nn.Conv2d:
    """A first convolution like ``old`` but with ``in_channels`` inputs.

    With ``small_stem`` it is a 3x3 convolution with stride 1 and padding 1.
    """
    kernel: Any
    stride: Any
    padding: Any
    if small_stem:
        kernel, stride, padding = (3, 3), (1, 1), (1, 1)
    else:
        kernel, stride, padding = old.kernel_size, old.stride, old.padding
    return nn.Conv2d(
        in_channels,
        old.out_channels,
        kernel_size=kernel,
        stride=stride,
        padding=padding,
        bias=old.bias is not None,
    )


def _kaiming(conv: nn.Conv2d) -> None:
    nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")


def _trunc_normal(conv: nn.Conv2d) -> None:
    nn.init.trunc_normal_(conv.weight, mean=0.0, std=0.01, a=-2, b=2)


def _default_init(conv: nn.Conv2d) -> None:
    """Keep PyTorch's default initialisation (as torchvision's ShuffleNetV2)."""


def _adapt_stem(
    parent: nn.Module,
    name: str,
    in_channels: int,
    small_stem: bool,
    init: Callable[[nn.Conv2d], None],
) -> None:
    """Rebuild the first convolution ``parent.<name>`` when needed."""
    old = getattr(parent, name)
    if in_channels == 3 and not small_stem:
        return
    new = _new_conv(old, in_channels, small_stem)
    init(new)
    setattr(parent, name, new)


def _resnet(model: nn.Module, in_channels: int, small_stem: bool) -> nn.Module:
    _adapt_stem(model, "conv1", in_channels, small_stem, _kaiming)
    if small_stem:
        model.maxpool = nn.Identity()
    model.fc = nn.Identity()
    return model


def _mobilenet_v2(model: nn.Module, in_channels: int, small_stem: bool) -> nn.Module:
    _adapt_stem(model.get_submodule("features.0"), "0", in_channels, small_stem, _kaiming)
    model.classifier = nn.Identity()
    return model


def _shufflenet_v2(model: nn.Module, in_channels: int, small_stem: bool) -> nn.Module:
    _adapt_stem(model.get_submodule("conv1"), "0", in_channels, small_stem, _default_init)
    if small_stem:
        model.maxpool = nn.Identity()
    model.fc = nn.Identity()
    return model


def _googlenet(model: nn.Module, in_channels: int, small_stem: bool) -> nn.Module:
    _adapt_stem(model.get_submodule("conv1"), "conv", in_channels, small_stem, _trunc_normal)
    if small_stem:
        model.maxpool1 = nn.Identity()
    model.fc = nn.Identity()
    return model


_TORCHVISION: dict[str, tuple[str, dict[str, object], Callable[..., nn.Module]]] = {
    "resnet18": ("resnet18", {}, _resnet),
    "resnet34": ("resnet34", {}, _resnet),
    "resnet50": ("resnet50", {}, _resnet),
    "resnet101": ("resnet101", {}, _resnet),
    "resnet152": ("resnet152", {}, _resnet),
    "mobilenet_v2": ("mobilenet_v2", {}, _mobilenet_v2),
    "shufflenet_v2": ("shufflenet_v2_x1_0", {}, _shufflenet_v2),
    "googlenet": (
        "googlenet",
        {"aux_logits": False, "transform_input": False, "init_weights": True},
        _googlenet,
    ),
}
"""arch -> (torchvision.models constructor, its arguments, stem adapter). torchvision
is imported only when one is built: it costs seconds of start-up per client process."""


def torchvision_extractor(name: str, in_channels: int, small_stem: bool) -> nn.Module:
    """Build a randomly initialised torchvision net without its classifier.

    Parameters
    ----------
    name : str
        One of the keys of ``TORCHVISION_OUT_FEATURES``.
    in_channels : int
        Number of input channels; the first convolution is rebuilt for it.
    small_stem : bool
        Use a 3x3/stride-1 first convolution and no stem max-pool (28-32 px).

    Returns
    -------
    nn.Module
        Module mapping ``[B, c_in, H, W]`` to the globally pooled, flattened
        features of size ``TORCHVISION_OUT_FEATURES[name]``.
    """
    import torchvision.models as tvm

    constructor, kwargs, adapt = _TORCHVISION[name]
    net = getattr(tvm, constructor)(weights=None, **kwargs)
    return adapt(net, in_channels, small_stem)
