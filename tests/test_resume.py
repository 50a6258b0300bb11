"""A run killed after round 2 and resumed ends exactly where an uninterrupted one does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from client_app.app import app as client_app
from common.config import ConfigError, parse_run_config
from server_app.app import serve
from server_app.inprocess import FakeGrid, small_config

KEYS = ("round", "accuracy", "loss", "accuracy-std", "bytes-up", "valid-replies")


class Crash(RuntimeError):
    pass


class CrashingGrid(FakeGrid):
    """Dies (like a killed server) when round ``at`` starts."""

    def __init__(self, *args, at: int, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.at = at

    def send_and_receive(self, messages, *, timeout=None):  # type: ignore[no-untyped-def]
        messages = list(messages)
        if any(
            int(m.content["config"].get("server-round", 0)) == self.at
            for m in messages
            if "config" in m.content
        ):
            raise Crash(f"killed at the start of round {self.at}")
        return super().send_and_receive(messages, timeout=timeout)


def _run(tmp_path: Path, name: str, **over) -> Path:  # type: ignore[no-untyped-def]
    run_config = small_config(tmp_path, **{"out-dir": str(tmp_path / name), **over})
    return serve(FakeGrid(client_app, run_config, 4), parse_run_config(run_config), True)


@pytest.mark.parametrize(
    "algorithm",
    [pytest.param(a, marks=pytest.mark.slow) for a in ("fedre", "fedtgp", "fedara")],
)
def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path: Path, algorithm: str) -> None:
    common = {"algorithm": algorithm, "num-server-rounds": 4, "fedtgp.server-epochs": 2}
    full = _run(tmp_path, "full", **common)
    with pytest.raises(Crash):
        run_config = small_config(tmp_path, **{"out-dir": str(tmp_path / "crashed"), **common})
        serve(CrashingGrid(client_app, run_config, 4, at=3), parse_run_config(run_config), True)
    done = json.loads((tmp_path / "crashed" / "results.json").read_text())["rounds"]
    assert (tmp_path / "crashed" / "checkpoint.pt").exists() and len(done) == 2
    # a new server and new nodes (all memory lost), the personal models on disk
    resumed = small_config(tmp_path, **{**common, "resume": str(tmp_path / "crashed")})
    path = serve(FakeGrid(client_app, resumed, 4), parse_run_config(resumed), True)
    assert path == tmp_path / "crashed" / "results.json"
    want = json.loads(full.read_text())["rounds"]
    got = json.loads(path.read_text())["rounds"]
    assert [[r[k] for k in KEYS] for r in got] == [[r[k] for k in KEYS] for r in want]


def test_resuming_with_a_changed_key_is_refused_naming_it(tmp_path: Path) -> None:
    _run(tmp_path, "first", **{"num-server-rounds": 2})
    changed = small_config(tmp_path, **{"resume": str(tmp_path / "first"), "train.lr": 0.1})
    with pytest.raises(ConfigError, match="'train.lr' = 0.1 differs from the resumed run's 0.01"):
        serve(FakeGrid(client_app, changed, 4), parse_run_config(changed), True)
    more = small_config(tmp_path, **{"resume": str(tmp_path / "first"), "num-server-rounds": 3})
    path = serve(FakeGrid(client_app, more, 4), parse_run_config(more), True)
    assert [r["round"] for r in json.loads(path.read_text())["rounds"]] == [1, 2, 3]


def test_resuming_a_folder_without_a_checkpoint_is_refused(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, **{"resume": str(tmp_path / "nothing")})
    with pytest.raises(ConfigError, match="'resume': no checkpoint.pt"):
        serve(FakeGrid(client_app, cfg, 4), parse_run_config(cfg), True)
