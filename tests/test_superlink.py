"""fedhet superlink's changes to Flower's SuperLink (cli/superlink.py): the Control
middlewares scoped to Control paths, and the in-memory state's per-node message index,
against Flower's own behaviour."""

from __future__ import annotations

import asyncio
import copy
import time
from typing import Any

import pytest

from cli import superlink as sl


# ------------------------------------------------------------------ middleware scope
class Tracer:
    """A middleware that records the paths it saw."""

    seen: list[str] = []

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        Tracer.seen.append(scope.get("path", scope["type"]))
        await self.app(scope, receive, send)


async def endpoint(scope: dict, receive: Any, send: Any) -> None:
    endpoint.reached.append(scope.get("path", scope["type"]))  # type: ignore[attr-defined]


endpoint.reached = []  # type: ignore[attr-defined]


def call(app: Any, scope: dict) -> None:
    asyncio.run(app(scope, None, None))


def test_a_scoped_middleware_runs_only_where_it_applies() -> None:
    Tracer.seen, endpoint.reached = [], []  # type: ignore[attr-defined]
    app = sl.Scoped(endpoint, Tracer, sl.control_path)
    for path in ("/v1/fleet/pull-messages", "/v1/control/start-run", "/v1/runtime/x"):
        call(app, {"type": "http", "path": path})
    call(app, {"type": "lifespan"})
    assert Tracer.seen == ["/v1/control/start-run", "lifespan"]
    assert endpoint.reached == [  # type: ignore[attr-defined]
        "/v1/fleet/pull-messages",
        "/v1/control/start-run",
        "/v1/runtime/x",
        "lifespan",
    ]


def test_the_fleet_log_runs_only_with_its_plugin() -> None:
    class App:
        class state:  # noqa: N801 - Starlette's attribute
            fleet_event_log_plugin = None

    assert not sl.fleet_log_set({"app": App})
    App.state.fleet_event_log_plugin = object()  # type: ignore[assignment]
    assert sl.fleet_log_set({"app": App})
    assert not sl.fleet_log_set({})


def test_flowers_stack_keeps_its_order_with_five_layers_scoped() -> None:
    import flwr.superlink.main as main
    from flwr.superlink.routers.control import middlewares as control
    from flwr.superlink.routers.fleet.middlewares import FleetEventLogMiddleware

    from common import flower_gate as gate

    stock = gate.original(main, "_get_middleware")()
    scoped = sl.scoped_middleware(stock)
    assert len(scoped) == len(stock)
    wrapped = {
        control.ControlSensitiveResponseMiddleware: sl.control_path,
        control.ControlEventLogMiddleware: sl.control_path,
        control.ControlLicenseMiddleware: sl.control_path,
        control.ControlAuthenticationMiddleware: sl.control_path,
        FleetEventLogMiddleware: sl.fleet_log_set,
    }
    for before, after in zip(stock, scoped, strict=True):
        if before.cls in wrapped:
            assert after.cls is sl.Scoped
            assert after.args[:2] == (before.cls, wrapped[before.cls])
        else:
            assert after is before
    assert sum(a.cls is sl.Scoped for a in scoped) == 5


# ------------------------------------------------------------------ per-node index
@pytest.fixture()
def states() -> Any:
    """Two in-memory link states with the same run, nodes and messages: Flower's own
    ``get_message_ins`` on the first, the indexed one on the second."""
    from flwr.app import Message, RecordDict
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.server.superlink.linkstate.linkstate_factory import LinkStateFactory
    from flwr.supercore.constant import NOOP_FEDERATION_ID
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.supercore.task_identity import TaskIdentity
    from flwr.superlink.federation.noop_federation_manager import NoOpFederationManager

    def state() -> Any:
        return LinkStateFactory(
            ":flwr-in-memory:", NoOpFederationManager(), ObjectStoreFactory()
        ).state()

    flowers, ours = state(), state()
    run_id = flowers.create_run(None, None, None, {}, NOOP_FEDERATION_ID, None, None, "serverapp")
    ours.run_ids, ours.task_store = flowers.run_ids, flowers.task_store  # shared: read by both
    nodes = []
    for i in range(4):
        node = flowers.create_node("none", "none", f"key-{i}".encode(), 30.0)
        flowers.acknowledge_node_heartbeat(node, 30.0)
        nodes.append(node)
    ours.nodes = flowers.nodes
    saved = TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, run_id, SUPERLINK_NODE_ID
    try:
        for i in range(12):  # nodes 0, 1, 2 get 4, 4, 4 messages, interleaved; node 3 none
            msg = Message(RecordDict(), dst_node_id=nodes[i % 3], message_type="train", ttl=600)
            msg.metadata.__dict__["_message_id"] = msg.object_id
            assert flowers.store_message_ins(msg)
            assert ours.store_message_ins(copy.deepcopy(msg))
    finally:
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = saved
    indexed = sl.indexed_get_message_ins(type(ours).get_message_ins)
    return flowers, ours, indexed, nodes, run_id


def ids(messages: list[Any]) -> list[str]:
    return [m.metadata.message_id for m in messages]


def test_the_index_finds_what_flowers_scan_finds(states: Any) -> None:
    flowers, ours, indexed, nodes, run_id = states
    calls = [
        (nodes[0], 1, None),
        (nodes[1], None, run_id),
        (nodes[0], 2, None),
        (nodes[3], 1, None),
        (nodes[2], 1, run_id + 1),
        (nodes[0], None, None),
    ]
    for node, limit, run in calls:
        want = flowers.get_message_ins(node_id=node, limit=limit, run_id=run)
        got = indexed(ours, node, limit, run_id=run)
        assert ids(got) == ids(want), (node, limit, run)
        assert all(m.metadata.delivered_at for m in got)
    assert set(ours.message_ins_store) == set(flowers.message_ins_store)
    assert ours.message_ins_store.by_node.keys() == {nodes[0], nodes[1], nodes[2]}


def test_deleted_messages_leave_the_index(states: Any) -> None:
    flowers, ours, indexed, nodes, _ = states
    indexed(ours, nodes[3], 1)  # the store becomes the indexed one
    gone = list(ours.message_ins_store.by_node[nodes[1]])
    ours.delete_messages(set(gone))
    assert nodes[1] not in ours.message_ins_store.by_node
    assert indexed(ours, nodes[1], None) == []
    assert ours.message_ins_store.pop("nope", None) is None
    first = next(iter(ours.message_ins_store.by_node[nodes[0]]))
    ours.message_ins_store.pop(first)
    assert first not in ours.message_ins_store.by_node[nodes[0]]


def test_expired_messages_are_removed_by_their_nodes_poll_and_by_the_sweep(
    states: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    flowers, ours, indexed, nodes, _ = states
    for msg in ours.message_ins_store.values():
        msg.metadata.__dict__["_created_at"] = time.time() - 3600  # expired
    assert indexed(ours, nodes[0], 1) == []
    by_node = ours.message_ins_store.by_node
    assert nodes[0] not in by_node and {nodes[1], nodes[2]} <= by_node.keys()
    # another node's expired messages stay until the sweep (every SWEEP_S) ...
    monkeypatch.setattr(sl, "SWEEP_S", 0.0)
    swept = sl.indexed_get_message_ins(type(ours).get_message_ins)
    assert swept(ours, nodes[3], 1) == []
    assert len(ours.message_ins_store) == 0 and not ours.message_ins_store.by_node
