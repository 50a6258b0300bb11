"""Tests of the low-rank factorisation: algebra, layers, selection and state dicts."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models import build_model
from models.lowrank import (
    LowRankConv2d,
    LowRankLinear,
    conv_to_matrix,
    decompose,
    default_layers,
    eckart_young_error,
    factorisable_layers,
    factorise,
    layer_rank,
    matrix_to_conv,
    param_count,
    reconstruct,
)
from models.lowrank_state import (
    decompose_state,
    factors_from_state,
    factors_to_state,
    lowrank_state_keys,
    reconstruct_state,
    served_updates,
    weighted_reconstruction,
)

SHAPES = [(20, 7), (7, 20), (8, 3, 3, 3), (6, 16, 5, 5), (32, 16, 5, 5), (5, 4, 1, 1)]
FULL = 0.9999  # a ratio < 1 (so layers are factorised) that rounds to full rank


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """LAPACK SVDs on a busy shared CPU are much faster single-threaded."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _rand(shape: tuple[int, ...], seed: int = 0) -> Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _full_rank(shape: tuple[int, ...]) -> int:
    return layer_rank(shape, 1.0)


def _extractor(arch: str) -> nn.Module:
    channels, size = (1, 28) if arch.startswith("cnn") else (3, 32)
    model = build_model(
        arch, in_channels=channels, num_classes=10, image_size=size,
        feature_dim=500, seed=0,
    )  # fmt: skip
    return model.extractor


def _input(arch: str, batch: int = 4) -> Tensor:
    shape = (batch, 1, 28, 28) if arch.startswith("cnn") else (batch, 3, 32, 32)
    return _rand(shape, seed=1)


def _layers(extractor: nn.Module) -> dict[str, tuple[int, ...]]:
    shapes = factorisable_layers(extractor)
    return {name: shapes[name] for name in default_layers(extractor)}


# ------------------------------------------------------------------ the algebra


@pytest.mark.parametrize("shape", [(8, 3, 3, 3), (6, 16, 5, 5), (4, 2, 1, 1)])
def test_conv_matrix_reshape_is_exact_and_invertible(shape: tuple[int, ...]) -> None:
    w = _rand(shape)
    c_out, c_in, k, _ = shape
    m = conv_to_matrix(w)
    assert m.shape == (c_out * k, c_in * k)
    assert torch.equal(matrix_to_conv(m, c_out, c_in, k), w)
    assert torch.equal(conv_to_matrix(matrix_to_conv(m, c_out, c_in, k)), m)
    for o, c, i, j in [(0, 0, 0, 0), (c_out - 1, c_in - 1, k - 1, 0), (1, 1, 0, k - 1)]:
        assert m[o * k + i, c * k + j] == w[o, c, i, j]


def test_non_square_kernel_is_rejected() -> None:
    with pytest.raises(ValueError, match="non-square"):
        conv_to_matrix(torch.zeros(4, 3, 3, 5))
    with pytest.raises(ValueError, match="non-square"):
        layer_rank((4, 3, 1, 3), 0.5)


@pytest.mark.parametrize("shape", SHAPES)
def test_full_rank_decompose_reconstructs_the_weight(shape: tuple[int, ...]) -> None:
    w = _rand(shape)
    u, v = decompose(w, _full_rank(shape))
    assert u.dtype == v.dtype == torch.float32
    back = reconstruct(u, v, shape)
    assert back.shape == w.shape
    torch.testing.assert_close(back, w, atol=1e-5, rtol=0)


