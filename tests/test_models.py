"""Tests of the model zoo: shapes, RM, parameter counts, families and seeding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models import (
    ARCHITECTURES,
    FAMILIES,
    NATURAL_DIM,
    HetNet,
    arch_for_partition,
    build_model,
    extractor_out_features,
    family_archs,
    natural_dim,
    represent,
)

LIGHT = ("cnn-1", "cnn-2", "cnn-3", "cnn-4", "cnn-5", "fedavgcnn")
HEAVY = ("resnet18", "resnet34", "resnet50", "mobilenet_v2", "shufflenet_v2")
HEAVY += ("googlenet",)
BUILD_ONLY = ("resnet101", "resnet152")
MLP = ("mlp-1", "mlp-2", "mlp-3", "mlp-4", "mlp-5")
STEM_POOL = {"shufflenet_v2": "maxpool", "googlenet": "maxpool1"}
STEM_POOL.update(dict.fromkeys(["resnet18", "resnet34", "resnet50"], "maxpool"))
CNN_HIDDEN = {"cnn-1": 2000, "cnn-2": 2000, "cnn-3": 1000, "cnn-4": 800, "cnn-5": 500}


def _forward(arch: str, channels: int, size: int, classes: int, dim: int) -> None:
    model = build_model(
        arch,
        in_channels=channels,
        num_classes=classes,
        image_size=size,
        feature_dim=dim,
        seed=0,
    )
    model.eval()
    x = torch.randn(2, channels, size, size)
    with torch.no_grad():
        z = model.extractor(x)
        feats = model.features(x)
        logits = model(x)
    n = extractor_out_features(arch, channels, size, True)
    assert z.flatten(1).shape == (2, n)
    assert feats.shape == (2, dim)
    assert logits.shape == (2, classes)
    assert torch.isfinite(logits).all()


def test_every_family_arch_is_covered() -> None:
    family_members = {arch for archs in FAMILIES.values() for arch in archs}
    assert family_members <= set(ARCHITECTURES)
    assert set(LIGHT + HEAVY + BUILD_ONLY + MLP) == set(ARCHITECTURES)


@pytest.mark.parametrize("arch", MLP)
@pytest.mark.parametrize("features", [1, 16, 64])
def test_mlp_shapes(arch: str, features: int) -> None:
    """Feature vectors ``[B, F]`` (image size 0): ``extractor -> RM -> head``, every
    extractor layer a Linear; the family's widths and depths differ."""
    model = build_model(arch, in_channels=features, num_classes=5, image_size=0, feature_dim=64)
    x = torch.randn(3, features)
    assert model.extractor(x).shape == (3, extractor_out_features(arch, features, 0)) == (3, 128)
    assert model.features(x).shape == (3, 64) and model(x).shape == (3, 5)
    assert all(isinstance(m, nn.Linear) for m in model.extractor if not isinstance(m, nn.ReLU))
    with pytest.raises(ValueError, match="takes feature vectors.*image family"):
        build_model(arch, in_channels=1, num_classes=5, image_size=28, feature_dim=64)
    with pytest.raises(ValueError, match="takes images.*model.family=mlp"):
        build_model("cnn-1", in_channels=features, num_classes=5, image_size=0, feature_dim=64)


def test_the_mlp_family_differs_in_width_and_depth() -> None:
    sizes = {
        arch: [m.out_features for m in build_model(
            arch, in_channels=16, num_classes=5, image_size=0, feature_dim=128
        ).extractor if isinstance(m, nn.Linear)]
        for arch in MLP
    }  # fmt: skip
    assert len({len(v) for v in sizes.values()}) == 2 and len({v[0] for v in sizes.values()}) == 4
    assert natural_dim("mlp") == natural_dim("mlp-2,mlp-4") == 128


@pytest.mark.parametrize("arch", LIGHT)
@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("size", [28, 32])
@pytest.mark.parametrize("classes", [7, 100])
def test_light_shapes(arch: str, channels: int, size: int, classes: int) -> None:
    _forward(arch, channels, size, classes, natural_dim(arch))


@pytest.mark.parametrize("arch", HEAVY)
@pytest.mark.parametrize(("channels", "size"), [(1, 28), (3, 32)])
def test_heavy_shapes(arch: str, channels: int, size: int) -> None:
    _forward(arch, channels, size, 7 if channels == 1 else 100, 512)


