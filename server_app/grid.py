"""A Grid that collects replies when they are due.

Flower 1.42's HTTP grid (what a ServerApp gets in a deployment) polls for replies
every 3 s inside ``send_and_receive``; the simulation's in-memory grid every 0.1 s.
:class:`PollingGrid` wraps whichever grid the ServerApp receives and implements
``send_and_receive`` with the public ``push_messages`` / ``pull_messages``, so a
deployment round does not wait up to 3 s per phase for nothing, and does not poll
the SuperLink while no reply can be there either (run-config ``reply-poll``):

* ``informed`` (default): a phase ends with its last reply, so early replies cost
  nothing by waiting. The grid remembers how long each kind of phase (``train``,
  ``evaluate``, ...) took to its last reply, and polls ever closer to
  :data:`LEAD` x that time (each wait half the time left), then every
  ``interval``, backing off by :data:`GROWTH` per second overdue, at most
  :data:`CAP_S`. With no history (a run's first round) it backs off from the push on.
* ``fixed``: every ``interval`` (0.1 s) from the push on;
* ``flower``: Flower's own ``send_and_receive`` (3 s in a deployment).

The reply objects it pulls are retried with the node side's short backoff
(``common.flower_runtime.PULL_BACKOFF``: 0.05 s doubling to 0.5 s, not Flower's 1 s
doubling to 10 s), and it moves
:data:`~common.flower_runtime.OBJECT_CONCURRENCY` objects at once (Flower: 2).
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Iterable
from logging import WARNING
from typing import Any

from flwr.app import Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.supercore.run import Run

from common import carry, flower_gate
from common.flower_runtime import concurrent_objects, fast_object_pulls, object_concurrency
from common.packing import PackingError, is_packed, pack, unpack

REPLY_POLLS = ("informed", "fixed", "flower")
HTTP_GRID = "flwr.superlink.grid.http_grid"
MESSAGE_PB = "flwr.proto.message_pb2"
LEAD = 0.8
"""Fast polls start at this share of the phase's expected time to its last reply."""
GROWTH = 0.05
"""An overdue phase's poll interval grows by this many seconds per second overdue."""
CAP_S = 3.0
"""The longest wait between two polls (Flower's own interval)."""


def reply_wait(interval: float, elapsed: float, expected: float | None) -> float:
    """How long to wait before the next poll, ``elapsed`` seconds into a phase whose
    last reply is expected ``expected`` seconds after the push (None: unknown)."""
    if expected is not None and elapsed < LEAD * expected:
        return min(CAP_S, max(interval, (LEAD * expected - elapsed) / 2))
    overdue = elapsed - (LEAD * expected if expected is not None else 0.0)
    return min(CAP_S, interval + GROWTH * overdue)


class PhaseBoundPulls:
    """Flower's ``pull_objects`` as the ServerApp's HTTP grid calls it, giving up on a
    reply's objects at the phase's deadline (``round-timeout``): Flower's grid then
    turns that reply into an error reply and the round goes on without it. Measured at
    100 nodes: a reply whose object push the SuperLink refused (its SQLite state locked)
    had its message but never its objects, and the pull waited on them for up to about
    5,000 s (the backoff's patience) with the round stalled."""

    def __init__(self, pulls: Any, grid: PollingGrid) -> None:
        self.pulls, self.grid = pulls, grid
        self.func = getattr(pulls, "func", pulls)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        deadline = self.grid.deadline
        if deadline is not None and "max_time" not in kwargs:
            kwargs["max_time"] = max(1.0, deadline - time.monotonic())
        return self.pulls(*args, **kwargs)


class UnpackOnArrival:
    """Flower's ``inflate_object_from_contents`` in the grid's module, unpacking a
    packed message as it is inflated (part ``unpack-on-arrival``). A pull inflates all
    the replies it brought before it returns: packed, a pull of 300 FedARA replies
    held 300 packed copies until the grid unpacked them (traced: 708 MB in 91 blocks
    at N = 100). One that does not unpack stays packed, for the grid to reject."""

    def __init__(self, inflate: Any) -> None:
        self.inflate = inflate

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        found = self.inflate(*args, **kwargs)
        if isinstance(found, Message) and found.has_content() and is_packed(found.content):
            with contextlib.suppress(PackingError):
                found.content = unpack(found.content)
        return found