@pytest.mark.parametrize("shape", SHAPES[:5])
def test_truncation_error_is_the_svd_tail_norm(shape: tuple[int, ...]) -> None:
    w = _rand(shape, seed=2)
    matrix = w.numpy().astype(np.float64)
    if len(shape) == 4:
        matrix = matrix.transpose(0, 2, 1, 3).reshape(shape[0] * shape[2], -1)
    sigma = np.linalg.svd(matrix, compute_uv=False)
    for rank in (1, 2, _full_rank(shape) // 2):
        tail = float(np.sqrt(np.sum(sigma[rank:] ** 2)))
        u, v = decompose(w, rank)
        error = torch.linalg.norm(reconstruct(u, v, shape) - w).item()
        assert error == pytest.approx(tail, rel=1e-4, abs=1e-5)
        assert eckart_young_error(w, rank) == pytest.approx(tail, rel=1e-9)


@pytest.mark.parametrize("shape", [(20, 7), (6, 16, 5, 5)])
def test_balanced_split_gives_equal_column_norms(shape: tuple[int, ...]) -> None:
    w = _rand(shape, seed=3)
    matrix = w if len(shape) == 2 else conv_to_matrix(w)
    sigma = torch.linalg.svdvals(matrix.double())
    u, v = decompose(w, 5)
    expected = sigma[:5].sqrt().float()
    torch.testing.assert_close(u.norm(dim=0), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v.norm(dim=0), expected, atol=1e-5, rtol=1e-5)
    gram_u, gram_v = u.T @ u, v.T @ v  # P_r and Q_r orthonormal: both diag(sigma)
    torch.testing.assert_close(gram_u, torch.diag(expected**2), atol=1e-4, rtol=0)
    torch.testing.assert_close(gram_v, torch.diag(expected**2), atol=1e-4, rtol=0)


def test_decompose_rejects_out_of_range_ranks() -> None:
    for rank in (0, 8):
        with pytest.raises(ValueError, match="rank"):
            decompose(torch.zeros(7, 9), rank)


def test_rank_rule_examples() -> None:
    assert layer_rank((500, 2000), 0.0625) == 31
    assert layer_rank((2000, 500), 0.0625) == 31
    assert layer_rank((500, 2000), 1.0) == 500
    assert layer_rank((500, 2000), 0.5) == 250
    assert layer_rank((32, 16, 5, 5), 0.25) == 20  # matrix 160 x 80
    assert layer_rank((10, 3), 0.01) == 1  # never 0
    assert layer_rank((10, 3, 3, 3), 1e-9) == 1
    assert layer_rank((2000, 512), FULL) == 512
    for ratio in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="ratio"):
            layer_rank((10, 10), ratio)


def test_param_count_examples() -> None:
    assert param_count((2000, 512), 31) == 31 * 2512
    assert param_count((32, 16, 5, 5), 20) == 20 * 5 * (16 + 32)


# -------------------------------------------------------------------- the layers


def test_lowrank_linear_matches_linear_with_product_weight() -> None:
    linear = nn.Linear(12, 9)
    layer = LowRankLinear.from_linear(linear, 4)
    assert layer.u.shape == (9, 4) and layer.v.shape == (12, 4)
    assert isinstance(layer.u, nn.Parameter) and isinstance(layer.v, nn.Parameter)
    torch.testing.assert_close(layer.bias, linear.bias, atol=0, rtol=0)
    x = _rand((2, 5, 12))
    expected = F.linear(x, layer.u @ layer.v.T, layer.bias)
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer(x), x @ layer.v @ layer.u.T + layer.bias)
    weights = layer.u.numel() + layer.v.numel()
    assert weights == param_count((9, 12), 4)
    assert sum(p.numel() for p in layer.parameters()) == weights + 9
    no_bias = LowRankLinear(12, 9, 4, bias=False)
    assert sum(p.numel() for p in no_bias.parameters()) == weights


def test_lowrank_linear_fresh_init_has_linear_scale() -> None:
    torch.manual_seed(0)
    layer = LowRankLinear(400, 300, 64)
    reference = nn.Linear(400, 300).weight
    std = (layer.u @ layer.v.T).std().item()
    assert std == pytest.approx(reference.std().item(), rel=0.1)


