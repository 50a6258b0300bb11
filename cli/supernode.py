"""``fedhet supernode``: Flower's SuperNode, paced, and told when its task's run stops.

* :func:`run_supernode`: Flower's ``flower-supernode`` (same flags) with its reply waits
  (0.5 s) capped at ``poll`` seconds, its idle pull (3 s) paced by when its next
  message is due (:class:`PacedSleep`, :mod:`cli.pacing`), and its object pulls with
  :data:`common.flower_runtime.PULL_BACKOFF`.
* Its executor's task requests are held (:class:`HeldTasks`): a SuperExec that asks
  for a task while there is none gets its answer when a message arrives, or after
  :data:`TASK_HOLD_S` without one, instead of polling (Flower's SuperExec, the warm
  executor or any other: the answer is Flower's own).
* Its connections to the SuperLink are opened before a wave of requests needs them
  (:class:`WarmConnections`): the SuperLink closes a connection 5 s after its last
  answer, so in longer rounds every wave of object transfers paid a TCP and a TLS
  handshake first.
* ``flwr stop``: Flower's SuperNode waits for its task's reply for ever and pulls
  nothing meanwhile, so a stopped run's task trained on and held the next run back.
  Here the SuperNode asks the SuperLink every :data:`STOP_CHECK_S` seconds while it
  waits whether the run still runs (:class:`RunWatch`); once it does not, the node
  finishes the run's tasks (stopped) and goes on with the next message. The warm
  executor (``cli/warm.py``) ends the children of tasks the node has finished.

What it relies on in ``flwr==1.42.0`` is listed in
:data:`common.flower_runtime.FLOWER_INTERNALS`. Flower is imported on first use.
"""

from __future__ import annotations

import importlib
import inspect
import os
import random
import re
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable
from logging import DEBUG, INFO, WARNING
from typing import Any

from cli.pacing import (
    FAST_GROWTH,
    LEAD,
    LOAD,
    Gaps,
    ServerLoad,
    fast_polls,
    idle_interval,
    idle_poll_s,
    informed_interval,
)
from common import carry
from common.flower_gate import replace
from common.flower_runtime import (
    concurrent_objects,
    fast_object_pulls,
    flower_internal,
    log,
    object_concurrency,
)

SUPERNODE_POLL_S = 0.05
FLOWER_IDLE_PULL_S = 3.0
"""The SuperNode's idle wait between two pulls in flwr 1.42.0
(``start_client_internal``); its other waits (0.5 s) are inside a task."""
FLOWER_REPLY_WAIT_S = 0.5
"""The SuperNode's wait between two looks for its task's reply in flwr 1.42.0
(``_push_messages``), capped at the ``poll`` of :func:`run_supernode`."""
TASK_HOLD_S = 10.0
"""Longest time the node holds a SuperExec's request for a task while it has none
(Flower's Runtime API client gives up after 30 s)."""
BUSY_HOLD_S = 2.0
"""The same while one of its tasks runs: the executor then watches its task's child
between two requests (a child that died is noticed within this time)."""
STOP_CHECK_S = 2.0
"""While its task runs, a SuperNode asks the SuperLink this often whether the task's
run still runs (one small Fleet request per node; Flower's own node heartbeat is
every 30 s). A stopped run's task ends on the node within this time."""
REPLY_GRACE_S = 5.0
"""A task its node has finished and that left no reply this long gets an error reply
(:meth:`RunWatch.push`): its child died without a word, or this Flower stores replies
where fedhet does not look. Never a silent wait."""
TASK_START_S = 120.0
"""A task no executor has taken this long (env ``FEDHET_TASK_START_S``) is failed with
an error reply that says so: the node's ``fedhet superexec`` is not running, or cannot
reach it."""
WARM_MARGIN_S = 0.5
""":class:`WarmConnections`: a node reuses a connection until this (plus a round
trip) before the SuperLink closes it, and opens the connections its next message
needs this long (plus three round trips) before the message is due."""
KEEPALIVE_S = 5.0
"""How long the SuperLink keeps an idle connection after its last answer, unless its
answers say otherwise (:func:`keep_alive_of`): uvicorn's ``timeout_keep_alive``
default (Flower's SuperLink sets none), which is also the keep-alive expiry of the
node's HTTP client (httpx's default). ``fedhet superlink`` keeps them 60 s and says
so."""
KEEPALIVE_MAX_S = 300.0
"""A node reuses an idle connection at most this long, whatever the SuperLink says (a
middlebox may drop an idle TCP connection)."""
FRESH_MAX_S = 60.0
"""A connection opened ahead and unused this long is closed, not counted (an idle
TCP connection may have been dropped by a middlebox without a word)."""
HTTPCORE_INTERNALS = (
    ("httpcore._sync.connection_pool", "ConnectionPool", "create_connection"),
    ("httpcore._sync.connection", "HTTPConnection", "_connect"),
    ("httpcore._sync.http11", "HTTP11Connection", "is_available"),
    ("httpcore._models", "Request", "__init__"),
)
"""What :class:`WarmConnections` relies on in httpcore 1.0 (Flower's HTTP client is
httpx over httpcore): a pool's ``_connections``, ``_optional_thread_lock`` and
``_keepalive_expiry``, a connection's ``_connection`` and ``_connect``, an HTTP/1.1
connection's ``_state`` and ``_expire_at``; a test checks them."""


def keep_alive_of(response: Any) -> float | None:
    """The seconds a server keeps an idle connection, from its answer's
    ``Keep-Alive: timeout=N`` header (None: no such header)."""
    text = response.headers.get("keep-alive", "")
    match = re.search(r"(?:^|[\s,;])timeout\s*=\s*(\d+(?:\.\d+)?)", text, re.IGNORECASE)
    return float(match.group(1)) if match else None


PULL_PATH = "/v1/fleet/pull-messages"
HOLD_MAX_S = 120.0
"""The longest hold a node asks for, whatever its SuperLink offers."""
HELD_POLL_GRACE_S = 120.0
"""How long past its hold a node waits for a held poll's answer (Flower waits 30 s
for any answer). A SuperLink moving a FedARA round of 1,000 nodes answered held polls
more than 30 s late, and a node that hung up first lost the message the SuperLink had
claimed for it meanwhile (the answer was written before the hang-up was seen): 13 of
1,000 nodes never got their round's message."""
HELD = threading.local()
"""Per node thread: how long the SuperLink held this thread's last poll (``seconds``)."""


def held_s() -> float:
    """Seconds the SuperLink held this thread's last poll (0: not held)."""
    return float(getattr(HELD, "seconds", 0.0))


ALIVE_OFFER = "x-fedhet-alive-polls"
"""The SuperLink's answers name it (``1``) while it takes a held poll that declares a
heartbeat interval (``x-fedhet-alive``) as the node's heartbeat."""