@pytest.mark.parametrize("arch", HEAVY)
def test_heavy_shapes_without_small_stem(arch: str) -> None:
    model = build_model(
        arch, in_channels=1, num_classes=10, image_size=32, feature_dim=512,
        small_stem=False, seed=0,
    )  # fmt: skip
    model.eval()
    with torch.no_grad():
        assert model(torch.randn(2, 1, 32, 32)).shape == (2, 10)


@pytest.mark.parametrize("arch", BUILD_ONLY)
def test_deep_resnets_build(arch: str) -> None:
    model = build_model(arch, in_channels=1, num_classes=10, image_size=28, feature_dim=512)
    assert isinstance(model, HetNet)
    assert model.extractor.conv1.in_channels == 1
    assert extractor_out_features(arch, 1, 28) == 2048


@pytest.mark.parametrize("arch", LIGHT)
def test_other_feature_dims(arch: str) -> None:
    for dim in (64, 300, 1024):
        _forward(arch, 1, 28, 10, dim)


def test_represent_identity_when_sizes_match() -> None:
    z = torch.randn(2, 500)
    out = represent(z, 500)
    assert out is z
    model = build_model("cnn-3", in_channels=1, num_classes=10, image_size=28, feature_dim=500)
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        assert torch.equal(model.features(x), model.extractor(x))


@pytest.mark.parametrize(("n", "d"), [(512, 500), (1280, 512), (2048, 512), (7, 3)])
def test_represent_is_average_pooling(n: int, d: int) -> None:
    z = torch.randn(2, n)
    out = represent(z, d)
    assert out.shape == (2, d)
    expected = torch.stack(
        [z[:, (i * n) // d : -((-(i + 1) * n) // d)].mean(dim=1) for i in range(d)],
        dim=1,
    )
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(out, F.adaptive_avg_pool1d(z.unsqueeze(1), d)[:, 0])


def test_represent_even_split_means() -> None:
    z = torch.arange(8.0).reshape(1, 8)
    assert torch.equal(represent(z, 4), torch.tensor([[0.5, 2.5, 4.5, 6.5]]))


@pytest.mark.parametrize("arch", list(CNN_HIDDEN))
def test_cnn_parameter_counts(arch: str) -> None:
    h1 = CNN_HIDDEN[arch]
    c2 = 16 if arch == "cnn-2" else 32
    flat = c2 * 4 * 4  # 28 -> 24 -> 12 -> 8 -> 4
    expected = (
        (1 * 16 * 25 + 16)
        + (16 * c2 * 25 + c2)
        + (flat * h1 + h1)
        + (h1 * 500 + 500)
        + (500 * 10 + 10)
    )
    model = build_model(arch, in_channels=1, num_classes=10, image_size=28, feature_dim=500)
    assert sum(p.numel() for p in model.parameters()) == expected


def test_fedavgcnn_parameter_count() -> None:
    model = build_model("fedavgcnn", in_channels=1, num_classes=10, image_size=28, feature_dim=512)
    expected = (32 * 25 + 32) + (32 * 64 * 25 + 64) + (1024 * 512 + 512)
    expected += 512 * 10 + 10
    assert sum(p.numel() for p in model.parameters()) == expected


@pytest.mark.parametrize("arch", ["cnn-1", "fedavgcnn", "shufflenet_v2"])
def test_state_dict_keys(arch: str) -> None:
    model = build_model(arch, in_channels=3, num_classes=10, image_size=32, feature_dim=256)
    keys = list(model.state_dict())
    head = [k for k in keys if not k.startswith("extractor.")]
    assert head == ["head.weight", "head.bias"]
    assert model.head.weight.shape == (10, 256)
    assert (model.feature_dim, model.num_classes, model.arch) == (256, 10, arch)


def test_cnn_layers_are_addressable() -> None:
    model = build_model("cnn-2", in_channels=1, num_classes=10, image_size=28, feature_dim=500)
    ext = model.extractor
    assert isinstance(ext, nn.Sequential)
    names = [name for name, _ in ext.named_children()]
    assert names == [
        "conv1", "relu1", "pool1", "conv2", "relu2", "pool2",
        "flatten", "fc1", "relu3", "fc2", "relu4",
    ]  # fmt: skip
    assert type(ext.conv2) is nn.Conv2d and ext.conv2.out_channels == 16
    assert type(ext.fc1) is nn.Linear and ext.fc1.in_features == 256
    assert "extractor.fc2.weight" in model.state_dict()
    fed = build_model("fedavgcnn", in_channels=3, num_classes=10, image_size=32, feature_dim=512)
    assert [n for n, _ in fed.extractor.named_children()][-2:] == ["fc1", "relu3"]
    assert fed.extractor.fc1.in_features == 64 * 5 * 5


def test_families() -> None:
    assert family_archs("cnn") == ("cnn-1", "cnn-2", "cnn-3", "cnn-4", "cnn-5")
    assert [arch_for_partition("cnn", k) for k in range(7)] == [
        "cnn-1", "cnn-2", "cnn-3", "cnn-4", "cnn-5", "cnn-1", "cnn-2",
    ]  # fmt: skip
    assert arch_for_partition("htfe", 5) == "resnet18"
    assert len(family_archs("htfe8")) == 8
    assert family_archs("cnn-1, cnn-3") == ("cnn-1", "cnn-3")
    assert arch_for_partition("cnn-1,cnn-3", 3) == "cnn-3"
    assert NATURAL_DIM == {"cnn": 500, "fedavgcnn": 512, "htfe": 512, "htfe8": 512, "mlp": 128}
    assert natural_dim("cnn-2,cnn-5") == 500
    assert natural_dim("cnn-2,resnet18") == 512
    assert natural_dim("htfe") == 512


@pytest.mark.parametrize("family", ["nope", "cnn-1,cnn-9", "", "cnn,"])
def test_unknown_family_names_setting(family: str) -> None:
    with pytest.raises(ValueError, match="model.family") as info:
        family_archs(family)
    assert "htfe8" in str(info.value) and "cnn-5" in str(info.value)
    with pytest.raises(ValueError, match="model.family"):
        natural_dim(family)


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="architecture"):
        build_model("vgg", in_channels=1, num_classes=10, image_size=28, feature_dim=500)
    with pytest.raises(ValueError, match="image_size"):
        build_model("cnn-1", in_channels=1, num_classes=10, image_size=12, feature_dim=500)
    with pytest.raises(ValueError, match="partition_id"):
        arch_for_partition("cnn", -1)


def _weights(arch: str, seed: int | None) -> list[torch.Tensor]:
    model = build_model(
        arch, in_channels=1, num_classes=10, image_size=28, feature_dim=500,
        seed=seed,
    )  # fmt: skip
    return list(model.state_dict().values())


@pytest.mark.parametrize("arch", ["cnn-4", "shufflenet_v2"])
def test_seeded_init_is_deterministic(arch: str) -> None:
    state = torch.random.get_rng_state()
    first, again, other = _weights(arch, 1), _weights(arch, 1), _weights(arch, 2)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))


