"""``log.tensorboard``: every completed round's metrics, read back from the event files."""

from __future__ import annotations

import builtins
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tensorboard", reason="pip install -e '.[dev]' (tensorboard)")
from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    EventAccumulator,
)

from common.config import ConfigError, parse_run_config  # noqa: E402
from server_app.inprocess import run_inprocess  # noqa: E402
from server_app.tracking import Tracker, tensorboard_writer  # noqa: E402


def read(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Tag -> [(step, value)] of every scalar in the event files under ``folder``."""
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def row(rnd: int, **values: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "round": rnd,
        "accuracy": None,
        "bytes-up": 1000 * rnd,
        "client-accuracy": {},
        "virtual-time-s": 2.5,
    }
    return {**base, **values}


def test_rows_become_scalars_and_a_completed_row_adds_only_what_is_new(tmp_path: Path) -> None:
    tracker = Tracker(tensorboard_writer(tmp_path))
    rejected = [(1, 17, "non-finite"), (2, 17, "too large"), (2, 34, "too large")]
    tracker.log_round(row(1, accuracy=0.5, **{"client-accuracy": {"0": 0.25, "1": 0.75}}), rejected)
    tracker.log_round(row(2), rejected)  # its evaluation comes later
    tracker.log_round(row(2, accuracy=0.625, **{"client-accuracy": {"0": 0.5}}), rejected)
    tracker.close()
    got = read(tmp_path)
    assert got["accuracy/all"] == [(1, 0.5), (2, 0.625)]
    assert got["client-accuracy/0"] == [(1, 0.25), (2, 0.5)]
    assert got["client-accuracy/1"] == [(1, 0.75)]
    assert got["bytes/up"] == [(1, 1000.0), (2, 2000.0)]  # written once per round
    assert got["replies/rejected"] == [(1, 1.0), (2, 2.0)]
    assert got["time/virtual-total-s"] == [(1, 2.5), (2, 5.0)]
    assert got["accuracy/by-virtual-second"] == [(2, 0.5), (5, 0.625)]


def test_a_run_logs_every_round_as_results_json_records_it(tmp_path: Path) -> None:
    """Through the ServerApp's recorder (simulation and deployment share it)."""
    folder = tmp_path / "tb"
    overrides: dict[str, Any] = {"algorithm": "lgfedavg", "log.tensorboard": str(folder)}
    res, _ = run_inprocess(tmp_path, 2, **overrides)
    runs = [p for p in folder.iterdir() if p.is_dir()]
    assert [p.name for p in runs] == ["out"]  # <log.tensorboard>/<out-dir's name>
    got = read(runs[0])
    rounds = res["rounds"]
    assert got["accuracy/all"] == [(r["round"], pytest.approx(r["accuracy"])) for r in rounds]
    for pid in ("0", "1"):
        assert got[f"client-accuracy/{pid}"] == [
            (r["round"], pytest.approx(r["client-accuracy"][pid])) for r in rounds
        ]
    assert got["bytes/up"] == [(r["round"], float(r["bytes-up"])) for r in rounds]
    assert got["bytes/down"] == [(r["round"], float(r["bytes-down"])) for r in rounds]
    assert [s for s, _ in got["time/round-s"]] == [1, 2]
    assert got["replies/rejected"] == [(1, 0.0), (2, 0.0)]


def test_off_by_default_and_a_clear_error_without_tensorboard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = parse_run_config({})
    assert cfg.log.tensorboard == ""
    tracker = Tracker.from_config(cfg, tmp_path / "run")
    assert tracker.writer is None
    tracker.log_round(row(1, accuracy=0.5))  # nothing to write, nothing written
    assert not any(tmp_path.iterdir())

    real_import = builtins.__import__

    def no_tensorboard(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("torch.utils.tensorboard") or name.startswith("tensorboard"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    on = parse_run_config({"log.tensorboard": str(tmp_path / "tb")})
    with pytest.raises(ConfigError, match=r"log.tensorboard.*fedhet\[tensorboard\]"):
        Tracker.from_config(on, tmp_path / "run")