class PollingGrid(Grid):
    """``grid`` with ``send_and_receive`` polling by ``mode`` (:data:`REPLY_POLLS`);
    every other method is the wrapped grid's."""

    def __init__(
        self, grid: Grid, interval: float = 0.1, mode: str = "informed", pack: bool = False
    ) -> None:
        if mode not in REPLY_POLLS:
            raise ValueError(f"reply-poll {mode!r}: choose one of {list(REPLY_POLLS)}")
        self._grid, self._interval, self.mode = grid, interval, mode
        self.pack = pack
        """Messages go out packed (``common/packing.py``), replies are unpacked."""
        self._sent: dict[str, Message] = {}
        self.expected: dict[str, float] = {}
        """Phase kind -> seconds from its push to its last reply, last time."""
        self.polls = 0
        """Reply polls sent so far (``pull_messages`` calls)."""
        count = object_concurrency()
        if not flower_gate.use("server-objects"):
            pass  # Flower's own object concurrency and backoff (one warning line)
        elif count is None:
            fast_object_pulls(HTTP_GRID, "pull_objects")
        else:
            concurrent_objects(HTTP_GRID, "pull_objects", "push_objects", count=count)
        self.deadline: float | None = None
        """When the phase in progress gives up (``round-timeout``; monotonic seconds)."""
        self.carrying = False
        """Pushes carry their messages' objects (part ``carried-objects``)."""
        self.confirmations: carry.Confirmations | None = None
        """The replies a pull confirms, in one request (part ``carried-confirmations``)."""
        client = getattr(getattr(grid, "_runtime_client", None), "_client", None)
        if client is not None and flower_gate.use("carried-objects"):
            # replies' objects in the poll's answer, messages' objects in their push
            carry.attach(
                client,
                (carry.RUNTIME_PULL,),
                (carry.RUNTIME_PUSH,),
                patience_s=carry.RUNTIME_PATIENCE_S,
            )
            self.carrying = True
            if flower_gate.use("carried-confirmations"):  # a pull's replies, one request
                runtime = grid._runtime_client  # type: ignore[attr-defined]
                self.confirmations = carry.Confirmations(
                    runtime.ConfirmMessageReceived,
                    importlib.import_module(MESSAGE_PB).ConfirmMessageReceivedResponse,
                )
                runtime.ConfirmMessageReceived = self.confirmations
            module = importlib.import_module(HTTP_GRID)
            nested = carry.gathering(module.get_all_nested_objects)
            flower_gate.replace(module, "get_all_nested_objects", nested)
            pulls = module.pull_objects
            base = pulls.pulls if isinstance(pulls, PhaseBoundPulls) else pulls
            flower_gate.replace(module, "pull_objects", carry.pulls(base))
        if pack and flower_gate.use("unpack-on-arrival"):
            module = importlib.import_module(HTTP_GRID)
            inflate = module.inflate_object_from_contents
            base = inflate.inflate if isinstance(inflate, UnpackOnArrival) else inflate
            flower_gate.replace(module, "inflate_object_from_contents", UnpackOnArrival(base))
        if count is not None or self.mode != "flower":
            module = importlib.import_module(HTTP_GRID)
            if hasattr(module, "pull_objects"):
                pulls = module.pull_objects
                base = pulls.pulls if isinstance(pulls, PhaseBoundPulls) else pulls
                flower_gate.replace(module, "pull_objects", PhaseBoundPulls(base, self))

    def set_run(self, run: Run) -> None:
        self._grid.set_run(run)

    @property
    def run(self) -> Run:
        return self._grid.run

    def create_message(self, *args, **kwargs) -> Message:  # type: ignore[no-untyped-def]
        return self._grid.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        return self._grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        if not self.pack:
            return self._pushed(messages)
        messages = list(messages)
        shared: dict = {}  # nodes sent the same arrays share one packed array
        for message in messages:
            if message.has_content() and not is_packed(message.content):
                message.content = pack(message.content, shared=shared)
        ids = list(self._pushed(messages))
        self._sent.update((i, m) for i, m in zip(ids, messages, strict=False) if i)
        return ids

    def _pushed(self, messages: Iterable[Message]) -> Iterable[str]:
        """The wrapped grid's push, its messages' objects carried in its request."""
        if not self.carrying:
            return self._grid.push_messages(messages)
        carry.LOCAL.outgoing = {}  # filled as Flower's grid gathers the objects
        try:
            return self._grid.push_messages(messages)
        finally:
            carry.LOCAL.outgoing = None

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = list(self._grid.pull_messages(message_ids))
        if self.confirmations is not None:
            self.confirmations.flush()
        if not self.pack:
            return replies
        return [self._unpacked(reply) for reply in replies]

    def _unpacked(self, reply: Message) -> Message:
        """``reply`` with its content unpacked; one that does not unpack becomes an
        error reply naming why (logged, never aggregated)."""
        sent = self._sent.pop(reply.metadata.reply_to_message_id, None)
        if not reply.has_content() or not is_packed(reply.content):
            return reply
        try:
            reply.content = unpack(reply.content)
            return reply
        except PackingError as exc:
            why = f"node {reply.metadata.src_node_id}: its reply does not unpack ({exc})"
            log(WARNING, "fedhet: %s; rejected", why)
            if sent is None:
                reply.content = RecordDict()
                return reply
            error = Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, why), reply_to=sent)
            error.metadata.__dict__["_src_node_id"] = reply.metadata.src_node_id
            return error

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Push, then pull (by :attr:`mode`) until every reply is in or ``timeout``
        (seconds, None: no limit) has passed."""
        if self.mode == "flower":
            try:
                return self._grid.send_and_receive(messages, timeout=timeout)
            finally:
                if self.confirmations is not None:
                    self.confirmations.flush()
        messages = list(messages)
        kind = str(messages[0].metadata.message_type).split(".")[0] if messages else ""
        expected = self.expected.get(kind) if self.mode == "informed" else None
        start = time.monotonic()
        pending = set(self.push_messages(messages))
        deadline = None if timeout is None else start + timeout
        self.deadline = deadline
        replies: list[Message] = []
        while pending:
            got = list(self.pull_messages(pending))
            self.polls += 1
            replies += got
            pending -= {m.metadata.reply_to_message_id for m in got}
            now = time.monotonic()
            if not pending:
                self.expected[kind] = now - start
                break
            if deadline is not None and now >= deadline:
                break
            wait = (
                reply_wait(self._interval, now - start, expected)
                if self.mode == "informed"
                else self._interval
            )
            time.sleep(wait if deadline is None else max(0.0, min(wait, deadline - now)))
        return replies
