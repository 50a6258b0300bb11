"""Dataset sources, the partition cache and per-client loading (``data``)."""

from __future__ import annotations

import gzip
import multiprocessing
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import data.builtin
import data.client
import data.store
from common.config import ConfigError, DataConfig
from data import (
    export_partition,
    load_arrays,
    load_client_data,
    load_global_test,
    load_local_data,
    partition_summary,
    prepare_partition,
)
from data.store import partition_key

FASHION = Path("/usr/share/datasets/fashion-mnist")
needs_fashion = pytest.mark.skipif(
    not (FASHION / "train-images-idx3-ubyte.gz").is_file(),
    reason="apt package dataset-fashion-mnist not installed",
)


def _cfg(tmp_path: Path, **kwargs: Any) -> DataConfig:
    settings: dict[str, Any] = {"name": "synthetic", "cache_dir": str(tmp_path / "c")}
    return DataConfig(**(settings | kwargs))


# --------------------------------------------------------------------- sources


def test_synthetic_is_deterministic(tmp_path: Path) -> None:
    ds = load_arrays(_cfg(tmp_path))
    assert ds.x_train.shape == (2000, 28, 28, 1) and ds.x_train.dtype == np.uint8
    assert ds.x_test is not None and ds.x_test.shape == (500, 28, 28, 1)
    assert ds.y_train.dtype == np.int64 and ds.num_classes == 10
    assert set(np.unique(ds.y_train).tolist()) == set(range(10))
    assert len(ds.mean) == len(ds.std) == 1
    np.testing.assert_array_equal(ds.x_train, load_arrays(_cfg(tmp_path)).x_train)


@needs_fashion
def test_fashion_mnist_from_debian_package(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, name="fashion-mnist", partition="iid")
    ds = load_arrays(cfg)
    assert ds.x_train.shape == (60_000, 28, 28, 1) and ds.num_classes == 10
    assert ds.x_test is not None and ds.x_test.shape == (10_000, 28, 28, 1)
    summary = partition_summary(prepare_partition(cfg, 2, 0))
    merged = sum(map(sum, summary["train_class_counts"] + summary["test_class_counts"]))
    assert merged == 70_000
    assert summary["image_shape"] == [28, 28, 1] and summary["num_classes"] == 10


def _write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 8, array.ndim])
    header += b"".join(d.to_bytes(4, "big") for d in array.shape)
    path.write_bytes(gzip.compress(header + array.astype(np.uint8).tobytes()))


