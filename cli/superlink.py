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
* ``superlink-whole-messages`` (:func:`whole`, with either index): a poll returns a
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
* ``superlink-held-pulls`` (:class:`HeldPulls`, with either index): a node that asks
  (``x-fedhet-hold: S``, which ``fedhet supernode`` sends once the SuperLink's answers
  name ``x-fedhet-holds: S``) has its empty poll held up to ``S`` (at most
  :data:`HOLD_S`) seconds and answered as soon as a whole message for it is there; the
  answer says how long it was held (``x-fedhet-held``). Without it a node polls
  ahead of its message and more often as it comes due: 10-13 polls per node-round.
  ``FEDHET_HOLD_S`` (default :data:`HOLD_S`; 0: never hold). A held poll that
  declares a heartbeat interval (``x-fedhet-alive: I``, which ``fedhet supernode``
  sends once the answers name ``x-fedhet-alive-polls: 1``) is also the node's
  heartbeat (:func:`acknowledge`): the state holds the node online for
  ``HEARTBEAT_PATIENCE`` (2) x ``I`` from its arrival and from its answer, as for
  Flower's own heartbeat, and the node sends none of those while it polls (a held
  poll keeps it on the line with the SuperLink most of the time anyway).
* ``superlink-carried-objects`` (:class:`CarriedObjects`, :func:`carried_objects`): a
  message's objects move in the request or answer that moves the message
  (:mod:`common.carry`): a poll of a node or of the ServerApp that asks has its
  messages' objects appended to the answer, each read by Flower's own ``pull_object``
  handler (up to ``FEDHET_CARRY_MB`` an answer); a node's push that carries its
  reply's objects has each one the SuperLink asks for stored by Flower's own
  ``push_object`` handler, and the answer asks for none of those. Flower moves each
  object in a request of its own: about 11 of 21 requests per node-round at a
  thousand nodes.

* ``superlink-database-index`` (:class:`Undelivered`, :func:`database_message_pulls`):
  with the state in a database (``--database FILE``), the SuperLink also keeps each
  node's undelivered messages in memory, learnt as each stored message's transaction
  commits and read again from the database every :data:`SWEEP_S` seconds. A poll for
  a node with none leaves the database alone (Flower: a claim query on every poll and
  on every reply pull of the ServerApp); with ``superlink-whole-messages``, a message
  is returned once its objects have all arrived; and held polls, standing for
  heartbeats too, apply as with the state in memory (their database work off the
  event loop).
* ``superlink-database-reads`` (:func:`remembered_run_status`, :class:`NodeKeys`):
  with the state in a database, a run's status (which Flower reads, after two
  updates of expired task tokens, on every node request that checks for an aborted
  run and on every object a carried poll or push moves) is reused for
  :data:`RUN_STATUS_S` seconds, and a node's id by its public key (read on every
  authenticated node request) is remembered (read again after :data:`SWEEP_S`; a
  node deleted through this SuperLink is forgotten at once).
* ``superlink-database-lock`` (:func:`database_lock`): the SuperLink's threads take
  turns at the database, a transaction at a time (Flower's meet at SQLite's lock,
  polled in sleeps, and fail after 5 s); its connections wait up to :data:`BUSY_S`
  seconds for a lock another process holds.
* ``superlink-database-writes`` (:class:`DatabaseWrites`): with the state in a
  database, the traffic records (an update of the run's row for every poll, push and
  object moved) summed and the held polls' heartbeats gathered, and written together
  every :data:`WRITES_S` seconds, one transaction per state.
* ``superlink-kept-windows`` (:func:`kept_windows`): a node's heartbeat never
  shortens the window an earlier one granted (Flower: the latest one's interval
  decides, whatever an earlier one promised).
