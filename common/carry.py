"""A message's objects carried in the request or answer that moves the message.

Flower 1.42 moves every object of a message in an HTTP request of its own: a node
polls (``pull-messages``), then asks for each of the message's objects
(``pull-object``); it pushes a reply (``push-messages``), then each of its objects
(``push-object``); the ServerApp pulls replies (``runtime/pull-messages``), then each
of their objects. With three objects a message that was about 11 of the 21
SuperLink requests per node-round at a thousand nodes (docs/deployment.md).

``fedhet superlink`` offers to carry them (its answers name :data:`OFFER`):

* a poll that asks (:data:`ASK`) gets its messages' objects appended to the answer,
  each read by Flower's own ``pull_object`` handler, up to :func:`budget` bytes an
  answer (the rest is pulled as before);
* a push whose body carries its message's objects (:data:`CARRIED`) has each object
  the SuperLink asks for stored by Flower's own ``push_object`` handler, and the
  answer asks for none of those.

It also takes confirmations along (its answers name :data:`CONFIRMS`): the ServerApp
confirms the replies of one pull in one request (:class:`Confirmations`), the first
as Flower does and the others' ids in :data:`CONFIRMED`, and a node's reply push
names the message it answers there (``cli.supernode.RunWatch``); each confirmed by
Flower's own handler.

The body is the request's or answer's protobuf (its length in :data:`CARRIED`)
followed by frames ``>HQ`` (id length, content length), id, content. A client keeps
what an answer carried for its thread (:data:`LOCAL`) and :func:`pulls` takes an
object from there before asking the SuperLink; a carried object whose content does
not hash to its id is dropped (pulled as before). A SuperLink that offers nothing
(Flower's own) gets Flower's requests unchanged.

Standard library only; Flower is imported on first use.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import time
from collections.abc import Callable, Iterable
from logging import WARNING
from typing import Any

from common import envvars

OFFER = "x-fedhet-carries"
"""Every answer of a SuperLink that carries objects names it (value ``1``)."""
ASK = "x-fedhet-carry"
"""A poll whose answer may carry its messages' objects (value ``1``)."""
CARRIED = "x-fedhet-carried"
"""The length of the protobuf at the start of a body that carries objects."""
CONFIRMS = "x-fedhet-confirms"
"""Every answer of a SuperLink that takes confirmations along names it (value ``1``)."""
CONFIRMED = "x-fedhet-confirmed"
"""A confirmation request's header: the ids of further messages it confirms (comma
separated, at most :data:`CONFIRMED_MAX`)."""
CONFIRMED_MAX = 1000
FLEET_CONFIRM = "/v1/fleet/confirm-message-received"
RUNTIME_CONFIRM = "/v1/runtime/confirm-message-received"
FLEET_PULL = "/v1/fleet/pull-messages"
FLEET_PUSH = "/v1/fleet/push-messages"
RUNTIME_PULL = "/v1/runtime/pull-messages"
RUNTIME_PUSH = "/v1/runtime/push-messages"
"""The Fleet (node) and Runtime (ServerApp) paths that move messages in flwr 1.42."""
FRAME = struct.Struct(">HQ")
RUNTIME_PATIENCE_S = 600.0
"""How long the ServerApp waits for the answer to a push or poll of its messages."""
NODE_PUSH_PATIENCE_S = 600.0
"""How long a node waits to send its carried reply and for the answer. The SuperLink
lets a push over its budget of incoming bytes wait unread (:data:`INFLIGHT_MB`): with
Flower's 30 s a node gave up on such a push and sent it again, and the new push
replaced the first one's object session, whose objects then failed (1,000 FedARA
nodes on one SuperLink lost 4 replies in round 1 so)."""
BUDGET_MB = 64.0
"""Bytes of objects one answer carries at most (``FEDHET_CARRY_MB``): a ServerApp's
pull of a thousand replies of a large model must not become one answer of gigabytes."""


class CarryError(ValueError):
    """A body that claims to carry objects and does not parse."""


def budget() -> int:
    """Bytes one answer carries at most (``FEDHET_CARRY_MB``; 0: carry nothing)."""
    return _megabytes("FEDHET_CARRY_MB", BUDGET_MB, "0: off")


def _megabytes(name: str, default: float, zero: str) -> int:
    return int(envvars.nonnegative(name, default, f"a number of megabytes ({zero})") * 2**20)


INFLIGHT_MB = 512.0
"""Bytes of objects all answers being made and sent may carry at once on a SuperLink
(``FEDHET_CARRY_INFLIGHT_MB``)."""


def inflight_budget() -> int:
    """Bytes all carried answers hold at most at once (``FEDHET_CARRY_INFLIGHT_MB``)."""
    return _megabytes("FEDHET_CARRY_INFLIGHT_MB", INFLIGHT_MB, "0: carry nothing")


def frame(proto: bytes, objects: Iterable[tuple[str, bytes]]) -> bytes:
    """``proto`` followed by each ``(object id, content)`` framed."""
    parts = [proto]
    for object_id, content in objects:
        key = object_id.encode("ascii")
        parts += [FRAME.pack(len(key), len(content)), key, content]
    return b"".join(parts)