def test_fashion_mnist_torchvision_layout_and_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(data.builtin, "DEBIAN_FASHION_MNIST", tmp_path / "nowhere")
    cfg = _cfg(tmp_path, name="fashion-mnist", root=str(tmp_path / "root"))
    with pytest.raises(ConfigError, match="apt-get install dataset-fashion-mnist"):
        load_arrays(cfg)
    raw = tmp_path / "root" / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 12), ("t10k", 4)):
        _write_idx(raw / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte.gz", np.arange(n) % 10)
    ds = load_arrays(cfg)
    assert ds.x_train.shape == (12, 28, 28, 1) and ds.x_test is not None
    np.testing.assert_array_equal(ds.y_test, [0, 1, 2, 3])


def test_cifar10_pickle_batches(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, name="cifar10", root=str(tmp_path))
    with pytest.raises(ConfigError, match="cifar-10-batches-py"):
        load_arrays(cfg)
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        pixels = rng.integers(0, 256, (4, 3072), dtype=np.uint8)
        (folder / name).write_bytes(pickle.dumps({"data": pixels, "labels": [0, 1, 9, 2]}))
    ds = load_arrays(cfg)
    assert ds.x_train.shape == (20, 32, 32, 3) and ds.num_classes == 10
    assert len(ds.mean) == 3
    pixel = pixels[3].reshape(3, 32, 32)[:, 5, 7]  # last test image, stored CHW
    assert ds.x_test is not None and ds.y_test is not None
    np.testing.assert_array_equal(ds.x_test[3, 5, 7], pixel)
    np.testing.assert_array_equal(ds.y_test, [0, 1, 9, 2])


def test_tiny_imagenet_layout(tmp_path: Path) -> None:
    base = tmp_path / "tiny-imagenet-200"
    wnids = ["n02", "n01"]
    for wnid in wnids:
        (base / "train" / wnid / "images").mkdir(parents=True)
        for i in range(2):
            image = Image.new("RGB", (64, 64), (i * 50, 10, 20))
            image.save(base / "train" / wnid / "images" / f"{wnid}_{i}.JPEG")
    (base / "val" / "images").mkdir(parents=True)
    Image.new("L", (64, 64), 128).save(base / "val" / "images" / "val_0.JPEG")
    (base / "val" / "val_annotations.txt").write_text("val_0.JPEG\tn02\t0\t0\t9\t9\n")
    (base / "wnids.txt").write_text("\n".join(wnids) + "\n")
    ds = load_arrays(_cfg(tmp_path, name="tiny-imagenet", root=str(tmp_path)))
    assert ds.x_train.shape == (4, 64, 64, 3) and ds.num_classes == 200
    np.testing.assert_array_equal(ds.y_train, [0, 0, 1, 1])  # sorted wnids
    assert ds.x_test is not None and ds.x_test.shape == (1, 64, 64, 3)
    np.testing.assert_array_equal(ds.y_test, [1])


def test_npz_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    path = tmp_path / "local.npz"
    x = rng.integers(0, 256, (30, 8, 8), dtype=np.uint8)
    np.savez(path, x=x, y=np.arange(30) % 3)
    ds = load_arrays(_cfg(tmp_path, name="npz", root=str(path)))
    assert ds.x_train.shape == (30, 8, 8, 1) and ds.x_test is None
    np.testing.assert_array_equal(ds.x_train[..., 0], x)
    assert ds.num_classes == 3 and ds.y_train.dtype == np.int64
    x_test = rng.integers(0, 256, (5, 8, 8, 3), dtype=np.uint8)
    np.savez(path, x=np.repeat(x[..., None], 3, -1), y=np.arange(30) % 3,
             x_test=x_test, y_test=np.full(5, 4))  # fmt: skip
    ds = load_arrays(_cfg(tmp_path, name="npz", root=str(path)))
    assert ds.num_classes == 5 and ds.x_test is not None
    np.testing.assert_array_equal(ds.x_test, x_test)


@pytest.mark.parametrize(
    ("arrays", "bad"),
    [
        ({"x": np.zeros((4, 8, 8), np.float32), "y": np.zeros(4, int)}, "'x'"),
        ({"x": np.zeros((4, 8, 8, 2), np.uint8), "y": np.zeros(4, int)}, "'x'"),
        ({"x": np.zeros((4, 8, 8), np.uint8), "y": np.zeros(3, int)}, "'y'"),
        ({"x": np.zeros((4, 8, 8), np.uint8), "y": np.full(4, -1)}, "'y'"),
        ({"x": np.zeros((4, 8, 8), np.uint8)}, "'y'"),
    ],
)
def test_npz_bad_arrays_name_the_file(tmp_path: Path, arrays: dict[str, Any], bad: str) -> None:
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(ConfigError, match=str(path)) as info:
        load_arrays(_cfg(tmp_path, name="npz", root=str(path)))
    assert bad in str(info.value)


def test_npz_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="missing.npz"):
        load_arrays(_cfg(tmp_path, name="npz", root=str(tmp_path / "missing.npz")))


