"""fedhet superlink's changes to Flower's SuperLink (cli/superlink.py): the Control
middlewares scoped to Control paths, and the in-memory state's per-node message index,
against Flower's own behaviour."""

from __future__ import annotations

import asyncio
import copy
import importlib
import re
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


def test_a_message_is_returned_only_once_all_its_objects_are_on_the_superlink(
    states: Any,
) -> None:
    """Part superlink-whole-messages: a message whose objects the ServerApp has
    registered but not all pushed is not returned (nor marked delivered); the node's
    next whole message is; once the last object arrives, the held one is."""
    from flwr.supercore.inflatable.inflatable_object import (
        get_all_nested_objects,
        get_object_tree,
    )

    _, ours, _, nodes, run_id = states
    whole_only = sl.indexed_get_message_ins(type(ours).get_message_ins, whole_only=True)
    first, second = list(sl.NodeIndexed(ours.message_ins_store).of(nodes[0]))[:2]
    held = ours.message_ins_store[first]
    store = ours.object_store
    store.preregister(run_id, get_object_tree(held))
    objects = get_all_nested_objects(held)
    assert len(objects) >= 2
    *early, last = objects.items()
    for object_id, obj in early:
        store.put(object_id, obj.deflate())
    assert not sl.whole(store, first) and sl.whole(store, second)
    assert ids(whole_only(ours, nodes[0], 1)) == [second]
    assert held.metadata.delivered_at == ""
    store.put(last[0], last[1].deflate())
    assert sl.whole(store, first)
    assert ids(whole_only(ours, nodes[0], 1)) == [first]
    assert held.metadata.delivered_at != ""


# ------------------------------------------------------------------ database index
def _instruction(node: int, run_id: int, content: Any = None) -> Any:
    """A message from the ServerApp of run ``run_id`` to ``node``."""
    from flwr.app import Message, RecordDict
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.task_identity import TaskIdentity

    saved = TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, run_id, SUPERLINK_NODE_ID
    try:
        msg = Message(content or RecordDict(), dst_node_id=node, message_type="train", ttl=600)
    finally:
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = saved
    msg.metadata.__dict__["_message_id"] = msg.object_id
    return msg


def _indexed_store() -> Any:
    """The index's ``store_message_ins`` around Flower's."""
    from flwr.server.superlink.linkstate.sql_linkstate import SqlLinkState

    flowers = SqlLinkState.__dict__["store_message_ins"]
    return sl.indexed_store_message_ins(getattr(flowers, "__wrapped__", flowers))


def _database(path: Any, indexed: bool) -> Any:
    """Flower's database state in ``path`` with a run, 4 nodes online and 12 messages
    (nodes 0, 1, 2 get 4 each, interleaved; node 3 none), stored by the index's
    ``store_message_ins`` (``indexed``) or Flower's: (state, nodes, run, message ids
    in the order stored, the message id -> its number)."""
    from flwr.app import Message, RecordDict
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.server.superlink.linkstate.linkstate_factory import LinkStateFactory
    from flwr.server.superlink.linkstate.sql_linkstate import SqlLinkState
    from flwr.supercore.constant import NOOP_FEDERATION_ID
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.supercore.task_identity import TaskIdentity
    from flwr.superlink.federation.noop_federation_manager import NoOpFederationManager

    db = str(path)
    state = LinkStateFactory(db, NoOpFederationManager(), ObjectStoreFactory(db)).state()
    run_id = state.create_run(None, None, None, {}, NOOP_FEDERATION_ID, None, None, "serverapp")
    nodes = []
    for i in range(4):
        node = state.create_node("none", "none", f"key-{i}".encode(), 30.0)
        state.acknowledge_node_heartbeat(node, 30.0)
        nodes.append(node)
    flowers = SqlLinkState.__dict__["store_message_ins"]
    flowers = getattr(flowers, "__wrapped__", flowers)
    store = sl.indexed_store_message_ins(flowers) if indexed else flowers
    saved = TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, run_id, SUPERLINK_NODE_ID
    order = []
    try:
        for i in range(12):
            msg = Message(RecordDict(), dst_node_id=nodes[i % 3], message_type="train", ttl=600)
            msg.metadata.__dict__["_message_id"] = msg.object_id
            assert store(state, msg)
            order.append(msg.object_id)
    finally:
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = saved
    return state, nodes, run_id, order, {key: i for i, key in enumerate(order)}