@pytest.mark.parametrize(
    ("k", "stride", "padding", "dilation", "mode"),
    [
        (3, 1, 0, 1, "zeros"),
        (3, 2, 1, 1, "zeros"),
        (5, 1, 2, 1, "zeros"),
        (5, 2, 0, 1, "zeros"),
        (3, (1, 2), (2, 0), 1, "zeros"),
        (3, (2, 1), (0, 1), (2, 1), "zeros"),
        (3, 1, "same", 2, "zeros"),
        (5, 1, 2, 1, "reflect"),
        (1, 1, 0, 1, "zeros"),
    ],
)
def test_lowrank_conv_matches_conv_with_reconstructed_weight(
    k: int, stride: object, padding: object, dilation: object, mode: str
) -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(5, 7, k, stride=stride, padding=padding, dilation=dilation, padding_mode=mode)  # type: ignore[arg-type]
    shape = tuple(conv.weight.shape)
    layer = LowRankConv2d.from_conv(conv, max(1, _full_rank(shape) // 2))
    weight = reconstruct(layer.factor_u(), layer.factor_v(), shape)
    reference = nn.Conv2d(
        5, 7, k, stride=stride, padding=padding, dilation=dilation, padding_mode=mode
    )  # type: ignore[arg-type]
    reference.weight.data.copy_(weight)
    reference.bias.data.copy_(layer.u_conv.bias.data)
    x = _rand((2, 5, 13, 11), seed=4)
    out = layer(x)
    assert out.shape == conv(x).shape
    torch.testing.assert_close(out, reference(x), atol=1e-5, rtol=1e-5)
    if mode == "zeros":
        direct = F.conv2d(x, weight, conv.bias, stride, padding, dilation)
        torch.testing.assert_close(out, direct, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("k", [3, 5])
def test_full_rank_lowrank_conv_equals_original_conv(k: int) -> None:
    torch.manual_seed(1)
    conv = nn.Conv2d(4, 6, k, stride=2, padding=1)
    layer = LowRankConv2d.from_conv(conv, _full_rank(tuple(conv.weight.shape)))
    x = _rand((3, 4, 12, 12), seed=5)
    torch.testing.assert_close(layer(x), conv(x), atol=1e-5, rtol=1e-5)


def test_lowrank_conv_factor_layout_and_param_count() -> None:
    c_out, c_in, k, r = 6, 4, 3, 5
    layer = LowRankConv2d(c_in, c_out, k, r)
    assert layer.v_conv.weight.shape == (r, c_in, 1, k)
    assert layer.u_conv.weight.shape == (c_out, r, k, 1)
    assert layer.v_conv.bias is None
    u, v = _rand((c_out * k, r), seed=6), _rand((c_in * k, r), seed=7)
    layer.load_factors(u, v)
    assert torch.equal(layer.factor_u(), u) and torch.equal(layer.factor_v(), v)
    assert layer.u_conv.weight[4, 2, 1, 0] == u[4 * k + 1, 2]
    assert layer.v_conv.weight[3, 2, 0, 2] == v[2 * k + 2, 3]
    weights = layer.u_conv.weight.numel() + layer.v_conv.weight.numel()
    assert weights == param_count((c_out, c_in, k, k), r) == r * k * (c_in + c_out)
    assert sum(p.numel() for p in layer.parameters()) == weights + c_out
    layer.factor_u().sum().backward()  # the factors are differentiable views
    assert layer.u_conv.weight.grad is not None


def test_grouped_conv_is_not_factorisable() -> None:
    net = nn.Sequential(
        OrderedDict(
            stem=nn.Conv2d(3, 8, 3),
            dw=nn.Conv2d(8, 8, 3, groups=8),
            rect=nn.Conv2d(8, 8, (1, 3)),
            pw=nn.Conv2d(8, 16, 1),
            fc=nn.Linear(16, 4),
        )
    )
    assert factorisable_layers(net) == {
        "stem": (8, 3, 3, 3), "pw": (16, 8, 1, 1), "fc": (4, 16),
    }  # fmt: skip
    assert default_layers(net, count=5) == ["pw", "fc"]
    with pytest.raises(ValueError, match="not factorisable"):
        LowRankConv2d.from_conv(net.dw, 2)
    with pytest.raises(ValueError, match="not factorisable"):
        factorise(net, ["dw"], 0.5)


# ------------------------------------------------------------ extractor-level


def test_default_layers_of_the_cnns() -> None:
    cnn1 = _extractor("cnn-1")
    assert list(factorisable_layers(cnn1)) == ["conv1", "conv2", "fc1", "fc2"]
    assert default_layers(cnn1) == ["fc1", "fc2"]
    assert default_layers(cnn1, count=10) == ["conv2", "fc1", "fc2"]
    assert default_layers(_extractor("fedavgcnn")) == ["conv2", "fc1"]
    nested = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 8)))
    assert default_layers(nested, count=1) == ["1.0"]