class PollAlive:
    """One Fleet API client's held polls that stand for its node's heartbeats.

    ``fedhet superlink`` acknowledges a held poll that declares an interval
    (``x-fedhet-alive: I``) as the node's heartbeat on its arrival and again as it
    answers it: it holds the node online for ``HEARTBEAT_PATIENCE`` (2) x ``I`` from
    then on, as for a heartbeat sent then. :func:`follow_superlink` notes each such
    poll here as it is sent, and how it ended (answered: acknowledged at the latest
    when it was sent plus the time it was held, ``x-fedhet-held``); the node's
    heartbeat sender (:func:`load_aware_heartbeats`) reads it. Per client, not per
    process: the fleet emulator runs many nodes in one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._request: Any = None
        self.sent: float | None = None
        """When (``time.monotonic``) the latest such poll was sent (None: none, or it
        failed)."""
        self.interval = 0.0
        """The interval it declared."""
        self.in_flight = False
        """It has not been answered yet (it may not have reached the SuperLink)."""
        self.answered: tuple[float, float] | None = None
        """The latest such poll answered with 2xx: when the SuperLink acknowledged it
        last (at the latest: when it was sent plus the time it was held), and its
        interval."""

    def sending(self, request: Any, interval: float, now: float) -> None:
        """Poll ``request`` declares ``interval`` and is sent at ``now``."""
        with self._lock:
            self._request, self.sent, self.interval, self.in_flight = request, now, interval, True

    def ended(self, request: Any, ok: bool, held: float = 0.0) -> None:
        """Poll ``request`` was answered with 2xx by a SuperLink that still offers
        (``ok``) after holding it ``held`` seconds, or not (another answer, a transport
        error): then no poll stands for a heartbeat until the next one is sent. Any
        other request: nothing."""
        with self._lock:
            if request is not self._request:
                return
            self._request, self.in_flight = None, False
            if ok and self.sent is not None:
                self.sent += held  # acknowledged again as it was answered
                self.answered = (self.sent, self.interval)
            else:
                self.sent = None

    def view(self) -> tuple[float | None, float, bool, tuple[float, float] | None]:
        """``(sent, interval, in_flight, answered)``, read together."""
        with self._lock:
            return self.sent, self.interval, self.in_flight, self.answered


POLL_ALIVE: weakref.WeakKeyDictionary[Any, PollAlive] = weakref.WeakKeyDictionary()
"""Each Fleet API client's :class:`PollAlive`, by its ``httpx.Client``
(:func:`follow_superlink` fills it)."""


class AliveInterval:
    """What a held poll declares: ``declared()``, the interval the node's heartbeat
    would declare now (set by :func:`load_aware_heartbeats` while polls stand for
    heartbeats; None: polls declare nothing)."""

    declared: Callable[[], float] | None = None


def polls_of(heartbeat_fn: Any) -> PollAlive | None:
    """The :class:`PollAlive` of the Fleet API client a heartbeat function sends on:
    Flower's ``send_node_heartbeat`` (``http_request_response``) closes over that
    client as ``client`` (a ``FleetHttpClient``, its ``httpx.Client`` in
    ``_client``). None: not such a function, or a client nobody followed."""
    code = getattr(heartbeat_fn, "__code__", None)
    cells = getattr(heartbeat_fn, "__closure__", None) or ()
    if code is None or "client" not in code.co_freevars:
        return None
    try:
        fleet = cells[code.co_freevars.index("client")].cell_contents
        return POLL_ALIVE.get(getattr(fleet, "_client", None))
    except (IndexError, ValueError, TypeError):  # empty cell; no weak reference to it
        return None


def follow_superlink(client: Any, learn: Callable[[float], None], hold: bool | None = None) -> None:
    """Follow what the SuperLink's answers to ``client`` (an ``httpx.Client``) name:
    ``learn(seconds)`` whenever its keep-alive changes (:data:`KEEPALIVE_S` at first,
    capped at :data:`KEEPALIVE_MAX_S`); and, once it names how long it holds an empty
    poll (``x-fedhet-holds``, ``fedhet superlink``), each poll asks for that hold
    (``x-fedhet-hold``, at most :data:`HOLD_MAX_S`; ``hold`` False or
    ``FEDHET_HELD_PULLS=0``: never) with its read timeout longer by as much, and
    :func:`held_s` says how long the poll was held (``x-fedhet-held``).

    While the answers also name :data:`ALIVE_OFFER` and :attr:`AliveInterval.declared`
    is set, each held poll declares the interval the node's heartbeat would declare
    now (``x-fedhet-alive``), noted in the client's :class:`PollAlive`
    (:data:`POLL_ALIVE`) as it is sent and as it ends."""
    known = {"keepalive": KEEPALIVE_S, "holds": 0.0, "alive": False}
    asking = switch("FEDHET_HELD_PULLS") if hold is None else hold
    alive = POLL_ALIVE.setdefault(client, PollAlive())

    def on_response(response: Any) -> None:
        value = keep_alive_of(response)
        if value is not None:
            value = min(value, KEEPALIVE_MAX_S)
            if value != known["keepalive"]:
                known["keepalive"] = value
                learn(value)
        holds = number(response.headers.get("x-fedhet-holds"))
        if holds is not None:
            known["holds"] = min(holds, HOLD_MAX_S)
        known["alive"] = response.headers.get(ALIVE_OFFER) == "1"
        if response.request.url.path == PULL_PATH:
            HELD.seconds = number(response.headers.get("x-fedhet-held")) or 0.0

    def on_request(request: Any) -> None:
        if request.url.path == PULL_PATH:
            HELD.seconds = 0.0
            if asking and known["holds"] > 0:
                request.headers["x-fedhet-hold"] = f"{known['holds']:g}"
                timeout = dict(request.extensions.get("timeout") or {})
                read = max(timeout.get("read") or 30.0, HELD_POLL_GRACE_S)
                timeout["read"] = read + known["holds"]
                request.extensions["timeout"] = timeout
                declared = AliveInterval.declared
                if known["alive"] and declared is not None:
                    interval = declared()
                    request.headers["x-fedhet-alive"] = f"{interval:g}"
                    alive.sending(request, interval, time.monotonic())

    send = client.send

    def sending(request: Any, *args: Any, **kwargs: Any) -> Any:
        """``client.send``: a poll noted in :class:`PollAlive` ends with its answer."""
        try:
            response = send(request, *args, **kwargs)
        except BaseException:
            alive.ended(request, False)
            raise
        alive.ended(
            request,
            response.is_success and response.headers.get(ALIVE_OFFER) == "1",
            number(response.headers.get("x-fedhet-held")) or 0.0,
        )
        return response

    hooks = dict(client.event_hooks)
    hooks["request"] = [*hooks.get("request", ()), on_request]
    hooks["response"] = [*hooks.get("response", ()), on_response]
    client.event_hooks = hooks
    client.send = sending


def number(text: str | bytes | None) -> float | None:
    """A header's non-negative finite number (None: absent or not one)."""
    try:
        value = float(text) if text is not None else None
    except ValueError:
        return None
    return value if value is not None and 0 <= value < float("inf") else None


def set_pool_expiry(pool: Any, expiry: float) -> None:
    """An httpcore pool (None: nothing) and its connections reuse an idle connection
    for ``expiry`` seconds."""
    if pool is None:
        return
    pool._keepalive_expiry = expiry  # connections made from now on
    with pool._optional_thread_lock:
        for conn in pool._connections:
            inner = getattr(conn, "_connection", None)
            if inner is not None and hasattr(inner, "_keepalive_expiry"):
                inner._keepalive_expiry = expiry


def keep_alive_clients() -> None:
    """Every Fleet API client made from now on reuses an idle connection for the
    keep-alive the SuperLink names, less twice :data:`WARM_MARGIN_S` (for nodes
    without :class:`WarmConnections`: the fleet emulator's)."""

    def follow(client: Any, base_url: str) -> None:
        pool = getattr(getattr(client, "_transport", None), "_pool", None)
        follow_superlink(
            client, lambda s: set_pool_expiry(pool, max(WARM_MARGIN_S, s - 2 * WARM_MARGIN_S))
        )

    on_fleet_client(follow)


