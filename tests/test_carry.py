"""Carried objects (common/carry.py; fedhet superlink part superlink-carried-objects):
a message's objects move in the poll's answer and in the push's request."""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Any

import httpx
import pytest

from cli import superlink as sl
from common import carry


def oid(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


@pytest.fixture(autouse=True)
def _fresh_thread_state() -> Any:
    """What a test's requests leave in this thread's :data:`carry.LOCAL` (the offer
    last seen, the ids to confirm) does not reach the next test."""
    yield
    carry.LOCAL.confirms_offered = False
    carry.LOCAL.confirmed = None


def test_a_framed_body_gives_back_its_protobuf_and_objects() -> None:
    objects = [(oid(b"a"), b"a"), (oid(b""), b""), (oid(b"x" * 300), b"x" * 300)]
    body = carry.frame(b"PROTO", objects)
    # 5 protobuf bytes, then per object 2 + 8 header bytes, a 64-char id, the content
    assert len(body) == 5 + 3 * (10 + 64) + 1 + 0 + 300
    proto, got = carry.unframe(body, 5)
    assert proto == b"PROTO" and got == dict(objects)
    assert carry.unframe(b"PROTO", 5) == (b"PROTO", {})


@pytest.mark.parametrize(
    ("cut", "length", "says"),
    [
        (-1, 5, "an object cut short"),
        (5 + 4, 5, "a frame cut short"),
        (None, 99, "protobuf length"),
    ],
)
def test_a_body_that_does_not_parse_is_refused_saying_where(
    cut: int | None, length: int, says: str
) -> None:
    body = carry.frame(b"PROTO", [(oid(b"abc"), b"abc")])
    with pytest.raises(carry.CarryError, match=says):
        carry.unframe(body[:cut] if cut is not None else body, length)


def test_pulls_take_the_carried_objects_and_ask_only_for_the_rest() -> None:
    asked: list[list[str]] = []

    def flowers(object_ids: list[str], pull_object_fn: Any, **kwargs: Any) -> dict[str, bytes]:
        asked.append(list(object_ids))
        return {i: pull_object_fn(i) for i in object_ids}

    large = b"L" * carry.KEEP_BELOW
    carry.LOCAL.received = {"a": b"A", "b": b"B", "l": large}
    try:
        got = carry.pulls(flowers)(["a", "c", "b", "l"], lambda i: i.upper().encode(), max_time=3)
        assert got == {"a": b"A", "b": b"B", "c": b"C", "l": large} and asked == [["c"]]
        # the large one handed over, not kept until the next poll; small ones kept
        assert carry.LOCAL.received == {"a": b"A", "b": b"B"}
        asked.clear()
        assert carry.pulls(flowers)(object_ids=["b"], pull_object_fn=None) == {"b": b"B"}
        assert asked == []  # nothing left to ask for
    finally:
        carry.LOCAL.received = {}


def _client(answer: Any) -> tuple[httpx.Client, list[httpx.Request]]:
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        request.read()
        seen.append(request)
        return answer(request)

    client = httpx.Client(transport=httpx.MockTransport(handle), base_url="http://sl")
    carry.attach(client, ("/pull",), ("/push",))
    return client, seen


def test_a_patient_client_waits_long_for_its_pushes_and_polls_only() -> None:
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=b"PB")

    client = httpx.Client(transport=httpx.MockTransport(handle), base_url="http://sl", timeout=30.0)
    carry.attach(client, ("/pull",), ("/push",), patience_s=600.0)
    for path in ("/push", "/pull", "/heartbeat"):
        client.post(path, content=b"REQ")
    reads = [request.extensions["timeout"]["read"] for request in seen]
    assert reads == [600.0, 600.0, 30.0]
    assert seen[0].extensions["timeout"]["write"] == 600.0  # an unread body blocks it
    seen.clear()  # a node: patient with its pushes alone (its polls are held, timed so)
    node = httpx.Client(transport=httpx.MockTransport(handle), base_url="http://sl", timeout=30.0)
    carry.attach(node, ("/pull",), ("/push",), push_patience_s=300.0)
    for path in ("/push", "/pull", "/heartbeat"):
        node.post(path, content=b"REQ")
    assert [request.extensions["timeout"]["write"] for request in seen] == [300.0, 30.0, 30.0]