def test_factorise_full_and_low_rank_outputs() -> None:
    extractor = _extractor("cnn-1")
    layers = default_layers(extractor)
    x = _input("cnn-1")
    reference = extractor(x)
    copy = factorise(extractor, layers, 1.0)
    assert copy is not extractor and isinstance(copy.fc1, nn.Linear)
    torch.testing.assert_close(copy(x), reference, atol=0, rtol=0)
    full = factorise(extractor, layers, FULL)
    assert isinstance(full.fc1, LowRankLinear) and full.fc1.rank == 512
    torch.testing.assert_close(full(x), reference, atol=1e-5, rtol=1e-4)
    low = factorise(extractor, layers, 0.0625)
    assert (low.fc1.rank, low.fc2.rank) == (32, 31)
    assert isinstance(extractor.fc1, nn.Linear)  # the original is untouched
    out = low(x)
    assert (out - reference).abs().max() > 1e-3
    out.square().mean().backward()
    assert low.fc1.u.grad is not None and low.fc2.v.grad is not None
    assert low.conv1.weight.grad is not None


def test_factorise_convolution_layers_of_fedavgcnn() -> None:
    extractor = _extractor("fedavgcnn")
    x = _input("fedavgcnn")
    full = factorise(extractor, ["conv1", "conv2"], FULL)
    assert isinstance(full.conv2, LowRankConv2d)
    torch.testing.assert_close(full(x), extractor(x), atol=1e-5, rtol=1e-4)
    low = factorise(extractor, default_layers(extractor), 0.25)
    assert low.conv2.rank == layer_rank((64, 32, 5, 5), 0.25) == 40
    low(x).sum().backward()
    assert low.conv2.u_conv.weight.grad is not None


# ------------------------------------------------------------------ state dicts


@pytest.mark.parametrize(
    ("arch", "ratio"),
    [("cnn-1", 1.0), ("cnn-1", 0.5), ("cnn-1", 0.0625), ("fedavgcnn", 0.5)],
)
def test_state_conversion_matches_factorised_modules(arch: str, ratio: float) -> None:
    extractor = _extractor(arch)
    layers = _layers(extractor)
    full_state = extractor.state_dict()
    module_state = factorise(extractor, list(layers), ratio).state_dict()
    state = decompose_state(full_state, layers, ratio)
    assert list(state) == list(module_state)
    for key, value in module_state.items():
        assert state[key].shape == value.shape and state[key].dtype == value.dtype
        torch.testing.assert_close(state[key], value, atol=1e-6, rtol=0)
    back = reconstruct_state(module_state, layers)
    assert list(back) == list(full_state)
    for key, value in full_state.items():
        assert back[key].shape == value.shape
        if ratio == 1.0 or key.split(".")[0] not in layers:
            assert torch.equal(back[key], value)
    for layer, shape in layers.items():
        if ratio < 1.0:
            u, v = factors_from_state(module_state, layer, shape)
            torch.testing.assert_close(back[f"{layer}.weight"], reconstruct(u, v, shape))
            assert torch.equal(back[f"{layer}.bias"], full_state[f"{layer}.bias"])


@pytest.mark.parametrize("arch", ["cnn-1", "fedavgcnn"])
def test_full_rank_state_round_trip(arch: str) -> None:
    extractor = _extractor(arch)
    layers = factorisable_layers(extractor)
    state = extractor.state_dict()
    back = reconstruct_state(decompose_state(state, layers, FULL), layers)
    assert list(back) == list(state)
    for key, value in state.items():
        torch.testing.assert_close(back[key], value, atol=1e-5, rtol=0)


