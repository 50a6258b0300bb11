"""Shared test helpers: a small run config, an in-process run, a client context."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flwr.app import Context, RecordDict

from client_app.app import app as client_app
from common.config import flatten, parse_run_config
from server_app.results import Recorded
from strategies import make_strategy
from tests.fakegrid import FakeGrid


def small_config(tmp_path: Path, **overrides) -> dict:
    cfg = {
        "num-server-rounds": 2,
        "seed": 0,
        "out-dir": str(tmp_path / "out"),
        "data.name": "synthetic",
        "data.alpha": 0.5,
        "data.cache-dir": str(tmp_path / "c"),
        "model.family": "cnn",
        "train.batch-size": 32,
    }
    cfg.update(overrides)
    return {**flatten(parse_run_config({})), **cfg}


def run_inprocess(tmp_path: Path, num_nodes: int = 3, **overrides) -> tuple[dict, FakeGrid]:
    run_config = small_config(tmp_path, **overrides)
    cfg = parse_run_config(run_config)
    grid = FakeGrid(client_app, run_config, num_nodes)
    strategy = make_strategy(cfg)
    recorder = Recorded(strategy, cfg, cfg.resolved_out_dir("t"))
    initial = strategy.initial_arrays(grid)  # type: ignore[arg-type]
    recorder.start(grid, initial, num_rounds=cfg.num_server_rounds, evaluate_fn=recorder.end_round)  # type: ignore[arg-type]
    path = recorder.write()
    return json.loads(path.read_text()), grid


def client_context(
    tmp_path: Path,
    algorithm: str,
    pid: int = 0,
    num: int = 3,
    node_config: dict[str, Any] | None = None,
    **cfg: Any,
) -> Context:
    """A node's context (fresh state) for calling the ClientApp or ``open_run``."""
    return Context(
        run_id=1,
        node_id=100 + pid,
        node_config={"partition-id": pid, "num-partitions": num, **(node_config or {})},
        state=RecordDict(),
        run_config=small_config(tmp_path, algorithm=algorithm, **cfg),
    )