def test_a_client_asks_and_carries_only_once_offered_and_keeps_sound_objects() -> None:
    good, bad = b"content", b"tampered"
    offered = [False]

    def answer(request: httpx.Request) -> httpx.Response:
        headers = {carry.OFFER: "1"} if offered[0] else {}
        if request.url.path == "/pull" and request.headers.get(carry.ASK) == "1":
            body = carry.frame(b"PB", [(oid(good), good), (oid(b"other"), bad)])
            return httpx.Response(200, content=body, headers={**headers, carry.CARRIED: "2"})
        return httpx.Response(200, content=b"PB", headers=headers)

    client, seen = _client(answer)
    carry.LOCAL.outgoing = [(oid(good), good)]
    assert client.post("/push", content=b"REQ").content == b"PB"
    assert carry.CARRIED not in seen[-1].headers and seen[-1].content == b"REQ"  # not offered
    assert carry.LOCAL.outgoing is None  # one push takes it, carried or not
    offered[0] = True
    client.post("/pull", content=b"REQ")
    assert carry.ASK not in seen[-1].headers  # the offer came with that answer
    response = client.post("/pull", content=b"REQ")
    assert seen[-1].headers[carry.ASK] == "1"
    assert response.content == b"PB"  # what Flower's client parses
    assert carry.LOCAL.received == {oid(good): good}  # the tampered one dropped
    carry.LOCAL.outgoing = [(oid(good), good)]
    client.post("/push", content=b"REQ")
    sent = seen[-1]
    assert carry.unframe(sent.content, int(sent.headers[carry.CARRIED])) == (
        b"REQ",
        {oid(good): good},
    )
    client.post("/pull", content=b"REQ")
    carry.LOCAL.received = {}