class WarmConnections:
    """The node's connections to the SuperLink, opened before a wave of requests
    needs them.

    A message's objects, and its reply's, move :data:`OBJECT_CONCURRENCY
    <common.flower_runtime.OBJECT_CONCURRENCY>` at once, each on an HTTP/1.1
    connection of its own. The SuperLink closes a connection :data:`KEEPALIVE_S`
    after its last answer, so in a round longer than that every wave opened its
    connections anew: a TCP and a TLS handshake, two round trips, before its first
    request (and a request sent just as the SuperLink closed its connection failed
    and went again after a backoff). Here the node reuses a connection only while a
    request on it reaches the SuperLink in time (:meth:`expiry`), and keeps
    connections opened ahead and not used yet, as many as its last message had
    objects to pull (:attr:`pull_count`) or its last reply to push
    (:attr:`push_count`) plus one: :meth:`ensure` opens the missing ones, in threads,
    while the node waits anyway, before its next message is due (:class:`PacedSleep`
    calls it before an idle wait) and while its task runs (:class:`RunWatch`). A
    connection opened and not yet used stays open on both sides until it is used
    (the SuperLink's keep-alive timer starts with an answer), and the pool takes the
    older connections first, so the fresh ones serve a wave only when the others are
    gone. A connection that cannot be opened is left to the
    request that needs it, as before.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        """At most this many at once (the object concurrency)."""
        self.client: Any = None
        """The node's ``httpx.Client`` (:meth:`attach`)."""
        self.url = ""
        self.pull_count = 0
        """Objects the node's last message had to pull (at most :attr:`limit`)."""
        self.push_count = 0
        """Objects the node's last reply pushed (at most :attr:`limit`)."""
        self.opened = 0
        """Connections opened ahead so far."""
        self.keepalive = KEEPALIVE_S
        """How long the SuperLink keeps an idle connection (its answers' header)."""
        self._opening = 0
        self._rtts: list[float] = []
        self._lock = threading.Lock()

    def attach(self, client: Any, base_url: str) -> None:
        """The node's HTTP client (Flower's ``ProtobufClient._client``) and URL."""
        self.client, self.url = client, base_url
        follow_superlink(client, self.learn_keepalive)
        self._set_expiry()

    def learn_keepalive(self, seconds: float) -> None:
        """The SuperLink keeps an idle connection ``seconds`` (:func:`keep_alive_of`)."""
        self.keepalive = seconds
        self._set_expiry()

    def note_rtt(self, seconds: float) -> None:
        """A request's time (its round trip and the SuperLink's answer)."""
        before = self.rtt()
        self._rtts = [*self._rtts[-7:], seconds]
        if abs(self.rtt() - before) > 0.05:
            self._set_expiry()

    def lead(self) -> float:
        """How long before its next message is due a node opens the connections the
        message's objects need: :data:`WARM_MARGIN_S` and three round trips (TCP,
        TLS, and the session tickets that follow)."""
        return WARM_MARGIN_S + 3 * self.rtt()

    def _pool(self) -> Any:
        transport = getattr(self.client, "_transport", None)
        return getattr(transport, "_pool", None)

    def fresh(self) -> int:
        """Connections to the SuperLink opened ahead and not used yet (a used one is
        the pool's to reuse while it lives, :meth:`expiry`); one opened ahead more
        than :data:`FRESH_MAX_S` ago is closed (a middlebox may have dropped it)."""
        pool = self._pool()
        if pool is None:
            return 0
        now = time.monotonic()
        count = 0
        with pool._optional_thread_lock:
            for conn in list(pool._connections):
                opened = getattr(conn, "_fedhet_opened", None)
                inner = getattr(conn, "_connection", None)
                if opened is None or inner is None or inner.is_closed():
                    continue
                if getattr(inner, "_request_count", 1) or not inner.is_idle():
                    continue
                if now - opened > FRESH_MAX_S:
                    pool._connections.remove(conn)
                    conn.close()
                    continue
                count += 1
        return count

    def ensure(self, count: int) -> int:
        """Open (in threads) as many connections as the :meth:`fresh` ones (and
        those being opened) lack of ``count``; how many it started to open."""
        if self.client is None or count <= 0:
            return 0
        count = min(count, self.limit + 1)
        with self._lock:
            missing = count - self.fresh() - self._opening
            if missing <= 0:
                return 0
            self._opening += missing
        for _ in range(missing):
            threading.Thread(target=self._open_one, daemon=True, name="fedhet-warm").start()
        return missing

    def _open_one(self) -> None:
        try:
            from httpcore import Request
            from httpcore._sync.http11 import HTTP11Connection, HTTPConnectionState

            pool = self._pool()
            request = Request(b"POST", self.url, extensions={"timeout": {"connect": 30.0}})
            origin = request.url.origin
            conn = pool.create_connection(origin)
            stream = conn._connect(request)
            if not settled(stream.get_extra_info("socket"), self.lead()):
                stream.close()
                return
            inner = HTTP11Connection(
                origin=origin, stream=stream, keepalive_expiry=pool._keepalive_expiry
            )
            inner._state = HTTPConnectionState.IDLE  # available to the pool's next request
            conn._connection = inner
            conn._fedhet_opened = time.monotonic()
            with pool._optional_thread_lock:
                pool._connections.append(conn)
            self.opened += 1
        except Exception as exc:  # noqa: BLE001 - the request that needs it opens its own
            log(DEBUG, "fedhet: could not open a connection ahead: %s", exc)
        finally:
            with self._lock:
                self._opening -= 1

    def expiry(self) -> float:
        """How long the node reuses an idle connection: the SuperLink's keep-alive
        (:attr:`keepalive`) less a round trip and :data:`WARM_MARGIN_S`, so that a
        request on it reaches the SuperLink before the SuperLink closes it (on a
        connection the SuperLink had closed meanwhile a request fails, and Flower sends
        it again after a backoff)."""
        return max(WARM_MARGIN_S, self.keepalive - WARM_MARGIN_S - self.rtt())

    def rtt(self) -> float:
        """The shortest request seen (its round trip and the SuperLink's answer)."""
        return min(self._rtts) if self._rtts else 0.0

    def _set_expiry(self) -> None:
        set_pool_expiry(self._pool(), self.expiry())

    def counting(self, pull: Callable[..., Any], push: Callable[..., Any]) -> tuple[Any, Any]:
        """Flower's ``pull_objects`` and ``push_object_contents_from_iterable`` that
        note how many objects each moved (:attr:`pull_count`, :attr:`push_count`)."""

        def pull_counted(object_ids: Any, *args: Any, **kwargs: Any) -> Any:
            self.pull_count = min(len(object_ids), self.limit)
            return pull(object_ids, *args, **kwargs)

        def push_counted(contents: Any, *args: Any, **kwargs: Any) -> Any:
            moved = 0

            def each() -> Any:
                nonlocal moved
                for item in contents:
                    moved += 1
                    yield item

            try:
                return push(each(), *args, **kwargs)
            finally:
                self.push_count = min(moved, self.limit)

        return pull_counted, push_counted


class PacedSleep(types.ModuleType):
    """``time`` for Flower's SuperNode loop: a wait inside a task (Flower asks for
    0.5 s) is capped at ``poll`` seconds and marks the node active (its reply goes out
    right after); the idle wait between two pulls (Flower's 3 s) lasts until the next
    message is due (:func:`informed_interval`, from the gaps :meth:`arrived` has
    seen; ``fast``: :func:`idle_interval` from the reply on), at most ``cap``."""

    def __init__(
        self,
        real: types.ModuleType,
        poll: float,
        cap: float | None = None,
        fast: bool = False,
        load: ServerLoad | None = None,
    ) -> None:
        super().__init__("time")
        self.__dict__.update(vars(real))
        self._real, self._poll, self._fast = real, poll, fast
        self.load = load
        """The SuperLink's load as the node sees it: its idle waits are stretched by
        :meth:`ServerLoad.slowdown` (None: never)."""
        self._cap = FLOWER_IDLE_PULL_S if fast else (idle_poll_s() if cap is None else cap)
        self.last_active = real.monotonic()
        self.gaps = Gaps()
        self.replied: str | None = None
        """Kind of the message the node last worked on (None: none yet)."""
        self.before_idle: Callable[[float, float | None], None] | None = None
        """Called before each idle wait (not ``fast``) with the wait and the seconds
        until the next message is due (None: no history yet), until the message is
        overdue by more than its expected gap (a run that ended, a round the node was
        not sampled in)."""
        self.sleep = self._sleep  # type: ignore[method-assign] # not the copied time.sleep

    def arrived(self, kind: str) -> None:
        """A message of ``kind`` (``train``, ``evaluate``, ...) was pulled: note the
        gap since the reply to the previous one."""
        if self.replied is not None:
            self.gaps.add(self.replied, self._real.monotonic() - self.last_active)
        self.replied = kind

    def wait_for(self, seconds: float) -> float:
        """How long a ``sleep(seconds)`` of Flower's loop sleeps now."""
        now = self._real.monotonic()
        if seconds < FLOWER_IDLE_PULL_S:
            self.last_active = now
            return min(seconds, self._poll)
        since = now - self.last_active
        if self._fast:
            return min(seconds, idle_interval(self._poll, since, self._cap, FAST_GROWTH))
        expected = self.gaps.expected(self.replied)
        wait = informed_interval(self._poll, since, expected, self._cap)
        if self.load is not None:
            wait *= self.load.slowdown()
        wait = max(0.0, wait - held_s())  # a held poll waited on the SuperLink
        if self.before_idle is not None and (expected is None or since <= 2 * expected):
            self.before_idle(wait, None if expected is None else LEAD * expected - since)
        return wait

    def _sleep(self, seconds: float) -> None:
        self._real.sleep(self.wait_for(seconds))


