"""An in-process federation: every message goes straight to a ClientApp, no Ray.

:class:`FakeGrid` is a minimal Grid for ``Strategy.start`` (``get_node_ids`` +
``send_and_receive``). Each node keeps its own ``Context`` (node config, persistent
``state``) across messages, as a SuperNode does. ``faults`` can turn a node's reply
into a crafted one (NaN arrays, wrong shapes, an error) to see what the server
survives; nothing in a run config reaches it. :func:`run_inprocess` runs a whole
small federation through it (the tests; ``benchmarks/faults.py`` serves through the
grid itself).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp

from common.config import flatten, parse_run_config
from server_app.results import Recorded
from strategies import make_strategy

Fault = Callable[[Message], Message]


class FakeGrid:
    """Minimal Grid for ``Strategy.start``: ``get_node_ids`` + ``send_and_receive``."""

    def __init__(
        self,
        app: ClientApp,
        run_config: dict,
        num_nodes: int,
        node_configs: list[dict] | None = None,
    ) -> None:
        self.app = app
        self.contexts: dict[int, Context] = {}
        for pid in range(num_nodes):
            nid = 1000 + 17 * pid
            node_config: dict[str, bool | float | int | str] = {
                "partition-id": pid,
                "num-partitions": num_nodes,
            }
            if node_configs:
                node_config.update(node_configs[pid])
            self.contexts[nid] = Context(
                run_id=1,
                node_id=nid,
                node_config=node_config,
                state=RecordDict(),
                run_config=dict(run_config),
            )
        self.faults: dict[int, Fault] = {}
        self.sent: list[Message] = []
        self.offline: set[int] = set()

    def get_node_ids(self) -> Iterable[int]:
        return [n for n in self.contexts if n not in self.offline]

    def node_of_partition(self, pid: int) -> int:
        return next(n for n, c in self.contexts.items() if c.node_config["partition-id"] == pid)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        replies = []
        for msg in messages:
            self.sent.append(msg)
            nid = msg.metadata.dst_node_id
            if nid in self.offline:
                continue
            reply = self.app(msg, self.contexts[nid])
            if nid in self.faults and msg.metadata.message_type.startswith("train"):
                reply = self.faults[nid](reply)
            replies.append(reply)
        return replies


def small_config(tmp_path: Path, **overrides: Any) -> dict:
    """A full flat run config for a small, fast run under ``tmp_path`` (synthetic
    data, 2 rounds), with ``overrides`` (flat run-config keys)."""
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


def run_inprocess(
    tmp_path: Path,
    num_nodes: int = 3,
    *,
    app: ClientApp | None = None,
    keep_clients: bool = False,
    **overrides: Any,
) -> tuple[dict, FakeGrid]:
    """A whole run of :func:`small_config` with ``overrides`` through a
    :class:`FakeGrid` of ``num_nodes`` nodes running ``app`` (default: fedhet's
    ClientApp); the run's ``results.json`` and the grid. ``keep_clients``: the nodes
    keep their personal models under ``<out-dir>/clients``, as a simulation's do."""
    if app is None:
        from client_app.app import app as fedhet_app

        app = fedhet_app
    run_config = small_config(tmp_path, **overrides)
    cfg = parse_run_config(run_config)
    grid = FakeGrid(app, run_config, num_nodes)
    strategy = make_strategy(cfg)
    if keep_clients:
        strategy.clients_dir = str(cfg.resolved_out_dir("t") / "clients")
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
