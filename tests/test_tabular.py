"""Tabular and sensor data: ``npz`` feature vectors ``[N, F]``, the ``mlp`` family.

Features are standardised per feature with the mean and std of the training samples
only (closed forms below); every method learns on a tabular set; an image family on
feature vectors (or ``mlp`` on images) stops before round 1 with one line naming the
way out; an exported ``mlp`` model decides in ``fedhet predict`` (``.npz`` and CSV
inputs in the data's own units) exactly as it was evaluated.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client_app.preflight import NodeUnfit, check_partitions
from common import methods
from common.config import ConfigError, DataConfig, parse_run_config
from data import load_client_data
from data.client import load_local_data
from data.store import prepare_partition
from server_app.inprocess import run_inprocess, small_config

CLASSES, FEATURES = 6, 16


def tabular_set(path: Path, count: int = 1200, seed: int = 0) -> Path:
    """Gaussian clusters in units far from 0 / 1 (as raw sensor readings are)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0.0, 2.0, (CLASSES, FEATURES))
    y = rng.integers(0, CLASSES, count)
    x = (centres[y] + rng.normal(0.0, 1.0, (count, FEATURES))) * 50.0 + 1000.0
    np.savez(path, x=x.astype(np.float32), y=y)
    return path


@pytest.fixture(scope="module")
def npz(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tabular_set(tmp_path_factory.mktemp("tabular") / "sensors.npz")


def tabular(npz: Path, tmp: Path, **overrides: Any) -> dict[str, Any]:
    return {
        "data.name": "npz",
        "data.root": str(npz),
        "data.cache-dir": str(tmp / "cache"),
        "model.family": "mlp",
        **overrides,
    }


def test_features_are_standardised_with_the_training_samples_only(
    npz: Path, tmp_path: Path
) -> None:
    cfg = DataConfig.model_validate({"name": "npz", "root": str(npz), "cache_dir": str(tmp_path)})
    folder = prepare_partition(cfg, 3, seed=0)
    meta = json.loads((folder / "meta.json").read_text())
    train = [np.load(folder / "train" / f"{i}.npz")["x"].astype(np.float64) for i in range(3)]
    test = [np.load(folder / "test" / f"{i}.npz")["x"].astype(np.float64) for i in range(3)]
    pooled = np.concatenate(train)
    np.testing.assert_allclose(meta["mean"], pooled.mean(0), rtol=1e-12)
    np.testing.assert_allclose(meta["std"], pooled.std(0), rtol=1e-12)
    everything = np.concatenate(train + test)
    assert not np.allclose(meta["mean"], everything.mean(0), rtol=1e-9, atol=0)
    assert meta["features"] == FEATURES
    data = load_client_data(cfg, 1, 3, seed=0)
    assert data.tabular and data.input_shape == (FEATURES,) and data.image_size == 0
    assert data.in_channels == FEATURES
    expected = (test[1] - pooled.mean(0)) / pooled.std(0)
    np.testing.assert_allclose(data.x_test.numpy(), expected.astype(np.float32), rtol=0, atol=1e-6)
    assert abs(float(data.x_train.mean())) < 0.5  # the raw units (about 1000) are gone


def test_a_device_standardises_with_its_own_training_split(npz: Path) -> None:
    data = load_local_data("npz", npz, train_fraction=0.75, seed=3)
    raw = np.load(npz)["x"].astype(np.float64)
    mean, std = np.asarray(data.mean), np.asarray(data.std)
    train_raw = data.x_train.numpy() * std + mean
    np.testing.assert_allclose(train_raw.mean(0), mean, atol=1e-3)
    assert len(data.y_train) + len(data.y_test) == len(raw)
    assert not np.allclose(mean, raw.mean(0), rtol=1e-9, atol=0)  # the test rows left out


def test_constant_features_get_std_one_and_bad_values_name_their_row(tmp_path: Path) -> None:
    x = np.random.default_rng(0).normal(size=(40, 3)).astype(np.float32)
    x[:, 1] = 7.0
    np.savez(tmp_path / "ok.npz", x=x, y=np.arange(40) % 2)
    data = load_local_data("npz", tmp_path / "ok.npz")
    assert data.std[1] == 1.0 and float(data.x_train[:, 1].abs().max()) == 0.0
    x[17, 2] = np.nan
    np.savez(tmp_path / "bad.npz", x=x, y=np.arange(40) % 2)
    with pytest.raises(ConfigError, match=r"array 'x' in .*bad\.npz.* row 17"):
        load_local_data("npz", tmp_path / "bad.npz")
    np.savez(tmp_path / "words.npz", x=np.array([["a", "b"]] * 4), y=np.zeros(4, np.int64))
    with pytest.raises(ConfigError, match="array 'x'.*expected numbers"):
        load_local_data("npz", tmp_path / "words.npz")


FAST = ("fedara", "fedlora", "lgfedavg")
"""In the fast tier: low-rank Linear layers, adapters in the MLP, a shared head."""


@pytest.mark.parametrize(
    "algorithm",
    [
        pytest.param(a, marks=() if a in FAST else (pytest.mark.slow,))
        for a in sorted(methods.METHODS)
    ],
)
def test_every_method_learns_on_feature_vectors(npz: Path, tmp_path: Path, algorithm: str) -> None:
    family = "mlp-1" if algorithm == "fedavg" else "mlp"
    overrides = {"model.family": family, "train.local-epochs": 3}
    res, _ = run_inprocess(tmp_path, algorithm=algorithm, **tabular(npz, tmp_path, **overrides))
    last = res["rounds"][-1]
    assert last["accuracy"] > 2.0 / CLASSES  # chance is 1/6
    assert all(np.isfinite(r["loss"]) for r in res["rounds"])


def test_image_family_on_feature_vectors_stops_before_round_one(npz: Path, tmp_path: Path) -> None:
    cfg = parse_run_config(
        small_config(tmp_path, **tabular(npz, tmp_path, **{"model.family": "cnn"}))
    )
    with pytest.raises(NodeUnfit) as caught:
        check_partitions(cfg, 3)
    line = str(caught.value)
    assert line.startswith("partition 0: model: cnn-1 takes images") and "model.family=mlp" in line
    assert "\n" not in line
    images = parse_run_config(small_config(tmp_path, **{"model.family": "mlp"}))  # synthetic images
    with pytest.raises(NodeUnfit, match="mlp-1 takes feature vectors.*image family"):
        check_partitions(images, 3)
    resized = parse_run_config(
        small_config(tmp_path, **tabular(npz, tmp_path, **{"data.image-size": 16}))
    )
    with pytest.raises(NodeUnfit, match="data.image-size = 16 resizes images.*feature vectors"):
        check_partitions(resized, 3)


@pytest.mark.slow
def test_an_exported_mlp_predicts_from_npz_and_csv_as_evaluated(npz: Path, tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime", reason="pip install -e '.[dev]' (onnxruntime)")
    pytest.importorskip("onnxscript", reason="pip install -e '.[dev]' (onnxscript)")
    from cli.export import export_run
    from cli.predict import predict
    from client_app.app import app as client_app
    from server_app.app import serve
    from server_app.inprocess import FakeGrid

    run_config = small_config(tmp_path, **tabular(npz, tmp_path, algorithm="lgfedavg"))
    grid = FakeGrid(client_app, run_config, 2)
    cfg = parse_run_config(run_config)
    results = serve(grid, cfg, True)  # type: ignore[arg-type]
    res = json.loads(results.read_text())
    written = export_run(results.parent, tmp_path / "onnx", echo=lambda _: None)
    folder = prepare_partition(cfg.data, 2, cfg.seed)
    for path in written:
        pid = int(path.stem.removeprefix("client-"))
        card = json.loads(path.with_suffix(".json").read_text())
        assert card["input"]["shape"] == ["batch", FEATURES] and card["input"]["layout"] == "NF"
        recorded = res["rounds"][-1]["client-accuracy"][str(pid)]
        raw = folder / "test" / f"{pid}.npz"
        rows, accuracy = predict(path, [raw])
        assert accuracy == recorded and len(rows) == len(np.load(raw)["y"])
        arrays = np.load(raw)
        table = np.column_stack([arrays["x"].astype(np.float64), arrays["y"]])
        csv = tmp_path / f"client-{pid}.csv"
        header = ",".join([*(f"f{i}" for i in range(FEATURES)), "label"])
        np.savetxt(csv, table, delimiter=",", header=header, comments="", fmt="%.9g")
        csv_rows, csv_accuracy = predict(path, [csv])
        assert csv_accuracy == recorded
        assert [r[1] for r in csv_rows] == [r[1] for r in rows]