class HeldTasks:
    """The SuperNode's ``acquire_task`` handler (Runtime API), held while there is no
    task: it answers as soon as :meth:`ring` tells it that a message arrived (or a
    task was finished), or after ``hold_s`` with Flower's own empty answer. A request
    without capacity (an executor busy with its tasks) is answered at once."""

    def __init__(
        self,
        acquire: Callable[..., Any],
        hold_s: float = TASK_HOLD_S,
        busy_hold_s: float = BUSY_HOLD_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._acquire, self.hold_s, self.busy_hold_s = acquire, hold_s, busy_hold_s
        self._clock = clock
        self._cond = threading.Condition()
        self._rings = 0
        self.closing = False

    def ring(self) -> None:
        with self._cond:
            self._rings += 1
            self._cond.notify_all()

    def close(self) -> None:
        """The node is stopping: every held request is answered now, none held again
        (the Runtime API's server then stops at once, with no request to cancel)."""
        with self._cond:
            self.closing = True
            self._cond.notify_all()

    def __call__(self, request: Any, state: Any) -> Any:
        if not request.supported_task_types and not request.agentapp_fab_hashes:
            return self._acquire(request, state)  # no capacity: Flower answers at once
        deadline = self._clock() + (self.busy_hold_s if self._busy(state) else self.hold_s)
        while True:
            with self._cond:
                seen = self._rings
            answer = self._acquire(request, state)
            left = deadline - self._clock()
            if answer.HasField("task") or left <= 0 or self.closing:
                return answer
            with self._cond:
                if self._rings == seen:
                    self._cond.wait(left)

    @staticmethod
    def _busy(state: Any) -> bool:
        """Whether one of the node's tasks is starting or running."""
        status = flower_internal("flwr.common.constant", "Status")
        try:
            return bool(state.get_tasks(statuses=[status.STARTING, status.RUNNING], limit=1))
        except Exception:  # noqa: BLE001 - unknown: hold briefly
            return True


class FailedTasks:
    """The SuperNode's ``push_task_output`` handler (Runtime API): a ClientApp task
    finished as failed (the warm executor reports a task child that died) gets an
    error reply for its message at once (:meth:`RunWatch.fail`), as Flower's node does
    only when the task's token expires (about 60 s later); everything else is
    Flower's own handler."""

    def __init__(
        self,
        push: Callable[..., Any],
        fail: Callable[[Any, str], bool],
        on_failed: Callable[[], None] | None = None,
    ) -> None:
        self._push, self._fail, self._on_failed = push, fail, on_failed

    def __call__(self, request: Any, state: Any, task: Any) -> Any:
        answer = self._push(request, state, task)
        failed = flower_internal("flwr.common.constant", "SubStatus").FAILED
        client_app = flower_internal("flwr.supercore.constant", "TaskType").CLIENT_APP
        if request.sub_status == failed and task.type == client_app:
            if self._fail(state, f"ClientApp crashed: {request.details}"):
                log(
                    INFO,
                    "fedhet: task %d failed (%s): error reply sent",
                    task.task_id,
                    request.details,
                )
            if self._on_failed is not None:
                self._on_failed()
        return answer


class _TakenReplies:
    """A node state whose first look for replies returns the replies already taken
    from it (Flower's state hands each message out once); all else is the state's."""

    def __init__(self, state: Any, replies: list[Any]) -> None:
        self._state, self._replies = state, replies

    def get_messages_legacy(self, **kwargs: Any) -> Any:
        if kwargs.get("is_reply") and self._replies:
            replies, self._replies = self._replies, []
            return replies
        return self._state.get_messages_legacy(**kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)


class Inbox:
    """Where the installed Flower's SuperNode loop keeps its messages, for
    :class:`RunWatch` (the gate's ``inbox`` fact of the checked version).

    * ``legacy`` (flwr 1.42.0): the node state's ``msg_store``; replies are found with
      ``get_messages_legacy(is_reply=True)`` (which hands each out once), dropped with
      ``delete_messages``, error replies stored by ``_store_error_replies``.
    * ``store`` (flwr 1.43 nightly): the core state's message store; replies are the
      messages addressed to the SuperLink (``get_messages(dst_node_id=...)``, which
      hands nothing out), dropped with ``cancel_messages``, error replies stored there
      as the loop's own ``_insert_message`` stores a reply (that Flower's
      ``_store_error_replies`` still writes to the old store, which its loop no longer
      reads: a crashed ClientApp's token expiry never reaches the SuperLink).
    """

    FLAVOURS = ("legacy", "store")

    def __init__(self, flavour: str) -> None:
        if flavour not in self.FLAVOURS:
            raise ValueError(f"inbox {flavour!r}: one of {self.FLAVOURS}")
        self.flavour = flavour

    def replies(self, state: Any) -> list[Any]:
        """The replies waiting to go to the SuperLink."""
        if self.flavour == "legacy":
            return list(state.get_messages_legacy(is_reply=True))
        to_link = flower_internal("flwr.common.constant", "SUPERLINK_NODE_ID")
        return list(state.get_messages(dst_node_id=to_link))

    def for_push(self, state: Any, replies: list[Any]) -> Any:
        """The state Flower's ``_push_messages`` gets: one that finds ``replies``."""
        return _TakenReplies(state, replies) if self.flavour == "legacy" else state

    def drop(self, state: Any, store: Any, message_ids: list[str]) -> None:
        """Forget messages (and their objects)."""
        if not message_ids:
            return
        if self.flavour == "legacy":
            state.delete_messages(message_ids=list(message_ids))
            for message_id in message_ids:
                store.delete(message_id)
        else:
            state.cancel_messages(message_ids=list(message_ids))

    def error_reply(self, state: Any, store: Any, message: Any, reason: str) -> None:
        """Store an error reply (ClientApp crashed, ``reason``) to ``message``."""
        crashed = flower_internal(NODE_STATE, "CLIENT_APP_CRASHED_ERROR")
        error = type(crashed)(code=crashed.code, reason=reason)
        if self.flavour == "legacy":
            # a message no task has taken yet is handed out here, so it gets its reply
            state.get_messages_legacy(run_ids=[message.metadata.run_id], is_reply=False)
            state._store_error_replies({message.metadata.run_id}, error)
            return
        from flwr.app import Message

        objects = "flwr.supercore.inflatable.inflatable_object"
        reply = Message(error, reply_to=message)
        with flower_internal(objects, "no_object_id_recompute")():
            reply.metadata.__dict__["_message_id"] = reply.object_id
            if not state.store_messages([message, reply])[1]:
                raise RuntimeError("the node state refused the error reply")
            store.preregister(
                reply.metadata.run_id, flower_internal(objects, "get_object_tree")(reply)
            )
            for object_id, obj in flower_internal(objects, "get_all_nested_objects")(reply).items():
                store.put(object_id, obj.deflate())


class _NotesCreated:
    """A node state that notes the tasks it creates and the instruction messages it
    stores (for :meth:`RunWatch.pull` to undo them); all else is the state's."""

    def __init__(self, state: Any) -> None:
        self._state = state
        self.tasks: list[int] = []
        self.messages: list[str] = []

    def create_task(self, *args: Any, **kwargs: Any) -> Any:
        task_id = self._state.create_task(*args, **kwargs)
        if task_id is not None:
            self.tasks.append(task_id)
        return task_id

    def store_message(self, message: Any) -> Any:
        stored = self._state.store_message(message)
        self._note([message])
        return stored

    def store_messages(self, messages: Any) -> Any:
        stored = self._state.store_messages(messages)
        self._note(messages)
        return stored

    def _note(self, messages: Any) -> None:
        self.messages += [
            m.metadata.message_id for m in messages if not m.metadata.reply_to_message_id
        ]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)


class _RingsOnStore:
    """A node state that calls ``ring`` once it has stored an instruction message
    (its task can start: its objects follow, and the task's ClientApp waits for them
    with a short backoff); all else is the state's."""

    def __init__(self, state: Any, ring: Callable[[], None]) -> None:
        self._state, self._ring = state, ring

    def store_message(self, message: Any) -> Any:
        stored = self._state.store_message(message)
        if not message.metadata.reply_to_message_id:
            self._ring()
        return stored

    def store_messages(self, messages: Any) -> Any:
        stored = self._state.store_messages(messages)
        if any(not m.metadata.reply_to_message_id for m in messages):
            self._ring()
        return stored

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)


RECEIVE_RETRIES = (0.5, 1.0, 2.0, 4.0, 8.0)
"""Waits before pulling the next message (or pushing a reply) again after the SuperLink
answered with a server error or not at all. On the first one Flower's node loop ended,
and its SuperNode with it (a pull), or dropped the reply (a push): seen at 100 nodes,
where the SuperLink's SQLite state answered with 500 (database is locked)."""


def transient(exc: BaseException) -> bool:
    """A server error (5xx) or a failed connection: worth trying again."""
    import httpx

    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code >= 500
    return isinstance(exc, httpx.TransportError)