def _png(path: Path, mode: str, size: tuple[int, int], value: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    color: Any = value if mode == "L" else (value, 0, 255 - value)
    Image.new(mode, size, color).save(path)


def test_imagefolder_sorted_classes_and_resizing(tmp_path: Path) -> None:
    root = tmp_path / "images"
    _png(root / "zebra" / "a.png", "L", (6, 4), 10)
    _png(root / "zebra" / "b.PNG", "L", (6, 4), 20)
    _png(root / "ant" / "c.png", "L", (9, 9), 30)  # resized to the common 6x4
    (root / "empty").mkdir()
    ds = load_arrays(_cfg(tmp_path, name="imagefolder", root=str(root)))
    assert ds.x_train.shape == (3, 4, 6, 1) and ds.num_classes == 2
    np.testing.assert_array_equal(ds.y_train, [0, 1, 1])  # ant < zebra
    assert ds.x_train[0].min() == 30
    _png(root / "bee" / "d.png", "RGB", (6, 4), 200)
    ds = load_arrays(_cfg(tmp_path, name="imagefolder", root=str(root)))
    assert ds.x_train.shape == (4, 4, 6, 3) and ds.num_classes == 3


def test_imagefolder_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no images"):
        load_arrays(_cfg(tmp_path, name="imagefolder", root=str(tmp_path)))
    with pytest.raises(ConfigError, match="not a folder"):
        load_arrays(_cfg(tmp_path, name="imagefolder", root=str(tmp_path / "x")))


# ----------------------------------------------------------- partition cache


def test_client_data_tensors(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, partition="pathological", classes_per_client=2)
    client = load_client_data(cfg, 1, 5, seed=0)
    assert client.x_train.dtype == torch.float32 and client.y_train.dtype == torch.int64
    assert client.x_train.shape[1:] == (1, 28, 28) and client.x_train.is_contiguous()
    assert (client.in_channels, client.image_size, client.num_classes) == (1, 28, 10)
    assert client.train_class_counts.sum() == len(client.y_train)
    assert np.count_nonzero(client.train_class_counts) == 2
    assert len(client.y_test) > 0
    assert load_client_data(cfg, 1, 5, seed=0) is client  # per-process cache
    with pytest.raises(ConfigError, match="partition id 5"):
        load_client_data(cfg, 5, 5, seed=0)


def test_partition_is_complete_and_normalised(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, alpha=0.5)
    clients = [load_client_data(cfg, i, 4, seed=1) for i in range(4)]
    total = sum(len(c.y_train) + len(c.y_test) for c in clients)
    assert total == 2500  # merge: official train + test pooled
    pixels = torch.cat([c.x_train for c in clients] + [c.x_test for c in clients])
    assert abs(float(pixels.mean())) < 0.05 and abs(float(pixels.std()) - 1) < 0.05
    for c in clients:
        assert abs(len(c.y_train) / (len(c.y_train) + len(c.y_test)) - 0.75) < 0.02


def test_official_protocol_and_fraction(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, protocol="official", partition="iid", fraction=0.5)
    summary = partition_summary(prepare_partition(cfg, 3, 0))
    counts = np.array(summary["train_class_counts"]) + summary["test_class_counts"]
    assert counts.sum() == 1000 and np.all(counts.sum(axis=0) > 0)
    global_test = load_global_test(cfg, 3, 0)
    assert global_test is not None and global_test[0].shape == (250, 1, 28, 28)
    assert load_global_test(_cfg(tmp_path), 3, 0) is None


@pytest.mark.parametrize("name", ["synthetic", "npz"])
def test_own_data_cache_holds_only_its_node_and_equals_the_whole(tmp_path: Path, name: str) -> None:
    """node-config data-cache="own": the node's folder holds its two files alone, equal
    to the whole partition's (the normalisation too: for tabular data it comes from
    every client's training samples), and no other node's class counts."""
    settings: dict[str, Any] = {"alpha": 0.3, "protocol": "official"}
    if name == "npz":
        rng = np.random.default_rng(0)
        np.savez(tmp_path / "t.npz", x=rng.normal(size=(400, 6)).astype(np.float32),
                 y=np.arange(400) % 4)  # fmt: skip
        settings = {"name": "npz", "root": str(tmp_path / "t.npz"), "alpha": 0.3}
    cfg = _cfg(tmp_path, **settings)
    whole = prepare_partition(cfg, 4, 0)
    own = prepare_partition(cfg, 4, 0, only=2)
    assert own != whole and own.parent == whole.parent
    assert sorted(str(p.relative_to(own)) for p in own.rglob("*.npz")) == sorted(
        ["train/2.npz", "test/2.npz"] + (["global_test.npz"] if name == "synthetic" else [])
    )
    meta, full = partition_summary(own), partition_summary(whole)
    assert meta["only"] == 2 and meta["train_class_counts"] == [full["train_class_counts"][2]]
    assert meta["test_class_counts"] == [full["test_class_counts"][2]]
    assert (meta["mean"], meta["std"]) == (full["mean"], full["std"])
    for path in own.rglob("*.npz"):
        with np.load(path) as a, np.load(whole / path.relative_to(own)) as b:
            assert all(np.array_equal(a[k], b[k]) for k in ("x", "y"))
    data.client._CACHE.clear()
    mine = load_client_data(cfg, 2, 4, 0, own_only=True)
    data.client._CACHE.clear()
    theirs = load_client_data(cfg, 2, 4, 0)
    assert torch.equal(mine.x_train, theirs.x_train) and torch.equal(mine.y_test, theirs.y_test)
    with pytest.raises(ConfigError, match="partition id 4"):
        prepare_partition(cfg, 4, 0, only=4)


def test_partition_key_only_tracks_split_settings(tmp_path: Path) -> None:
    base = _cfg(tmp_path, partition="iid")
    key = partition_key(base, 4, 0)
    assert key == partition_key(_cfg(tmp_path / "o", partition="iid", alpha=9), 4, 0)
    assert key == partition_key(_cfg(tmp_path, partition="iid", download=True), 4, 0)
    assert key != partition_key(base, 5, 0)
    assert key != partition_key(base, 4, 1)
    assert partition_key(_cfg(tmp_path, alpha=0.1), 4, 0) != partition_key(
        _cfg(tmp_path, alpha=0.2), 4, 0
    )


def test_cache_reuse_does_not_recompute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = data.store.load_arrays

    def counting(cfg: DataConfig) -> Any:
        calls.append(cfg.name)
        return real(cfg)

    monkeypatch.setattr(data.store, "load_arrays", counting)
    cfg = _cfg(tmp_path)
    first = prepare_partition(cfg, 3, 0)
    stamp = (first / "meta.json").stat().st_mtime_ns
    assert prepare_partition(cfg, 3, 0) == first and calls == ["synthetic"]
    assert (first / "meta.json").stat().st_mtime_ns == stamp
    prepare_partition(cfg, 3, 1)
    assert len(calls) == 2


def _prepare_in_child(args: tuple[str, str]) -> str:
    cache, log = args

    def logged(cfg: DataConfig, num_partitions: int, seed: int, out: Path, *only: Any) -> None:
        with open(log, "a") as handle:
            handle.write("computed\n")
        real_write(cfg, num_partitions, seed, out, *only)

    real_write = data.store.write_partition
    data.store.write_partition = logged
    cfg = DataConfig.model_validate({"name": "synthetic", "cache_dir": cache, "partition": "iid"})
    return str(prepare_partition(cfg, 4, 0))


def test_concurrent_prepare_builds_once(tmp_path: Path) -> None:
    cache, log = tmp_path / "cache", tmp_path / "log.txt"
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        paths = pool.map(_prepare_in_child, [(str(cache), str(log))] * 2)
    assert paths[0] == paths[1]
    assert log.read_text().count("computed") == 1
    visible = [p.name for p in cache.iterdir() if not p.name.endswith(".lock")]
    assert visible == [Path(paths[0]).name], "no temporary folders may remain"
    assert partition_summary(paths[0])["num_clients"] == 4


# ------------------------------------------------------------- clients-npz


def test_export_then_clients_npz_gives_identical_clients(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, alpha=0.3)
    out = export_partition(cfg, 4, 2, tmp_path / "export")
    exported = _cfg(tmp_path, name="clients-npz", root=str(out))
    for cid in range(4):
        a = load_client_data(cfg, cid, 4, 2)
        b = load_client_data(exported, cid, 4, 123)  # the seed no longer matters
        assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
        np.testing.assert_array_equal(a.train_class_counts, b.train_class_counts)
    assert load_client_data(exported, 0, 2, 0).num_classes == 10
    with pytest.raises(ConfigError, match="holds 4 clients"):
        load_client_data(exported, 0, 5, 0)
    with pytest.raises(ConfigError, match="not empty"):
        export_partition(cfg, 4, 2, out)
    (out / "test" / "3.npz").unlink()
    with pytest.raises(ConfigError, match="3.npz"):
        load_client_data(exported, 3, 4, 0)


def test_foreign_clients_npz_without_meta(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        (tmp_path / "f" / split).mkdir(parents=True)
        for cid in range(2):
            x = rng.normal(size=(6, 3, 8, 8)).astype(np.float32)
            np.savez(tmp_path / "f" / split / f"{cid}.npz", x=x, y=np.arange(6) % 4)
    # image_size 8: as they are (0 would resize these 8x8 images up to 16)
    cfg = _cfg(tmp_path, name="clients-npz", root=str(tmp_path / "f"), image_size=8)
    client = load_client_data(cfg, 1, 2, 0)
    stored = np.load(tmp_path / "f" / "train" / "1.npz")["x"]
    np.testing.assert_array_equal(client.x_train.numpy(), stored)  # no re-normalising
    assert (client.num_classes, client.in_channels, client.image_size) == (4, 3, 8)
    assert partition_summary(tmp_path / "f")["train_class_counts"][0] == [2, 2, 1, 1]
    with pytest.raises(ConfigError, match="clients-npz folder"):
        load_client_data(_cfg(tmp_path, name="clients-npz", root=str(tmp_path)), 0, 1, 0)


# ---------------------------------------------------------- device-local data


def test_load_local_data(tmp_path: Path) -> None:
    path = tmp_path / "device.npz"
    x = np.random.default_rng(0).integers(0, 256, (40, 8, 8, 3), dtype=np.uint8)
    np.savez(path, x=x, y=np.arange(40) % 4)
    local = load_local_data("npz", path, seed=3, image_size=8)  # as they are
    assert (len(local.y_train), len(local.y_test)) == (30, 10)
    assert local.x_train.shape[1:] == (3, 8, 8) and local.num_classes == 4
    resized = load_local_data("npz", path, seed=3)  # the default: up to 16 px
    assert resized.x_train.shape[1:] == (3, 16, 16) and resized.resized_from == 8
    with pytest.raises(ConfigError, match="nowhere.npz"):
        load_local_data("npz", tmp_path / "nowhere.npz")