# ------------------------------------------------------------------ end to end
@pytest.fixture()
def superlink(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Any:
    """Flower's SuperLink app (in-memory state) on uvicorn, with part
    superlink-carried-objects when the test's parameter says so; yields its port and
    state. What the parts replace is put back after the test."""
    import flwr.superlink.main as main
    import uvicorn
    from flwr.superlink.servicer.fleet import fleet_handlers
    from flwr.superlink.servicer.runtime import runtime_handlers
    from flwr.supernode import fleet_http_connection as conn

    from cli.launch import free_port
    from common import flower_gate as gate

    monkeypatch.setattr(main, "_get_middleware", main._get_middleware)
    monkeypatch.setattr(conn, "FleetHttpClient", conn.FleetHttpClient)
    for module in (main, conn, fleet_handlers, runtime_handlers):
        monkeypatch.setitem(
            module.__dict__, gate.ORIGINALS, dict(getattr(module, gate.ORIGINALS, {}))
        )
    for name in ("pull_messages", "push_messages"):
        monkeypatch.setattr(fleet_handlers, name, getattr(fleet_handlers, name))
        monkeypatch.setattr(runtime_handlers, name, getattr(runtime_handlers, name))
    if request.param:
        sl.carried_objects(carry.budget())
    app = main.create_app()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    serving = threading.Thread(target=server.run, daemon=True)
    serving.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and serving.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield port, app.state.linkstate_factory.state(), request.param
    finally:
        server.should_exit = True
        serving.join(timeout=10)


@pytest.mark.parametrize("superlink", [True, False], indirect=True, ids=["fedhet", "flower"])
def test_a_node_gets_and_sends_a_message_whole_in_one_request_each(
    superlink: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Flower's own node connection (``http_request_response``) with part
    carried-objects: from ``fedhet superlink`` its poll's answer carries the message's
    objects and its push carries the reply's (no object request either way, every
    object where it belongs); from Flower's own SuperLink the same node asks for each
    object as Flower does, with the same result."""
    import numpy as np
    from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.constant import NOOP_FEDERATION_ID
    from flwr.supercore.inflatable.inflatable_object import (
        get_all_nested_objects,
        get_object_tree,
        iterate_object_tree,
    )
    from flwr.supercore.inflatable.inflatable_utils import (
        inflate_object_from_contents,
        pull_objects,
        push_object_contents_from_iterable,
    )
    from flwr.supercore.task_identity import TaskIdentity
    from flwr.supernode import fleet_http_connection as conn

    port, state, carrying = superlink
    paths: list[str] = []
    conn_client = conn.FleetHttpClient

    class Counted(conn_client):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            carry.attach(self._client, ("/v1/fleet/pull-messages",), ("/v1/fleet/push-messages",))
            hooks = self._client.event_hooks
            hooks["request"] = [*hooks["request"], lambda r: paths.append(r.url.path)]
            self._client.event_hooks = hooks

    monkeypatch.setattr(conn, "FleetHttpClient", Counted)
    from flwr.superlink.servicer.fleet import fleet_handlers

    monkeypatch.setattr(fleet_handlers, "check_abort", lambda *a, **k: None)  # a running run
    run_id = state.create_run(None, None, None, {}, NOOP_FEDERATION_ID, None, None, "serverapp")
    weights = np.arange(12, dtype=np.float32).reshape(3, 4)
    done = False
    with conn.http_request_response(f"127.0.0.1:{port}", insecure=True) as (
        node_id,
        receive,
        send,
        _get_run,
        _get_fab,
        pull_object,
        push_object,
        _confirm,
    ):
        content = RecordDict({"w": ArrayRecord([weights]), "c": ConfigRecord({"lr": 0.1})})
        saved = TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id
        TaskIdentity.task_id, TaskIdentity.run_id = 1, run_id
        TaskIdentity.node_id = SUPERLINK_NODE_ID
        try:  # as the ServerApp's task makes and stores it
            sent = Message(content, dst_node_id=node_id, message_type="train", ttl=600)
            sent.metadata.__dict__["_message_id"] = sent.object_id
            assert state.store_message_ins(sent)
        finally:
            TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = saved
        store = state.object_store
        store.preregister(run_id, get_object_tree(sent))
        for object_id, obj in get_all_nested_objects(sent).items():
            store.put(object_id, obj.deflate())

        message, tree = receive()
        ids = [t.object_id for t in iterate_object_tree(tree)]
        contents = carry.pulls(pull_objects)(ids, lambda i: pull_object(run_id, i))
        got = inflate_object_from_contents(message.metadata.message_id, contents)
        assert np.array_equal(got.content["w"].to_numpy_ndarrays()[0], weights)
        got.metadata.__dict__["_message_id"] = message.metadata.message_id  # as a node does

        reply = Message(RecordDict({"w": ArrayRecord([weights * 2])}), reply_to=got)
        reply.metadata.__dict__["_message_id"] = reply.object_id
        reply_tree = get_object_tree(reply)
        mine = {k: v.deflate() for k, v in get_all_nested_objects(reply).items()}

        asked: dict[str, int] = {}

        class Store:  # as a node's: the ClientApp's objects arrive after its message
            def get(self, object_id: str) -> bytes:
                asked[object_id] = asked.get(object_id, 0) + 1
                return mine[object_id] if asked[object_id] > 3 else b""

        to_push, session = carry.carrying_send(send, Store())(reply, reply_tree, 0.5)
        push_object_contents_from_iterable(
            ((i, mine[i]) for i in to_push),
            push_object_fn=lambda i, c: push_object(run_id, session, i, c),
        )
        done = True  # (Flower's connection logs and swallows what its body raises)
    assert done
    objects_asked = paths.count("/v1/fleet/pull-object")
    objects_sent = paths.count("/v1/fleet/push-object")
    if carrying:
        assert (objects_asked, objects_sent) == (0, 0), paths
    else:
        assert objects_asked == len(ids) and objects_sent == len(mine), paths
    for object_id, content in mine.items():  # the reply, whole on the SuperLink
        assert store.get(object_id) == content


def test_a_poll_answer_waits_for_the_objects_a_push_is_storing_and_only_for_those() -> None:
    from types import SimpleNamespace

    from flwr.proto.message_pb2 import ObjectTree
    from flwr.proto.node_pb2 import Node

    stored: dict[str, bytes] = {}
    arrivals = sl.Arrivals()
    late, lost = b"stored by a push meanwhile", b"never pushed"
    tree = ObjectTree(object_id=oid(late), children=[ObjectTree(object_id=oid(lost))])

    def pull(request: Any) -> Any:
        content = stored.get(request.object_id)
        return SimpleNamespace(object_available=content is not None, object_content=content)

    pushing = threading.Event()

    def push() -> None:  # Flower's handler stores the message, then each object
        with arrivals.storing([oid(late)]):
            pushing.set()
            time.sleep(0.2)
            stored[oid(late)] = late

    box = sl.Box(budget=2**20)
    pusher = threading.Thread(target=push)
    pusher.start()
    try:
        pushing.wait()
        assert sl.carried_out(box, tree, pull, Node(node_id=1), 1, arrivals, wait_s=30)
    finally:
        pusher.join()
    assert box.out == [(oid(late), late)]  # the other one is the client's to ask for
    assert not arrivals.wait(oid(lost), 30)  # nothing waits for what no push is storing
    assert not arrivals.wait(oid(late), 30)  # nor for what is stored


def test_a_carried_push_stores_what_is_asked_and_its_objects_are_arriving_meanwhile() -> None:
    from types import SimpleNamespace

    from flwr.proto.node_pb2 import Node

    carried = {oid(b"a"): b"a", oid(b"b"): b"b"}
    seen: list[bool] = []

    def respond() -> Any:  # Flower's handler: the message is stored, its objects asked for
        seen.extend(sl.ARRIVALS.wait(i, 0) for i in carried)
        return SimpleNamespace(objects_to_push=[oid(b"a"), oid(b"c")], session_id="s")

    stored: list[str] = []

    def push(request: Any) -> Any:
        stored.append(request.object_id)
        return SimpleNamespace(stored=True)

    box = sl.Box(incoming=carried)
    response = sl.stored_carried(respond, box, push, Node(node_id=1), 1)
    assert seen == [True, True]  # a poll answering with the message waits for them
    assert stored == [oid(b"a")] and list(response.objects_to_push) == [oid(b"c")]
    assert not any(sl.ARRIVALS.wait(i, 0) for i in carried)  # stored: nothing to wait for


@pytest.mark.parametrize("text", ["-1", "lots", "inf"])
def test_a_bad_carry_budget_is_refused_naming_the_variable(
    text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FEDHET_CARRY_MB", text)
    with pytest.raises(SystemExit, match="FEDHET_CARRY_MB"):
        carry.budget()
    monkeypatch.setenv("FEDHET_CARRY_MB", "0.5")
    assert carry.budget() == 2**19
    monkeypatch.delenv("FEDHET_CARRY_MB")
    assert carry.budget() == 64 * 2**20


# ------------------------------------------------------------------ confirmations
def test_a_pulls_confirmations_go_in_one_request_once_offered() -> None:
    """Part carried-confirmations: before the SuperLink offers it each confirmation
    is Flower's request; after, they are kept (answered at once) and one request
    confirms them all, the others' ids in its header; a failed one is not raised."""
    from types import SimpleNamespace

    offered = [False]

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={carry.CONFIRMS: "1"} if offered[0] else {})

    client, seen = _client(answer)

    def confirm(request: Any) -> str:  # Flower's ConfirmMessageReceived, one id
        client.post(carry.RUNTIME_CONFIRM, content=request.message_object_id.encode())
        return "Flower's answer"

    confirmations = carry.Confirmations(confirm, lambda: "kept")
    ask = [SimpleNamespace(message_object_id=c * 64) for c in "abc"]
    assert confirmations(ask[0]) == "Flower's answer" and len(seen) == 1  # not offered yet
    offered[0] = True
    client.post("/pull")
    assert [confirmations(a) for a in ask] == ["kept"] * 3 and len(seen) == 2
    assert confirmations.flush() == 1
    sent = seen[-1]
    assert sent.content == b"a" * 64 and sent.headers[carry.CONFIRMED] == f"{'b' * 64},{'c' * 64}"
    assert carry.LOCAL.confirmed is None and confirmations.flush() == 0
    client.post(carry.RUNTIME_CONFIRM)  # a confirmation of its own names nothing more
    assert carry.CONFIRMED not in seen[-1].headers

    def failing(request: Any) -> None:
        raise httpx.ConnectError("down")

    broken = carry.Confirmations(failing, lambda: "kept")
    broken(ask[0])
    assert broken.flush() == 1 and carry.LOCAL.confirmed is None  # logged, not raised