def receive_again(receive: Callable[[], Any], waits: tuple[float, ...] = RECEIVE_RETRIES) -> Any:
    """``receive()``, tried again after each of ``waits`` when it fails transiently."""
    for wait in (*waits, None):
        try:
            return receive()
        except Exception as exc:
            if wait is None or not transient(exc):
                raise
            log(
                WARNING,
                "fedhet: a request to the SuperLink failed (%s); again in %.1f s",
                exc,
                wait,
            )
            time.sleep(wait)
    return None  # not reached


class RunWatch:
    """Flower's SuperNode loop, told when the run of its task in progress stops.

    Flower's loop pulls a message (``_pull_and_store_message``), then waits for that
    task's reply for as long as it takes (``_push_messages``) and pulls nothing
    meanwhile: a run stopped with ``flwr stop`` trained on and held the next run's
    first round back. :meth:`pull` (in place of ``_pull_and_store_message``) notes
    the message and the Fleet API's ``get_run``; :meth:`push` (in place of
    ``_push_messages``) waits for the reply as Flower does and every ``interval``
    seconds asks the SuperLink for the run. Once the run is not running, the node
    finishes the run's unfinished tasks (sub-status stopped: the warm executor ends
    their children), drops the message and its objects and returns, so the loop
    pulls the next message at once. With the reply there, Flower's own
    ``_push_messages`` sends it.
    """

    def __init__(
        self,
        pull: Callable[..., int | None],
        push: Callable[..., None],
        *,
        interval: float = STOP_CHECK_S,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        on_message: Callable[[str], None] | None = None,
        on_stop: Callable[[], None] | None = None,
        on_stored: Callable[[], None] | None = None,
        confirm_along: bool = False,
        on_receive_s: Callable[[float], None] | None = None,
        on_waiting: Callable[[], None] | None = None,
        inbox: Inbox | None = None,
        reply_grace_s: float = REPLY_GRACE_S,
        start_bound_s: float | None = None,
        load: ServerLoad | None = None,
        carry: bool = False,
        confirm_on_push: bool = False,
    ) -> None:
        self._pull, self._push = pull, push
        self.carry = carry
        """A reply's push carries its objects (:func:`common.carry.carrying_send`)."""
        self.confirm_on_push = confirm_on_push
        """With ``confirm_along``: once the SuperLink takes confirmations along
        (:data:`common.carry.CONFIRMS`), a message's confirmation goes with its
        reply's push (part ``carried-confirmations``), not as a request of its own."""
        self._along: tuple[Callable[[int, str], None], int, str] | None = None
        self.load = load
        """The SuperLink's load as this node sees it: a message object that is not
        there yet is asked for again later the busier it is (:class:`PatientPulls`;
        None: Flower's backoff alone)."""
        self.inbox = inbox if inbox is not None else Inbox("legacy")
        self.reply_grace_s = reply_grace_s
        self.start_bound_s = (
            float(os.environ.get("FEDHET_TASK_START_S", TASK_START_S))
            if start_bound_s is None
            else start_bound_s
        )
        self.message: Any = None
        """The instruction message in progress (its error reply's ``reply_to``)."""
        self.task_ids: list[int] = []
        self.pulled_at = 0.0
        self._ended_at: float | None = None
        self._state: Any = None
        self._store: Any = None
        self._on_receive_s, self._on_waiting = on_receive_s, on_waiting
        self._on_message, self._on_stop = on_message, on_stop
        self._on_stored, self._confirm_along = on_stored, confirm_along
        self._confirming: threading.Thread | None = None
        self._pull_sig, self._push_sig = inspect.signature(pull), inspect.signature(push)
        for sig, names, name in (
            (self._pull_sig, ("receive", "get_run"), "_pull_and_store_message"),
            (self._push_sig, ("state", "object_store"), "_push_messages"),
        ):
            if missing := [n for n in names if n not in sig.parameters]:
                raise RuntimeError(
                    f"fedhet needs flwr==1.42.0: flwr.supernode.start_client_internal.{name} "
                    f"no longer takes {missing}"
                )
        self.interval, self._sleep, self._clock = interval, sleep, clock
        self.get_run: Callable[[int], Any] | None = None
        self.run_id: int | None = None
        self.message_ids: list[str] = []
        self.dropped: set[str] = set()
        """Instruction messages of stopped runs: a late reply to one is discarded."""

    def pull(self, *args: Any, **kwargs: Any) -> int | None:
        """Flower's ``_pull_and_store_message``; notes the run and message it stored."""
        bound = self._pull_sig.bind(*args, **kwargs)
        receive = bound.arguments["receive"]
        received: list[str] = []
        kinds: list[str] = []

        def receive_and_note() -> Any:
            start = time.monotonic()
            got = receive_again(receive)
            if self._on_receive_s is not None:  # its answer's time, not its hold
                self._on_receive_s(max(0.0, time.monotonic() - start - held_s()))
            if got is not None:
                self.message = got[0]
                received.append(got[0].metadata.message_id)
                kinds.append(str(got[0].metadata.message_type).split(".")[0])
            return got

        bound.arguments["receive"] = receive_and_note
        if self.load is not None and "pull_object" in bound.arguments:
            bound.arguments["pull_object"] = PatientPulls(bound.arguments["pull_object"], self.load)
        self.get_run = bound.arguments["get_run"]
        state = bound.arguments.get("state")
        noted = _NotesCreated(state) if state is not None else None
        if noted is not None:
            bound.arguments["state"] = noted
        if self._on_stored is not None and noted is not None:
            bound.arguments["state"] = _RingsOnStore(noted, self._on_stored)
        if self._confirm_along and "confirm_message_received" in bound.arguments:
            bound.arguments["confirm_message_received"] = self._confirm_later(
                bound.arguments["confirm_message_received"]
            )
        self._state, self._store = state, bound.arguments.get("object_store")
        run_id = self._pull(*bound.args, **bound.kwargs)
        if run_id is None and noted is not None and noted.tasks:
            self._abandon(state, bound.arguments.get("object_store"), noted)
        self.run_id = run_id
        self.task_ids = list(noted.tasks) if noted is not None and run_id is not None else []
        self.pulled_at, self._ended_at = self._clock(), None
        self.message_ids = received if run_id is not None else []
        if run_id is not None and self._on_message is not None:
            self._on_message(kinds[0] if kinds else "")
        return run_id

    def _abandon(self, state: Any, store: Any, noted: _NotesCreated) -> None:
        """Flower's pull stored a message and created its task, then gave up on it
        without finishing the task: the run stopped while the message's objects were
        pulled (a ``RunNotRunningException``, which Flower's own clean-up does not
        catch), e.g. a SuperLink restarted mid-round. Left so, the task's ClientApp
        waited for those objects for ever and its executor took no other task: finish
        the task (stopped: the warm executor ends its child), drop the message."""
        status = flower_internal("flwr.common.constant", "Status")
        stopped = flower_internal("flwr.common.constant", "SubStatus").STOPPED
        unfinished = state.get_tasks(
            task_ids=list(noted.tasks), statuses=[status.PENDING, status.STARTING, status.RUNNING]
        )
        ended = [
            t.task_id
            for t in unfinished
            if state.finish_task(
                t.task_id, sub_status=stopped, details="its run stopped while its message arrived"
            )
        ]
        if noted.messages and store is not None:
            self.inbox.drop(state, store, list(noted.messages))
        if ended:
            log(
                INFO,
                "fedhet: the run of message(s) %s stopped while they arrived: finished "
                "task(s) %s, dropped the message(s)",
                noted.messages,
                ended,
            )
            if self._on_stop is not None:
                self._on_stop()

    def _confirm_later(self, confirm: Callable[[int, str], None]) -> Callable[[int, str], None]:
        """Flower's ``confirm_message_received``, sent in a thread of its own: the
        message's task starts without waiting a round trip for it (:meth:`push` waits
        for it before the reply goes out); or kept for the reply's push
        (``confirm_on_push``, once the SuperLink takes confirmations along)."""

        def later(run_id: int, message_id: str) -> None:
            self.confirmed()
            self._send_kept()  # one kept for a push that never came
            if self.confirm_on_push and carry.LOCAL.confirms_offered:
                self._along = (confirm, run_id, message_id)  # with the reply's push
                return
            self._send(confirm, run_id, message_id)

        return later

    def _send(self, confirm: Callable[[int, str], None], run_id: int, message_id: str) -> None:
        """``confirm(run_id, message_id)`` in a thread of its own (:meth:`confirmed`
        waits for it)."""

        def send() -> None:
            try:
                confirm(run_id, message_id)
            except Exception as exc:  # noqa: BLE001 - the SuperLink cleans up by its TTL
                log(WARNING, "fedhet: could not confirm message %s: %s", message_id, exc)

        self._confirming = threading.Thread(target=send, daemon=True, name="fedhet-confirm")
        self._confirming.start()

    def confirmed(self) -> None:
        """Wait until the last confirmation sent by :meth:`_send` is done."""
        if self._confirming is not None:
            self._confirming.join()
            self._confirming = None

    def _send_kept(self) -> None:
        """The confirmation kept for the reply's push, sent by itself in a thread of
        its own (the push did not go, or failed: confirming twice deletes nothing
        twice)."""
        along, self._along = self._along, None
        if along is not None:
            self.confirmed()
            self._send(*along)

    def push(self, *args: Any, **kwargs: Any) -> None:
        """Flower's ``_push_messages``, or a return without a reply once the task's
        run is no longer running. Every ``interval`` it also checks that a reply can
        still come (:meth:`stalled`); when none can, the message gets an error reply
        with the cause, which the ServerApp logs for this node."""
        bound = self._push_sig.bind(*args, **kwargs)
        state, store = bound.arguments["state"], bound.arguments["object_store"]
        self._state, self._store = state, store
        next_check = self._clock() + self.interval
        while not (replies := self._fresh(state, store)):
            if self._on_waiting is not None:
                self._on_waiting()
            if self._clock() >= next_check:
                if not self.running():
                    self._along = None  # its run stopped: the SuperLink deletes its objects
                    self._stop(state, store)
                    return
                if (cause := self.stalled(state)) is not None:
                    self.fail(state, cause)
                    continue
                next_check = self._clock() + self.interval
            self._sleep(FLOWER_REPLY_WAIT_S)
        self.confirmed()
        bound.arguments["state"] = self.inbox.for_push(state, replies)
        if "send" in bound.arguments:  # a reply the SuperLink failed to store goes again
            send = bound.arguments["send"]
            if self.carry:
                send = carry.carrying_send(send, bound.arguments["object_store"])
            bound.arguments["send"] = lambda *a, **k: receive_again(lambda: send(*a, **k))
        along, self._along = self._along, None
        carry.LOCAL.confirmed = [along[2]] if along is not None else None
        try:
            self._push(*bound.args, **bound.kwargs)
        except BaseException:
            self._along = along
            self._send_kept()
            raise
        finally:
            carry.LOCAL.confirmed = None

    def stalled(self, state: Any) -> str | None:
        """Why the message in progress can get no reply by itself (None: it can):
        its task ended :data:`REPLY_GRACE_S` ago without one, or no executor took it
        within ``start_bound_s``."""
        if not self.task_ids:
            return None
        status = flower_internal("flwr.common.constant", "Status")
        tasks = list(state.get_tasks(task_ids=list(self.task_ids)))
        now = self._clock()
        pending = [t for t in tasks if t.status.status == status.PENDING]
        if pending and now - self.pulled_at > self.start_bound_s:
            failed = flower_internal("flwr.common.constant", "SubStatus").FAILED
            cause = (
                f"no executor took its task in {self.start_bound_s:.0f} s (is this node's "
                "`fedhet superexec` running, with the node's --superexec-auth-secret-file?)"
            )
            for task in pending:
                state.finish_task(task.task_id, sub_status=failed, details=cause)
            return cause
        if any(t.status.status != status.FINISHED for t in tasks):
            self._ended_at = None
            return None
        if self._ended_at is None:
            self._ended_at = now
            return None
        if now - self._ended_at < self.reply_grace_s:
            return None
        last = tasks[-1].status if tasks else None
        how = f" ({last.sub_status}: {last.details})" if last is not None and last.details else ""
        return f"its task ended{how} and left no reply for {self.reply_grace_s:.0f} s"

    def fail(self, state: Any, cause: str) -> bool:
        """Give the message in progress an error reply carrying ``cause`` (logged);
        False when there is none (or the reply could not be stored)."""
        if self.message is None or not self.message_ids:
            return False
        try:
            self.inbox.error_reply(state, self._store, self.message, cause)
        except Exception as exc:  # noqa: BLE001 - say so; Flower's token expiry remains
            log(WARNING, "fedhet: could not store an error reply (%s): %s", cause, exc)
            return False
        self.task_ids = []
        log(
            WARNING,
            "fedhet: message %s (%s): %s; error reply sent",
            self.message.metadata.message_id[:12],
            self.message.metadata.message_type,
            cause,
        )
        return True

    def running(self) -> bool:
        """Whether the run of the message in progress is still running (True when it
        cannot be told: no run, no answer)."""
        if self.run_id is None or self.get_run is None:
            return True
        not_running = flower_internal("flwr.supercore.run", "RunNotRunningException")
        finished = flower_internal("flwr.common.constant", "Status").FINISHED
        try:
            run = self.get_run(self.run_id)
        except not_running:
            return False
        except Exception as exc:  # noqa: BLE001 - an unanswered question is no stop
            log(DEBUG, "fedhet: could not ask for run %s: %s", self.run_id, exc)
            return True
        return getattr(getattr(run, "status", None), "status", None) != finished

    def _fresh(self, state: Any, store: Any) -> list[Any]:
        """Replies in ``state``; late replies of stopped runs are deleted instead."""
        replies = []
        for reply in self.inbox.replies(state):
            if reply.metadata.reply_to_message_id in self.dropped:
                self.dropped.discard(reply.metadata.reply_to_message_id)
                self.inbox.drop(state, store, [reply.metadata.message_id])
                log(INFO, "fedhet: dropped a late reply of stopped run %s", reply.metadata.run_id)
            else:
                replies.append(reply)
        return replies

    def _stop(self, state: Any, store: Any) -> None:
        """Finish the stopped run's tasks and drop its message."""
        status = flower_internal("flwr.common.constant", "Status")
        stopped = flower_internal("flwr.common.constant", "SubStatus").STOPPED
        tasks = state.get_tasks(
            run_ids=[self.run_id], statuses=[status.PENDING, status.STARTING, status.RUNNING]
        )
        ended = [
            t.task_id
            for t in tasks
            if state.finish_task(t.task_id, sub_status=stopped, details="the run was stopped")
        ]
        self.inbox.drop(state, store, list(self.message_ids))
        self.dropped.update(self.message_ids)
        log(
            INFO,
            "fedhet: run %s is no longer running: stopped its task(s) %s, dropped message(s) "
            "%s; pulling the next message",
            self.run_id,
            ended,
            self.message_ids,
        )
        self.run_id, self.message_ids = None, []
        if self._on_stop is not None:
            self._on_stop()