* ``superlink-urgent-first`` (:func:`urgent_first`): the heartbeats, the ServerApp
  task's and the nodes', are answered in threads of their own and go first at the
  database lock (Flower's wait in line with every request, and a task heartbeat
  answered after 60 s ends the ServerApp's task).
* ``superlink-released-claims`` (:func:`release`): a message marked delivered for a
  poll whose answer did not reach the node (its handler failed after the claim, or
  the node of a held poll hung up) is made undelivered again, for the node's next
  poll; Flower never hands a delivered message out again.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import importlib
import json
import os
import re
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from typing import Any

from cli.supernode import number
from common import carry, heap
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
HOLD_S = 45.0
"""The longest a node's empty poll is held (``FEDHET_HOLD_S``; the node's read timeout
grows by as much), below the 60 s a reverse proxy commonly allows an answer."""
HOLD_MAX_S = 120.0
PULL_PATH = "/v1/fleet/pull-messages"
FLEET_HANDLERS = "flwr.superlink.servicer.fleet.fleet_handlers"
RUNTIME_HANDLERS = "flwr.superlink.servicer.runtime.runtime_handlers"
MESSAGE_PB = "flwr.proto.message_pb2"
FLEET_PB = "flwr.proto.fleet_pb2"
CONSTANT = "flwr.common.constant"
RECHECK_S = (0.2, 2.0)
"""A held poll woken by a message whose objects have not all arrived looks again after
the first, doubling up to the second."""

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
        node = value.metadata.dst_node_id
        self.by_node.setdefault(node, {})[key] = None
        WAITING.wake(node)

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


def tree_ids(store: Any, message_id: str) -> list[str] | None:
    """The ids of every object of message ``message_id`` in the object ``store``; None
    for a message the store does not know."""
    objects = importlib.import_module(OBJECT_STORE)
    try:
        tree = store.get_object_tree(message_id)
    except objects.NoObjectInStoreError:
        return None
    iterate = importlib.import_module(INFLATABLE).iterate_object_tree
    return [node.object_id for node in iterate(tree)]


def whole(store: Any, message_id: str) -> bool:
    """Every object of message ``message_id`` is in the object ``store`` (Flower keeps a
    registered object that has not arrived as empty content). A message the store does
    not know is left to Flower's handler, which logs and deletes it."""
    ids = tree_ids(store, message_id)
    return ids is None or all(store.get(object_id) for object_id in ids)


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
                WAITING.states.add(self)
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
        claimed(self, found)
        return found

    get_message_ins.__wrapped__ = flowers  # type: ignore[attr-defined]
    return get_message_ins


CLAIMS: contextvars.ContextVar[list[tuple[Any, str]] | None] = contextvars.ContextVar(
    "fedhet_claims", default=None
)
"""The messages a poll's handler claimed (marked delivered) so far: ``(state, id)``."""


def claimed(state: Any, messages: Iterable[Any]) -> None:
    """``messages`` of ``state`` were marked delivered for the poll running now."""
    claims = CLAIMS.get()
    if claims is not None:
        claims.extend((state, msg.metadata.message_id) for msg in messages)


def release(claims: Iterable[tuple[Any, str]]) -> None:
    """Messages marked delivered for a poll whose answer did not reach its node (its
    handler failed, or the node had hung up) made undelivered again, and a poll held
    for their node woken: Flower marks a message delivered as it reads it and never
    hands it out again, so the node would never get it and the ServerApp wait for
    its reply until the round's timeout. A state that cannot is logged."""
    by_state: dict[int, tuple[Any, list[str]]] = {}
    for state, message_id in claims:
        by_state.setdefault(id(state), (state, []))[1].append(message_id)
    for state, ids in by_state.values():
        for attempt in range(3):
            try:
                released = (
                    release_in_database(state, ids)
                    if state in UNDELIVERED
                    else release_in_memory(state, ids)
                )
                break
            except Exception as exc:  # noqa: BLE001 - a locked database: again, then logged
                if attempt == 2:
                    print(f"fedhet superlink: {len(ids)} message(s) stay delivered: {exc}")
                    released = []
                else:
                    time.sleep(0.5 * 2**attempt)
        for node_id in released:
            WAITING.wake(node_id)


def release_in_memory(state: Any, ids: list[str]) -> list[int]:
    """:func:`release` in an in-memory state; the nodes of the messages released."""
    nodes = []
    with state.lock:
        for message_id in ids:
            msg = state.message_ins_store.get(message_id)
            if msg is not None and msg.metadata.delivered_at != "":
                msg.metadata.delivered_at = ""
                nodes.append(msg.metadata.dst_node_id)
    return nodes


def release_in_database(state: Any, ids: list[str]) -> list[int]:
    """:func:`release` in a database state (back in its :class:`Undelivered`); the
    nodes of the messages released."""
    from sqlalchemy import update

    model = importlib.import_module(SQL_STATE).MessageInsModel
    query = (
        update(model)
        .where(model.message_id.in_(ids), model.delivered_at != "")
        .values(delivered_at="")
        .returning(model.message_id, model.dst_node_id, model.created_at, model.ttl, model.run_id)
    )
    with state.session() as session:
        rows = entries(session.execute(query).all())
    index = undelivered(state)
    for key, node_id, until, run_id in rows:
        index.add(node_id, key, until, run_id)
    return [node_id for _, node_id, _, _ in rows]


def released_on_failure(flowers: Callable[..., Any]) -> Callable[..., Any]:
    """Flower's Fleet ``pull_messages`` (as wrapped so far) whose claimed messages
    are released (:func:`release`) when it fails after claiming them: the node gets
    an error, not the messages (Flower: a failed traffic record after the claim, a
    locked database, lost them)."""

    def pull_messages(request: Any, state: Any, store: Any) -> Any:
        claims: list[tuple[Any, str]] = []
        token = CLAIMS.set(claims)
        try:
            return flowers(request=request, state=state, store=store)
        except BaseException:
            release(claims)
            raise
        finally:
            CLAIMS.reset(token)

    pull_messages.__wrapped__ = flowers  # type: ignore[attr-defined]
    return pull_messages


SQL_STATE = "flwr.server.superlink.linkstate.sql_linkstate"
SQL_MIXIN = "flwr.supercore.sql_mixin"
OBJECT_MODELS = "flwr.supercore.state.schema.objectstore_models"
INDEX_KEY = "fedhet_undelivered"
"""Where a database session keeps the index entries it adds once it commits."""


class Entry:
    """An undelivered instruction message in :class:`Undelivered`."""

    __slots__ = ("added", "run_id", "until")

    def __init__(self, until: float, run_id: int, added: float) -> None:
        self.until = until
        """When it expires (Unix time: its ``created_at`` + ``ttl``)."""
        self.run_id = run_id
        self.added = added
        """When the index learnt of it (``time.monotonic()``)."""


class Undelivered:
    """A database state's undelivered instruction messages, by destination node, in
    the SuperLink's memory beside the database (part ``superlink-database-index``).

    A message is added once the transaction that stored it commits, dropped once a
    poll claims it (or once a claim finds nothing for its node: it was deleted), and
    leaves when it expires; every :data:`SWEEP_S` the index is read again from the
    database (what another process stored, or deleted, is right within that time).
    A poll for a node with none in the index leaves the database alone; a message's
    being whole (:func:`whole_in_database`) is remembered once it is."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_node: dict[int, dict[str, Entry]] = {}
        self.whole: set[str] = set()
        self.missing: dict[str, tuple[int, set[str]]] = {}
        """Message -> (its node, the objects its sender was asked to push)."""
        self.awaiting: dict[str, set[str]] = {}
        """Object -> the messages in :attr:`missing` waiting for it."""
        self.arriving = Arrivals()
        """The messages carried pushes are storing (not whole until their answers say
        which objects are left: :func:`learn_wholeness`)."""
        self.read_at: float | None = None
        """When the last read from the database began (``time.monotonic()``)."""

    def add(self, node_id: int, message_id: str, until: float, run_id: int) -> None:
        with self.lock:
            self.by_node.setdefault(node_id, {})[message_id] = Entry(
                until, run_id, time.monotonic()
            )

    def of(self, node_id: int, run_id: int | None = None) -> list[str]:
        """Node ``node_id``'s messages (of run ``run_id``, if given) that have not
        expired, in the order the index learnt of them; expired ones leave."""
        now = time.time()
        with self.lock:
            entries = self.by_node.get(node_id)
            if not entries:
                return []
            gone = [key for key, entry in entries.items() if entry.until <= now]
            if gone:
                self._drop(node_id, gone)
            return [
                key for key, entry in entries.items() if run_id is None or entry.run_id == run_id
            ]

    def drop(self, node_id: int, message_ids: Iterable[str]) -> None:
        with self.lock:
            self._drop(node_id, message_ids)

    def _drop(self, node_id: int, message_ids: Iterable[str]) -> None:
        entries = self.by_node.get(node_id, {})
        for message_id in list(message_ids):
            entries.pop(message_id, None)
            self.whole.discard(message_id)
            _, missing = self.missing.pop(message_id, (0, set()))
            for object_id in missing:
                self._unawait(object_id, message_id)
        if not entries:
            self.by_node.pop(node_id, None)

    def _unawait(self, object_id: str, message_id: str) -> None:
        waiting = self.awaiting.get(object_id)
        if waiting is not None:
            waiting.discard(message_id)
            if not waiting:
                del self.awaiting[object_id]

    def expect(self, node_id: int, message_id: str, missing: set[str]) -> None:
        """Message ``message_id`` (for ``node_id``) lacks the objects ``missing``, which
        its sender was asked to push (whole once :meth:`arrived` says so)."""
        with self.lock:
            self.missing[message_id] = (node_id, set(missing))
            for object_id in missing:
                self.awaiting.setdefault(object_id, set()).add(message_id)

    def arrived(self, object_id: str) -> list[tuple[int, str]]:
        """Object ``object_id`` was stored: the messages ``(node, id)`` now whole."""
        done = []
        with self.lock:
            for message_id in self.awaiting.pop(object_id, ()):
                node_id, missing = self.missing.get(message_id, (0, set()))
                missing.discard(object_id)
                if not missing:
                    self.missing.pop(message_id, None)
                    self.whole.add(message_id)
                    done.append((node_id, message_id))
        return done

    def due(self) -> bool:
        """Time to read the index from the database again (claimed by the caller:
        one reader at a time)."""
        now = time.monotonic()
        with self.lock:
            if self.read_at is not None and now - self.read_at < SWEEP_S:
                return False
            self.read_at = now
            return True

    def reread(self, rows: Iterable[tuple[str, int, float, int]], began: float) -> None:
        """The database's undelivered messages ``(message id, node, until, run)``,
        read from ``began`` on: what the index lacks is added, what it has takes the
        database's expiry; what it learnt before ``began`` and the database no longer
        holds as undelivered leaves, and so does every expired message."""
        seen: dict[int, dict[str, tuple[float, int]]] = {}
        for message_id, node_id, until, run_id in rows:
            seen.setdefault(node_id, {})[message_id] = (until, run_id)
        now = time.time()
        with self.lock:
            for node_id, held in seen.items():
                entries = self.by_node.setdefault(node_id, {})
                for message_id, (until, run_id) in held.items():
                    entry = entries.get(message_id)
                    if entry is None:
                        entries[message_id] = Entry(until, run_id, began)
                    else:
                        entry.until = until
            for node_id in list(self.by_node):
                held = seen.get(node_id, {})
                gone = [
                    key
                    for key, entry in self.by_node[node_id].items()
                    if entry.until <= now or (entry.added < began and key not in held)
                ]
                self._drop(node_id, gone)

    def is_whole(self, store: Any, message_id: str) -> bool:
        """Every object of ``message_id`` is in the database's object ``store`` (known
        without a query once a carried push stored them all, while its sender still
        has some to push: :meth:`expect`, and while a carried push stores it:
        :attr:`arriving`)."""
        if message_id in self.whole:
            return True
        if message_id in self.missing or message_id in self.arriving:
            return False
        if not whole_in_database(store, message_id):
            return False
        with self.lock:
            self.whole.add(message_id)
        return True


UNDELIVERED: weakref.WeakKeyDictionary[Any, Undelivered] = weakref.WeakKeyDictionary()
UNDELIVERED_LOCK = threading.Lock()


def undelivered(state: Any) -> Undelivered:
    """The index of database state ``state`` (made on first use, which also puts the
    state among :data:`WAITING`'s)."""
    index = UNDELIVERED.get(state)
    if index is None:
        with UNDELIVERED_LOCK:
            index = UNDELIVERED.get(state)
            if index is None:
                index = UNDELIVERED[state] = Undelivered()
                WAITING.states.add(state)
    return index


def read_undelivered(state: Any) -> list[tuple[str, int, float, int]]:
    """Database state ``state``'s undelivered instruction messages: ``(message id,
    destination node, expiry as Unix time, run)``."""
    from sqlalchemy import select

    model = importlib.import_module(SQL_STATE).MessageInsModel
    query = select(
        model.message_id, model.dst_node_id, model.created_at, model.ttl, model.run_id
    ).where(model.delivered_at == "")
    with state.session() as session:
        return entries(session.execute(query).all())


def entries(rows: Iterable[Any]) -> list[tuple[str, int, float, int]]:
    """Database rows ``(message id, node, created_at, ttl, run)`` of instruction
    messages as :class:`Undelivered` keeps them: ``(message id, node, expiry as Unix
    time, run)``, ids unsigned as Flower hands them out."""
    unsigned = importlib.import_module(SQL_STATE).int64_to_uint64
    return [
        (str(key), unsigned(int(node)), float(created) + float(ttl), unsigned(int(run)))
        for key, node, created, ttl, run in rows
    ]


def whole_in_database(store: Any, message_id: str) -> bool:
    """:func:`whole` for Flower's database object store: one query for the objects
    not yet arrived (no object's content read)."""
    from sqlalchemy import func, select

    ids = tree_ids(store, message_id)
    if ids is None:
        return True
    stored = importlib.import_module(OBJECT_MODELS).StoredObject
    query = (
        select(func.count())
        .select_from(stored)
        .where(stored.object_id.in_(ids), stored.is_available == 0)
    )
    with store.session() as session:
        return not session.scalar(query)


def on_commit(state: Any, action: Callable[[], None]) -> None:
    """``action()`` once the database transaction open in this context for
    ``state`` commits (at once when none is open; never if it rolls back)."""
    from sqlalchemy import event

    sessions = importlib.import_module(SQL_MIXIN)._current_sessions.get()
    session = sessions.get(state._session_scope) if sessions else None
    if session is None:
        action()
        return
    actions = session.info.get(INDEX_KEY)
    if actions is None:
        actions = session.info[INDEX_KEY] = []

        def committed(done: Any) -> None:
            for each in done.info.pop(INDEX_KEY, ()):
                each()

        event.listen(session, "after_commit", committed, once=True)
    actions.append(action)


def indexed_store_message_ins(flowers: Callable[..., Any]) -> Callable[..., Any]:
    """``SqlLinkState.store_message_ins`` that adds a stored message to the state's
    :class:`Undelivered` once its transaction commits, and wakes a poll held for its
    node."""

    def store_message_ins(self: Any, message: Any) -> str | None:
        stored = flowers(self, message)
        if stored is not None:
            meta = message.metadata
            index = undelivered(self)
            node_id, until, run_id = meta.dst_node_id, meta.created_at + meta.ttl, meta.run_id

            def learnt() -> None:
                index.add(node_id, stored, until, run_id)
                WAITING.wake(node_id)

            on_commit(self, learnt)
        return stored

    store_message_ins.__wrapped__ = flowers  # type: ignore[attr-defined]
    return store_message_ins


def database_get_message_ins(
    flowers: Callable[..., Any], whole_only: bool = False
) -> Callable[..., Any]:
    """``SqlLinkState.get_message_ins`` that asks the database only for a node the
    state's :class:`Undelivered` holds messages for (Flower's claim, order and
    checks then); with ``whole_only``, only once each of them is whole
    (:meth:`Undelivered.is_whole`). The index is read again when due."""

    def get_message_ins(
        self: Any, node_id: int, limit: int | None, *, run_id: int | None = None
    ) -> list[Any]:
        if limit is not None and limit < 1:
            raise AssertionError("`limit` must be >= 1")
        index = undelivered(self)
        if index.due():
            began = time.monotonic()
            try:
                index.reread(read_undelivered(self), began)
            except Exception:  # noqa: BLE001 - the index stays as it was; read again later
                with index.lock:
                    index.read_at = None
        wanted = index.of(node_id, run_id)
        if not wanted:
            return []
        if whole_only and not all(index.is_whole(self.object_store, key) for key in wanted):
            return []
        found = flowers(self, node_id, limit, run_id=run_id)
        claimed(self, found)
        gone = {msg.metadata.message_id for msg in found}
        if limit is None or len(found) < limit:
            gone.update(wanted)  # the rest of those it knew of was not there
        index.drop(node_id, gone)
        return found

    get_message_ins.__wrapped__ = flowers  # type: ignore[attr-defined]
    return get_message_ins


RUN_STATUS_S = 1.0
"""How long the database state's answer to a run-status read is reused."""


def remembered_run_status(
    flowers: Callable[..., Any], seconds: float = RUN_STATUS_S
) -> Callable[..., Any]:
    """``SqlLinkState.get_run_status`` that reuses its answer for the same runs for
    ``seconds`` (part ``superlink-database-reads``). Flower reads it, with two
    updates of expired task tokens first, on every node request that checks for an
    aborted run, and on every object a carried poll or push moves; with this, a
    stopped or finished run is seen up to ``seconds`` later."""
    memo: dict[tuple[int, frozenset[int]], tuple[float, dict[int, Any]]] = {}
    lock = threading.Lock()

    def get_run_status(self: Any, run_ids: set[int]) -> dict[int, Any]:
        key = (id(self), frozenset(run_ids))
        now = time.monotonic()
        with lock:
            hit = memo.get(key)
        if hit is not None and now - hit[0] < seconds:
            return dict(hit[1])
        found = flowers(self, run_ids)
        with lock:
            for old in [k for k, (at, _) in memo.items() if now - at >= seconds]:
                del memo[old]
            memo[key] = (now, dict(found))
        return found

    get_run_status.__wrapped__ = flowers  # type: ignore[attr-defined]
    return get_run_status


class NodeKeys:
    """The database state's node id by public key, as read (part
    ``superlink-database-reads``): every authenticated node request asks for it.
    A key is read again after :data:`SWEEP_S` seconds; a node deleted through this
    SuperLink leaves at once."""

    def __init__(self, seconds: float | None = None) -> None:
        self.seconds = seconds
        self.lock = threading.Lock()
        self.ids: dict[tuple[int, bytes], tuple[int, float]] = {}

    def lookup(self, flowers: Callable[..., Any]) -> Callable[..., Any]:
        """``SqlLinkState.get_node_id_by_public_key``, remembered."""

        def get_node_id_by_public_key(state: Any, public_key: bytes) -> int | None:
            key = (id(state), bytes(public_key))
            now = time.monotonic()
            keep = SWEEP_S if self.seconds is None else self.seconds
            with self.lock:
                hit = self.ids.get(key)
            if hit is not None and now - hit[1] < keep:
                return hit[0]
            node_id = flowers(state, public_key)
            if node_id is not None:
                with self.lock:
                    self.ids[key] = (node_id, now)
            return node_id

        get_node_id_by_public_key.__wrapped__ = flowers  # type: ignore[attr-defined]
        return get_node_id_by_public_key

    def forgetting(self, flowers: Callable[..., Any]) -> Callable[..., Any]:
        """``SqlLinkState.delete_node`` that forgets the node's key, before and after."""

        def delete_node(state: Any, owner_aid: str, node_id: int) -> None:
            self.forget(state, node_id)
            try:
                flowers(state, owner_aid, node_id)
            finally:
                self.forget(state, node_id)

        delete_node.__wrapped__ = flowers  # type: ignore[attr-defined]
        return delete_node

    def forget(self, state: Any, node_id: int) -> None:
        with self.lock:
            for key in [k for k, (n, _) in self.ids.items() if k[0] == id(state) and n == node_id]:
                del self.ids[key]


NODE_KEYS = NodeKeys()


def replace_methods(cls: type, wraps: Iterable[tuple[str, Callable[..., Any]]]) -> None:
    """Each method ``name`` of ``cls`` replaced by ``wrap(Flower's own)`` (Flower's own
    found through ``__wrapped__`` once a wrapper replaced it)."""
    for name, wrap in wraps:
        flowers = cls.__dict__[name]
        setattr(cls, name, wrap(getattr(flowers, "__wrapped__", flowers)))


def database_reads() -> None:
    """Part ``superlink-database-reads``: the database state's run status reused for
    :data:`RUN_STATUS_S` (:func:`remembered_run_status`), its node ids by public key
    remembered (:class:`NodeKeys`)."""
    replace_methods(
        importlib.import_module(SQL_STATE).SqlLinkState,
        (
            ("get_run_status", remembered_run_status),
            ("get_node_id_by_public_key", NODE_KEYS.lookup),
            ("delete_node", NODE_KEYS.forgetting),
        ),
    )


class Waiting:
    """Held polls by node: each an asyncio future on the SuperLink's event loop, woken
    (from any thread) when a message for its node is stored."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.by_node: dict[int, set[asyncio.Future[None]]] = {}
        self.states: weakref.WeakSet[Any] = weakref.WeakSet()
        """The in-memory states whose message store is :class:`NodeIndexed`."""

    def wait(self, node_id: int) -> asyncio.Future[None]:
        """A future that a message for ``node_id`` completes (on the running loop)."""
        self.loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = self.loop.create_future()
        self.by_node.setdefault(node_id, set()).add(future)
        return future

    def drop(self, node_id: int, future: asyncio.Future[None]) -> None:
        waiting = self.by_node.get(node_id)
        if waiting is not None:
            waiting.discard(future)
            if not waiting:
                del self.by_node[node_id]

    def wake(self, node_id: int) -> None:
        """A message for ``node_id`` was stored (any thread)."""
        loop = self.loop
        if loop is not None and node_id in self.by_node:
            loop.call_soon_threadsafe(self._wake, node_id)

    def _wake(self, node_id: int) -> None:
        for future in self.by_node.pop(node_id, ()):
            if not future.done():
                future.set_result(None)

    def ready(self, node_id: int) -> bool:
        """A message for ``node_id`` that is undelivered and whole, in any indexed
        state (in memory: a read without the state's lock, a wrong answer costs one
        poll; a database's: :class:`Undelivered`, which may ask the database)."""
        for state in list(self.states):
            index = UNDELIVERED.get(state)
            if index is not None:
                store = state.object_store
                if any(index.is_whole(store, key) for key in index.of(node_id)):
                    return True
                continue
            store = state.message_ins_store
            for msg_id in list(store.by_node.get(node_id, ())):
                msg = store.get(msg_id)
                if (
                    msg is not None
                    and msg.metadata.delivered_at == ""
                    and whole(state.object_store, msg_id)
                ):
                    return True
        return False


WAITING = Waiting()


OFF_LOOP_THREADS = 16
_OFF_LOOP: list[Any] = []


async def off_loop(call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)`` in one of :data:`OFF_LOOP_THREADS` worker threads of its own
    once a database state is indexed (its queries would hold up the event loop),
    else at once (dictionary reads)."""
    if not UNDELIVERED:
        return call(*args)
    if not _OFF_LOOP:
        from concurrent.futures import ThreadPoolExecutor

        _OFF_LOOP.append(ThreadPoolExecutor(OFF_LOOP_THREADS, "fedhet-off-loop"))
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_OFF_LOOP[0], functools.partial(call, *args))


def header(scope: dict, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value)
    return None


class HeldPulls:
    """An ASGI middleware that holds a node's empty poll (``x-fedhet-hold: S``) up to
    ``S`` seconds (at most ``hold_s``) until a whole message for the node is there,
    then answers with Flower's own handler (:func:`held_pulls` puts
    :class:`AnswerHeaders` around it, which offers the hold in every answer).

    Such a poll that declares a heartbeat interval (``x-fedhet-alive: I``,
    :func:`alive_interval`) is acknowledged as the node's heartbeat with that interval
    (:func:`acknowledge`) once Flower's stack has answered it with 200, i.e. has
    taken it (with SuperNode authentication on, as from that node): on its arrival,
    before it is held, and again as its answer goes out after a hold of a second or
    more (the node was on the line all along)."""

    def __init__(self, app: ASGIApp, hold_s: float) -> None:
        self.app = app
        self.hold_s = hold_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        asked = header(scope, b"x-fedhet-hold")
        if (
            scope.get("type") != "http"
            or scope.get("path") != PULL_PATH
            or asked is None
            or not WAITING.states
        ):
            await self.app(scope, receive, send)
            return
        try:
            hold = min(self.hold_s, max(0.0, float(asked)))
        except ValueError:
            hold = 0.0
        alive = declared = alive_interval(header(scope, b"x-fedhet-alive"))
        body = await read_body(receive)
        try:
            request = importlib.import_module(FLEET_PB).PullMessagesRequest
            node_id: int | None = request.FromString(body).node.node_id
        except Exception:  # noqa: BLE001 - Flower's handler answers a bad request
            node_id = None
        start = time.monotonic()
        deadline = start + hold
        recheck = RECHECK_S[0]
        gone = asyncio.ensure_future(receive())  # the node hung up (http.disconnect)
        try:
            while True:
                answer = await answered(self.app, dict(scope), body)
                if alive is not None:  # once, as Flower's stack took the poll
                    if node_id and answer.start.get("status") == 200:
                        await off_loop(acknowledge, node_id, alive)
                    alive = None
                left = deadline - time.monotonic()
                if node_id is None or left <= 0 or not answer.empty():
                    break
                if not await self._wait(node_id, left, gone):
                    if gone.done():  # nobody to answer
                        return
                    break
                # woken: a message is stored; its objects may still be on their way
                while (
                    not await off_loop(WAITING.ready, node_id)
                    and time.monotonic() + recheck < deadline
                ):
                    await asyncio.sleep(recheck)
                    recheck = min(2 * recheck, RECHECK_S[1])
                if gone.done():  # nobody to give a message to: leave it undelivered
                    return
        finally:
            hung_up = gone.done()
            gone.cancel()
        held = time.monotonic() - start
        if hung_up:  # while its answer was made: the messages in it stay undelivered
            ids = answer.message_ids()
            if ids:
                await off_loop(release, [(s, i) for s in list(WAITING.states) for i in ids])
            return
        if declared is not None and node_id and held >= 1.0 and answer.start.get("status") == 200:
            await off_loop(acknowledge, node_id, declared)  # on the line until now: again
        await answer.send(send, (b"x-fedhet-held", b"%.3f" % held))

    @staticmethod
    async def _wait(node_id: int, left: float, gone: asyncio.Future[Any]) -> bool:
        """Until a message for ``node_id`` is stored (True), ``left`` seconds passed or
        the node hung up (False)."""
        future = WAITING.wait(node_id)
        try:
            if await off_loop(WAITING.ready, node_id):  # stored (or made whole) since the answer
                return True
            await asyncio.wait({future, gone}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            return future.done() and not gone.done()
        finally:
            WAITING.drop(node_id, future)


async def read_body(receive: Any) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(chunks)


class Answer:
    """An HTTP answer the app gave, kept to be sent later."""

    def __init__(self) -> None:
        self.start: dict = {}
        self.body: list[bytes] = []

    def message_ids(self) -> list[str] | None:
        """The ids of the messages in a 200 answer to a poll; None for any other
        answer."""
        if self.start.get("status") != 200:
            return None
        try:
            pulled = importlib.import_module(FLEET_PB).PullMessagesResponse.FromString(
                b"".join(self.body)
            )
        except Exception:  # noqa: BLE001 - not a poll's answer: send it as it is
            return None
        return [msg.metadata.message_id for msg in pulled.messages_list]

    def empty(self) -> bool:
        """A 200 answer to a poll with no message in it."""
        return self.message_ids() == []

    async def send(self, send: Any, *headers: tuple[bytes, bytes]) -> None:
        await send(with_headers(self.start, headers))
        await send({"type": "http.response.body", "body": b"".join(self.body)})


async def answered(app: ASGIApp, scope: dict, body: bytes) -> Answer:
    """The app's answer to the request ``scope`` with ``body`` (kept, not sent)."""
    answer = Answer()
    given = False

    async def receive() -> dict:
        nonlocal given
        if given:
            await asyncio.Event().wait()  # the app does not read past the body
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def keep(message: dict) -> None:
        if message["type"] == "http.response.start":
            answer.start = message
        elif message["type"] == "http.response.body":
            answer.body.append(message.get("body", b""))

    await app(scope, receive, keep)
    return answer


def holds_header(hold_s: float) -> tuple[bytes, bytes]:
    """What every answer says of the hold on offer (``fedhet supernode`` asks for it)."""
    return (b"x-fedhet-holds", b"%g" % hold_s)


ALIVE_POLLS_HEADER = (b"x-fedhet-alive-polls", b"1")
"""What every answer says once a held poll can stand for a heartbeat
(:func:`alive_offer`)."""


def alive_offer() -> tuple[tuple[bytes, bytes], ...]:
    """:data:`ALIVE_POLLS_HEADER` once the SuperLink serves a state whose held polls
    it acknowledges as heartbeats (an indexed state: in memory, indexed by the first
    poll, or in a database, by its first stored message or poll); nothing before,
    and nothing when neither index applies: the nodes keep their heartbeats."""
    return (ALIVE_POLLS_HEADER,) if WAITING.states else ()


def alive_interval(text: bytes | None) -> float | None:
    """The heartbeat interval a poll declares (``x-fedhet-alive``), within Flower's
    ``[HEARTBEAT_MIN_INTERVAL, HEARTBEAT_MAX_INTERVAL]``; None: no header, or not a
    positive finite number."""
    value = number(text)
    if value is None or value <= 0:
        return None
    constant = importlib.import_module(CONSTANT)
    low, high = float(constant.HEARTBEAT_MIN_INTERVAL), float(constant.HEARTBEAT_MAX_INTERVAL)
    return min(high, max(low, value))


def acknowledge(node_id: int, interval: float) -> bool:
    """Node ``node_id``'s heartbeat with ``interval`` seconds, acknowledged in every
    indexed state (Flower's ``acknowledge_node_heartbeat``: online until now +
    ``HEARTBEAT_PATIENCE`` x ``interval``; a node it does not know: False). On the
    event loop for an in-memory state (its lock is held for a dictionary update), in
    a worker thread once a database state is indexed (:func:`off_loop`)."""
    done = False
    for state in list(WAITING.states):
        if WRITES.on and state in UNDELIVERED:
            WRITES.beat(state, node_id, interval)  # written with the next batch
            done = True
            continue
        try:
            done = bool(state.acknowledge_node_heartbeat(node_id, interval)) or done
        except Exception:  # noqa: BLE001 - not acknowledged: Flower's handler still answers
            continue
    return done


WRITES_S = 1.0
"""How often :class:`DatabaseWrites` writes what it gathered."""


class DatabaseWrites:
    """Writes of a database state that can wait a second, gathered and written
    together every :data:`WRITES_S` by a thread of their own, in one transaction per
    state (part ``superlink-database-writes``): traffic records (Flower: an update of
    the run's row for every poll, push and object moved, eight a message with its
    objects carried), summed per run; held polls' heartbeats, the latest per node.
    A batch the database refuses is kept for the next one."""

    def __init__(self, period: float = WRITES_S) -> None:
        self.period = period
        self.on = False
        self.lock = threading.Lock()
        self.traffic: dict[int, tuple[Any, dict[int, list[int]]]] = {}
        self.beats: dict[int, tuple[Any, dict[int, float]]] = {}
        self.queued: dict[int, float] = {}
        """A node whose held poll's heartbeat waits to be written: since when
        (``time.monotonic``)."""
        self.flowers: dict[str, Callable[..., Any]] = {}
        self.thread: threading.Thread | None = None

    def record(self, state: Any, run_id: int, sent: int, received: int) -> None:
        with self.lock:
            runs = self.traffic.setdefault(id(state), (state, {}))[1]
            total = runs.setdefault(run_id, [0, 0])
            total[0] += sent
            total[1] += received
        self._start()

    def beat(self, state: Any, node_id: int, interval: float) -> None:
        with self.lock:
            self.beats.setdefault(id(state), (state, {}))[1][node_id] = interval
            self.queued.setdefault(node_id, time.monotonic())
        self._start()

    def waiting_s(self, node_id: int) -> float | None:
        """How long node ``node_id``'s held-poll heartbeat has waited to be written
        (None: none waits)."""
        with self.lock:
            since = self.queued.get(node_id)
        return None if since is None else time.monotonic() - since

    def _start(self) -> None:
        if self.thread is None:
            with self.lock:
                if self.thread is None:
                    self.thread = threading.Thread(
                        target=self._run, name="fedhet-database-writes", daemon=True
                    )
                    self.thread.start()

    def _run(self) -> None:
        URGENT.set(True)  # heartbeats among them: first at the database lock
        while True:
            time.sleep(self.period)
            self.flush()

    def flush(self) -> None:
        """Write what was gathered (each state in one transaction)."""
        with self.lock:
            traffic, self.traffic = self.traffic, {}
            beats, self.beats = self.beats, {}
            queued, self.queued = self.queued, {}
        for key in set(traffic) | set(beats):
            state = (traffic.get(key) or beats[key])[0]
            runs = traffic.get(key, (state, {}))[1]
            nodes = beats.get(key, (state, {}))[1]
            try:
                with state.session():
                    for run_id, (sent, received) in runs.items():
                        try:
                            self.flowers["store_traffic"](
                                state, run_id, bytes_sent=sent, bytes_recv=received
                            )
                        except ValueError:  # the run is gone: nothing to count it on
                            continue
                    for node_id, interval in nodes.items():
                        self.flowers["acknowledge_node_heartbeat"](state, node_id, interval)
            except Exception as exc:  # noqa: BLE001 - kept for the next batch
                print(f"fedhet superlink: database writes postponed: {exc}")
                with self.lock:
                    for run_id, (sent, received) in runs.items():
                        total = self.traffic.setdefault(key, (state, {}))[1].setdefault(
                            run_id, [0, 0]
                        )
                        total[0] += sent
                        total[1] += received
                    later = self.beats.setdefault(key, (state, {}))[1]
                    for node_id, interval in nodes.items():
                        later.setdefault(node_id, interval)
                        self.queued.setdefault(node_id, queued.get(node_id, time.monotonic()))

    def traffic_recorder(self, flowers: Callable[..., Any]) -> Callable[..., Any]:
        """``SqlLinkState.store_traffic`` that checks as Flower does, then gathers."""
        self.flowers["store_traffic"] = flowers

        def store_traffic(state: Any, run_id: int, *, bytes_sent: int, bytes_recv: int) -> None:
            if bytes_sent < 0 or bytes_recv < 0:
                raise ValueError(
                    f"Negative traffic values for run {run_id}: "
                    f"bytes_sent={bytes_sent}, bytes_recv={bytes_recv}"
                )
            if bytes_sent == 0 and bytes_recv == 0:
                raise ValueError(f"Both bytes_sent and bytes_recv cannot be zero for run {run_id}")
            self.record(state, run_id, bytes_sent, bytes_recv)

        store_traffic.__wrapped__ = flowers  # type: ignore[attr-defined]
        return store_traffic


WRITES = DatabaseWrites()


def memory_online_until(state: Any, node_id: int) -> float | None:
    """Until when (a Unix time) the in-memory ``state`` holds node ``node_id`` online
    (None: a node it does not know, or one never online)."""
    return getattr(state.nodes.get(node_id), "online_until", None)


def database_online_until(state: Any, node_id: int) -> float | None:
    """The same, read from a database ``state`` (in the caller's transaction)."""
    from sqlalchemy import select

    module = importlib.import_module(SQL_STATE)
    model = module.NodeModel
    with state.session() as session:
        return session.scalar(  # type: ignore[no-any-return]
            select(model.online_until).where(model.node_id == module.uint64_to_int64(node_id))
        )


def kept_window(
    online_until: Callable[[Any, int], float | None],
    transaction: Callable[[Any], Any] = lambda state: contextlib.nullcontext(),
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A wrap of ``acknowledge_node_heartbeat`` that never shortens the window an
    earlier acknowledgement granted: the interval it records is at least what is
    left of that window (``online_until``) / ``HEARTBEAT_PATIENCE``, read and written
    in one ``transaction(state)``."""

    def wrap(flowers: Callable[..., Any]) -> Callable[..., Any]:
        def acknowledge_node_heartbeat(state: Any, node_id: int, heartbeat_interval: float) -> bool:
            patience = float(importlib.import_module(CONSTANT).HEARTBEAT_PATIENCE)
            with transaction(state):
                until = online_until(state, node_id)
                left = (until - time.time()) / patience if until else 0.0
                return bool(flowers(state, node_id, max(heartbeat_interval, left)))

        acknowledge_node_heartbeat.__wrapped__ = flowers  # type: ignore[attr-defined]
        return acknowledge_node_heartbeat

    return wrap


def kept_windows() -> None:
    """Part ``superlink-kept-windows``: a node's heartbeat (a Fleet heartbeat, or a
    held poll standing for one) never shortens the window an earlier one granted
    (:func:`kept_window`). Flower holds a node online for 2 x the interval of its
    latest acknowledgement, and fedhet's nodes declare intervals that follow the load
    (30-127 s at a thousand FedARA nodes): a later, shorter one (a held poll's,
    acknowledged in a batch after the node's heartbeat) cut the window a node was
    counting on, and the node was found unavailable, its reply dropped."""
    replace_methods(
        importlib.import_module(MEMORY_STATE).InMemoryLinkState,
        (("acknowledge_node_heartbeat", kept_window(memory_online_until)),),
    )
    replace_methods(
        importlib.import_module(SQL_STATE).SqlLinkState,
        (
            (
                "acknowledge_node_heartbeat",
                kept_window(database_online_until, lambda state: state.session()),
            ),
        ),
    )


def unavailable_logged(flowers: Callable[..., Any]) -> Callable[..., Any]:
    """Flower's ``check_node_availability_for_in_message`` (the error reply "Node
    Unavailable" for a message whose node's heartbeats are overdue), logging each
    such node with how overdue it was and whether a held poll's heartbeat of its own
    was still waiting to be written (:class:`DatabaseWrites`)."""

    def check(
        inquired_in_message_ids: Any,
        found_in_message_dict: Any,
        node_id_to_online_until: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        errors = flowers(
            inquired_in_message_ids, found_in_message_dict, node_id_to_online_until, *args,
            **kwargs,
        )  # fmt: skip
        for message_id in errors:
            node = found_in_message_dict[message_id].metadata.dst_node_id
            until = node_id_to_online_until.get(node)
            late = f"{time.time() - until:.1f} s past" if until else "never online"
            waiting = WRITES.waiting_s(node)
            print(
                f"fedhet superlink: node {node} unavailable ({late} its heartbeats' "
                f"patience); a held poll's heartbeat waiting to be written: "
                + ("none" if waiting is None else f"for {waiting:.1f} s"),
                flush=True,
            )
        return errors

    check.__wrapped__ = flowers  # type: ignore[attr-defined]
    return check


def database_writes() -> None:
    """Part ``superlink-database-writes``: the database state's traffic records and
    held polls' heartbeats written together (:class:`DatabaseWrites`), their
    transactions first at the database lock (:data:`URGENT`); a node found
    unavailable is logged (:func:`unavailable_logged`)."""
    module = importlib.import_module(SQL_STATE)
    cls = module.SqlLinkState
    replace_methods(cls, (("store_traffic", WRITES.traffic_recorder),))
    # the state's own (superlink-kept-windows' when it applies)
    WRITES.flowers["acknowledge_node_heartbeat"] = cls.__dict__["acknowledge_node_heartbeat"]
    check = gate.original(module, "check_node_availability_for_in_message")
    gate.replace(module, "check_node_availability_for_in_message", unavailable_logged(check))
    WRITES.on = True


def held_pulls(hold_s: float = HOLD_S) -> None:
    """Part ``superlink-held-pulls``: :class:`HeldPulls` in front of Flower's stack,
    every answer offering the hold (:func:`holds_header`) and, once it applies, a
    held poll as a heartbeat (:func:`alive_offer`)."""
    from starlette.middleware import Middleware

    in_front(
        [
            Middleware(AnswerHeaders, holds_header(hold_s), offered=alive_offer),
            Middleware(HeldPulls, hold_s),
        ]
    )


class InFlight:
    """The bytes of objects that the answers being made and sent hold now, for the
    whole SuperLink (``FEDHET_CARRY_INFLIGHT_MB``). A thousand held polls answered at
    once, each carrying its node's message, would otherwise hold a thousand messages
    at once (and their copies in the framed answers): an answer that finds the
    budget spent carries what fits, and its node pulls the rest one request each."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0
        self.lock = threading.Lock()
        self.peak = 0
        self.refused = 0
        """Objects not carried because the budget was spent (a diagnostic)."""

    def take(self, size: int) -> bool:
        with self.lock:
            if self.used + size > self.limit:
                self.refused += 1
                return False
            self.used += size
            self.peak = max(self.peak, self.used)
            return True

    def give(self, size: int) -> None:
        with self.lock:
            self.used -= size


class Incoming:
    """The bytes of carried pushes read and not yet stored, for the whole SuperLink
    (the same ``FEDHET_CARRY_INFLIGHT_MB``; 0: no bound): a push that would go over it waits,
    unread, until earlier ones are stored (a push alone always goes). Three hundred
    FedARA replies pushed at once otherwise all sat in the SuperLink's memory, each
    read whole and split into its objects, while its handler waited for its turn at
    the database. The wait is asynchronous: no thread is held."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used, self.peak, self.waits = limit, 0, 0, 0
        self._changed: asyncio.Condition | None = None

    def _fits(self, size: int) -> bool:
        return self.limit <= 0 or self.used == 0 or self.used + size <= self.limit

    async def enter(self, size: int) -> None:
        if self._changed is None:  # made in the server's loop
            self._changed = asyncio.Condition()
        async with self._changed:
            if not self._fits(size):
                self.waits += 1
                await self._changed.wait_for(lambda: self._fits(size))
            self.used += size
            self.peak = max(self.peak, self.used)

    async def leave(self, size: int) -> None:
        assert self._changed is not None
        async with self._changed:
            self.used -= size
            self._changed.notify_all()


INFLIGHT = InFlight(int(carry.INFLIGHT_MB * 2**20))
INCOMING = Incoming(int(carry.INFLIGHT_MB * 2**20))
"""Both limits are set from ``FEDHET_CARRY_INFLIGHT_MB`` when the SuperLink starts."""


class Box:
    """What one request carries in (a push's objects) and out (a poll's)."""

    def __init__(
        self,
        budget: int = 0,
        incoming: dict[str, bytes] | None = None,
        inflight: InFlight | None = None,
    ) -> None:
        self.left = budget
        self.out: list[tuple[str, bytes]] = []
        self.incoming = incoming or {}
        self.inflight, self.taken = inflight, 0

    def add(self, object_id: str, content: bytes) -> bool:
        """``content`` carried out, if it fits what is left of the budget (and of
        the SuperLink's :class:`InFlight` budget)."""
        if len(content) > self.left or (
            self.inflight is not None and not self.inflight.take(len(content))
        ):
            self.left = 0
            return False
        self.taken += len(content) if self.inflight is not None else 0
        self.left -= len(content)
        self.out.append((object_id, content))
        return True

    def release(self) -> None:
        """The answer is sent: what it carried leaves the in-flight budget."""
        self.out = []
        if self.inflight is not None and self.taken:
            self.inflight.give(self.taken)
            self.taken = 0


BOX: contextvars.ContextVar[Box | None] = contextvars.ContextVar("fedhet_carry", default=None)
"""The request's :class:`Box`, set by :class:`CarriedObjects` (the handlers run in a
copy of the request's context: the same box)."""


ARRIVAL_WAIT_S = 5.0
"""The longest a poll's answer waits for an object a push is storing meanwhile."""


class Arrivals:
    """The ids pushes are storing now. :data:`ARRIVALS`: the objects their requests
    carried, from before Flower's handler stores the message until each is stored; a
    poll that answers with the message meanwhile (the ServerApp's, woken or timed by
    the reply) waits for them instead of leaving its client to ask for each
    (:func:`carried_out`). :attr:`Undelivered.arriving`: the messages of the
    ServerApp's carried pushes, not whole meanwhile (:func:`runtime_pushes_carried`)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._ids: dict[str, int] = {}

    @contextlib.contextmanager
    def storing(self, object_ids: Iterable[str]) -> Iterator[None]:
        """``object_ids`` are arriving while the block runs."""
        ids = list(object_ids)
        with self._changed:
            for object_id in ids:
                self._ids[object_id] = self._ids.get(object_id, 0) + 1
        try:
            yield
        finally:
            with self._changed:
                for object_id in ids:
                    self._ids[object_id] -= 1
                    if not self._ids[object_id]:
                        del self._ids[object_id]
                self._changed.notify_all()

    def __contains__(self, key: str) -> bool:
        with self._changed:
            return key in self._ids

    def wait(self, object_id: str, timeout: float) -> bool:
        """Wait up to ``timeout`` while ``object_id`` is arriving; whether it was."""
        with self._changed:
            if object_id not in self._ids:
                return False
            self._changed.wait_for(lambda: object_id not in self._ids, timeout)
            return True


ARRIVALS = Arrivals()


class CarriedObjects:
    """An ASGI middleware: a poll (Fleet or Runtime) that asks (:data:`carry.ASK`) has
    its messages' objects, which the wrapped handler put in the request's
    :class:`Box`, framed after the answer's protobuf (:func:`carry.frame`); a Fleet
    push that carries objects (:data:`carry.CARRIED`) reaches Flower's stack as its
    protobuf alone, its objects in the box. Every answer names :data:`carry.OFFER`."""

    confirms = False
    """Confirmations are taken along (part ``superlink-carried-confirmations``):
    every answer names :data:`carry.CONFIRMS`, and a confirmation's
    :data:`carry.CONFIRMED` ids reach its handler (:data:`CONFIRMING`)."""

    def __init__(self, app: ASGIApp, budget: int) -> None:
        self.app = app
        self.budget = budget

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path")
        offers: tuple[tuple[bytes, bytes], ...] = ((carry.OFFER.encode(), b"1"),)
        if self.confirms:
            offers = (*offers, (carry.CONFIRMS.encode(), b"1"))
            text = header(scope, carry.CONFIRMED.encode())
            if text and path in CONFIRMING_PATHS:
                ids = confirmed_ids(text)
                if ids is None:
                    detail = (
                        f"{carry.CONFIRMED}: at most {carry.CONFIRMED_MAX} comma-separated "
                        "object ids (64 hexadecimal digits) expected"
                    )
                    await refused(send, detail, offers)
                    return
                token = CONFIRMING.set(ids)
                try:
                    await self._route(scope, receive, send, path, offers)
                finally:
                    CONFIRMING.reset(token)
                return
        await self._route(scope, receive, send, path, offers)

    async def _route(self, scope: dict, receive: Any, send: Any, path: Any, offers: tuple) -> None:
        if (
            path in (carry.FLEET_PULL, carry.RUNTIME_PULL)
            and header(scope, carry.ASK.encode()) == b"1"
        ):
            await self._pull(scope, receive, send, offers)
            return
        length = header(scope, carry.CARRIED.encode())
        if path in (carry.FLEET_PUSH, carry.RUNTIME_PUSH) and length is not None:
            await self._push(scope, receive, send, length, offers)
            return

        await self.app(scope, receive, starting_with(send, offers))

    async def _pull(self, scope: dict, receive: Any, send: Any, offers: tuple) -> None:
        box = Box(self.budget, inflight=INFLIGHT)
        start: dict = {}
        chunks: list[bytes] = []

        async def capture(message: dict) -> None:
            nonlocal start
            if message.get("type") == "http.response.start":
                start = message
                return
            if message.get("type") != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            proto = b"".join(chunks)
            headers: tuple = offers
            body = proto
            if start.get("status") == 200 and box.out:
                body = carry.frame(proto, box.out)
                box.out = []  # framed: the objects are the body's bytes now, not twice
                headers = (*offers, (carry.CARRIED.encode(), b"%d" % len(proto)))
            kept = [h for h in start.get("headers", ()) if h[0].lower() != b"content-length"]
            await send(
                with_headers(
                    {**start, "headers": kept}, (*headers, (b"content-length", b"%d" % len(body)))
                )
            )
            await send({"type": "http.response.body", "body": body})

        token = BOX.set(box)
        try:
            await self.app(scope, receive, capture)
        finally:
            BOX.reset(token)
            box.release()

    async def _push(
        self, scope: dict, receive: Any, send: Any, length: bytes, offers: tuple
    ) -> None:
        text = header(scope, b"content-length") or b""
        size = int(text) if text.isdigit() else INCOMING.limit
        await INCOMING.enter(size)
        try:
            await self._store_pushed(scope, receive, send, length, offers)
        finally:
            await INCOMING.leave(size)

    async def _store_pushed(
        self, scope: dict, receive: Any, send: Any, length: bytes, offers: tuple
    ) -> None:
        body = await read_body(receive)
        try:
            proto, objects = carry.unframe(body, int(length))
        except ValueError as exc:
            await refused(send, str(exc), offers)
            return
        del body  # the objects are copies: the body need not be held while they are stored
        skip = (b"content-length", carry.CARRIED.encode())
        headers = [h for h in scope.get("headers", ()) if h[0].lower() not in skip]
        inner = {**scope, "headers": [*headers, (b"content-length", b"%d" % len(proto))]}
        given = False

        async def replay() -> dict:
            nonlocal given
            if given:
                return await receive()
            given = True
            return {"type": "http.request", "body": proto, "more_body": False}

        token = BOX.set(Box(incoming=objects))
        try:
            await self.app(inner, replay, starting_with(send, offers))
        finally:
            BOX.reset(token)


async def refused(send: Any, detail: str, offers: tuple) -> None:
    """A 400 answer naming ``detail``."""
    text = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 400,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(text)),
                *offers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": text})


OBJECT_ID = re.compile(r"[0-9a-f]{64}")
"""A Flower object id (SHA-256, hexadecimal)."""

CONFIRMING_PATHS = (carry.FLEET_CONFIRM, carry.RUNTIME_CONFIRM, carry.FLEET_PUSH)
"""The requests whose :data:`carry.CONFIRMED` header confirms messages: a
confirmation (node or ServerApp) and a node's push of its reply."""


def confirmed_ids(text: bytes) -> tuple[str, ...] | None:
    """The object ids a :data:`carry.CONFIRMED` header names (None: not such a list,
    or more than :data:`carry.CONFIRMED_MAX`)."""
    ids = tuple(text.decode("latin-1").split(","))
    if len(ids) > carry.CONFIRMED_MAX or not all(OBJECT_ID.fullmatch(i) for i in ids):
        return None
    return ids


CONFIRMING: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "fedhet_confirming", default=()
)
"""The further messages a confirmation request confirms (:data:`carry.CONFIRMED`)."""


def confirming_along(flowers: Callable[..., Any]) -> Callable[..., Any]:
    """Flower's ``confirm_message_received(request, state, store_or_task)`` (Fleet or
    Runtime) that also confirms, with the same handler and the same caller, each
    further message the request's :data:`carry.CONFIRMED` names."""

    def confirm_message_received(request: Any, *args: Any, **kwargs: Any) -> Any:
        response = flowers(request, *args, **kwargs)
        for message_id in CONFIRMING.get():
            more = type(request)()
            more.CopyFrom(request)
            more.message_object_id = message_id
            flowers(more, *args, **kwargs)
        return response

    confirm_message_received.__wrapped__ = flowers  # type: ignore[attr-defined]
    return confirm_message_received


def pushes_confirming(flowers: Callable[..., Any]) -> Callable[..., Any]:
    """Flower's Fleet ``push_messages(request, state)`` (a node's reply) that then
    confirms, with Flower's Fleet confirmation handler as that node, each message
    the request's :data:`carry.CONFIRMED` names (the one the reply answers: the
    node's own confirmation spared)."""
    handlers = importlib.import_module(FLEET_HANDLERS)
    message_pb = importlib.import_module(MESSAGE_PB)

    def push_messages(request: Any, state: Any) -> Any:
        response = flowers(request=request, state=state)
        ids = CONFIRMING.get()
        if ids and request.messages_list:
            confirm = gate.original(handlers, "confirm_message_received")
            run_id = request.messages_list[0].metadata.run_id
            for message_id in ids:
                asked = message_pb.ConfirmMessageReceivedRequest(
                    node=request.node, run_id=run_id, message_object_id=message_id
                )
                try:
                    confirm(asked, state=state, store=state.object_store)
                except Exception as exc:  # noqa: BLE001 - cleanup: the reply is stored
                    print(
                        f"fedhet superlink: node {request.node.node_id}'s reply push could "
                        f"not confirm message {message_id}: {exc!r} (its objects stay "
                        "until the run's are deleted)"
                    )
        return response

    push_messages.__wrapped__ = flowers  # type: ignore[attr-defined]
    return push_messages


def carried_confirmations() -> None:
    """Part ``superlink-carried-confirmations``: :class:`CarriedObjects` offers it,
    Flower's Fleet and Runtime confirmation handlers confirm what a request names, and
    so does a node's push of its reply."""
    for name in (FLEET_HANDLERS, RUNTIME_HANDLERS):
        module = importlib.import_module(name)
        gate.replace(
            module,
            "confirm_message_received",
            confirming_along(gate.original(module, "confirm_message_received")),
        )
    fleet = importlib.import_module(FLEET_HANDLERS)
    gate.replace(fleet, "push_messages", pushes_confirming(fleet.push_messages))
    CarriedObjects.confirms = True


def carried_out(
    box: Box,
    tree: Any,
    pull: Callable[[Any], Any],
    node: Any,
    run_id: int,
    arrivals: Arrivals = ARRIVALS,
    wait_s: float = ARRIVAL_WAIT_S,
) -> bool:
    """Each object of the message ``tree`` put in ``box``, read by Flower's
    ``pull_object`` handler (``pull(request)``) as ``node`` of run ``run_id`` would ask
    for it (one a push is storing meanwhile read once it is stored, ``wait_s`` at
    most an answer); False once the box's budget is spent."""
    message_pb = importlib.import_module(MESSAGE_PB)
    deadline = time.monotonic() + wait_s
    for item in importlib.import_module(INFLATABLE).iterate_object_tree(tree):
        request = message_pb.PullObjectRequest(node=node, run_id=run_id, object_id=item.object_id)
        got = pull(request)
        left = deadline - time.monotonic()
        if not got.object_available and left > 0 and arrivals.wait(item.object_id, left):
            got = pull(request)
        if got.object_available and not box.add(item.object_id, got.object_content):
            return False
    return True


def stored_carried(
    respond: Callable[[], Any], box: Box, push: Callable[[Any], Any], node: Any, run_id: int
) -> Any:
    """Flower's answer to a push (``respond()``), with each object it asks for that
    the request carried stored by Flower's ``push_object`` handler (``push(request)``)
    as ``node`` of run ``run_id`` would push it; the answer then asks for the others
    only (an object the handler refuses stays asked for: the client pushes it and
    meets the error). The carried objects are :data:`ARRIVALS` from before Flower
    stores the message until they are stored."""
    message_pb = importlib.import_module(MESSAGE_PB)
    with ARRIVALS.storing(box.incoming):
        response = respond()
        wanted = []
        errors: list[Exception] = []
        for object_id in response.objects_to_push:
            content = box.incoming.get(object_id)
            stored = False
            if content is not None:
                request = message_pb.PushObjectRequest(
                    node=node,
                    run_id=run_id,
                    object_id=object_id,
                    object_content=content,
                    session_id=response.session_id,
                )
                try:
                    stored = bool(push(request).stored)
                except Exception as exc:  # noqa: BLE001 - the client pushes it itself: Flower's error
                    stored = False
                    errors.append(exc)
            if not stored:
                wanted.append(object_id)
    if wanted:
        carried = sum(key in box.incoming for key in wanted)
        print(
            f"fedhet superlink: a carried push leaves {len(wanted)} of "
            f"{len(response.objects_to_push)} object(s) to its client "
            f"({carried} carried but not stored, {len(errors)} of them refused with an "
            f"error{f', the first: {errors[0]!r}' if errors else ''}; "
            f"{len(wanted) - carried} not carried)"
        )
    del response.objects_to_push[:]
    response.objects_to_push.extend(wanted)
    return response


def superlink_node() -> Any:
    """The node a ServerApp's Runtime requests name (Flower's ``SUPERLINK_NODE_ID``)."""
    node_pb = importlib.import_module("flwr.proto.node_pb2")
    return node_pb.Node(node_id=importlib.import_module(CONSTANT).SUPERLINK_NODE_ID)


def fleet_pulls_carrying(flowers: Callable[..., Any]) -> Callable[..., Any]:
    """Flower's Fleet ``pull_messages`` that puts each object of the messages it
    answers with in the request's :class:`Box` (read by Flower's ``pull_object``)."""
    handlers = importlib.import_module(FLEET_HANDLERS)

    def pull_messages(request: Any, state: Any, store: Any) -> Any:
        response = flowers(request=request, state=state, store=store)
        box = BOX.get()
        if box is not None:
            pull = functools.partial(handlers.pull_object, state=state)
            for message, tree in zip(
                response.messages_list, response.message_object_trees, strict=False
            ):
                if not carried_out(box, tree, pull, request.node, message.metadata.run_id):
                    break
        return response

    pull_messages.__wrapped__ = flowers  # type: ignore[attr-defined]
    return pull_messages


def runtime_pulls_carrying(flowers: Callable[..., Any]) -> Callable[..., Any]:
    """Flower's Runtime ``pull_messages`` (the ServerApp's pull of replies) that puts
    each object of the replies it answers with in the request's :class:`Box` (read
    by Flower's Runtime ``pull_object``, as the ServerApp's own request would)."""
    handlers = importlib.import_module(RUNTIME_HANDLERS)

    def pull_messages(request: Any, state: Any, task: Any) -> Any:
        response = flowers(request, state, task)
        box = BOX.get()
        if box is not None:
            node = superlink_node()
            pull = functools.partial(handlers.pull_object, state=state, task=task)
            for tree in response.message_object_trees:
                if not carried_out(box, tree, pull, node, task.run_id):
                    break
        return response

    pull_messages.__wrapped__ = flowers  # type: ignore[attr-defined]
    return pull_messages


def fleet_pushes_carried(flowers: Callable[..., Any]) -> Callable[..., Any]:
    """Flower's Fleet ``push_messages`` that stores each object the answer asks for
    and the request carried (in its :class:`Box`) with Flower's ``push_object``, and
    asks for the rest only."""
    handlers = importlib.import_module(FLEET_HANDLERS)

    def push_messages(request: Any, state: Any) -> Any:
        respond = functools.partial(flowers, request=request, state=state)
        box = BOX.get()
        if box is None or not box.incoming or not request.messages_list:
            return respond()
        push = functools.partial(handlers.push_object, state=state)
        run_id = request.messages_list[0].metadata.run_id
        return stored_carried(respond, box, push, request.node, run_id)

    push_messages.__wrapped__ = flowers  # type: ignore[attr-defined]
    return push_messages


def runtime_pushes_carried(flowers: Callable[..., Any]) -> Callable[..., Any]:
    """Flower's Runtime ``push_messages`` (the ServerApp's push of instructions) that
    stores each object the answer asks for and the request carried with Flower's
    Runtime ``push_object``, and asks for the rest only."""
    handlers = importlib.import_module(RUNTIME_HANDLERS)

    def push_messages(request: Any, state: Any, task: Any) -> Any:
        respond = functools.partial(flowers, request, state, task)
        box = BOX.get()
        if box is None or not box.incoming:
            return respond()
        push = functools.partial(handlers.push_object, state=state, task=task)
        keys = [msg.metadata.message_id for msg in request.messages_list]
        with contextlib.ExitStack() as marks:
            for index in list(UNDELIVERED.values()):
                marks.enter_context(index.arriving.storing(keys))
            response = stored_carried(respond, box, push, superlink_node(), task.run_id)
            learn_wholeness(request, response)
        return response

    push_messages.__wrapped__ = flowers  # type: ignore[attr-defined]
    return push_messages


def learn_wholeness(request: Any, response: Any) -> None:
    """After a carried push of the ServerApp's messages: each message none of whose
    objects its answer asks for is whole (:func:`made_whole`); each other one is
    expected whole once those arrive (:meth:`Undelivered.expect`)."""
    if not UNDELIVERED:
        return
    iterate = importlib.import_module(INFLATABLE).iterate_object_tree
    wanted = set(response.objects_to_push)
    whole_now = []
    for msg, tree, key in zip(
        request.messages_list, request.message_object_trees, response.message_ids, strict=False
    ):
        if not key:
            continue
        missing = {node.object_id for node in iterate(tree)} & wanted
        if not missing:
            whole_now.append((msg.metadata.dst_node_id, key))
            continue
        for index in list(UNDELIVERED.values()):
            index.expect(msg.metadata.dst_node_id, key, missing)
    made_whole(whole_now)


def objects_pushed(flowers: Callable[..., Any]) -> Callable[..., Any]:
    """Flower's Runtime ``push_object`` (an object the ServerApp pushes itself) that
    tells each database state's :class:`Undelivered` it arrived, and wakes the held
    polls of the messages it made whole."""

    def push_object(request: Any, state: Any, task: Any) -> Any:
        response = flowers(request, state, task)
        if response.stored:
            for index in list(UNDELIVERED.values()):
                for node_id, _ in index.arrived(request.object_id):
                    WAITING.wake(node_id)
        return response

    push_object.__wrapped__ = flowers  # type: ignore[attr-defined]
    return push_object


def made_whole(messages: Iterable[tuple[int, str]]) -> None:
    """Messages ``(node, id)`` whose objects a carried push has all stored: whole in
    each database state's :class:`Undelivered` (no query to learn it) and their
    nodes' held polls woken again."""
    messages = list(messages)
    for index in list(UNDELIVERED.values()):
        with index.lock:
            index.whole.update(key for _, key in messages)
    for node_id, _ in messages:
        WAITING.wake(node_id)


def carried_objects(budget: int) -> None:
    """Part ``superlink-carried-objects``: :class:`CarriedObjects` in front of
    Flower's stack, Flower's poll and push handlers wrapped to fill and empty its
    box."""
    from starlette.middleware import Middleware

    fleet = importlib.import_module(FLEET_HANDLERS)
    runtime = importlib.import_module(RUNTIME_HANDLERS)
    gate.replace(
        fleet, "pull_messages", fleet_pulls_carrying(gate.original(fleet, "pull_messages"))
    )
    gate.replace(
        fleet, "push_messages", fleet_pushes_carried(gate.original(fleet, "push_messages"))
    )
    gate.replace(
        runtime, "pull_messages", runtime_pulls_carrying(gate.original(runtime, "pull_messages"))
    )
    gate.replace(
        runtime, "push_messages", runtime_pushes_carried(gate.original(runtime, "push_messages"))
    )
    in_front([Middleware(CarriedObjects, budget)])


def in_front(middleware: list[Any]) -> None:
    """The SuperLink app built with ``middleware`` outside the stack it has now
    (Flower's, or one a part changed already)."""
    main = importlib.import_module(MIDDLEWARE)
    current = main._get_middleware
    gate.replace(main, "_get_middleware", lambda: [*middleware, *current()])


def indexed_message_pulls(whole_only: bool = False) -> None:
    """Part ``superlink-node-index``: the in-memory state finds a node's messages by
    its index (:func:`indexed_get_message_ins`); with part
    ``superlink-whole-messages`` (``whole_only``), only messages that have all their
    objects."""
    replace_methods(
        importlib.import_module(MEMORY_STATE).InMemoryLinkState,
        (("get_message_ins", functools.partial(indexed_get_message_ins, whole_only=whole_only)),),
    )


BUSY_S = 20.0
"""How long a database request waits for SQLite's lock held by another process
(Flower: 5 s)."""

URGENT: contextvars.ContextVar[bool] = contextvars.ContextVar("fedhet_urgent", default=False)
"""Set for a request that goes first (part ``superlink-urgent-first``): in its
threads and at :data:`DATABASE_LOCK`."""


class TurnLock:
    """A re-entrant lock handed over in turns: to the thread that waited longest,
    an urgent waiter (:data:`URGENT` when it asked) before every other. A thread
    that waits blocks on an event of its own; the holder that lets go hands the lock
    to the next one (no wake of every waiter, no race to take it)."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._owner: int | None = None
        self._depth = 0
        self._queues: tuple[list[tuple[threading.Event, int]], ...] = ([], [])
        self._since = 0.0
        self.longest: list[tuple[float, str]] = []
        """The longest turns (a diagnostic): seconds held, what held it (the state's
        method that opened the transaction), at most :data:`LONGEST_TURNS`."""

    def acquire(self, urgent: bool = False) -> None:
        me = threading.get_ident()
        with self._mutex:
            if self._owner == me or self._owner is None:
                if self._owner is None:
                    self._since = time.monotonic()
                self._owner, self._depth = me, self._depth + 1
                return
            turn = threading.Event()
            self._queues[0 if urgent else 1].append((turn, me))
        turn.wait()  # the lock is ours once set (see release)

    def release(self) -> None:
        with self._mutex:
            if self._owner != threading.get_ident():
                raise RuntimeError("TurnLock released by a thread that does not hold it")
            self._depth -= 1
            if self._depth:
                return
            now = time.monotonic()
            held = now - self._since
            if len(self.longest) < LONGEST_TURNS or held > self.longest[-1][0]:
                self.longest = sorted([*self.longest, (held, holder())], reverse=True)[
                    :LONGEST_TURNS
                ]
            queue = self._queues[0] or self._queues[1]
            if not queue:
                self._owner = None
                return
            turn, self._owner = queue.pop(0)
            self._depth, self._since = 1, now
        turn.set()

    @contextlib.contextmanager
    def held(self, urgent: bool = False) -> Iterator[None]:
        self.acquire(urgent)
        try:
            yield
        finally:
            self.release()


LONGEST_TURNS = 10


def holder() -> str:
    """The state's method (Flower's, or fedhet's) whose transaction ends here: the
    outermost frame of this thread in a state or object store class."""
    frame, found = sys._getframe(2), "?"
    while frame is not None:
        owner = frame.f_locals.get("self")
        name = type(owner).__name__ if owner is not None else ""
        if name.endswith(("State", "Store", "Writes")):
            found = f"{name}.{frame.f_code.co_name}"
        frame = frame.f_back  # type: ignore[assignment]
    return found


DATABASE_LOCK = TurnLock()
"""One database transaction at a time in the SuperLink, in turns, urgent requests'
first (part ``superlink-database-lock``)."""


def locked_session(flowers: Callable[..., Any]) -> Callable[..., Any]:
    """``SqlMixin.session`` that holds :data:`DATABASE_LOCK` for the whole outermost
    transaction (re-entrant: a nested session of the same thread goes on); an
    :data:`URGENT` request's turn comes before the others'."""

    @contextlib.contextmanager
    def session(self: Any) -> Iterator[Any]:
        with DATABASE_LOCK.held(URGENT.get()), flowers(self) as opened:
            yield opened

    session.__wrapped__ = flowers  # type: ignore[attr-defined]
    session.flowers = flowers  # type: ignore[attr-defined]
    return session


def database_lock(seconds: float = BUSY_S) -> None:
    """Part ``superlink-database-lock``: the SuperLink's threads take turns at the
    database (:func:`locked_session`), each transaction whole, so SQLite never finds
    its lock taken by another thread of the SuperLink; its connections wait up to
    ``seconds`` for a lock another process holds (``PRAGMA busy_timeout``). Flower's
    threads meet at SQLite's lock, which a waiting one polls (sleeps of up to 0.1 s)
    for 5 s before its request fails with ``database is locked``: at a thousand
    nodes on two cores, a traffic record after a claim did, and the claimed message
    was lost; a transaction that reads, then writes after another committed, fails
    at once."""
    mixin = importlib.import_module(SQL_MIXIN)
    pragmas = tuple(
        (name, str(int(seconds * 1000)) if name == "busy_timeout" else value)
        for name, value in gate.original(mixin, "SQLITE_PRAGMAS")
    )
    gate.replace(mixin, "SQLITE_PRAGMAS", pragmas)
    cls = mixin.SqlMixin
    flowers = cls.__dict__["session"]
    flowers = getattr(flowers, "flowers", flowers)  # Flower's own, once replaced
    cls.session = locked_session(flowers)


URGENT_PATHS = ("/v1/runtime/send-task-heartbeat", "/v1/fleet/send-node-heartbeat")
"""The requests that go first (part ``superlink-urgent-first``): the heartbeats. A
task heartbeat answered later than Flower's patience (2 x 30 s from the last one)
ends the ServerApp's task, a node's makes it unavailable for the round."""
URGENT_THREADS = 4
_URGENT_POOL: list[Any] = []
THREADPOOL_USERS = (
    "fastapi.routing",
    "fastapi.dependencies.utils",
    "flwr.supercore.protobuf.routing",
    "flwr.superlink.routers.fleet.node_auth",
    "flwr.superlink.routers.fleet.middlewares",
    "flwr.superlink.routers.control.middlewares",
    "flwr.supercore.routers.runtime.responses",
)
"""The modules that run a request's blocking work (a route, a dependency, Flower's
protobuf routes, its node authentication, its middlewares) through Starlette's
``run_in_threadpool``, each given :func:`urgent_first_threads`'."""


class Urgent:
    """An ASGI middleware that marks the requests to :data:`URGENT_PATHS` urgent."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") == "http" and scope.get("path") in URGENT_PATHS:
            token = URGENT.set(True)
            try:
                await self.app(scope, receive, send)
            finally:
                URGENT.reset(token)
        else:
            await self.app(scope, receive, send)


def urgent_first_threads(flowers: Callable[..., Any]) -> Callable[..., Any]:
    """Starlette's ``run_in_threadpool`` (a handler or dependency that is not a
    coroutine, run in one of 40 worker threads taken in turn by every request) that
    runs an :data:`URGENT` request's in one of :data:`URGENT_THREADS` threads of its
    own instead."""

    async def run_in_threadpool(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not URGENT.get():
            return await flowers(func, *args, **kwargs)
        if not _URGENT_POOL:
            from concurrent.futures import ThreadPoolExecutor

            _URGENT_POOL.append(ThreadPoolExecutor(URGENT_THREADS, "fedhet-urgent"))
        call = functools.partial(contextvars.copy_context().run, func, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(_URGENT_POOL[0], call)

    run_in_threadpool.flowers = flowers  # type: ignore[attr-defined]
    return run_in_threadpool


def urgent_first() -> None:
    """Part ``superlink-urgent-first``: the heartbeats (:data:`URGENT_PATHS`) are
    answered ahead of the rest: in threads of their own (:func:`urgent_first_threads`),
    and, with part ``superlink-database-lock``, first at the database lock
    (:class:`TurnLock`). Flower's go in the queue with every other request: at a
    thousand FedARA nodes with the state in a database, task heartbeats waited up to
    41 s for their answer, node heartbeats 18 s (median), and the SuperLink ended the
    ServerApp's task ("No heartbeat received from the task")."""
    from starlette.middleware import Middleware

    for name in THREADPOOL_USERS:
        module = importlib.import_module(name)
        flowers = gate.original(module, "run_in_threadpool")
        gate.replace(module, "run_in_threadpool", urgent_first_threads(flowers))
    in_front([Middleware(Urgent)])