def unframe(body: bytes, proto_length: int) -> tuple[bytes, dict[str, bytes]]:
    """The protobuf at the start of ``body`` and the objects framed after it."""
    if not 0 <= proto_length <= len(body):
        raise CarryError(f"carried body: protobuf length {proto_length} of {len(body)} bytes")
    view, pos, objects = memoryview(body), proto_length, {}
    while pos < len(body):
        if pos + FRAME.size > len(body):
            raise CarryError(f"carried body: a frame cut short at byte {pos}")
        key_length, length = FRAME.unpack_from(body, pos)
        start = pos + FRAME.size + key_length
        end = start + length
        if end > len(body):
            raise CarryError(f"carried body: an object cut short at byte {pos}")
        try:
            object_id = bytes(view[pos + FRAME.size : start]).decode("ascii")
        except UnicodeDecodeError:
            raise CarryError(
                f"carried body: an object id that is not ASCII at byte {pos}"
            ) from None
        objects[object_id] = bytes(view[start:end])
        pos = end
    return body[:proto_length], objects


def sound(object_id: str, content: bytes) -> bool:
    """``content`` hashes to ``object_id`` (Flower's object ids are SHA-256 hex)."""
    return hashlib.sha256(content).hexdigest() == object_id


class _Local(threading.local):
    def __init__(self) -> None:
        self.received: dict[str, bytes] = {}
        """What the last poll's answer on this thread carried."""
        self.outgoing: list[tuple[str, bytes]] | dict[str, Any] | None = None
        """What this thread's next push carries: ``(id, content)`` pairs, or Flower's
        objects by id (deflated as the push is sent)."""
        self.confirmed: list[str] | None = None
        """The further messages this thread's next confirmation (or a node's push)
        confirms."""
        self.confirms_offered = False
        """The SuperLink's last answer on this thread offered :data:`CONFIRMS` (a
        client attached by :func:`attach`)."""


LOCAL = _Local()


def attach(
    client: Any,
    pulls: tuple[str, ...],
    pushes: tuple[str, ...],
    patience_s: float | None = None,
    push_patience_s: float | None = None,
) -> None:
    """``client`` (an ``httpx.Client``) asks for carried objects on the paths in
    ``pulls`` and carries :attr:`_Local.outgoing` on the paths in ``pushes``, once
    the server's answers name :data:`OFFER`; with ``patience_s``, its requests on
    those paths wait that long for their answer at least (a push of a thousand
    messages with their objects takes the SuperLink more than Flower's 30 s when it
    is loaded: the client then sent it again, the new push took the messages'
    objects over from the first, whose carried objects were all refused and pushed
    one request each); ``push_patience_s`` the same for the paths in ``pushes`` alone.
    Patience covers sending the request too (a body the server leaves unread blocks
    its sender)."""
    offered = [False]
    send = client.send

    def sending(request: Any, *args: Any, **kwargs: Any) -> Any:
        path = request.url.path
        if path in (FLEET_CONFIRM, RUNTIME_CONFIRM, FLEET_PUSH) and LOCAL.confirmed:
            request.headers[CONFIRMED] = ",".join(LOCAL.confirmed)
        patience = patience_s if path in pulls else None
        if path in pushes:
            patience = max(patience_s or 0.0, push_patience_s or 0.0) or None
        if patience is not None:
            timeout = dict(request.extensions.get("timeout") or {})
            for phase in ("read", "write"):
                timeout[phase] = max(timeout.get(phase) or 0.0, patience)
            request.extensions["timeout"] = timeout
        if path in pulls:
            LOCAL.received = {}
            if offered[0]:
                request.headers[ASK] = "1"
        elif path in pushes:
            outgoing, LOCAL.outgoing = LOCAL.outgoing, None
            if offered[0] and outgoing:
                request = _carrying(client, request, outgoing)
        response = send(request, *args, **kwargs)
        offered[0] = response.headers.get(OFFER) == "1"
        LOCAL.confirms_offered = response.headers.get(CONFIRMS) == "1"
        length = response.headers.get(CARRIED)
        if length is not None and response.is_success and path in pulls:
            proto, objects = unframe(response.content, int(length))
            response._content = proto  # what Flower's client parses
            LOCAL.received.update((k, v) for k, v in objects.items() if sound(k, v))
        return response

    client.send = sending


