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
    ("make", "says"),
    [
        (_small_images, "partition 0: model: image_size 8 is too small; need at least 16"),
        (_tabular, "partition 0: data: array 'x' in"),
    ],
)
def test_simulate_stops_before_flower_with_one_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    make,
    says: str,  # type: ignore[no-untyped-def]
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
            f"data.name='npz' data.root='{data}' data.cache-dir='{tmp_path / 'c'}'",
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
    assert "data: array 'x' in" in text and "expected uint8 pixels" in text