def test_the_superlink_confirms_each_message_a_confirmation_names() -> None:
    """Part superlink-carried-confirmations: Flower's handler runs for the request and
    again, with the same caller, for each further id (:data:`sl.CONFIRMING`)."""
    from flwr.proto.message_pb2 import ConfirmMessageReceivedRequest

    calls: list[tuple[str, Any]] = []

    def flowers(request: Any, state: Any, task: Any) -> str:
        calls.append((request.message_object_id, task))
        return "answer"

    confirm = sl.confirming_along(flowers)
    request = ConfirmMessageReceivedRequest(run_id=7, message_object_id="a" * 64)
    token = sl.CONFIRMING.set(("b" * 64, "c" * 64))
    try:
        assert confirm(request, "state", "task") == "answer"
    finally:
        sl.CONFIRMING.reset(token)
    assert calls == [("a" * 64, "task"), ("b" * 64, "task"), ("c" * 64, "task")]
    assert request.message_object_id == "a" * 64  # the request itself untouched
    calls.clear()
    confirm(request, "state", "task")  # no header: Flower's alone
    assert calls == [("a" * 64, "task")]


@pytest.mark.parametrize("superlink", [True], indirect=True, ids=["fedhet"])
def test_a_nodes_confirmation_deletes_the_messages_it_names_and_a_bad_list_is_refused(
    superlink: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through Flower's own node connection and SuperLink stack: a reply's push naming
    the message it answers deletes that message's objects; one confirmation naming
    another message deletes both messages' objects (a third stays); a header that is
    not a list of object ids is refused with 400 naming it."""
    import numpy as np
    from flwr.app import ArrayRecord, Message, RecordDict
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.constant import NOOP_FEDERATION_ID
    from flwr.supercore.inflatable.inflatable_object import (
        get_all_nested_objects,
        get_object_tree,
    )
    from flwr.supercore.task_identity import TaskIdentity
    from flwr.superlink.servicer.fleet import fleet_handlers
    from flwr.superlink.servicer.runtime import runtime_handlers
    from flwr.supernode import fleet_http_connection as conn

    for module in (fleet_handlers, runtime_handlers):
        name = "confirm_message_received"
        monkeypatch.setattr(module, name, getattr(module, name))
    monkeypatch.setattr(sl.CarriedObjects, "confirms", False)
    sl.carried_confirmations()
    port, state, _ = superlink
    flowers_client = conn.FleetHttpClient

    class Attached(flowers_client):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            carry.attach(self._client, ("/v1/fleet/pull-messages",), ("/v1/fleet/push-messages",))

    monkeypatch.setattr(conn, "FleetHttpClient", Attached)
    monkeypatch.setattr(fleet_handlers, "check_abort", lambda *a, **k: None)  # a running run
    run_id = state.create_run(None, None, None, {}, NOOP_FEDERATION_ID, None, None, "serverapp")
    store = state.object_store
    with conn.http_request_response(f"127.0.0.1:{port}", insecure=True) as (
        node_id,
        receive,
        send,
        *_,
        confirm,
    ):

        def stored(k: int) -> str:  # a message as the ServerApp's task stores it
            saved = TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id
            TaskIdentity.task_id, TaskIdentity.run_id = 1, run_id
            TaskIdentity.node_id = SUPERLINK_NODE_ID
            try:
                content = RecordDict({"w": ArrayRecord([np.full(3, k, dtype=np.float32)])})
                sent = Message(content, dst_node_id=node_id, message_type="train", ttl=600)
                sent.metadata.__dict__["_message_id"] = sent.object_id
                assert state.store_message_ins(sent)
            finally:
                TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = saved
            store.preregister(run_id, get_object_tree(sent))
            for object_id, obj in get_all_nested_objects(sent).items():
                store.put(object_id, obj.deflate())
            return str(sent.object_id)

        answered = stored(9)
        message, _tree = receive()
        assert message.metadata.message_id == answered
        reply = Message(RecordDict({"w": ArrayRecord([np.zeros(3, np.float32)])}), reply_to=message)
        reply.metadata.__dict__["_message_id"] = reply.object_id
        carry.LOCAL.confirmed = [answered]
        try:
            send(reply, get_object_tree(reply), 0.1)
        finally:
            carry.LOCAL.confirmed = None
        assert store.get(answered) is None  # confirmed by the reply's push
        ids = [stored(k) for k in range(3)]
        carry.LOCAL.confirmed = [ids[1]]
        try:
            confirm(run_id, ids[0])
        finally:
            carry.LOCAL.confirmed = None
    assert store.get(ids[0]) is None and store.get(ids[1]) is None
    assert store.get(ids[2])  # not named: kept
    bad = httpx.post(
        f"http://127.0.0.1:{port}{carry.FLEET_CONFIRM}",
        content=b"",
        headers={carry.CONFIRMED: "not-an-id"},
    )
    assert bad.status_code == 400 and carry.CONFIRMED in bad.json()["detail"]


def test_the_serverapps_pull_confirms_its_replies_in_one_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """server_app.grid.PollingGrid with part carried-confirmations: the confirmations
    Flower's grid makes while it pulls replies go out in one request after the pull."""
    from types import SimpleNamespace

    import flwr.superlink.grid.http_grid as module

    from common import flower_gate as gate
    from server_app.grid import PollingGrid

    monkeypatch.setitem(module.__dict__, gate.ORIGINALS, dict(getattr(module, gate.ORIGINALS, {})))
    for name in ("get_all_nested_objects", "pull_objects"):
        monkeypatch.setattr(module, name, getattr(module, name))
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        request.read()
        seen.append(request)
        return httpx.Response(200, headers={carry.OFFER: "1", carry.CONFIRMS: "1"})

    client = httpx.Client(transport=httpx.MockTransport(handle), base_url="http://sl")

    class Runtime:  # Flower's Runtime client: a request per confirmation
        _client = client

        def ConfirmMessageReceived(self, request: Any) -> str:  # noqa: N802 - Flower's name
            client.post(carry.RUNTIME_CONFIRM, content=request.message_object_id.encode())
            return "Flower's answer"

    class Inner:  # Flower's grid: each reply pulled is confirmed
        _runtime_client = Runtime()

        def pull_messages(self, message_ids: Any) -> list[Any]:
            for key in message_ids:
                self._runtime_client.ConfirmMessageReceived(SimpleNamespace(message_object_id=key))
            return []

    grid = PollingGrid(Inner(), mode="fixed")  # type: ignore[arg-type]
    client.post(carry.RUNTIME_PULL)  # the SuperLink's offer is known
    grid.pull_messages(["a" * 64, "b" * 64, "c" * 64])
    confirms = [r for r in seen if r.url.path == carry.RUNTIME_CONFIRM]
    assert len(confirms) == 1 and confirms[0].content == b"a" * 64
    assert confirms[0].headers[carry.CONFIRMED] == f"{'b' * 64},{'c' * 64}"


def test_answers_carry_within_the_superlinks_in_flight_budget() -> None:
    """Answers made at once draw on one budget: one that finds it spent carries what
    fits (its node pulls the rest), and a sent answer gives its bytes back."""
    from cli.superlink import Box, InFlight

    inflight = InFlight(10)
    first, second = Box(100, inflight=inflight), Box(100, inflight=inflight)
    assert first.add("a", b"x" * 6) and not second.add("b", b"y" * 6)
    assert second.out == [] and inflight.used == 6 and inflight.refused == 1
    assert not second.add("c", b"z")  # a refused answer carries nothing more
    first.release()
    assert inflight.used == 0 and inflight.peak == 6 and first.out == []
    third = Box(100, inflight=inflight)
    assert third.add("d", b"w" * 10) and inflight.used == 10
    third.release()
    assert inflight.used == 0
    assert Box(5).add("e", b"v" * 5)  # without an in-flight budget: the answer's alone


def test_pushes_wait_unread_while_earlier_ones_fill_the_budget() -> None:
    """A push that would go over the budget waits until earlier ones are stored; a
    push alone always goes; 0 bounds nothing."""
    import asyncio

    from cli.superlink import Incoming

    async def scenario() -> list[str]:
        budget, order = Incoming(10), []

        async def push(name: str, size: int, hold: float) -> None:
            await budget.enter(size)
            order.append(f"{name} in")
            await asyncio.sleep(hold)
            order.append(f"{name} out")
            await budget.leave(size)

        await asyncio.gather(push("a", 6, 0.05), push("b", 6, 0.0), push("c", 4, 0.0))
        assert budget.used == 0 and budget.peak == 10 and budget.waits == 1
        await budget.enter(50)  # over the budget, but alone
        await budget.leave(50)
        free = Incoming(0)
        await free.enter(6)
        await free.enter(6)
        assert free.used == 12 and free.waits == 0
        return order

    order = asyncio.run(scenario())
    assert order.index("b in") > order.index("a out"), order  # b waited for a
    assert order.index("c in") < order.index("a out"), order  # c fit beside a
