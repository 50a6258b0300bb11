"""Data checked before round 1: a data set that does not fit stops `fedhet simulate`
before Flower starts, with one line naming the key; a node whose data does not fit
answers the profile query with its cause, and the ServerApp stops with the causes
instead of "no node answered"."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from typer.testing import CliRunner


def _npz(path: Path, x: np.ndarray, classes: int = 4) -> Path:
    rng = np.random.default_rng(0)
    np.savez(path, x=x, y=rng.integers(0, classes, len(x)))
    return path


def _small_images(tmp: Path) -> Path:
    rng = np.random.default_rng(0)
    return _npz(tmp / "digits8.npz", rng.integers(0, 256, (400, 8, 8), dtype=np.uint8))


def _tabular(tmp: Path) -> Path:
    rng = np.random.default_rng(0)
    return _npz(tmp / "sensors.npz", rng.normal(size=(400, 16)).astype(np.float32), 26)


@pytest.mark.parametrize(
    ("make", "extra", "says"),
    [
        (
            _small_images,
            " data.image-size=8",  # kept at 8 px on purpose: too small for the stems
            "partition 0: model: image_size 8 is too small; need at least 16",
        ),
        (
            _tabular,
            "",
            "partition 0: model: cnn-1 takes images, but the data are feature "
            "vectors [n, F]; use model.family=mlp",
        ),
    ],
)
def test_simulate_stops_before_flower_with_one_line(  # type: ignore[no-untyped-def]
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make, extra: str, says: str
) -> None:
    import cli.launch
    from cli.main import app

    def never(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("Flower was started for a data set that does not fit")

    monkeypatch.setattr(cli.launch, "run_simulation", never)
    data = make(tmp_path)
    done = CliRunner().invoke(
        app,
        [
            "simulate",
            "-c",
            f"data.name='npz' data.root='{data}' data.cache-dir='{tmp_path / 'c'}'{extra}",
            "--num-supernodes",
            "4",
        ],
    )
    assert done.exit_code == 2, done.output
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedhet: ") and says in lines[0], lines


def test_a_node_that_cannot_run_answers_with_its_cause(tmp_path: Path) -> None:
    from client_app.app import profile
    from common.config import flatten, parse_run_config

    cfg = parse_run_config(
        {
            "data.name": "npz",
            "data.root": str(_small_images(tmp_path)),
            "data.cache-dir": str(tmp_path / "c"),
            "data.image-size": 8,
        }
    )
    context = Context(
        run_id=1,
        node_id=5,
        node_config={"partition-id": 2, "num-partitions": 4},
        state=RecordDict(),
        run_config=flatten(cfg),
    )
    query = Message(
        RecordDict({"config": ConfigRecord()}), dst_node_id=5, message_type="query.profile"
    )
    reply = profile(query, context)
    assert reply.has_error()
    assert reply.error.reason.startswith("partition 2: model: image_size 8 is too small")


def test_the_server_stops_with_the_nodes_causes_not_no_node_answered(tmp_path: Path) -> None:
    from server_app.inprocess import run_inprocess

    with pytest.raises(RuntimeError) as stop:
        run_inprocess(
            tmp_path,
            3,
            algorithm="lgfedavg",
            **{"data.name": "npz", "data.root": str(_tabular(tmp_path))},
        )
    text = str(stop.value)
    assert "no node can run (3 answered with a cause)" in text
    assert "model: cnn-1 takes images" in text and "use model.family=mlp" in text


@pytest.mark.slow  # loads and trains: about 10 s
def test_small_images_are_resized_up_to_what_the_stems_take(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """8x8 images, no key: every node loads them at 16x16 (bilinear, as torch's
    interpolate), says so once, and a run completes; data.image-size picks another side."""
    import logging

    import torch
    import torch.nn.functional as F

    from common.config import parse_run_config
    from data import load_client_data
    from data.client import _said_resized
    from server_app.inprocess import run_inprocess

    root = _small_images(tmp_path)
    base = {"data.name": "npz", "data.root": str(root), "data.cache-dir": str(tmp_path / "c")}
    _said_resized.clear()
    with caplog.at_level(logging.INFO):
        data = load_client_data(parse_run_config(base).data, 0, 4, 0)
        load_client_data(parse_run_config(base).data, 1, 4, 0)
    assert data.image_size == 16 and data.resized_from == 8
    assert tuple(data.x_train.shape[1:]) == (1, 16, 16)
    said = [r.getMessage() for r in caplog.records if "resized to" in r.getMessage()]
    assert said == [
        "fedhet: images are 8x8 px; resized to 16x16 (bilinear) as they load "
        "(data.image-size chooses the side)"
    ]
    wider = load_client_data(parse_run_config({**base, "data.image-size": 24}).data, 0, 4, 0)
    assert wider.image_size == 24 and wider.resized_from == 8
    plain = load_client_data(parse_run_config({**base, "data.image-size": 8}).data, 0, 4, 0)
    assert plain.resized_from == 0
    expected = F.interpolate(plain.x_train, size=(16, 16), mode="bilinear", align_corners=False)
    assert torch.equal(data.x_train, expected)
    results, _ = run_inprocess(tmp_path / "run", 2, algorithm="local", **base)
    assert results["rounds"][-1]["accuracy"] is not None