def released_claims() -> None:
    """Part ``superlink-released-claims``: Flower's Fleet ``pull_messages``, as the
    parts before wrapped it, releases what it claimed when it fails
    (:func:`released_on_failure`); a held poll whose node hung up releases what its
    answer held (:class:`HeldPulls`)."""
    fleet = importlib.import_module(FLEET_HANDLERS)
    gate.replace(fleet, "pull_messages", released_on_failure(fleet.pull_messages))


def database_message_pulls(whole_only: bool = False) -> None:
    """Part ``superlink-database-index``: the database state keeps its undelivered
    messages by node in memory too (:class:`Undelivered`): a poll for a node with
    none leaves the database alone (:func:`database_get_message_ins`); with part
    ``superlink-whole-messages`` (``whole_only``), a message is returned only once
    it has all its objects."""
    runtime = importlib.import_module(RUNTIME_HANDLERS)
    gate.replace(runtime, "push_object", objects_pushed(runtime.push_object))
    replace_methods(
        importlib.import_module(SQL_STATE).SqlLinkState,
        (
            ("store_message_ins", indexed_store_message_ins),
            ("get_message_ins", functools.partial(database_get_message_ins, whole_only=whole_only)),
        ),
    )


def env_seconds(name: str, default: float, low: float, high: float, whole: bool = False) -> float:
    """Environment variable ``name``: seconds from ``low`` to ``high`` (``whole``: a
    whole number), else ``default``; any other value stops with one line naming it."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(int(text)) if whole else float(text)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        kind = "whole seconds" if whole else "seconds"
        raise SystemExit(f"{name}={text!r}: give {kind} from {low:g} to {high:g}")
    return value


def keep_alive_s() -> int:
    """``FEDHET_KEEPALIVE_S`` (whole seconds, 1 to :data:`KEEPALIVE_MAX_S`), else
    :data:`KEEPALIVE_S`."""
    return int(env_seconds("FEDHET_KEEPALIVE_S", KEEPALIVE_S, 1, KEEPALIVE_MAX_S, whole=True))


def hold_s() -> float:
    """``FEDHET_HOLD_S`` (seconds, 0 to :data:`HOLD_MAX_S`; 0: never hold), else
    :data:`HOLD_S`."""
    return env_seconds("FEDHET_HOLD_S", HOLD_S, 0, HOLD_MAX_S)


def with_headers(start: dict, headers: Any) -> dict:
    """An ASGI ``http.response.start`` message with ``headers`` added."""
    return {**start, "headers": [*start.get("headers", ()), *headers]}


def starting_with(send: Any, headers: Any) -> Callable[[dict], Any]:
    """An ASGI ``send`` that adds ``headers`` to the answer's start."""

    async def sending(message: dict) -> None:
        if message.get("type") == "http.response.start":
            message = with_headers(message, headers)
        await send(message)

    return sending