def run_supernode(argv: list[str], poll: float = SUPERNODE_POLL_S) -> None:
    """Flower's ``flower-supernode`` with its reply waits (0.5 s) capped at ``poll``
    seconds, its idle pull (3 s) paced by :class:`PacedSleep`, its object pulls with
    :data:`PULL_BACKOFF`, its executor's task requests held (:class:`HeldTasks`), and
    the run of its task in progress watched by :class:`RunWatch` (same flags).
    ``FEDHET_NODE_POLL=fast``: the polling fedhet had before (no held requests).

    Each change is a part of :mod:`common.flower_gate`: one that does not fit the
    installed Flower is left out with one warning line (Flower's own behaviour)."""
    from common import flower_gate as gate
    from common import heap

    gate.use("entry-points")
    heap.start_trimmer()  # a node's messages and replies freed each round: pages back
    name = "flwr.supernode.start_client_internal"
    module = importlib.import_module(name)
    fast = fast_polls()
    early, along = switch("FEDHET_EARLY_TASK"), switch("FEDHET_CONFIRM_ALONG")
    paced: PacedSleep | None = None
    aware = switch("FEDHET_LOAD_AWARE") and gate.use("load-aware-idle")
    if gate.use("node-polling"):
        paced = PacedSleep(
            flower_internal(name, "time"), poll, fast=fast, load=LOAD if aware else None
        )
        replace(module, "time", paced)
    count = object_concurrency()
    warm: WarmConnections | None = None
    if not gate.use("node-objects"):
        count = None
    elif count is None:
        fast_object_pulls(name, "pull_objects")
    else:
        concurrent_objects(name, "pull_objects", "push_object_contents_from_iterable", count=count)
        if (
            not fast
            and paced is not None
            and switch("FEDHET_WARM_CONNECTIONS")
            and gate.use("warm-connections")
        ):
            warm = WarmConnections(count)
            attach_client(warm)
            pull, push = warm.counting(
                flower_internal(name, "pull_objects"),
                flower_internal(name, "push_object_contents_from_iterable"),
            )
            replace(module, "pull_objects", pull)
            replace(module, "push_object_contents_from_iterable", push)
            paced.before_idle = warm_before_idle(warm)
    carrying = switch("FEDHET_CARRIED_OBJECTS") and gate.use("carried-objects")
    if carrying:
        carried_node_objects()
    held: HeldTasks | None = None
    handlers = importlib.import_module(RUNTIME_HANDLERS)
    watching = gate.use("run-watch")  # held requests are woken by the watch's rings
    if not fast and watching and gate.use("held-tasks"):
        held = HeldTasks(flower_internal(RUNTIME_HANDLERS, "acquire_task"))
        replace(handlers, "acquire_task", held)
        # on SIGTERM, before Flower stops its Runtime API server (which waited for the
        # held requests, then cancelled them with tracebacks)
        flower_internal("flwr.supercore.exit", "add_exit_handler")(
            held.close, run_before_force_exit=True
        )
    if watching:
        watch = RunWatch(
            flower_internal(name, "_pull_and_store_message"),
            flower_internal(name, "_push_messages"),
            sleep=paced.sleep if paced is not None else time.sleep,
            on_message=_arrived(paced, held),
            on_stop=held.ring if held is not None else None,
            on_stored=held.ring if held is not None and early else None,
            confirm_along=along,
            on_receive_s=_noting(warm.note_rtt if warm is not None else None, aware),
            on_waiting=warm_while_working(warm) if warm is not None else None,
            inbox=Inbox(gate.fact("run-watch", "inbox")),
            load=LOAD if aware else None,
            carry=carrying,
            confirm_on_push=carrying and gate.use("carried-confirmations"),
        )
        replace(module, "_pull_and_store_message", watch.pull)
        replace(module, "_push_messages", watch.push)
        if gate.use("failed-tasks"):
            failed = FailedTasks(
                flower_internal(RUNTIME_HANDLERS, "push_task_output"),
                watch.fail,
                on_failed=held.ring if held is not None else None,
            )
            replace(handlers, "push_task_output", failed)
    if gate.use("heartbeat-patience"):
        patient_heartbeats()
    if aware:
        load_aware_heartbeats()
    sys.argv = ["flower-supernode", *argv]
    flower_internal("flwr.supernode.cli.flower_supernode", "flower_supernode")()


