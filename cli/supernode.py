"""``fedhet supernode``: Flower's SuperNode, paced, and told when its task's run stops.

* :func:`run_supernode`: Flower's ``flower-supernode`` (same flags) with its reply waits
  (0.5 s) capped at ``poll`` seconds, its idle pull (3 s) paced by when its next
  message is due (:class:`PacedSleep`, :mod:`cli.pacing`), and its object pulls with
  :data:`common.flower_runtime.PULL_BACKOFF`.
* Its executor's task requests are held (:class:`HeldTasks`): a SuperExec that asks
  for a task while there is none gets its answer when a message arrives, or after
  :data:`TASK_HOLD_S` without one, instead of polling (Flower's SuperExec, the warm
  executor or any other: the answer is Flower's own).
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
import sys
import threading
import time
import types
from collections.abc import Callable
from logging import DEBUG, INFO, WARNING
from typing import Any

from cli.pacing import (
    FAST_GROWTH,
    Gaps,
    fast_polls,
    idle_interval,
    idle_poll_s,
    informed_interval,
)
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


class PacedSleep(types.ModuleType):
    """``time`` for Flower's SuperNode loop: a wait inside a task (Flower asks for
    0.5 s) is capped at ``poll`` seconds and marks the node active (its reply goes out
    right after); the idle wait between two pulls (Flower's 3 s) lasts until the next
    message is due (:func:`informed_interval`, from the gaps :meth:`arrived` has
    seen; ``fast``: :func:`idle_interval` from the reply on), at most ``cap``."""

    def __init__(
        self, real: types.ModuleType, poll: float, cap: float | None = None, fast: bool = False
    ) -> None:
        super().__init__("time")
        self.__dict__.update(vars(real))
        self._real, self._poll, self._fast = real, poll, fast
        self._cap = FLOWER_IDLE_PULL_S if fast else (idle_poll_s() if cap is None else cap)
        self.last_active = real.monotonic()
        self.gaps = Gaps()
        self.replied: str | None = None
        """Kind of the message the node last worked on (None: none yet)."""
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
        return informed_interval(self._poll, since, self.gaps.expected(self.replied), self._cap)

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

    def ring(self) -> None:
        with self._cond:
            self._rings += 1
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
            if answer.HasField("task") or left <= 0:
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
    error reply for its message at once, as Flower's node does only when the task's
    token expires (about 60 s later); everything else is Flower's own handler."""

    def __init__(
        self, push: Callable[..., Any], on_failed: Callable[[], None] | None = None
    ) -> None:
        self._push, self._on_failed = push, on_failed

    def __call__(self, request: Any, state: Any, task: Any) -> Any:
        answer = self._push(request, state, task)
        failed = flower_internal("flwr.common.constant", "SubStatus").FAILED
        client_app = flower_internal("flwr.supercore.constant", "TaskType").CLIENT_APP
        if request.sub_status == failed and task.type == client_app:
            crashed = flower_internal(NODE_STATE, "CLIENT_APP_CRASHED_ERROR")
            error = type(crashed)(code=crashed.code, reason=f"ClientApp crashed: {request.details}")
            state._store_error_replies({task.run_id}, error)
            log(
                INFO, "fedhet: task %d failed (%s): error reply sent", task.task_id, request.details
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
        if not message.metadata.reply_to_message_id:
            self.messages.append(message.metadata.message_id)
        return stored

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

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)


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
    ) -> None:
        self._pull, self._push = pull, push
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
            got = receive()
            if got is not None:
                received.append(got[0].metadata.message_id)
                kinds.append(str(got[0].metadata.message_type).split(".")[0])
            return got

        bound.arguments["receive"] = receive_and_note
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
        run_id = self._pull(*bound.args, **bound.kwargs)
        if run_id is None and noted is not None and noted.tasks:
            self._abandon(state, bound.arguments.get("object_store"), noted)
        self.run_id = run_id
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
        if noted.messages:
            state.delete_messages(message_ids=list(noted.messages))
            if store is not None:
                for message_id in noted.messages:
                    store.delete(message_id)
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
        for it before the reply goes out)."""

        def send(run_id: int, message_id: str) -> None:
            try:
                confirm(run_id, message_id)
            except Exception as exc:  # noqa: BLE001 - the SuperLink cleans up by its TTL
                log(WARNING, "fedhet: could not confirm message %s: %s", message_id, exc)

        def later(run_id: int, message_id: str) -> None:
            self.confirmed()
            self._confirming = threading.Thread(
                target=send, args=(run_id, message_id), daemon=True, name="fedhet-confirm"
            )
            self._confirming.start()

        return later

    def confirmed(self) -> None:
        """Wait until the last confirmation sent by :meth:`_confirm_later` is done."""
        if self._confirming is not None:
            self._confirming.join()
            self._confirming = None

    def push(self, *args: Any, **kwargs: Any) -> None:
        """Flower's ``_push_messages``, or a return without a reply once the task's
        run is no longer running."""
        bound = self._push_sig.bind(*args, **kwargs)
        state, store = bound.arguments["state"], bound.arguments["object_store"]
        next_check = self._clock() + self.interval
        while not (replies := self._fresh(state, store)):
            if self._clock() >= next_check:
                if not self.running():
                    self._stop(state, store)
                    return
                next_check = self._clock() + self.interval
            self._sleep(FLOWER_REPLY_WAIT_S)
        self.confirmed()
        bound.arguments["state"] = _TakenReplies(state, replies)
        self._push(*bound.args, **bound.kwargs)

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
        for reply in state.get_messages_legacy(is_reply=True):
            if reply.metadata.reply_to_message_id in self.dropped:
                self.dropped.discard(reply.metadata.reply_to_message_id)
                state.delete_messages(message_ids=[reply.metadata.message_id])
                store.delete(reply.metadata.message_id)
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
        state.delete_messages(message_ids=list(self.message_ids))
        for message_id in self.message_ids:
            store.delete(message_id)
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
    ``FEDHET_NODE_POLL=fast``: the polling fedhet had before (no held requests)."""
    name = "flwr.supernode.start_client_internal"
    module = importlib.import_module(name)
    fast = fast_polls()
    early, along = switch("FEDHET_EARLY_TASK"), switch("FEDHET_CONFIRM_ALONG")
    paced = PacedSleep(flower_internal(name, "time"), poll, fast=fast)
    setattr(module, "time", paced)  # noqa: B010
    count = object_concurrency()
    if count is None:
        fast_object_pulls(name, "pull_objects")
    else:
        concurrent_objects(name, "pull_objects", "push_object_contents_from_iterable", count=count)
    held: HeldTasks | None = None
    handlers = importlib.import_module(RUNTIME_HANDLERS)
    if not fast:
        held = HeldTasks(flower_internal(RUNTIME_HANDLERS, "acquire_task"))
        setattr(handlers, "acquire_task", held)  # noqa: B010
    failed = FailedTasks(
        flower_internal(RUNTIME_HANDLERS, "push_task_output"),
        on_failed=held.ring if held is not None else None,
    )
    setattr(handlers, "push_task_output", failed)  # noqa: B010

    def arrived(kind: str) -> None:
        paced.arrived(kind)
        if held is not None:
            held.ring()

    watch = RunWatch(
        flower_internal(name, "_pull_and_store_message"),
        flower_internal(name, "_push_messages"),
        sleep=paced.sleep,
        on_message=arrived,
        on_stop=held.ring if held is not None else None,
        on_stored=held.ring if held is not None and early else None,
        confirm_along=along,
    )
    setattr(module, "_pull_and_store_message", watch.pull)  # noqa: B010
    setattr(module, "_push_messages", watch.push)  # noqa: B010
    sys.argv = ["flower-supernode", *argv]
    flower_internal("flwr.supernode.cli.flower_supernode", "flower_supernode")()


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


NODE_STATE = "flwr.supernode.nodestate.in_memory_nodestate"
"""The SuperNode's state (in memory in flwr 1.42.0): its error replies."""
RUNTIME_HANDLERS = "flwr.supernode.servicer.runtime.runtime_handlers"
"""The SuperNode's Runtime API handlers; its router looks ``acquire_task`` up there
on every request."""