class Confirmations:
    """A Runtime client's ``ConfirmMessageReceived(request)`` (Flower's ServerApp
    confirms each reply it pulled, a request each), gathered while the SuperLink
    takes confirmations along (:data:`CONFIRMS`): each is kept and answered at once,
    and :meth:`flush` (after each pull of replies) sends them in one request, the
    first as Flower's and the others' ids in :data:`CONFIRMED`. A SuperLink that
    does not offer it gets Flower's request for each, as before. The offer is the
    one the last answer on the calling thread made (the grid's own thread, which
    pulled the replies)."""

    def __init__(self, confirm: Callable[[Any], Any], answer: Callable[[], Any]):
        self.confirm, self.answer = confirm, answer
        self.kept: list[Any] = []
        self.lock = threading.Lock()

    def __call__(self, request: Any) -> Any:
        if not LOCAL.confirms_offered:
            return self.confirm(request)
        with self.lock:
            self.kept.append(request)
        return self.answer()

    def flush(self) -> int:
        """Send what was kept; the number of requests it took. One that fails is
        logged and not raised: the SuperLink deletes a run's objects when it ends."""
        with self.lock:
            kept, self.kept = self.kept, []
        sent = 0
        while kept:
            size = CONFIRMED_MAX + 1 if LOCAL.confirms_offered else 1
            batch, kept = kept[:size], kept[size:]
            LOCAL.confirmed = [r.message_object_id for r in batch[1:]]
            try:
                self.confirm(batch[0])
            except Exception as exc:  # noqa: BLE001 - cleanup only: the replies are in
                from flwr.common.logger import log

                log(WARNING, "fedhet: %d message(s) not confirmed: %s", len(batch), exc)
            finally:
                LOCAL.confirmed = None
            sent += 1
        return sent


def _carrying(client: Any, request: Any, objects: Any) -> Any:
    """``request`` with ``objects`` framed after its protobuf body."""
    if isinstance(objects, dict):
        objects = [(k, v.deflate()) for k, v in objects.items()]
    proto = request.content
    headers = dict(request.headers)
    headers.pop("content-length", None)
    headers[CARRIED] = str(len(proto))
    made = client.build_request(
        request.method, request.url, content=frame(proto, objects), headers=headers
    )
    made.extensions = request.extensions
    return made


def pulls(pull_objects: Callable[..., dict[str, bytes]]) -> Callable[..., dict[str, bytes]]:
    """Flower's ``pull_objects(object_ids, pull_object_fn, ...)`` that takes what this
    thread's last answer carried and asks the SuperLink only for the rest (one that
    does already is returned as it is)."""
    if getattr(pull_objects, "carried", False):
        return pull_objects

    def pull(
        object_ids: list[str], pull_object_fn: Any, *args: Any, **kwargs: Any
    ) -> dict[str, bytes]:
        received = LOCAL.received
        have = {i: received[i] for i in object_ids if i in received}
        for i, content in have.items():  # a large one is handed over, not kept: a node's
            if len(content) >= KEEP_BELOW:  # thread would hold the last message's bytes
                del received[i]  # until its next poll (a ServerApp's, up to the budget)
        rest = [i for i in object_ids if i not in have]
        if rest:
            have.update(pull_objects(rest, pull_object_fn, *args, **kwargs))
        return have

    pull.__wrapped__ = pull_objects  # type: ignore[attr-defined]
    pull.carried = True  # type: ignore[attr-defined]
    return pull


KEEP_BELOW = 64 * 1024
"""Carried objects smaller than this stay with the thread after they are taken, until
its next poll (another message of the same answer may share one: Flower stores an
object once); larger ones are handed over and dropped."""

CONTENT_WAIT_S = 10.0
"""How long a node's push waits for a reply's objects its store does not hold yet."""


def carrying_send(
    send: Callable[..., Any], store: Any, wait_s: float = CONTENT_WAIT_S, poll_s: float = 0.005
) -> Callable[..., Any]:
    """A node's ``send(message, object_tree, runtime)`` whose push carries every
    object of the message's tree that the node's ``store`` holds.

    A reply reaches the node's state before its objects are all in the store (the
    ClientApp pushes the message, then each object): an object still announced
    without content (``b""``) is waited for, every ``poll_s``, for at most ``wait_s``
    in all; what is still missing then goes as Flower sends it (a request each,
    after Flower's own wait). An object the store does not know is not carried."""
    from flwr.supercore.inflatable.inflatable_object import iterate_object_tree

    def content_of(object_id: str, deadline: float) -> bytes | None:
        while (content := store.get(object_id)) == b"" and time.monotonic() < deadline:
            time.sleep(poll_s)
        return bytes(content) if content else None

    def sending(message: Any, tree: Any, *args: Any, **kwargs: Any) -> Any:
        deadline = time.monotonic() + wait_s
        objects = []
        for node in iterate_object_tree(tree):
            content = content_of(node.object_id, deadline)
            if content is not None:
                objects.append((node.object_id, content))
        LOCAL.outgoing = objects
        try:
            return send(message, tree, *args, **kwargs)
        finally:
            LOCAL.outgoing = None

    return sending


def gathering(nested: Callable[[Any], dict[str, Any]]) -> Callable[[Any], dict[str, Any]]:
    """Flower's ``get_all_nested_objects`` that also adds what it finds to this
    thread's :attr:`_Local.outgoing` while that is a dict (the ServerApp's push of
    messages: :meth:`server_app.grid.PollingGrid.push_messages` opens it; one that
    does already is returned as it is)."""
    if getattr(nested, "carried", False):
        return nested

    def gather(obj: Any) -> dict[str, Any]:
        found = nested(obj)
        out = LOCAL.outgoing
        if isinstance(out, dict):
            for key, value in found.items():
                out.setdefault(key, value)
        return found

    gather.__wrapped__ = nested  # type: ignore[attr-defined]
    gather.carried = True  # type: ignore[attr-defined]
    return gather