class AnswerHeaders:
    """An ASGI middleware that adds ``headers`` to every HTTP answer, and those
    ``offered()`` names as the answer starts."""

    def __init__(
        self,
        app: ASGIApp,
        *headers: tuple[bytes, bytes],
        offered: Callable[[], tuple[tuple[bytes, bytes], ...]] | None = None,
    ) -> None:
        self.app = app
        self.headers = headers
        self.offered = offered

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return

        async def sending(message: dict) -> None:
            if message.get("type") == "http.response.start":
                more = self.offered() if self.offered is not None else ()
                message = with_headers(message, (*self.headers, *more))
            await send(message)

        await self.app(scope, receive, sending)


def keep_alive_header(seconds: int) -> tuple[bytes, bytes]:
    """What the SuperLink does with an idle connection (RFC 9112 appendix C)."""
    return (b"keep-alive", b"timeout=%d" % seconds)


def keep_alive(seconds: int) -> None:
    """Part ``superlink-keep-alive``: uvicorn started with ``timeout_keep_alive`` =
    ``seconds`` (unless Flower sets one), every answer saying so
    (:func:`keep_alive_header`)."""
    from starlette.middleware import Middleware

    uvicorn = importlib.import_module(FLOWER_CLI).uvicorn
    run = gate.original(uvicorn, "run")

    def run_kept(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("timeout_keep_alive", seconds)
        return run(*args, **kwargs)

    gate.replace(uvicorn, "run", run_kept)
    in_front([Middleware(AnswerHeaders, keep_alive_header(seconds))])


def run_superlink(argv: list[str], outermost: list[Any] | None = None) -> None:
    """Apply the parts that fit, then Flower's ``flower-superlink`` with ``argv``;
    ``outermost``: middleware in front of all the parts' (a benchmark's request
    counter sees each HTTP request once, not a held poll's answers to its wakes)."""
    gate.use("superlink-entry")
    # a bad value stops here, before anything starts
    seconds, hold, budget = keep_alive_s(), hold_s(), carry.budget()
    INFLIGHT.limit = INCOMING.limit = carry.inflight_budget()
    heap.start_trimmer()
    if gate.use("superlink-fleet-path"):
        fleet_path_middleware()
    memory, database = gate.use("superlink-node-index"), gate.use("superlink-database-index")
    if memory:
        indexed_message_pulls(gate.use("superlink-whole-messages"))
    if database:
        database_message_pulls(gate.use("superlink-whole-messages"))
    if gate.use("superlink-database-reads"):
        database_reads()
    if gate.use("superlink-database-lock"):
        database_lock()
    if gate.use("superlink-kept-windows"):
        kept_windows()
    if database and gate.use("superlink-database-writes"):
        database_writes()
    if gate.use("superlink-keep-alive"):
        keep_alive(seconds)
    if hold > 0 and (memory or database) and gate.use("superlink-held-pulls"):
        held_pulls(hold)
    if budget > 0 and gate.use("superlink-carried-objects"):
        carried_objects(budget)
        if gate.use("superlink-carried-confirmations"):
            carried_confirmations()
    if (memory or database) and gate.use("superlink-released-claims"):
        released_claims()
    if gate.use("superlink-urgent-first"):
        urgent_first()
    if outermost:
        in_front(outermost)
    sys.argv = ["flower-superlink", *argv]
    importlib.import_module("flwr.superlink.cli").flower_superlink()


if __name__ == "__main__":  # pragma: no cover
    run_superlink(sys.argv[1:])