@pytest.fixture()
def database(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Any:
    """Two database states made alike (:func:`_database`): Flower's, and one whose
    messages the index learnt as they were stored; a fresh index and waiting room;
    the indexed ``get_message_ins`` (Flower's claim, counted) and that of
    superlink-whole-messages."""
    from flwr.server.superlink.linkstate.sql_linkstate import SqlLinkState

    monkeypatch.setattr(sl, "WAITING", sl.Waiting())
    monkeypatch.setattr(sl, "UNDELIVERED", sl.weakref.WeakKeyDictionary())
    flowers = _database(tmp_path / "flowers.db", indexed=False)
    ours = _database(tmp_path / "ours.db", indexed=True)
    claims: list[int] = []
    claim = SqlLinkState.__dict__["get_message_ins"]
    claim = getattr(claim, "__wrapped__", claim)

    def counted(self: Any, node_id: int, limit: Any, *, run_id: Any = None) -> Any:
        claims.append(node_id)
        return claim(self, node_id, limit, run_id=run_id)

    return (
        flowers,
        ours,
        sl.database_get_message_ins(counted),
        sl.database_get_message_ins(counted, whole_only=True),
        claims,
    )


def test_the_database_index_finds_what_flowers_claim_finds(database: Any) -> None:
    flowers, ours, indexed, _, claims = database
    state, nodes, run_id, _, number = ours
    f_state, f_nodes, f_run, _, f_number = flowers
    calls = [
        (0, 1, "any"),
        (1, None, "this"),
        (0, 2, "any"),
        (3, 1, "any"),
        (2, 1, "another"),
        (0, None, "any"),
    ]
    runs = {"any": 0, "this": 1, "another": 2}
    for node, limit, run in calls:
        f_run_id = [None, f_run, f_run + 1][runs[run]]
        run_of = [None, run_id, run_id + 1][runs[run]]
        want = f_state.get_message_ins(node_id=f_nodes[node], limit=limit, run_id=f_run_id)
        got = indexed(state, nodes[node], limit, run_id=run_of)
        assert [number[k] for k in ids(got)] == [f_number[k] for k in ids(want)], (node, limit, run)
    index = sl.UNDELIVERED[state]
    assert {nodes.index(n): len(v) for n, v in index.by_node.items()} == {2: 4}
    # a node the index holds nothing for (of the run asked for) never reached the claim
    assert nodes[3] not in claims and nodes[2] not in claims and claims


def test_a_poll_for_a_node_without_messages_runs_no_query(database: Any) -> None:
    from sqlalchemy import event

    _, ours, indexed, _, claims = database
    state, nodes, *_ = ours
    indexed(state, nodes[3], 1)  # the first poll reads the index from the database
    statements: list[str] = []
    engine = state._engine

    def seen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    event.listen(engine, "before_cursor_execute", seen)
    try:
        assert indexed(state, nodes[3], 1) == []
        assert statements == [] and claims == []
        assert len(indexed(state, nodes[0], 1)) == 1
        assert statements and claims == [nodes[0]]
    finally:
        event.remove(engine, "before_cursor_execute", seen)


def test_a_message_joins_the_index_when_its_transaction_commits(database: Any) -> None:
    from flwr.app import ConfigRecord, RecordDict

    _, ours, indexed, _, _ = database
    state, nodes, run_id, *_ = ours
    store = _indexed_store()
    index = sl.undelivered(state)
    first = _instruction(nodes[3], run_id)
    with state.session():
        assert store(state, first)
        assert index.of(nodes[3]) == []  # not committed: another poll would not find it
    assert index.of(nodes[3]) == [first.object_id]
    second = _instruction(nodes[3], run_id, RecordDict({"c": ConfigRecord({"a": 1})}))
    with pytest.raises(RuntimeError), state.session():
        assert store(state, second)
        raise RuntimeError("rolled back")
    assert index.of(nodes[3]) == [first.object_id]
    assert ids(indexed(state, nodes[3], 1)) == [first.object_id]
    assert index.of(nodes[3]) == []


def test_the_sweep_reads_what_another_process_stored_and_drops_what_is_gone(
    database: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    flowers, ours, indexed, _, _ = database
    state, nodes, _, order, _ = ours
    index = sl.undelivered(state)
    indexed(state, nodes[3], 1)  # read once
    for key in order:  # forgotten: as if stored by another process
        index.drop(nodes[order.index(key) % 3], [key])
    assert indexed(state, nodes[0], 1) == []  # not due yet: the index is believed
    monkeypatch.setattr(sl, "SWEEP_S", 0.0)
    state.delete_messages({order[1]})  # node 1's first
    assert ids(indexed(state, nodes[0], 1)) == [order[0]]
    assert order[1] not in index.of(nodes[1]) and index.of(nodes[1]) == order[4::3]


def test_expired_messages_are_not_returned_and_leave_the_index(database: Any) -> None:
    from flwr.server.superlink.linkstate.sql_linkstate import MessageInsModel
    from sqlalchemy import update

    _, ours, indexed, _, claims = database
    state, nodes, _, order, _ = ours
    with state.session() as session:  # every message an hour older: expired
        session.execute(
            update(MessageInsModel).values(created_at=MessageInsModel.created_at - 3600)
        )
    assert indexed(state, nodes[0], 1) == []  # read from the database: as expired
    assert not sl.undelivered(state).by_node and claims == []
    assert state.get_message_ins(nodes[1], None) == []  # Flower's claim agrees


def test_a_database_message_is_returned_only_once_all_its_objects_arrived(
    database: Any,
) -> None:
    """Parts superlink-database-index and superlink-whole-messages: a message whose
    objects are registered but not all stored is not returned, nor marked delivered
    (no claim), nor is the node's next message; once its last object arrives it is."""
    import numpy as np
    from flwr.app import Array, ArrayRecord, RecordDict
    from flwr.supercore.inflatable.inflatable_object import (
        get_all_nested_objects,
        get_object_tree,
    )

    _, ours, _, whole_only, claims = database
    state, nodes, run_id, _, _ = ours
    store = _indexed_store()
    content = RecordDict({"x": ArrayRecord({"w": Array(np.arange(4.0))})})
    msg = _instruction(nodes[3], run_id, content)
    objects = state.object_store
    objects.preregister(run_id, get_object_tree(msg))
    assert store(state, msg)
    nested = get_all_nested_objects(msg)
    assert len(nested) >= 2
    *early, last = nested.items()
    for object_id, obj in early:
        objects.put(object_id, obj.deflate())
    assert not sl.whole_in_database(objects, msg.object_id)
    assert whole_only(state, nodes[3], 1) == [] and claims == []
    assert state.get_valid_message_ins(msg.object_id)["delivered_at"] == ""
    assert not sl.WAITING.ready(nodes[3])
    objects.put(last[0], last[1].deflate())
    assert sl.WAITING.ready(nodes[3])
    assert ids(whole_only(state, nodes[3], 1)) == [msg.object_id]
    assert state.get_valid_message_ins(msg.object_id)["delivered_at"] != ""
    assert not sl.WAITING.ready(nodes[3])


def test_a_message_a_carried_push_stored_whole_is_known_whole_without_a_query(
    database: Any,
) -> None:
    _, ours, *_ = database
    state, nodes, _, order, _ = ours
    sl.made_whole([(nodes[0], order[0])])
    index = sl.undelivered(state)
    assert index.is_whole(None, order[0])  # no store asked


def test_messages_a_carried_push_is_storing_are_not_whole_and_ask_no_query(
    database: Any,
) -> None:
    """While Flower stores the messages of the ServerApp's carried push (each commit
    wakes its node's held poll), they are not whole and no query asks (their objects
    are stored after the messages); once the answer says none is left, whole."""
    from types import SimpleNamespace

    from flwr.proto.message_pb2 import ObjectTree

    _, ours, *_ = database
    state, nodes, _, order, _ = ours
    index = sl.undelivered(state)
    request = SimpleNamespace(
        messages_list=[
            SimpleNamespace(metadata=SimpleNamespace(message_id=key, dst_node_id=nodes[0]))
            for key in order[:2]
        ],
        message_object_trees=[ObjectTree(object_id=key) for key in order[:2]],
    )
    during: list[bool] = []

    def flowers(request: Any, state: Any, task: Any) -> Any:
        during.extend(index.is_whole(None, key) for key in order[:2])  # no store to ask
        return SimpleNamespace(message_ids=list(order[:2]), objects_to_push=[], session_id="s")

    push = sl.runtime_pushes_carried(flowers)
    token = sl.BOX.set(sl.Box(incoming={"unused": b""}))
    try:
        push(request, state, SimpleNamespace(run_id=1))
    finally:
        sl.BOX.reset(token)
    assert during == [False, False]
    assert index.is_whole(None, order[0]) and index.is_whole(None, order[1])
    assert not any(key in index.arriving for key in order[:2])  # no longer storing


def test_a_message_whose_sender_still_pushes_objects_is_whole_when_they_arrived(
    database: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a carried push that left objects to the ServerApp: its message is not
    whole (no query), and is once the last of them arrives through Flower's Runtime
    ``push_object``, which wakes its node's held poll."""
    from types import SimpleNamespace

    _, ours, *_ = database
    state, nodes, _, order, _ = ours
    index = sl.undelivered(state)
    index.expect(nodes[0], order[0], {"a", "b"})
    assert not index.is_whole(None, order[0])  # no store asked
    woken: list[int] = []
    monkeypatch.setattr(sl.WAITING, "wake", woken.append)
    push = sl.objects_pushed(lambda request, state, task: SimpleNamespace(stored=True))
    push(SimpleNamespace(object_id="a"), state, None)
    assert woken == [] and not index.is_whole(None, order[0])
    push(SimpleNamespace(object_id="b"), state, None)
    assert woken == [nodes[0]] and index.is_whole(None, order[0])
    assert not index.missing and not index.awaiting


@pytest.mark.parametrize("locked", [False, True])
def test_the_superlinks_threads_take_turns_at_the_database(
    locked: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """Part superlink-database-lock: a thread writes while another holds a write
    transaction. With Flower's sessions the second meets SQLite's lock and, once its
    wait is over (cut to 0.05 s here), fails with 'database is locked'; with the
    part it waits its turn and writes."""
    import threading

    from flwr.supercore.sql_mixin import SqlMixin
    from sqlalchemy import text
    from sqlalchemy.exc import OperationalError

    flowers = SqlMixin.__dict__["session"]
    flowers = getattr(flowers, "flowers", flowers)
    monkeypatch.setattr(SqlMixin, "session", sl.locked_session(flowers) if locked else flowers)
    state, nodes, *_ = _database(tmp_path / "state.db", indexed=False)
    writing = threading.Event()

    def hold() -> None:
        with state.session():
            state.acknowledge_node_heartbeat(nodes[0], 30.0)
            writing.set()
            time.sleep(0.4)

    holder = threading.Thread(target=hold)
    holder.start()
    assert writing.wait(10)
    try:
        with state.session() as session:
            session.execute(text("PRAGMA busy_timeout = 50"))
            assert state.acknowledge_node_heartbeat(nodes[1], 30.0)
        wrote = True
    except OperationalError as exc:
        assert "locked" in str(exc)
        wrote = False
    finally:
        holder.join()
    assert wrote == locked


def _queue_at(lock: sl.TurnLock, who: list[tuple[str, bool]]) -> list[str]:
    """Threads that ask ``lock`` in the order of ``who`` (name, urgent) while this
    thread holds it; the order they got it in once it is let go."""
    import threading

    order: list[str] = []
    lock.acquire()
    threads = []
    for name, urgent in who:
        asked = len(lock._queues[0]) + len(lock._queues[1])

        def take(name: str = name, urgent: bool = urgent) -> None:
            with lock.held(urgent):
                order.append(name)

        thread = threading.Thread(target=take)
        thread.start()
        threads.append(thread)
        deadline = time.monotonic() + 5
        while len(lock._queues[0]) + len(lock._queues[1]) == asked:  # in line
            assert time.monotonic() < deadline
            time.sleep(0.001)
    lock.release()
    for thread in threads:
        thread.join(5)
    return order


def test_the_database_lock_is_taken_in_turns_urgent_requests_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Part superlink-urgent-first at the database: the lock goes to the thread that
    waited longest, and an urgent one (a heartbeat) goes before them all; the holder
    may take it again (a nested session); a session asks as URGENT says."""
    lock = sl.TurnLock()
    who = [("a", False), ("b", False), ("beat", True), ("c", False), ("beat2", True)]
    assert _queue_at(lock, who) == ["beat", "beat2", "a", "b", "c"]
    with lock.held(), lock.held():  # re-entrant
        pass
    assert lock._owner is None and lock._depth == 0
    import contextlib
    import contextvars
    import threading

    @contextlib.contextmanager
    def flowers(state: Any) -> Any:  # stands for Flower's session
        yield None

    monkeypatch.setattr(sl, "DATABASE_LOCK", lock)
    session = sl.locked_session(flowers)

    def urgent_turn() -> None:
        sl.URGENT.set(True)
        with session(None):
            pass

    lock.acquire()
    waiter = threading.Thread(target=contextvars.copy_context().run, args=(urgent_turn,))
    waiter.start()
    deadline = time.monotonic() + 5
    while not lock._queues[0] and not lock._queues[1]:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert len(lock._queues[0]) == 1  # in the urgent line
    lock.release()
    waiter.join(5)
    assert not waiter.is_alive() and lock._owner is None


def test_a_heartbeat_is_answered_while_every_worker_thread_is_busy() -> None:
    """Part superlink-urgent-first: with Starlette's worker threads all taken by
    other requests (here its limiter cut to one token, held by a handler that waits),
    a heartbeat's handler runs at once in a thread of its own; anything else waits
    for a worker as with Flower."""
    import threading

    import anyio
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.middleware import Middleware
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    ours = sl.urgent_first_threads(run_in_threadpool)
    release = threading.Event()
    ran_in: list[str] = []

    def busy() -> str:
        release.wait(10)
        return "busy"

    def handler_for(request: Any) -> Any:
        async def handle(request: Any) -> PlainTextResponse:
            if request.url.path == "/busy":
                return PlainTextResponse(await ours(busy))
            text = await ours(lambda: threading.current_thread().name)
            ran_in.append(text)
            return PlainTextResponse(text)

        return handle

    app = Starlette(
        routes=[Route(p, handler_for(None), methods=["POST"]) for p in (
            "/busy", *sl.URGENT_PATHS, "/v1/fleet/get-run")],
        middleware=[Middleware(sl.Urgent)],
    )  # fmt: skip
    with TestClient(app) as client:

        async def one_token() -> None:
            anyio.to_thread.current_default_thread_limiter().total_tokens = 1

        client.portal.call(one_token)
        answers: dict[str, Any] = {}
        blocker = threading.Thread(target=lambda: answers.update(b=client.post("/busy")))
        blocker.start()
        time.sleep(0.3)  # the one worker is taken
        try:
            for path in sl.URGENT_PATHS:
                assert client.post(path).text.startswith("fedhet-urgent")
            other = threading.Thread(
                target=lambda: answers.update(o=client.post("/v1/fleet/get-run"))
            )
            other.start()
            other.join(0.5)
            assert other.is_alive()  # waits for the busy worker
        finally:
            release.set()
        blocker.join(10)
        other.join(10)
    assert answers["o"].text != "" and not answers["o"].text.startswith("fedhet-urgent")
    assert sl.URGENT.get() is False  # the mark stays with its request


def test_every_module_of_the_superlink_app_runs_its_blocking_work_through_ours(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Part superlink-urgent-first reaches every place the SuperLink's app (Flower's
    routes, dependencies, protobuf routes, node authentication) hands blocking work
    to Starlette's worker threads: once applied, no module of the app still holds
    Starlette's ``run_in_threadpool``."""
    import sys

    import starlette.concurrency

    from common import flower_gate as gate

    importlib.import_module(sl.MIDDLEWARE)  # the app and everything it imports
    importlib.import_module(sl.FLOWER_CLI)
    for name in sl.THREADPOOL_USERS:
        module = importlib.import_module(name)
        monkeypatch.setattr(module, "run_in_threadpool", gate.original(module, "run_in_threadpool"))
    monkeypatch.setattr(sl, "in_front", lambda middleware: None)
    starlettes = starlette.concurrency.run_in_threadpool
    sl.urgent_first()
    left = [
        name
        for name, module in list(sys.modules.items())
        if name.startswith(("flwr.super", "fastapi"))
        and getattr(module, "run_in_threadpool", None) is starlettes
        and name != "fastapi.concurrency"  # re-exports it; no request runs through it
    ]
    assert left == []


def test_a_node_found_unavailable_is_logged_with_its_waiting_heartbeat(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Part superlink-database-writes: each node Flower's check finds unavailable is
    logged, how far past its patience and whether a held poll's heartbeat of its own
    still waited to be written; the check's answer is Flower's, unchanged."""
    from types import SimpleNamespace

    writes = sl.DatabaseWrites(period=3600)
    writes._start = lambda: None  # type: ignore[method-assign]
    flowers_errors = {"m1": "error reply", "m2": "error reply"}
    check = sl.unavailable_logged(lambda *args, **kwargs: dict(flowers_errors))
    found = {m: SimpleNamespace(metadata=SimpleNamespace(dst_node_id=n)) for m, n in
             (("m1", 7), ("m2", 8))}  # fmt: skip
    monkeypatch.setattr(sl, "WRITES", writes)
    writes.beat(object(), 7, 30.0)
    assert writes.waiting_s(7) is not None and writes.waiting_s(8) is None
    assert check({"m1", "m2"}, found, {7: time.time() - 5.0}) == flowers_errors
    out = capsys.readouterr().out
    assert re.search(r"node 7 unavailable \(5\.\d s past.*written: for \d+\.\d s", out)
    assert "node 8 unavailable (never online" in out and "written: none" in out


@pytest.mark.parametrize("where", ["memory", "database"])
def test_a_heartbeat_never_shortens_the_window_an_earlier_one_granted(
    where: str, states: Any, tmp_path: Any
) -> None:
    """Part superlink-kept-windows: after a heartbeat declaring 60 s (online for
    120 s), one declaring 30 s leaves the node online for those 120 s (Flower's: cut
    to 60 s from now); a longer one extends it as Flower's does. Flower's own
    acknowledgement is what writes it (the node is unknown: False, as Flower's)."""
    if where == "memory":
        state, nodes = states[0], states[3]
        online_until, wrap = sl.memory_online_until, sl.kept_window(sl.memory_online_until)
    else:
        state, nodes, *_ = _database(tmp_path / "state.db", indexed=False)
        online_until = sl.database_online_until
        wrap = sl.kept_window(online_until, lambda state: state.session())
    flowers = type(state).__dict__["acknowledge_node_heartbeat"]
    flowers = getattr(flowers, "__wrapped__", flowers)
    ours = wrap(flowers)
    node = nodes[0]
    assert ours(state, node, 60.0)
    granted = online_until(state, node)
    assert granted is not None and abs(granted - (time.time() + 120.0)) < 2.0
    assert ours(state, node, 30.0)
    assert abs(online_until(state, node) - granted) < 1.0  # kept
    assert ours(state, node, 90.0)
    assert abs(online_until(state, node) - (time.time() + 180.0)) < 2.0  # extended
    assert flowers(state, node, 30.0)  # Flower's own: cut to 60 s from now
    assert abs(online_until(state, node) - (time.time() + 60.0)) < 2.0
    assert not ours(state, 12345, 30.0)


def test_traffic_and_poll_heartbeats_are_written_together_and_kept_when_refused(
    tmp_path: Any,
) -> None:
    """Part superlink-database-writes: traffic records summed per run and held polls'
    heartbeats gathered, nothing written until the batch, then the sums and the
    latest heartbeat in one go; Flower's checks of the values still raise; a batch
    the database refuses is written with the next."""
    from flwr.server.superlink.linkstate.sql_linkstate import SqlLinkState

    state, nodes, run_id, _, _ = _database(tmp_path / "state.db", indexed=False)
    writes = sl.DatabaseWrites(period=3600)  # flushed by hand here
    flowers = SqlLinkState.__dict__["store_traffic"]
    record = writes.traffic_recorder(getattr(flowers, "__wrapped__", flowers))
    beat = SqlLinkState.__dict__["acknowledge_node_heartbeat"]
    writes.flowers["acknowledge_node_heartbeat"] = getattr(beat, "__wrapped__", beat)

    def traffic() -> tuple[int, int]:
        [run] = state.get_run_info(run_ids=[run_id])
        return run.bytes_sent, run.bytes_recv

    before = traffic()
    for sent, received in ((100, 10), (20, 2), (3, 0)):
        record(state, run_id, bytes_sent=sent, bytes_recv=received)
    with pytest.raises(ValueError, match="cannot be zero"):
        record(state, run_id, bytes_sent=0, bytes_recv=0)
    with pytest.raises(ValueError, match="Negative"):
        record(state, run_id, bytes_sent=-1, bytes_recv=5)
    writes.beat(state, nodes[1], 30.0)
    writes.beat(state, nodes[1], 600.0)  # the latest counts
    assert traffic() == before
    [info] = state.get_node_info(node_ids=[nodes[1]])
    assert info.heartbeat_interval == 30.0
    refused = [True]
    flowers_session = state.session

    def session() -> Any:
        if refused:
            refused.pop()
            raise RuntimeError("database is locked")
        return flowers_session()

    state.session = session
    writes.flush()  # refused: kept
    assert traffic() == before
    writes.flush()
    assert traffic() == (before[0] + 123, before[1] + 12)
    [info] = state.get_node_info(node_ids=[nodes[1]])
    assert info.heartbeat_interval == 600.0 and info.online_until > time.time() + 1000
    writes.flush()  # nothing left: nothing written twice
    assert traffic() == (before[0] + 123, before[1] + 12)


def test_a_runs_status_is_read_once_a_period_and_a_stop_seen_after_it(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Part superlink-database-reads: within the period Flower's read is not repeated
    (Flower's ``check_abort`` answers from the remembered status); a stopped run is
    seen once the period has passed."""
    from flwr.common.constant import Status
    from flwr.server.superlink.linkstate.sql_linkstate import SqlLinkState
    from flwr.server.superlink.utils import check_abort

    state, _, run_id, _, _ = _database(tmp_path / "state.db", indexed=False)
    reads: list[set[int]] = []
    flowers = SqlLinkState.__dict__["get_run_status"]
    flowers = getattr(flowers, "__wrapped__", flowers)

    def counted(self: Any, run_ids: set[int]) -> Any:
        reads.append(set(run_ids))
        return flowers(self, run_ids)

    clock = [1000.0]  # the period measured on a clock of the test's, not the machine's
    monkeypatch.setattr(sl.time, "monotonic", lambda: clock[0])
    remembered = sl.remembered_run_status(counted, seconds=0.5)
    state.get_run_status = remembered.__get__(state)
    assert check_abort(run_id, [Status.FINISHED], state) is None
    assert check_abort(run_id, [Status.FINISHED], state) is None
    assert reads == [{run_id}]
    assert state.stop_run(run_id)
    assert check_abort(run_id, [Status.FINISHED], state) is None  # within the period
    clock[0] += 0.4
    assert check_abort(run_id, [Status.FINISHED], state) is None  # still within
    clock[0] += 0.2
    assert check_abort(run_id, [Status.FINISHED], state) is not None
    assert len(reads) == 2


def test_a_nodes_id_by_key_is_remembered_and_forgotten_when_it_is_deleted(
    tmp_path: Any,
) -> None:
    from flwr.server.superlink.linkstate.sql_linkstate import SqlLinkState

    state, nodes, *_ = _database(tmp_path / "state.db", indexed=False)
    keys = sl.NodeKeys(seconds=60)
    reads: list[bytes] = []
    flowers = SqlLinkState.__dict__["get_node_id_by_public_key"]
    flowers = getattr(flowers, "__wrapped__", flowers)

    def counted(self: Any, public_key: bytes) -> Any:
        reads.append(public_key)
        return flowers(self, public_key)

    lookup = keys.lookup(counted)
    delete = keys.forgetting(
        getattr(SqlLinkState.delete_node, "__wrapped__", SqlLinkState.delete_node)
    )
    assert lookup(state, b"key-1") == nodes[1] == lookup(state, b"key-1")
    assert lookup(state, b"nobody") is None and lookup(state, b"nobody") is None
    assert reads == [b"key-1", b"nobody", b"nobody"]  # an unknown key is not remembered
    delete(state, "none", nodes[1])
    assert lookup(state, b"key-1") is None
    assert lookup(state, b"key-2") == nodes[2]


# ------------------------------------------------------------------ keep-alive
def test_every_http_answer_names_the_keep_alive() -> None:
    sent: list[dict] = []

    async def app(scope: dict, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"a", b"1")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def send(message: dict) -> None:
        sent.append(message)

    wrapped = sl.AnswerHeaders(app, sl.keep_alive_header(60))
    asyncio.run(wrapped({"type": "http", "path": "/v1/fleet/x"}, None, send))
    start, body = sent
    assert start["headers"] == [(b"a", b"1"), (b"keep-alive", b"timeout=60")]
    assert body == {"type": "http.response.body", "body": b"ok"}
    sent.clear()
    asyncio.run(wrapped({"type": "lifespan"}, None, send))  # not HTTP: untouched
    assert sent[0]["headers"] == [(b"a", b"1")]


def test_the_superlink_keeps_idle_connections_as_long_as_it_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Part superlink-keep-alive: uvicorn gets ``timeout_keep_alive`` (unless Flower
    passes one) and the header middleware is the outermost, before Flower's stack
    (scoped or not)."""
    import flwr.superlink.main as main
    import uvicorn

    from common import flower_gate as gate

    runs: list[dict] = []
    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: runs.append(kw))
    monkeypatch.setattr(main, "_get_middleware", main._get_middleware)
    for module in (uvicorn, main):  # what gate.replace keeps, as it was after the test
        monkeypatch.setitem(
            module.__dict__, gate.ORIGINALS, dict(getattr(module, gate.ORIGINALS, {}))
        )
    sl.keep_alive(42)
    uvicorn.run(app=None)
    uvicorn.run(app=None, timeout_keep_alive=7)
    assert [r.get("timeout_keep_alive") for r in runs] == [42, 7]
    first, *rest = main._get_middleware()
    assert first.cls is sl.AnswerHeaders and first.args == ((b"keep-alive", b"timeout=42"),)
    assert [m.cls for m in rest] == [m.cls for m in gate.original(main, "_get_middleware")()]


@pytest.mark.parametrize(
    ("name", "read", "text", "kind", "good", "value"),
    [
        *[("FEDHET_KEEPALIVE_S", "keep_alive_s", t, "whole seconds", " 30 ", 30)
          for t in ("0", "-5", "1.5", "soon", "3601")],
        *[("FEDHET_HOLD_S", "hold_s", t, "seconds", "0", 0.0) for t in ("-1", "121", "soon")],
    ],
)  # fmt: skip
def test_a_bad_setting_is_refused_naming_the_variable(
    name: str,
    read: str,
    text: str,
    kind: str,
    good: str,
    value: float,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    setting = getattr(sl, read)
    monkeypatch.setenv(name, text)
    with pytest.raises(SystemExit, match=f"{name}={text!r}: give {kind}"):
        setting()
    monkeypatch.setenv(name, good)
    assert setting() == value
    monkeypatch.delenv(name)
    assert setting() == {"FEDHET_KEEPALIVE_S": sl.KEEPALIVE_S, "FEDHET_HOLD_S": sl.HOLD_S}[name]


# ------------------------------------------------------------------ held pulls
class _Meta:
    def __init__(self, node: int) -> None:
        self.dst_node_id, self.delivered_at = node, ""


class _Msg:
    def __init__(self, node: int) -> None:
        self.metadata = _Meta(node)


class _Objects:
    """An object store that knows message ``missing`` as not yet whole."""

    def __init__(self) -> None:
        self.missing: set[str] = set()

    def get_object_tree(self, message_id: str) -> Any:
        from flwr.proto.message_pb2 import ObjectTree
        from flwr.supercore.object_store.object_store import NoObjectInStoreError

        if message_id not in self.missing:
            raise NoObjectInStoreError("unknown: whole for the hold")
        return ObjectTree(object_id=message_id)

    def get(self, object_id: str) -> bytes:
        return b"" if object_id in self.missing else b"x"


class _State:
    def __init__(self) -> None:
        import threading

        self.message_ins_store = sl.NodeIndexed()
        self.object_store = _Objects()
        self.lock = threading.RLock()


@pytest.fixture()
def held(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fresh waiting room with one indexed state, and an app standing for Flower's
    stack: it answers a poll of node 7 with the state's undelivered whole messages
    (marking them delivered), counting its calls."""
    from flwr.proto.fleet_pb2 import PullMessagesResponse

    waiting = sl.Waiting()
    monkeypatch.setattr(sl, "WAITING", waiting)
    state = _State()
    waiting.states.add(state)
    calls: list[float] = []

    async def app(scope: dict, receive: Any, send: Any) -> None:
        calls.append(time.monotonic())
        await receive()
        response = PullMessagesResponse()
        for msg_id in list(state.message_ins_store.by_node.get(7, ())):
            msg = state.message_ins_store[msg_id]
            if msg.metadata.delivered_at == "" and sl.whole(state.object_store, msg_id):
                msg.metadata.delivered_at = "now"
                response.messages_list.add()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": response.SerializeToString()})

    return state, app, calls


def _poll(hold: str | None, path: str = sl.PULL_PATH) -> tuple[dict, bytes]:
    from flwr.proto.fleet_pb2 import PullMessagesRequest

    request = PullMessagesRequest()
    request.node.node_id = 7
    headers = [] if hold is None else [(b"x-fedhet-hold", hold.encode())]
    scope = {"type": "http", "path": path, "headers": headers}
    return scope, request.SerializeToString()


async def _serve(
    app: Any, scope: dict, body: bytes, events: list[dict] | None = None
) -> list[dict]:
    """Run the middleware (as :func:`held_pulls` stacks it) on one request; ``events``
    after the body (a disconnect)."""
    sent: list[dict] = []
    queue: asyncio.Queue[dict] = asyncio.Queue()
    await queue.put({"type": "http.request", "body": body, "more_body": False})

    async def receive() -> dict:
        return await queue.get()

    async def send(message: dict) -> None:
        sent.append(message)

    stack = sl.AnswerHeaders(sl.HeldPulls(app, 5.0), sl.holds_header(5.0), offered=sl.alive_offer)
    task = asyncio.ensure_future(stack(scope, receive, send))
    for event in events or ():
        await asyncio.sleep(0.05)
        await queue.put(event)
    await task
    return sent


def _messages(sent: list[dict]) -> int:
    from flwr.proto.fleet_pb2 import PullMessagesResponse

    return len(PullMessagesResponse.FromString(sent[1]["body"]).messages_list)


def _headers(sent: list[dict]) -> dict[bytes, bytes]:
    return dict(sent[0]["headers"])


def test_a_held_poll_is_answered_when_its_message_is_stored(held: Any) -> None:
    """Stored from another thread (as Flower's handlers do) while the poll is held:
    Flower's stack is asked again and the message goes out, long before the hold
    ends; the answer names the hold on offer and how long this one was held."""
    state, app, calls = held

    async def main() -> list[dict]:
        scope, body = _poll("5")
        serving = asyncio.ensure_future(_serve(app, scope, body))
        await asyncio.sleep(0.1)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, state.message_ins_store.__setitem__, "m1", _Msg(7))
        return await serving

    sent = asyncio.run(main())
    assert len(calls) == 2 and _messages(sent) == 1
    headers = _headers(sent)
    assert headers[b"x-fedhet-holds"] == b"5"
    assert 0.1 <= float(headers[b"x-fedhet-held"]) < 5.0


def test_a_held_poll_without_a_message_is_answered_empty_when_its_hold_ends(
    held: Any,
) -> None:
    _, app, calls = held
    scope, body = _poll("0.3")
    sent = asyncio.run(_serve(app, scope, body))
    assert len(calls) == 1 and _messages(sent) == 0
    assert float(_headers(sent)[b"x-fedhet-held"]) >= 0.3


def test_another_nodes_message_does_not_end_the_hold(held: Any) -> None:
    state, app, calls = held

    async def main() -> list[dict]:
        scope, body = _poll("0.5")
        serving = asyncio.ensure_future(_serve(app, scope, body))
        await asyncio.sleep(0.1)
        state.message_ins_store["other"] = _Msg(8)
        return await serving

    sent = asyncio.run(main())
    assert len(calls) == 1 and _messages(sent) == 0


def test_a_poll_that_does_not_ask_or_is_not_a_poll_is_not_held(held: Any) -> None:
    _, app, calls = held
    for scope, body in (_poll(None), _poll("5", path="/v1/fleet/push-messages")):
        sent = asyncio.run(_serve(app, scope, body))
        assert _headers(sent) == {  # offered, not held
            b"x-fedhet-holds": b"5",
            b"x-fedhet-alive-polls": b"1",
        }
    assert len(calls) == 2


def test_a_message_whose_objects_are_on_their_way_waits_for_them(held: Any) -> None:
    """Woken by a message the ServerApp has not pushed all objects of: the held poll
    looks again until they are there (superlink-whole-messages), then delivers it."""
    state, app, calls = held

    async def main() -> list[dict]:
        scope, body = _poll("5")
        serving = asyncio.ensure_future(_serve(app, scope, body))
        await asyncio.sleep(0.1)
        state.object_store.missing.add("m1")
        state.message_ins_store["m1"] = _Msg(7)
        await asyncio.sleep(0.5)
        assert not serving.done()
        state.object_store.missing.clear()
        return await serving

    sent = asyncio.run(main())
    assert _messages(sent) == 1 and len(calls) == 2


def test_a_node_that_hung_up_is_not_given_its_message(held: Any) -> None:
    """A node that hung up while held (its timeout, its end): the message stored after
    stays undelivered for its next poll, and nothing is sent."""
    state, app, calls = held

    async def main() -> list[dict]:
        scope, body = _poll("5")
        serving = asyncio.ensure_future(
            _serve(app, scope, body, events=[{"type": "http.disconnect"}])
        )
        await asyncio.sleep(0.2)
        state.message_ins_store["m1"] = _Msg(7)
        return await serving

    sent = asyncio.run(main())
    assert sent == [] and len(calls) == 1
    assert state.message_ins_store["m1"].metadata.delivered_at == ""


def test_a_message_answered_to_a_node_that_hung_up_meanwhile_is_released(held: Any) -> None:
    """Part superlink-released-claims: the node hangs up while Flower's stack makes
    the answer that holds its message (a slow, locked database): nothing is sent,
    and the message is undelivered again for its next poll."""
    from flwr.proto.fleet_pb2 import PullMessagesResponse

    state, _, _ = held
    state.message_ins_store["m1"] = _Msg(7)

    async def slow(scope: dict, receive: Any, send: Any) -> None:
        await receive()
        state.message_ins_store["m1"].metadata.delivered_at = "now"  # claimed
        await asyncio.sleep(0.3)
        response = PullMessagesResponse()
        response.messages_list.add().metadata.message_id = "m1"
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": response.SerializeToString()})

    scope, body = _poll("5")
    sent = asyncio.run(_serve(slow, scope, body, events=[{"type": "http.disconnect"}]))
    assert sent == []
    assert state.message_ins_store["m1"].metadata.delivered_at == ""


@pytest.mark.parametrize("where", ["memory", "database"])
def test_a_poll_whose_handler_fails_after_the_claim_releases_its_message(
    where: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """Part superlink-released-claims, with Flower's own Fleet ``pull_messages`` and
    state: its traffic record after the claim fails (as SQLite's 'database is
    locked' did at a thousand nodes); the poll fails, and the node's next poll gets
    the message (Flower: marked delivered, never handed out again)."""
    from flwr.proto.fleet_pb2 import PullMessagesRequest
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
    from flwr.server.superlink.linkstate.linkstate_factory import LinkStateFactory
    from flwr.server.superlink.linkstate.sql_linkstate import SqlLinkState
    from flwr.supercore.constant import NOOP_FEDERATION_ID
    from flwr.supercore.inflatable.inflatable_object import (
        get_all_nested_objects,
        get_object_tree,
    )
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.superlink.federation.noop_federation_manager import NoOpFederationManager
    from flwr.superlink.servicer.fleet import fleet_handlers

    monkeypatch.setattr(sl, "WAITING", sl.Waiting())
    monkeypatch.setattr(sl, "UNDELIVERED", sl.weakref.WeakKeyDictionary())
    for cls in (InMemoryLinkState, SqlLinkState):
        monkeypatch.setattr(cls, "get_message_ins", cls.__dict__["get_message_ins"])
        monkeypatch.setattr(cls, "store_message_ins", cls.__dict__["store_message_ins"])
    sl.indexed_message_pulls(whole_only=True)
    sl.database_message_pulls(whole_only=True)
    db = str(tmp_path / "state.db") if where == "database" else ":flwr-in-memory:"
    state = LinkStateFactory(db, NoOpFederationManager(), ObjectStoreFactory(db)).state()
    run_id = state.create_run(None, None, None, {}, NOOP_FEDERATION_ID, None, None, "serverapp")
    node = state.create_node("none", "none", b"key-0", 30.0)
    state.acknowledge_node_heartbeat(node, 30.0)
    msg = _instruction(node, run_id)
    state.object_store.preregister(run_id, get_object_tree(msg))
    for object_id, obj in get_all_nested_objects(msg).items():
        state.object_store.put(object_id, obj.deflate())
    assert state.store_message_ins(msg)
    flowers_traffic = state.store_traffic
    failures = [RuntimeError("database is locked")]

    def store_traffic(*args: Any, **kwargs: Any) -> Any:
        if failures:
            raise failures.pop()
        return flowers_traffic(*args, **kwargs)

    monkeypatch.setattr(state, "store_traffic", store_traffic)
    pull = sl.released_on_failure(gate_original(fleet_handlers))
    request = PullMessagesRequest()
    request.node.node_id = node
    with pytest.raises(RuntimeError, match="locked"):
        pull(request=request, state=state, store=state.object_store)
    again = pull(request=request, state=state, store=state.object_store)
    assert [m.metadata.message_id for m in again.messages_list] == [msg.object_id]
    assert pull(request=request, state=state, store=state.object_store).messages_list == []


def gate_original(module: Any) -> Any:
    from common import flower_gate as gate

    return gate.original(module, "pull_messages")


def test_the_hold_is_offered_around_the_held_pulls_in_front_of_flowers_stack(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Part superlink-held-pulls as ``_serve`` builds it: the offer outermost, then the
    hold, then Flower's stack (as it was)."""
    import flwr.superlink.main as main

    from common import flower_gate as gate

    monkeypatch.setattr(main, "_get_middleware", main._get_middleware)
    monkeypatch.setitem(main.__dict__, gate.ORIGINALS, dict(getattr(main, gate.ORIGINALS, {})))
    before = [m.cls for m in main._get_middleware()]
    sl.held_pulls(12.0)
    offer, hold, *rest = main._get_middleware()
    assert offer.cls is sl.AnswerHeaders and offer.args == ((b"x-fedhet-holds", b"12"),)
    assert offer.kwargs == {"offered": sl.alive_offer}
    assert hold.cls is sl.HeldPulls and hold.args == (12.0,)
    assert [m.cls for m in rest] == before


# ------------------------------------------------------------------ a held poll as a heartbeat
@pytest.fixture()
def alive(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Flower's in-memory state with one node online (30 s heartbeats), indexed, in a
    fresh waiting room; an app standing for Flower's stack that answers the node's
    poll with the state's undelivered messages for it (``status[0]``: its status)."""
    from flwr.proto.fleet_pb2 import PullMessagesResponse
    from flwr.server.superlink.linkstate.linkstate_factory import LinkStateFactory
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.superlink.federation.noop_federation_manager import NoOpFederationManager

    waiting = sl.Waiting()
    monkeypatch.setattr(sl, "WAITING", waiting)
    state = LinkStateFactory(
        ":flwr-in-memory:", NoOpFederationManager(), ObjectStoreFactory()
    ).state()
    node = state.create_node("none", "none", b"key-alive", 30.0)
    assert state.activate_node(node, 30.0)
    state.message_ins_store = sl.NodeIndexed(state.message_ins_store)
    waiting.states.add(state)
    status = [200]

    async def app(scope: dict, receive: Any, send: Any) -> None:
        await receive()
        response = PullMessagesResponse()
        for msg_id in list(state.message_ins_store.by_node.get(node, ())):
            msg = state.message_ins_store[msg_id]
            if msg.metadata.delivered_at == "":
                msg.metadata.delivered_at = "now"
                response.messages_list.add()
        await send({"type": "http.response.start", "status": status[0], "headers": []})
        await send({"type": "http.response.body", "body": response.SerializeToString()})

    return state, node, app, status


def _alive_poll(node: int, hold: str | None, alive: str | None) -> tuple[dict, bytes]:
    from flwr.proto.fleet_pb2 import PullMessagesRequest

    request = PullMessagesRequest()
    request.node.node_id = node
    headers = [] if hold is None else [(b"x-fedhet-hold", hold.encode())]
    if alive is not None:
        headers.append((b"x-fedhet-alive", alive.encode()))
    return {"type": "http", "path": sl.PULL_PATH, "headers": headers}, request.SerializeToString()


def _online(state: Any, node: int) -> tuple[str, float, float]:
    [info] = state.get_node_info(node_ids=[node])
    return info.status, info.online_until, info.heartbeat_interval


def test_a_held_poll_that_declares_an_interval_is_the_nodes_heartbeat_on_arrival(
    alive: Any,
) -> None:
    """``x-fedhet-alive: 12`` on a held poll: while the poll is still held (long
    before its answer), the state holds the node online until its arrival + 2 x 12 s
    with that interval, as Flower's heartbeat would; the answer offers it."""
    state, node, app, _ = alive
    _, before, _ = _online(state, node)

    async def main() -> tuple[list[dict], tuple[str, float, float], float, float]:
        scope, body = _alive_poll(node, "5", "12")
        start = time.time()
        serving = asyncio.ensure_future(_serve(app, scope, body))
        await asyncio.sleep(0.2)
        assert not serving.done()  # held: not answered
        seen, checked = _online(state, node), time.time()
        state.message_ins_store["m1"] = _Msg(node)  # ends the hold
        return await serving, seen, start, checked

    sent, (status, until, interval), start, checked = asyncio.run(main())
    assert status == "online" and interval == 12.0
    assert start + 24.0 <= until <= checked + 24.0 and until < before  # 30 s -> 12 s
    assert _headers(sent)[b"x-fedhet-alive-polls"] == b"1" and _messages(sent) == 1


@pytest.mark.parametrize(("held_s", "again"), [(1.3, True), (0.3, False)])
def test_a_poll_held_a_second_or_more_is_acknowledged_again_as_it_is_answered(
    alive: Any, held_s: float, again: bool
) -> None:
    """The node was on the line all along: a poll held 1 s or more is acknowledged again
    as its answer goes out (online until then + 2 x 12 s); a shorter one only on
    arrival (the two would be the same moment)."""
    state, node, app, _ = alive

    async def main() -> float:
        scope, body = _alive_poll(node, "5", "12")
        serving = asyncio.ensure_future(_serve(app, scope, body))
        await asyncio.sleep(held_s)
        answered = time.time()
        state.message_ins_store["m1"] = _Msg(node)  # ends the hold
        await serving
        return answered

    answered = asyncio.run(main())
    status, until, interval = _online(state, node)
    assert status == "online" and interval == 12.0
    assert (until >= answered + 24.0) is again


@pytest.mark.parametrize(("text", "interval"), [("1", 10.0), ("99999", 1800.0), (" 45.5 ", 45.5)])
def test_the_declared_interval_is_kept_within_flowers_bounds(
    alive: Any, text: str, interval: float
) -> None:
    """Flower's [HEARTBEAT_MIN_INTERVAL, HEARTBEAT_MAX_INTERVAL] (10 s, 30 min)."""
    state, node, app, _ = alive
    start = time.time()
    asyncio.run(_serve(app, *_alive_poll(node, "0.01", text)))
    status, until, got = _online(state, node)
    assert status == "online" and got == interval
    assert start + 2 * interval <= until <= time.time() + 2 * interval


@pytest.mark.parametrize(
    ("hold", "text", "answer"),
    [
        ("0.01", None, 200),  # declares nothing
        (None, "12", 200),  # not held: only held polls stand for a heartbeat
        ("0.01", "soon", 200),
        ("0.01", "nan", 200),
        ("0.01", "inf", 200),
        ("0.01", "-12", 200),
        ("0.01", "0", 200),
        ("0.01", "12", 401),  # Flower's stack refused it (SuperNode authentication)
    ],
)
def test_a_poll_that_does_not_qualify_acknowledges_nothing(
    alive: Any, hold: str | None, text: str | None, answer: int
) -> None:
    state, node, app, status = alive
    status[0] = answer
    was = _online(state, node)
    sent = asyncio.run(_serve(app, *_alive_poll(node, hold, text)))
    assert _online(state, node) == was
    assert sent[0]["status"] == answer  # Flower's handler answered as ever


def test_another_nodes_poll_or_an_unknown_node_acknowledges_nothing_else(alive: Any) -> None:
    state, node, app, _ = alive
    was = _online(state, node)
    asyncio.run(_serve(app, *_alive_poll(node + 1, "0.01", "12")))  # no such node
    asyncio.run(_serve(app, *_alive_poll(0, "0.01", "12")))  # no node id
    assert _online(state, node) == was
    assert not sl.acknowledge(node + 1, 12.0) and sl.acknowledge(node, 12.0)


def test_the_offer_is_made_only_where_polls_are_acknowledged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A SuperLink whose state is not indexed (SQLite, or no poll yet) does not offer
    held polls as heartbeats; every answer does once it is."""
    sent: list[dict] = []

    async def app(scope: dict, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def send(message: dict) -> None:
        sent.append(message)

    waiting = sl.Waiting()
    monkeypatch.setattr(sl, "WAITING", waiting)
    stack = sl.AnswerHeaders(app, sl.holds_header(5.0), offered=sl.alive_offer)
    asyncio.run(stack({"type": "http", "path": "/v1/fleet/get-run"}, None, send))
    assert sent[0]["headers"] == [(b"x-fedhet-holds", b"5")]
    state = _State()  # held here: the room keeps weak references
    waiting.states.add(state)
    sent.clear()
    asyncio.run(stack({"type": "http", "path": "/v1/fleet/get-run"}, None, send))
    assert sent[0]["headers"] == [(b"x-fedhet-holds", b"5"), (b"x-fedhet-alive-polls", b"1")]


@pytest.mark.parametrize("where", ["memory", pytest.param("database", marks=pytest.mark.e2e)])
def test_a_node_whose_held_polls_stand_for_its_heartbeats_stays_online_without_them(
    where: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """End to end, in one process: Flower's SuperLink app (its state in memory, or in
    a database file) with parts superlink-node-index, superlink-database-index and
    superlink-held-pulls on uvicorn, and Flower's own Fleet
    connection of a node (``http_request_response``: its heartbeat thread, its polls)
    with fedhet's hooks (keep_alive_clients, load_aware_heartbeats). Heartbeat
    intervals shortened to 1.5 s (online for 3 s per heartbeat): while the node polls,
    a stretch of more than 3.5 s goes by without a heartbeat, and the node is online
    at its end; once it stops polling, its heartbeats come again."""
    import threading

    import flwr.superlink.main as main
    import uvicorn
    from flwr.common import constant
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
    from flwr.server.superlink.linkstate.sql_linkstate import SqlLinkState
    from flwr.superlink.servicer.fleet import fleet_handlers
    from flwr.supernode import fleet_http_connection as conn

    from cli import supernode as sn
    from cli.launch import free_port
    from cli.pacing import ServerLoad
    from common import flower_gate as gate

    interval = 1.5
    for module, name, value in (
        (constant, "HEARTBEAT_DEFAULT_INTERVAL", interval),
        (constant, "HEARTBEAT_MIN_INTERVAL", 0.5),
        (constant, "HEARTBEAT_CALL_TIMEOUT", 0.25),
        (fleet_handlers, "HEARTBEAT_MIN_INTERVAL", 0.5),
        (conn, "HEARTBEAT_DEFAULT_INTERVAL", interval),
    ):
        monkeypatch.setattr(module, name, value)
    # what the parts replace, as it was after the test
    monkeypatch.setattr(main, "_get_middleware", main._get_middleware)
    monkeypatch.setattr(conn, "HeartbeatSender", conn.HeartbeatSender)
    monkeypatch.setattr(conn, "FleetHttpClient", conn.FleetHttpClient)
    for cls, name in (
        (InMemoryLinkState, "get_message_ins"),
        (SqlLinkState, "get_message_ins"),
        (SqlLinkState, "store_message_ins"),
    ):
        monkeypatch.setattr(cls, name, cls.__dict__[name])
    monkeypatch.setattr(sn.AliveInterval, "declared", None)
    monkeypatch.setattr(sl, "UNDELIVERED", sl.weakref.WeakKeyDictionary())
    if where == "database":
        monkeypatch.setenv("FLWR_DATABASE", str(tmp_path / "state.db"))
    else:
        monkeypatch.delenv("FLWR_DATABASE", raising=False)
    for module in (main, conn):
        monkeypatch.setitem(
            module.__dict__, gate.ORIGINALS, dict(getattr(module, gate.ORIGINALS, {}))
        )
    monkeypatch.setattr(sl, "WAITING", sl.Waiting())
    beats: list[float] = []
    flowers_beat = fleet_handlers.send_node_heartbeat

    def counted(*args: Any, **kwargs: Any) -> Any:
        beats.append(time.time())
        return flowers_beat(*args, **kwargs)

    monkeypatch.setattr(fleet_handlers, "send_node_heartbeat", counted)

    sl.indexed_message_pulls(whole_only=True)
    sl.database_message_pulls(whole_only=True)
    sl.held_pulls(0.3)
    app = main.create_app()
    state = app.state.linkstate_factory.state()
    assert isinstance(state, SqlLinkState) == (where == "database")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    serving = threading.Thread(target=server.run, daemon=True)
    serving.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and serving.is_alive(), "uvicorn did not start"
            time.sleep(0.05)
        sn.keep_alive_clients()
        sn.load_aware_heartbeats(ServerLoad(), polls=True)
        # (Flower's connection logs and swallows what its body raises: checked after it)
        quiet, status, polled, after = 0.0, "", 0, 0
        with conn.http_request_response(f"127.0.0.1:{port}", insecure=True) as (
            node_id,
            receive,
            *_,
        ):
            started = time.time()
            while time.monotonic() < deadline:  # a stretch long enough, however loaded
                receive()
                quiet = time.time() - max([started, *beats])
                if quiet > 2 * interval + 0.5:
                    [info] = state.get_node_info(node_ids=[node_id])
                    status = info.status
                    break
            polled = len(beats)
            stop = time.monotonic() + 10
            while len(beats) == polled and time.monotonic() < stop:  # no more polls
                time.sleep(0.05)
            after = len(beats)
    finally:
        server.should_exit = True
        serving.join(timeout=10)
    assert quiet > 2 * interval + 0.5, f"no quiet stretch in 30 s: {beats}"
    assert status == "online", (quiet, beats)
    assert after > polled