def test_state_keys_and_factor_entries() -> None:
    assert lowrank_state_keys("fc1", (2000, 512)) == ("fc1.u", "fc1.v")
    assert lowrank_state_keys("a.conv2", (32, 16, 5, 5)) == (
        "a.conv2.u_conv.weight", "a.conv2.v_conv.weight",
    )  # fmt: skip
    extractor = _extractor("fedavgcnn")
    layers = _layers(extractor)
    factorised = factorise(extractor, list(layers), 0.5)
    state = factorised.state_dict()
    for layer, shape in layers.items():
        assert set(lowrank_state_keys(layer, shape)) <= set(state)
        u, v = factors_from_state(state, layer, shape)
        k = shape[2] if len(shape) == 4 else 1
        rank = layer_rank(shape, 0.5)
        assert u.shape == (shape[0] * k, rank) and v.shape == (shape[1] * k, rank)
        entries = factors_to_state(u, v, layer, shape)
        assert set(entries) == set(lowrank_state_keys(layer, shape))
        for key, value in entries.items():
            assert torch.equal(value, state[key])
    module_u = factorised.conv2.factor_u()
    assert torch.equal(factors_from_state(state, "conv2", layers["conv2"])[0], module_u)
    with pytest.raises(ValueError, match="do not fit"):
        factors_from_state(state, "conv2", (64, 32, 3, 3))