HEARTBEAT_PATIENCE_S = 30.0
"""How long a node waits for the answer to a heartbeat (Flower: 5 s). The SuperLink
declares a node unavailable after 2 x 30 s without one (``HEARTBEAT_PATIENCE`` x
``HEARTBEAT_DEFAULT_INTERVAL``) and fails the node's pending messages with "Node
Unavailable". A SuperLink whose one process is saturated answers seconds late: with
300 emulated nodes on 2 cores, heartbeats that gave up after 5 s (then retried after
growing backoffs) lost 10 replies of 1,500 that way (docs/deployment.md, "Beyond 16
nodes"). Waiting as long as one heartbeat interval keeps every answered heartbeat."""


def patient_heartbeats(seconds: float = HEARTBEAT_PATIENCE_S) -> None:
    """Flower's SuperNode heartbeat calls wait ``seconds`` for their answer."""
    module = importlib.import_module("flwr.supernode.fleet_http_client")
    replace(module, "HEARTBEAT_CALL_TIMEOUT", seconds)


MISSING_SHARE = 0.25
""":class:`PatientPulls`: an object missing for t seconds is asked for again after
``MISSING_SHARE`` x t (times the SuperLink's slowdown), once that is more than
Flower's own retry wait (at most 0.5 s with fedhet's ``PULL_BACKOFF``)."""


