"""``fedhet superlink``: Flower's SuperLink with fedhet's changes for large fleets.

Takes ``flower-superlink``'s flags and starts Flower's own SuperLink; before it starts,
two changes to Flower's runtime, each a gate part (:mod:`common.flower_gate`) that falls
back to Flower's own behaviour with one warning line when the installed Flower is not
the code it was checked against:

* ``superlink-fleet-path`` (:func:`fleet_path_middleware`): Flower 1.42 puts eight
  Starlette ``BaseHTTPMiddleware`` layers in front of every request. Four of them act
  only on Control API paths (``/v1/control/...``: its cache headers, event log, licence
  check and account authentication) and one only when a Fleet event-log plugin is set
  (``FLWR_ENABLE_EVENT_LOG=1``); for every other request each is a pass-through that
  still costs a task, a stream and a response copy. Here each of those five runs only
  where it acts; a Fleet or ServerAppIo request passes the other three (error
  translation, protobuf translation, node authentication) as before.
* ``superlink-node-index`` (:func:`indexed_message_pulls`): with the state in memory,
  Flower's ``get_message_ins`` (a node's poll, and every reply pull of the ServerApp)
  checks every stored message of every node to find the caller's: O(messages) per
  poll, O(N²) per round. Here the store keeps each node's message ids; a poll checks
  only the caller's, in the same order, with Flower's own check
  (``_check_stored_messages``); every :data:`SWEEP_S` seconds one poll still checks
  them all, so expired messages of silent nodes are removed as before.
* ``superlink-whole-messages`` (:func:`whole`, with the index): a poll returns a
  message only once every object of it is on the SuperLink. Flower returns it as soon
  as the ServerApp has registered it, before the ServerApp has pushed its objects; at
  a thousand nodes the ServerApp's pushes take minutes and a node that got its message
  early asked for objects that were not there yet (7 object pulls per node-round
  where 3 were needed).
* ``superlink-keep-alive`` (:func:`keep_alive`): the SuperLink keeps an idle
  connection :func:`keep_alive_s` seconds (``FEDHET_KEEPALIVE_S``, default
  :data:`KEEPALIVE_S`; Flower leaves uvicorn's 5 s) and says so in every answer
  (``Keep-Alive: timeout=N``), which ``fedhet supernode`` follows. A node whose
  requests come more than 5 s apart (every idle poll and heartbeat of a large fleet)
  opened a new TCP and TLS connection for each: at a thousand nodes the handshakes
  were a sixth of the SuperLink's busy time.

The SQLite state (``--database FILE``) finds a node's messages with one query and is
left as Flower has it.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

from common import flower_gate as gate

MIDDLEWARE = "flwr.superlink.main"
CONTROL_MIDDLEWARES = "flwr.superlink.routers.control.middlewares"
FLEET_MIDDLEWARES = "flwr.superlink.routers.fleet.middlewares"
MEMORY_STATE = "flwr.server.superlink.linkstate.in_memory_linkstate"
INFLATABLE = "flwr.supercore.inflatable.inflatable_object"
OBJECT_STORE = "flwr.supercore.object_store.object_store"
CONTROL_PREFIX = "/v1/control/"
SWEEP_S = 30.0
"""How often a poll still checks every stored message (Flower: every poll)."""
FLOWER_CLI = "flwr.superlink.cli.flower_superlink"
KEEPALIVE_S = 60
"""How long the SuperLink keeps an idle connection (``FEDHET_KEEPALIVE_S``)."""
KEEPALIVE_MAX_S = 3600

ASGIApp = Callable[..., Any]


class Scoped:
    """An ASGI middleware that runs ``inner`` (built on the same app) only for the HTTP
    requests ``applies`` accepts; every other request goes straight to the app."""

    def __init__(
        self, app: ASGIApp, inner: type, applies: Callable[[dict], bool], **kwargs: Any
    ) -> None:
        self.app = app
        self.inner = inner(app, **kwargs)
        self.applies = applies

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") == "http" and not self.applies(scope):
            await self.app(scope, receive, send)
        else:
            await self.inner(scope, receive, send)


def control_path(scope: dict) -> bool:
    """A Control API request (the only ones Flower's Control middlewares act on)."""
    return str(scope.get("path", "")).startswith(CONTROL_PREFIX)


def fleet_log_set(scope: dict) -> bool:
    """The app has a Fleet event-log plugin (the only case its middleware acts)."""
    state = getattr(scope.get("app"), "state", None)
    return getattr(state, "fleet_event_log_plugin", None) is not None


def scoped_middleware(stack: list[Any]) -> list[Any]:
    """Flower's middleware list with the Control ones scoped to Control paths and the
    Fleet event log to an app that has its plugin (same order, same arguments)."""
    from starlette.middleware import Middleware

    control = importlib.import_module(CONTROL_MIDDLEWARES)
    fleet = importlib.import_module(FLEET_MIDDLEWARES)
    scopes: dict[type, Callable[[dict], bool]] = {
        control.ControlSensitiveResponseMiddleware: control_path,
        control.ControlEventLogMiddleware: control_path,
        control.ControlLicenseMiddleware: control_path,
        control.ControlAuthenticationMiddleware: control_path,
        fleet.FleetEventLogMiddleware: fleet_log_set,
    }
    out = []
    for entry in stack:
        applies = scopes.get(entry.cls)
        if applies is None:
            out.append(entry)
        else:
            out.append(Middleware(Scoped, entry.cls, applies, *entry.args, **entry.kwargs))  # type: ignore[arg-type]
    return out


def fleet_path_middleware() -> None:
    """Part ``superlink-fleet-path``: the SuperLink app built with
    :func:`scoped_middleware`."""
    module = importlib.import_module(MIDDLEWARE)
    flowers = gate.original(module, "_get_middleware")
    gate.replace(module, "_get_middleware", lambda: scoped_middleware(flowers()))


class NodeIndexed(dict):  # type: ignore[type-arg]
    """The in-memory state's message store (message id -> message) that also keeps,
    per destination node, its message ids in the order they were stored. Flower writes
    the store only by item assignment and ``del``."""

    def __init__(self, items: MutableMapping[str, Any] | None = None) -> None:
        super().__init__()
        self.by_node: dict[int, dict[str, None]] = {}
        for key, value in (items or {}).items():
            self[key] = value

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        self.by_node.setdefault(value.metadata.dst_node_id, {})[key] = None

    def __delitem__(self, key: str) -> None:
        node = self[key].metadata.dst_node_id
        super().__delitem__(key)
        ids = self.by_node.get(node)
        if ids is not None:
            ids.pop(key, None)
            if not ids:
                del self.by_node[node]

    def pop(self, key: str, *default: Any) -> Any:
        if key in self:
            value = self[key]
            del self[key]
            return value
        if default:
            return default[0]
        raise KeyError(key)

    def clear(self) -> None:
        super().clear()
        self.by_node.clear()

    def of(self, node_id: int) -> Iterator[str]:
        """Node ``node_id``'s message ids, in the order they were stored (a copy)."""
        return iter(list(self.by_node.get(node_id, ())))


def whole(store: Any, message_id: str) -> bool:
    """Every object of message ``message_id`` is in the object ``store`` (Flower keeps a
    registered object that has not arrived as empty content). A message the store does
    not know is left to Flower's handler, which logs and deletes it."""
    objects = importlib.import_module(OBJECT_STORE)
    try:
        tree = store.get_object_tree(message_id)
    except objects.NoObjectInStoreError:
        return True
    iterate = importlib.import_module(INFLATABLE).iterate_object_tree
    return all(store.get(node.object_id) for node in iterate(tree))


def indexed_get_message_ins(
    flowers: Callable[..., Any], whole_only: bool = False
) -> Callable[..., Any]:
    """``InMemoryLinkState.get_message_ins`` that checks only the caller's messages
    (Flower's check, order and delivery mark), and all of them every :data:`SWEEP_S`;
    with ``whole_only``, only messages whose objects have all arrived (:func:`whole`)
    are returned (and marked delivered)."""
    last_sweep = [time.monotonic()]
    sweep_lock = threading.Lock()

    def get_message_ins(
        self: Any, node_id: int, limit: int | None, *, run_id: int | None = None
    ) -> list[Any]:
        if limit is not None and limit < 1:
            raise AssertionError("`limit` must be >= 1")
        with self.lock:
            store = self.message_ins_store
            if not isinstance(store, NodeIndexed):
                store = self.message_ins_store = NodeIndexed(store)
            with sweep_lock:
                sweep = time.monotonic() - last_sweep[0] >= SWEEP_S
                if sweep:
                    last_sweep[0] = time.monotonic()
            if sweep:
                self._check_stored_messages(set(store))
            found: list[Any] = []
            for msg_id in store.of(node_id):
                self._check_stored_messages({msg_id})
                msg = store.get(msg_id)
                if (
                    msg is not None
                    and (run_id is None or msg.metadata.run_id == run_id)
                    and msg.metadata.delivered_at == ""
                    and (not whole_only or whole(self.object_store, msg_id))
                ):
                    found.append(msg)
                if limit and len(found) == limit:
                    break
        delivered_at = importlib.import_module(MEMORY_STATE).now().isoformat()
        for msg in found:
            msg.metadata.delivered_at = delivered_at
        return found

    get_message_ins.__wrapped__ = flowers  # type: ignore[attr-defined]
    return get_message_ins


def indexed_message_pulls(whole_only: bool = False) -> None:
    """Part ``superlink-node-index``: the in-memory state finds a node's messages by
    its index (:func:`indexed_get_message_ins`); with part
    ``superlink-whole-messages`` (``whole_only``), only messages that have all their
    objects."""
    cls = importlib.import_module(MEMORY_STATE).InMemoryLinkState
    flowers = cls.__dict__["get_message_ins"]
    flowers = getattr(flowers, "__wrapped__", flowers)  # Flower's own, once replaced
    cls.get_message_ins = indexed_get_message_ins(flowers, whole_only)


def keep_alive_s() -> int:
    """``FEDHET_KEEPALIVE_S`` (whole seconds, 1 to :data:`KEEPALIVE_MAX_S`), else
    :data:`KEEPALIVE_S`."""
    text = os.environ.get("FEDHET_KEEPALIVE_S", "").strip()
    if not text:
        return KEEPALIVE_S
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= KEEPALIVE_MAX_S:
        raise SystemExit(
            f"FEDHET_KEEPALIVE_S={text!r}: give whole seconds from 1 to {KEEPALIVE_MAX_S}"
        )
    return value


class KeepAliveHeader:
    """An ASGI middleware that adds ``Keep-Alive: timeout=<seconds>`` to every HTTP
    answer (what the server does with an idle connection, RFC 9112 appendix C)."""

    def __init__(self, app: ASGIApp, seconds: int) -> None:
        self.app = app
        self.header = (b"keep-alive", b"timeout=%d" % seconds)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return

        async def sending(message: dict) -> None:
            if message.get("type") == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        await self.app(scope, receive, sending)


def keep_alive(seconds: int) -> None:
    """Part ``superlink-keep-alive``: uvicorn started with ``timeout_keep_alive`` =
    ``seconds`` (unless Flower sets one) and :class:`KeepAliveHeader` outermost."""
    from starlette.middleware import Middleware

    uvicorn = importlib.import_module(FLOWER_CLI).uvicorn
    run = gate.original(uvicorn, "run")

    def run_kept(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("timeout_keep_alive", seconds)
        return run(*args, **kwargs)

    gate.replace(uvicorn, "run", run_kept)
    main = importlib.import_module(MIDDLEWARE)
    current = main._get_middleware  # Flower's, or the scoped one
    gate.replace(
        main, "_get_middleware", lambda: [Middleware(KeepAliveHeader, seconds), *current()]
    )


def run_superlink(argv: list[str]) -> None:
    """Apply the parts that fit, then Flower's ``flower-superlink`` with ``argv``."""
    gate.use("superlink-entry")
    seconds = keep_alive_s()  # a bad value stops here, before anything starts
    if gate.use("superlink-fleet-path"):
        fleet_path_middleware()
    if gate.use("superlink-node-index"):
        indexed_message_pulls(gate.use("superlink-whole-messages"))
    if gate.use("superlink-keep-alive"):
        keep_alive(seconds)
    sys.argv = ["flower-superlink", *argv]
    importlib.import_module("flwr.superlink.cli").flower_superlink()


if __name__ == "__main__":  # pragma: no cover
    run_superlink(sys.argv[1:])