@pytest.mark.parametrize("shape", [(300, 80), (80, 300), (40, 8, 5, 5)])
def test_top_svd_matches_the_thin_svd_truncation(shape: tuple[int, ...]) -> None:
    from models.lowrank import thin_svd, top_svd

    gen = torch.Generator().manual_seed(7)
    w = torch.randn(*shape, generator=gen)
    p, s, qt = thin_svd(w)
    k = min(p.shape[1], 30)
    tp, ts, tqt = top_svd(w, k)
    torch.testing.assert_close(ts, s[:k], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(tp * ts @ tqt, p[:, :k] * s[:k] @ qt[:k], rtol=1e-8, atol=1e-8)
    for rank in (1, 5, k):
        u, v = decompose(w, rank, (tp, ts, tqt))
        u0, v0 = decompose(w, rank)
        torch.testing.assert_close(u @ v.T, u0 @ v0.T, rtol=1e-4, atol=1e-5)


def test_top_svd_of_a_rank_deficient_matrix_has_zero_tail() -> None:
    from models.lowrank import top_svd

    gen = torch.Generator().manual_seed(3)
    left = torch.randn(60, 3, generator=gen, dtype=torch.float64)
    w = left @ torch.randn(3, 40, generator=gen, dtype=torch.float64)
    p, s, qt = top_svd(w, 10)
    assert (s[3:] == 0).all() and torch.isfinite(p).all() and torch.isfinite(qt).all()
    torch.testing.assert_close(p * s @ qt, w, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("first_full", [True, False])
def test_weighted_reconstruction_is_the_weighted_mean_of_reconstructions(first_full: bool) -> None:
    """Mixed tiers of a conv + linear extractor, a full-rank or a factorised state
    first: the sample-weighted mean of the per-client reconstructions, in the full
    extractor's key order, and the clients' states are left as they were."""
    extractor = _extractor("fedavgcnn")
    layers = factorisable_layers(extractor)
    gen = torch.Generator().manual_seed(11)
    states, weights = [], [3.0, 1.0, 5.0, 2.0]
    for i, ratio in enumerate((1.0, 0.5, 0.125, 0.5) if first_full else (0.5, 1.0, 0.125, 0.5)):
        noisy = {
            k: v + 0.01 * torch.randn(v.shape, generator=gen)
            for k, v in extractor.state_dict().items()
        }
        state = decompose_state(noisy, layers, ratio)
        if i == 3:
            state = {k: v.double() for k, v in state.items()}  # any float dtype
        states.append(state)
    before = [{k: v.clone() for k, v in st.items()} for st in states]
    got = weighted_reconstruction(states, weights, layers)
    full = [reconstruct_state(st, layers) for st in states]
    assert list(got) == list(extractor.state_dict())
    for key, value in got.items():
        want = sum(f[key].double() * w for f, w in zip(full, weights, strict=True)) / sum(weights)
        assert value.dtype == torch.float64 and value.shape == want.shape
        torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-6)  # float32 products
    for st, kept in zip(states, before, strict=True):
        assert all(torch.equal(st[k], kept[k]) for k in st)


def test_served_updates_are_the_replies_changes_at_full_rank() -> None:
    """Mixed tiers of a conv + linear extractor, each reply against the state its tier
    was served (one float64, one returning what it was served), products scaled per
    layer: the weighted sum of the changes of the full-rank reconstructions and each
    change's squared norm, both computed here from :func:`reconstruct_state` in
    float64, in the full extractor's key order; on two threads exactly the same."""
    extractor = _extractor("fedavgcnn")
    layers = factorisable_layers(extractor)
    full = extractor.state_dict()
    gen = torch.Generator().manual_seed(5)
    replies, weights = [], [3.0, 1.0, 5.0, 2.0, 4.0]
    for i, ratio in enumerate((0.5, 1.0, 0.125, 0.5, 0.25)):
        served = decompose_state(full, layers, ratio)
        scales = {name: 0.5 + i / 10 for name in layers} if ratio < 1 else {}
        state = {k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in served.items()}
        if i == 3:
            state = dict(served)
        if i == 4:
            state = {k: v.double() for k, v in state.items()}  # any float dtype
        replies.append((state, served, scales))
    got, squares = served_updates(replies, weights, layers)
    want: dict[str, Tensor] = {}
    for (state, served, scales), w, square in zip(replies, weights, squares, strict=True):
        mine, sent = reconstruct_state(state, layers), reconstruct_state(served, layers)
        change = {k: mine[k].double() - sent[k].double() for k in mine}
        for layer in layers:
            if lowrank_state_keys(layer, layers[layer])[0] in state:
                change[f"{layer}.weight"] *= scales[layer]
        assert square == pytest.approx(
            sum(float(v.square().sum()) for v in change.values()), rel=1e-4
        )
        for k, v in change.items():
            want[k] = want.get(k, 0) + v * w / sum(weights)
    assert squares[3] < 1e-9 * squares[0]  # what it was served: nothing changed
    assert list(got) == list(full)
    for key, value in got.items():
        assert value.dtype == torch.float64
        torch.testing.assert_close(value, want[key], rtol=1e-4, atol=1e-7)  # float32 products
    # layers formed on two threads: the same arithmetic, the same numbers
    threads = torch.get_num_threads()
    again, squares_again = served_updates(replies, weights, layers, workers=2)
    assert torch.get_num_threads() == threads and squares_again == squares
    assert all(torch.equal(again[k], got[k]) for k in got)


def _spectrum(rows: int, cols: int, values: torch.Tensor, seed: int) -> torch.Tensor:
    """A [rows, cols] float64 matrix with the given singular values (random bases)."""
    gen = torch.Generator().manual_seed(seed)
    p, _ = torch.linalg.qr(torch.randn(rows, rows, generator=gen, dtype=torch.float64))
    q, _ = torch.linalg.qr(torch.randn(cols, cols, generator=gen, dtype=torch.float64))
    k = values.numel()
    return p[:, :k] * values @ q[:, :k].T


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", [(60, 20), (20, 60), (12, 4, 3, 3)])
def test_tracked_basis_is_an_exact_nested_projection(
    shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    """P, Q orthonormal; for every r the truncation P_r C[:r,:r] Q_rᵀ is the
    projection of W onto the first r tracked directions, core_energies sums to its
    energy and core_svd is its exact SVD; in float64, and in float32 (the server's
    setting) to float32 rounding."""
    from models.lowrank import conv_to_matrix, core_energies, core_svd, tracked_basis

    gen = torch.Generator().manual_seed(5)
    w = torch.randn(*shape, generator=gen, dtype=torch.float64)
    m = (conv_to_matrix(w) if len(shape) == 4 else w).to(dtype)
    tall = m.shape[0] >= m.shape[1]
    prev, _ = torch.linalg.qr(torch.randn(min(m.shape), 8, generator=gen, dtype=torch.float64))
    p, core, q = tracked_basis(w, prev, dtype)
    assert p.dtype == core.dtype == q.dtype == dtype
    tol = {} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-4}
    eye = torch.eye(8, dtype=dtype)
    torch.testing.assert_close(p.T @ p, eye, **tol)
    torch.testing.assert_close(q.T @ q, eye, **tol)
    for r in (1, 3, 8):
        proj = m @ q[:, :r] @ q[:, :r].T if tall else p[:, :r] @ p[:, :r].T @ m
        torch.testing.assert_close(p[:, :r] @ core[:r, :r] @ q[:, :r].T, proj, **tol)
        energy = float(core_energies(core)[:r].sum())
        assert energy == pytest.approx(float(proj.square().sum()), rel=tol.get("rtol", 1e-6))
        a, s, bt = core_svd(p, core, q, r)
        torch.testing.assert_close(a * s @ bt, proj, **tol)
        torch.testing.assert_close(a.T @ a, torch.eye(r, dtype=dtype), **tol)
    # one power step: the first direction is orth(WᵀW prev_1) (tall) / orth(WWᵀ prev_1)
    p0 = prev[:, 0].to(dtype)
    first = (m.T @ (m @ p0)) if tall else (m @ (m.T @ p0))
    small = q if tall else p
    torch.testing.assert_close(small[:, 0], first / first.norm(), **tol)


@pytest.mark.parametrize("tall", [True, False])
def test_tracked_basis_converges_with_a_gap_and_stays_put_when_flat(tall: bool) -> None:
    """Repeated from a random basis on a matrix with a spectral gap at 6, the tracked
    6 directions become the leading singular subspace; on a flat spectrum (all
    singular values within 1e-3) a perturbation that reorders the values moves the
    fresh SVD's leading subspace almost entirely, the tracked one hardly at all."""
    from models.lowrank import top_svd, tracked_basis

    rows, cols = (50, 30) if tall else (30, 50)

    values = torch.cat([torch.full((6,), 3.0), torch.linspace(1.0, 0.5, 24)]).double()
    w = _spectrum(rows, cols, values, seed=1)
    gen = torch.Generator().manual_seed(2)
    basis, _ = torch.linalg.qr(torch.randn(30, 10, generator=gen, dtype=torch.float64))
    for _ in range(12):
        out = tracked_basis(w, basis)
        basis = out[2] if tall else out[0]
    top = top_svd(w, 6)
    leading = top[2].T if tall else top[0]
    assert float((leading.T @ basis[:, :6]).square().sum()) / 6 > 0.999

    def overlap(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.T @ b).square().sum()) / a.shape[1]

    flat = 1 + 1e-3 * torch.rand(30, generator=gen, dtype=torch.float64)
    reordered = 1 + 1e-3 * torch.rand(30, generator=gen, dtype=torch.float64)
    w0, w1 = _spectrum(rows, cols, flat, seed=4), _spectrum(rows, cols, reordered, seed=4)
    svd0, svd1 = top_svd(w0, 8), top_svd(w1, 8)
    side = (lambda s: s[2].T) if tall else (lambda s: s[0])
    assert overlap(side(svd0), side(svd1)) < 0.6  # the fresh SVD jumps
    out = tracked_basis(w1, side(svd0))
    assert overlap(side(svd0), out[2] if tall else out[0]) > 0.999  # tracked stays
    assert torch.linalg.matrix_norm(w1 - w0) < 0.01 * torch.linalg.matrix_norm(w0)


def test_tracked_basis_rejects_a_basis_of_the_wrong_side() -> None:
    from models.lowrank import tracked_basis

    with pytest.raises(ValueError, match="does not fit"):
        tracked_basis(torch.randn(50, 30), torch.randn(50, 4))