def test_global_seed_gives_identical_models() -> None:
    torch.manual_seed(3)
    first = _weights("cnn-5", None)
    torch.manual_seed(3)
    again = _weights("cnn-5", None)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def _first_conv(model: HetNet) -> nn.Conv2d:
    return next(m for m in model.extractor.modules() if isinstance(m, nn.Conv2d))


@pytest.mark.parametrize("arch", HEAVY)
@pytest.mark.parametrize("small_stem", [True, False])
def test_torchvision_stem(arch: str, small_stem: bool) -> None:
    model = build_model(
        arch, in_channels=1, num_classes=10, image_size=28, feature_dim=512,
        small_stem=small_stem,
    )  # fmt: skip
    conv = _first_conv(model)
    assert conv.in_channels == 1
    assert (conv.stride == (1, 1)) == small_stem
    if small_stem:
        assert conv.kernel_size == (3, 3) and conv.padding == (1, 1)
    pool = STEM_POOL.get(arch)
    if pool is not None:
        assert isinstance(getattr(model.extractor, pool), nn.Identity) == small_stem
    assert not any(isinstance(m, nn.Linear) for m in model.extractor.modules())


def test_googlenet_trains_without_aux_heads() -> None:
    model = build_model("googlenet", in_channels=3, num_classes=5, image_size=28, feature_dim=512)
    model.train()
    logits = model(torch.randn(2, 3, 28, 28))
    assert isinstance(logits, torch.Tensor) and logits.shape == (2, 5)
    logits.sum().backward()
    assert _first_conv(model).weight.grad is not None