class PatientPulls:
    """A node's ``pull_object(run_id, object_id)``, patient with objects the
    SuperLink does not have yet.

    Flower's SuperLink hands a node its message as soon as the ServerApp pushed it,
    before the ServerApp has pushed the message's objects; the node's pulls of those
    find them missing and retry (fedhet's backoff: every 0.5 s at most). With a
    thousand nodes that waited for a ServerApp pushing a thousand messages, those
    retries were most of the SuperLink's requests and starved the ServerApp's own
    pushes and heartbeats (docs/deployment.md, "Beyond 16 nodes"). Here an object that
    stays missing is asked for again after a wait that grows with how long it has
    been missing (:data:`MISSING_SHARE` x that time) and with the SuperLink's
    slowdown (:meth:`ServerLoad.slowdown`); one missing for less than 2 s on an idle
    SuperLink retries as before."""

    def __init__(
        self,
        pull: Callable[[int, str], bytes],
        load: ServerLoad,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._pull, self._load, self._clock, self._sleep = pull, load, clock, sleep
        self._unavailable = flower_internal(
            "flwr.supercore.inflatable.inflatable_utils", "ObjectUnavailableError"
        )
        self.missing_since: dict[str, float] = {}

    def extra_wait(self, missing_s: float) -> float:
        """How much longer than Flower's retry wait to wait for an object missing
        for ``missing_s`` seconds."""
        return max(0.0, MISSING_SHARE * missing_s * self._load.slowdown() - 0.5)

    def __call__(self, run_id: int, object_id: str) -> bytes:
        try:
            content = self._pull(run_id, object_id)
        except self._unavailable:
            now = self._clock()
            wait = self.extra_wait(now - self.missing_since.setdefault(object_id, now))
            if wait > 0:
                self._sleep(wait)
            raise
        self.missing_since.pop(object_id, None)
        return content


class HeartbeatTally:
    """A process's node heartbeats as its nodes saw them (a diagnostic the fleet
    emulator reports): how many were sent, failed, the slowest, and how many were
    answered later than the SuperLink's patience (2 x the interval the node had
    declared) after the latest acknowledgement the node knew of: the SuperLink may
    have held that node offline meanwhile (a held poll in flight may have been
    acknowledged since; the node cannot know)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sent = self.failed = self.late = 0
        self.slowest_s = self.longest_gap_s = 0.0

    def note(self, seconds: float, ok: bool, gap: float | None, patience_s: float) -> None:
        with self._lock:
            self.sent += 1
            self.failed += not ok
            self.slowest_s = max(self.slowest_s, seconds)
            if gap is not None:
                self.longest_gap_s = max(self.longest_gap_s, gap)
                self.late += gap > patience_s

    def view(self) -> dict[str, float]:
        with self._lock:
            return {
                "sent": self.sent,
                "failed": self.failed,
                "late": self.late,
                "slowest-s": round(self.slowest_s, 3),
                "longest-gap-s": round(self.longest_gap_s, 3),
            }


HEARTBEATS = HeartbeatTally()


def load_aware_heartbeats(load: ServerLoad = LOAD, polls: bool | None = None) -> None:
    """Flower's SuperNode heartbeats, their interval stretched by the SuperLink's load
    (:meth:`ServerLoad.slowdown`): each heartbeat declares Flower's interval (30 s)
    times the slowdown, and the next one follows Flower's own rule for that interval
    (``(interval - 5 s) x 0.8 +- 0.1``). The SuperLink holds a node online for 2 x the
    interval its last heartbeat declared, so a node that sends fewer is not declared
    unavailable. The time each heartbeat takes is noted as a pull's is.

    With ``polls`` (default: ``FEDHET_POLL_HEARTBEATS``, on), a held poll stands for a
    heartbeat where the SuperLink offers it (:class:`PollAlive`): each declares the
    interval a heartbeat would declare now, and no heartbeat is sent while the
    latest one of the node's own client was acknowledged less than that rule's wait
    ago; the sender waits until then and looks again. A poll still in flight (it may
    not have reached the SuperLink) stands for one only up to the latest heartbeat or
    answered poll + its interval + the wait (:meth:`covered_until`). Only here: with
    ``FEDHET_LOAD_AWARE=0`` (or this part off) polls declare nothing and every
    heartbeat is sent, as in Flower."""
    conn = importlib.import_module(FLEET_CONNECTION)
    base = flower_internal("flwr.supercore.heartbeat", "HeartbeatSender")
    constant = importlib.import_module("flwr.common.constant")
    interval = float(constant.HEARTBEAT_DEFAULT_INTERVAL)
    timeout, top = constant.HEARTBEAT_CALL_TIMEOUT, constant.HEARTBEAT_MAX_INTERVAL
    patience = float(constant.HEARTBEAT_PATIENCE)
    share, spread = constant.HEARTBEAT_BASE_MULTIPLIER, constant.HEARTBEAT_RANDOM_RANGE
    polls = switch("FEDHET_POLL_HEARTBEATS") if polls is None else polls

    def declared() -> float:
        """The interval a heartbeat declares now."""
        return float(min(top, round(interval * load.slowdown(), 1)))

    def wait_for(seconds: float) -> float:
        """Flower's wait after a heartbeat that declared ``seconds``."""
        return float((seconds - timeout) * (share + random.uniform(*spread)))

    class LoadAwareHeartbeats(base):  # type: ignore[misc, valid-type]
        sent = interval
        """The interval the last heartbeat declared: the SuperLink holds the node
        online for 2 x that, so the next heartbeat follows from it, not from the load
        seen since (a slow answer raises the slowdown; a wait for the new, longer
        interval would outlast the old one's 2 x and the node would go offline)."""
        beat: tuple[float, float] | None = None
        """The latest heartbeat that got through: when (``time.monotonic``) it was
        sent, and the interval it declared."""

        def declared(self) -> float:
            return declared()

        def _run(self) -> None:
            alive = polls_of(self.heartbeat_fn) if polls else None
            self._alive = alive
            while not self._stop_event.is_set():
                until = self.covered_until(alive)
                if until is not None:  # a held poll stands for this heartbeat
                    self._stop_event.wait(until - time.monotonic())
                    continue
                self._retry_invoker.invoke(self._heartbeat)
                self._stop_event.wait(self.wait())

        def wait(self) -> float:
            """Flower's rule for the interval the last heartbeat declared."""
            return wait_for(self.sent)

        def covered_until(self, alive: PollAlive | None) -> float | None:
            """Until when (``time.monotonic``) the client's latest held poll stands for
            the heartbeat due now (None: it does not; send it). The SuperLink holds
            the node online for 2 x the interval of its *latest* acknowledgement (a
            later one with a shorter interval shortens what an earlier one promised),
            so the rule follows the latest the node knows of, an answered poll's or a
            heartbeat's: with no poll in flight, that one's time + its wait, as for a
            heartbeat sent then. With one in flight (acknowledged on arrival and again
            as it is answered, but maybe lost on the way): that one's time + its
            interval + its wait, and no later than the poll's own time + its interval
            + its wait (it may have arrived, with its own interval), so that a
            heartbeat still reaches the SuperLink within the 2 x interval in force."""
            if alive is None:
                return None
            sent, seconds, in_flight, answered = alive.view()
            if sent is None:
                return None
            known = [answered] if answered is not None else []
            if self.beat is not None:
                known.append(self.beat)
            if not known:
                return None
            at, interval = max(known)  # the latest acknowledgement: the one in force
            if not in_flight:
                until = at + wait_for(interval)
            else:
                until = min(at + interval + wait_for(interval), sent + seconds + wait_for(seconds))
            return until if until > time.monotonic() else None

        def _heartbeat(self) -> None:
            latest = self.latest()
            self.sent = self.declared()
            replace(conn, "HEARTBEAT_DEFAULT_INTERVAL", self.sent)
            start, ok = time.monotonic(), False
            try:
                super()._heartbeat()
                self.beat, ok = (start, self.sent), True
            finally:
                end = time.monotonic()
                load.note(end - start)
                if latest is None:
                    HEARTBEATS.note(end - start, ok, None, 0.0)
                else:
                    HEARTBEATS.note(end - start, ok, end - latest[0], patience * latest[1])

        def latest(self) -> tuple[float, float] | None:
            """The latest acknowledgement the node knows of (its last heartbeat's or
            its last answered held poll's): when, and the interval it declared."""
            alive = getattr(self, "_alive", None)
            answered = alive.view()[3] if alive is not None else None
            known = [k for k in (self.beat, answered) if k is not None]
            return max(known) if known else None

    AliveInterval.declared = declared if polls else None
    replace(conn, "HeartbeatSender", LoadAwareHeartbeats)


def _noting(
    note_rtt: Callable[[float], None] | None, aware: bool
) -> Callable[[float], None] | None:
    """What a pull's round trip is told to: the warm connections, the load view."""
    if not aware:
        return note_rtt
    if note_rtt is None:
        return LOAD.note

    def both(seconds: float) -> None:
        note_rtt(seconds)
        LOAD.note(seconds)

    return both


def _arrived(paced: PacedSleep | None, held: HeldTasks | None) -> Callable[[str], None]:
    """What the node does as a message arrives: note its gap, wake a held request."""

    def arrived(kind: str) -> None:
        if paced is not None:
            paced.arrived(kind)
        if held is not None:
            held.ring()

    return arrived


def settled(sock: Any, wait_s: float) -> bool:
    """Whether a connection just opened is ready for the pool: with TLS 1.3 the
    server sends its session tickets after the handshake, and an idle connection
    with bytes to read looks closed to the pool (httpcore's ``has_expired``), which
    would drop it; read them (up to ``wait_s`` for the first). False: the server
    closed it, or sent what no request asked for."""
    import select
    import ssl

    if not isinstance(sock, ssl.SSLSocket):
        return True
    wait = wait_s
    try:
        while select.select([sock], [], [], wait)[0]:
            sock.setblocking(False)
            try:
                sock.recv(4096)
                return False  # data no request asked for, or b"": closed
            except ssl.SSLWantReadError:  # only TLS records (tickets): consumed
                pass
            finally:
                sock.setblocking(True)
            wait = 0.05
    except OSError:
        return False
    return True


def warm_before_idle(warm: WarmConnections) -> Callable[[float, float | None], None]:
    """Before an idle wait: the connections the next message's objects need, once it
    is due within the wait and :meth:`WarmConnections.lead` (at once when the node
    has no history)."""

    def before(wait: float, due_in: float | None) -> None:
        if due_in is None or due_in <= wait + warm.lead():
            warm.ensure(warm.pull_count + 1)

    return before


def warm_while_working(warm: WarmConnections) -> Callable[[], None]:
    """While the node waits for its task's reply: the connections the reply's
    objects need."""

    def waiting() -> None:
        warm.ensure(warm.push_count + 1)

    return waiting


def attach_client(warm: WarmConnections) -> None:
    """Give ``warm`` the node's Fleet API client when Flower makes it."""
    on_fleet_client(warm.attach)


def on_fleet_client(made: Callable[[Any, str], None]) -> None:
    """``made(client, base_url)`` with each Fleet API client Flower makes from now on
    (its ``httpx.Client`` and URL)."""
    module = importlib.import_module(FLEET_CONNECTION)
    base = flower_internal(FLEET_CONNECTION, "FleetHttpClient")

    class Noted(base):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made(self._client, self._base_url)

    replace(module, "FleetHttpClient", Noted)


def carried_node_objects() -> None:
    """Part ``carried-objects`` on a node: every Fleet API client made from now on
    asks for its messages' objects in its polls' answers and carries its replies'
    objects in their pushes (:mod:`common.carry`; a SuperLink that does not offer it
    gets Flower's requests), and the node's object pulls take those first."""
    on_fleet_client(
        lambda client, _url: carry.attach(
            client,
            (carry.FLEET_PULL,),
            (carry.FLEET_PUSH,),
            push_patience_s=carry.NODE_PUSH_PATIENCE_S,
        )
    )
    loop = importlib.import_module(SUPERNODE_LOOP)
    replace(loop, "pull_objects", carry.pulls(flower_internal(SUPERNODE_LOOP, "pull_objects")))


SUPERNODE_LOOP = "flwr.supernode.start_client_internal"


def switch(name: str, default: bool = True) -> bool:
    """An on/off environment variable (``1``/``0``, ``on``/``off``; unset: ``default``)."""
    text = os.environ.get(name, "").strip().lower()
    if not text:
        return default
    if text in ("1", "on", "true", "yes"):
        return True
    if text in ("0", "off", "false", "no"):
        return False
    raise SystemExit(f"{name}={text!r}: choose 1 (on) or 0 (off)")


FLEET_CONNECTION = "flwr.supernode.fleet_http_connection"
"""Where the SuperNode makes its Fleet API client (``FleetHttpClient``)."""
NODE_STATE = "flwr.supernode.nodestate.in_memory_nodestate"
"""The SuperNode's state (in memory in flwr 1.42.0): its error replies."""
RUNTIME_HANDLERS = "flwr.supernode.servicer.runtime.runtime_handlers"
"""The SuperNode's Runtime API handlers; its router looks ``acquire_task`` up there
on every request."""
