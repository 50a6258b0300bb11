"""Deployment at simulation speed: a warm ClientApp executor and fast polling.

Flower 1.42 runs every ClientApp task (train or evaluate, per node) in a fresh
``flwr-clientapp`` process that imports torch and flwr again (seconds on a Raspberry
Pi), and polls at fixed intervals: SuperNode idle pull 3 s, SuperExec task poll 1 s,
the ServerApp's HTTP grid 3 s. This module removes both costs without patching
Flower's files:

* :class:`WarmExecutor`: the SuperExec executor of ``fedhet superexec``. It keeps one
  warm parent per SuperNode (a ``multiprocessing`` fork server that has imported
  torch, numpy and flwr, and never the app's own modules, so the code that travels
  in each run's FAB is what every task imports) and starts each ClientApp task as a
  fresh child forked from it, running Flower's own ``flwr-clientapp`` entry with
  exactly the arguments Flower's subprocess executor would pass (TLS settings
  included). Every task still gets a fresh process; only the import cost is paid
  once. Other task types go to Flower's subprocess executor.
* :func:`run_superexec`: Flower's SuperExec with that executor; it asks its SuperNode
  for a task 0.05 s after the last one ended, later ever less often (see
  :func:`idle_interval`), and while a task's child runs it waits on that child
  instead of polling (a SuperNode hands out its next task only after the reply).
* :func:`run_supernode`: Flower's SuperNode with its reply waits (0.5 s) capped at
  ``poll`` seconds and its idle pull (3 s) paced by :func:`idle_interval`.
* ``flwr stop``: Flower's SuperNode waits for its task's reply for ever and pulls
  nothing meanwhile, so a stopped run's task trained on and held the next run back.
  Here the SuperNode asks the SuperLink every :data:`STOP_CHECK_S` seconds while it
  waits whether the run still runs (:class:`RunWatch`); once it does not, the node
  finishes the run's tasks (stopped) and goes on with the next message. The warm
  executor sends a task heartbeat for each running child every
  :data:`TASK_BEAT_S` seconds with the child's token and ends a child whose task the
  node has finished (:data:`STOP_GRACE_S`, then SIGTERM, then SIGKILL).
* ``server_app.grid.PollingGrid`` (server side): ``send_and_receive`` that polls
  replies every 0.1 s through Flower's public Grid API.

What it relies on in ``flwr==1.42.0`` is listed in :data:`FLOWER_INTERNALS` and
checked by a test, which names any symbol a future Flower moves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import multiprocessing
import multiprocessing.connection
import os
import sys
import time
import types
from collections.abc import Callable
from logging import DEBUG, ERROR, INFO, WARNING
from typing import Any

FLOWER_INTERNALS = (
    ("flwr.supercore.superexec.run_superexec", "get_executor"),
    ("flwr.supercore.superexec.executor.subprocess_executor", "SubprocessExecutor"),
    ("flwr.supercore.superexec.executor.subprocess_executor", "subprocess"),
    ("flwr.supercore.superexec.executor.types", "LaunchResult"),
    ("flwr.supercore.cli.flower_superexec", "flower_superexec"),
    ("flwr.supercore.constant", "ExecutorType"),
    ("flwr.supercore.constant", "TaskType"),
    ("flwr.supernode.cli", "flwr_clientapp"),
    ("flwr.supernode.cli.flower_supernode", "flower_supernode"),
    ("flwr.supernode.start_client_internal", "time"),
    ("flwr.supernode.start_client_internal", "pull_objects"),
    ("flwr.supernode.runtime.run_clientapp", "pull_and_inflate_object_from_tree"),
    ("flwr.supernode.runtime.run_clientapp", "push_task_output"),
    ("flwr.superlink.grid.http_grid", "pull_objects"),
    ("flwr.supernode.start_client_internal", "_pull_and_store_message"),
    ("flwr.supernode.start_client_internal", "_push_messages"),
    ("flwr.supercore.run", "RunNotRunningException"),
    ("flwr.common.constant", "Status"),
    ("flwr.common.constant", "SubStatus"),
    ("flwr.supercore.runtime", "RuntimeHttpClient"),
    ("flwr.supercore.interceptors", "RuntimeTokenHttpInterceptor"),
    ("flwr.supercore.interceptors", "RuntimeVersionHttpInterceptor"),
    ("flwr.proto.runtime_pb2", "SendTaskHeartbeatRequest"),
)
"""``(module, attribute)`` pairs of Flower 1.42.0 this module uses or replaces."""

PRELOAD = [
    "numpy",
    "torch",
    "torch._dynamo",
    "flwr.app",
    "flwr.clientapp",
    "flwr.supernode.cli",
]
"""What the warm parent imports once (never the app's own packages). ``torch._dynamo``
(with sympy and torch._inductor) is what the first ``torch.optim`` optimiser of a
process imports: 2-3 s here that every training task would pay again; importing it
starts no thread."""

TASK_POLL_S = "0.05"
SUPERNODE_POLL_S = 0.05
IDLE_GROWTH = 0.05
"""An idle poll comes ``IDLE_GROWTH`` x the time since the last task after the
previous one (plus the base poll), up to Flower's own interval: 0.05 s right after a
reply, 0.1 s after 1 s idle, 3 s after about a minute. Within a round a node waits
for a few seconds at most and answers at once; an idle federation costs what stock
Flower's does (3 SuperNodes polling every 0.05 s for ever took 76 % of a core here,
a third of it in the SuperLink answering them; Flower's intervals 4 %)."""
FLOWER_IDLE_PULL_S = 3.0
"""The SuperNode's idle wait between two pulls in flwr 1.42.0
(``start_client_internal``); its other waits (0.5 s) are inside a task."""
FLOWER_TASK_POLL_S = 1.0
"""The SuperExec's task poll in flwr 1.42.0 (``run_superexec``)."""
FLOWER_REPLY_WAIT_S = 0.5
"""The SuperNode's wait between two looks for its task's reply in flwr 1.42.0
(``_push_messages``), capped at the ``poll`` of :func:`run_supernode`."""

STOP_CHECK_S = 2.0
"""While its task runs, a SuperNode asks the SuperLink this often whether the task's
run still runs (one small Fleet request per node; Flower's own node heartbeat is
every 30 s). A stopped run's task ends on the node within this time."""
TASK_BEAT_S = 1.0
"""The warm executor sends a task heartbeat (to its own SuperNode, loopback) for each
running child this often; the node answers ``success=False`` once it has finished
that task (a stopped run's, or one that ended)."""
STOP_GRACE_S = 2.0
"""A child whose task the node has finished gets this long to exit by itself (a task
that completed normally finishes its task just before its process exits) before
SIGTERM."""
KILL_AFTER_S = 3.0
"""SIGKILL for a child still alive this long after its SIGTERM."""


def idle_interval(base: float, idle_s: float, cap: float) -> float:
    """The poll interval after ``idle_s`` seconds without a task."""
    return min(cap, base + IDLE_GROWTH * max(0.0, idle_s))


PULL_BACKOFF = {"initial_backoff": 0.05, "backoff_cap": 0.5, "max_tries_per_object": 10_000}
"""Object pulls retry a missing object after 0.05 s, doubling to at most 0.5 s (Flower:
1 s doubling to 10 s, 500 tries; 10,000 tries at 0.5 s keep its patience of about
5,000 s). A SuperNode lists a task before it has pulled the message's objects from the
SuperLink, so a ClientApp that starts at once often finds an object missing and, with
Flower's backoff, waited 1 s or 1 + 2 s for it on every message."""


def log(level: int, msg: str, *args: Any) -> None:
    """Flower's logger, imported on first use (this module imports only the standard
    library at import time: it is the warm parent's main module)."""
    from flwr.common.logger import log as flower_log

    flower_log(level, msg, *args)


def flower_internal(module: str, name: str) -> Any:
    """``module.name`` or an error naming the symbol Flower moved."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise RuntimeError(
            f"fedhet's warm executor needs {module}.{name} (flwr 1.42.0); this Flower "
            f"does not have it ({exc}). Use `fedhet federation --cold` or pin flwr==1.42.0."
        ) from None


# --------------------------------------------------------------------- executor


def fast_object_pulls(module_name: str, name: str) -> None:
    """Replace ``module_name.name`` (Flower's ``pull_objects`` or
    ``pull_and_inflate_object_from_tree``, as that module imported it) by the same
    function with :data:`PULL_BACKOFF`; only that module's reference changes."""
    module = importlib.import_module(module_name)
    pull = flower_internal(module_name, name)
    if isinstance(pull, functools.partial):
        return  # already done in this process
    try:
        inspect.signature(pull).bind_partial(**PULL_BACKOFF)
    except TypeError as exc:
        raise RuntimeError(
            f"fedhet needs flwr==1.42.0: {module_name}.{name} no longer takes "
            f"{sorted(PULL_BACKOFF)} ({exc})"
        ) from None
    setattr(module, name, functools.partial(pull, **PULL_BACKOFF))


def _clientapp_child(argv: list[str], quiet: bool, finishing: Any = None) -> None:
    """A forked child: Flower's own ``flwr-clientapp`` for one task (its object pulls
    with :data:`PULL_BACKOFF`). ``finishing`` (an event) is set as the child reports
    its task's end to the node: from then on the task is finished there while the
    child still exits, and the executor sends no more heartbeats for it."""
    os.environ["FLWR_TELEMETRY_ENABLED"] = "0"  # its exit path would wait up to 4 s
    fast_object_pulls("flwr.supernode.runtime.run_clientapp", "pull_and_inflate_object_from_tree")
    if finishing is not None:
        module = importlib.import_module("flwr.supernode.runtime.run_clientapp")
        push_task_output = flower_internal(module.__name__, "push_task_output")

        def push_and_tell(*args: Any, **kwargs: Any) -> Any:
            finishing.set()
            return push_task_output(*args, **kwargs)

        setattr(module, "push_task_output", push_and_tell)  # noqa: B010
    if quiet:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    sys.argv = argv
    flower_internal("flwr.supernode.cli", "flwr_clientapp")()


def flower_command(spec: Any) -> tuple[list[str], bool]:
    """The ``flwr-clientapp`` command line Flower's subprocess executor would run for
    ``spec`` (captured from that executor itself), and whether output is suppressed."""
    module = importlib.import_module("flwr.supercore.superexec.executor.subprocess_executor")
    seen: list[tuple[list[str], bool]] = []

    def record(args: list[str], **kwargs: Any) -> None:
        seen.append((list(args), "stdout" in kwargs))

    real = flower_internal(module.__name__, "subprocess")
    setattr(module, "subprocess", types.SimpleNamespace(Popen=record, DEVNULL=real.DEVNULL))  # noqa: B010
    try:
        module.SubprocessExecutor().launch(spec)
    finally:
        setattr(module, "subprocess", real)  # noqa: B010
    if len(seen) != 1:
        raise RuntimeError("Flower's subprocess executor did not build one command")
    return seen[0]


class TaskBeat:
    """Task heartbeats for one child, sent with that child's task token to its
    SuperNode's Runtime API (what the child's own heartbeat thread sends every 24 s)."""

    def __init__(self, spec: Any) -> None:
        self._spec = spec
        self._client: Any = None

    def __call__(self) -> bool | None:
        """True while the node runs the task; False once the node has finished it (or
        no longer knows its token); None when the node did not answer."""
        import httpx

        try:
            if self._client is None:
                self._client = self._connect()
            request = flower_internal("flwr.proto.runtime_pb2", "SendTaskHeartbeatRequest")()
            return bool(self._client.SendTaskHeartbeat(request).success)
        except httpx.HTTPStatusError as exc:
            # finishing a task revokes its token: the node answers 401 from then on
            return False if exc.response.status_code == httpx.codes.UNAUTHORIZED else None
        except (httpx.HTTPError, OSError):
            return None

    def _connect(self) -> Any:
        """A Runtime API client without retries (Flower's retry invoker would signal
        this process on a 401)."""
        client_type = flower_internal("flwr.supercore.runtime", "RuntimeHttpClient")
        token = flower_internal("flwr.supercore.interceptors", "RuntimeTokenHttpInterceptor")
        version = flower_internal("flwr.supercore.interceptors", "RuntimeVersionHttpInterceptor")
        spec = self._spec
        root = None
        if not spec.insecure and spec.root_certificates_path:
            with open(spec.root_certificates_path, "rb") as fh:
                root = fh.read()
        return client_type.from_server_address(
            server_address=spec.runtime_api_address,
            insecure=spec.insecure,
            root_certificates=root,
            interceptors=[version(component_name="SuperExec"), token(spec.token)],
        )

    def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
            self._client = None


@dataclasses.dataclass
class TaskChild:
    """A task's child process and what the executor has learnt about its task."""

    task_id: int
    process: Any
    beat: Callable[[], bool | None] | None = None
    """Task heartbeat (:class:`TaskBeat`); None: the child is never checked."""
    next_beat: float = 0.0
    finishing: Any = None
    """Event the child sets as it reports its task's end (then it is not checked)."""
    finished_at: float | None = None
    """When the node first answered that this task is finished."""
    terminated_at: float | None = None
    killed: bool = False

    def due(self) -> float:
        """When :meth:`WarmExecutor.watch` has something to do for this child."""
        if self.beat is None or self.killed:
            return float("inf")
        if self.finished_at is None:
            if self.finishing is not None and self.finishing.is_set():
                return float("inf")  # ending by itself; its token is revoked now
            return self.next_beat
        if self.terminated_at is None:
            return self.finished_at + STOP_GRACE_S
        return self.terminated_at + KILL_AFTER_S

    def close(self) -> None:
        with contextlib.suppress(Exception):
            getattr(self.beat, "close", lambda: None)()
        with contextlib.suppress(Exception):
            self.process.close()


class WarmExecutor:
    """SuperExec executor: ClientApp tasks as children of a warm fork server."""

    def __init__(
        self, heartbeat: Callable[[Any], Callable[[], bool | None]] | None = TaskBeat
    ) -> None:
        self._log = log  # Flower's logger (tests replace it)
        self._heartbeat = heartbeat
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(PRELOAD)
        self._children: list[TaskChild] = []
        self._fallback = flower_internal(
            "flwr.supercore.superexec.executor.subprocess_executor", "SubprocessExecutor"
        )()
        self._result = flower_internal("flwr.supercore.superexec.executor.types", "LaunchResult")
        self._client_task = flower_internal("flwr.supercore.constant", "TaskType").CLIENT_APP
        self._last_active = time.monotonic()
        start = time.perf_counter()
        self._ctx.Process(target=_noop).start()  # start the warm parent now, not on task 1
        log(INFO, "fedhet warm executor: parent ready in %.1f s", time.perf_counter() - start)

    def get_eligible_capacity(
        self,
        supported_task_types: set[Any],
        *,
        insecure: bool = False,
        root_certificates_path: str | None = None,
    ) -> tuple[set[Any], set[str]]:
        del insecure, root_certificates_path
        self.pace()
        return supported_task_types, set()

    def pace(self) -> None:
        """Called once per loop of Flower's SuperExec, before it asks for a task.

        While a child runs, wait for it to end (at most Flower's own poll interval,
        less when :meth:`watch` is due sooner): the SuperNode pulls its next message
        only after it has this task's reply (or the task's run has stopped), so there
        is nothing to ask for. Idle, add :func:`idle_interval` beyond the loop's
        0.05 s sleep."""
        running = [t for t in self._children if t.process.exitcode is None]
        if running:
            due = min(t.due() for t in running) - time.monotonic()
            timeout = min(FLOWER_TASK_POLL_S, max(0.0, due))
            multiprocessing.connection.wait([t.process.sentinel for t in running], timeout)
            self._last_active = time.monotonic()
            return
        extra = idle_interval(0.0, time.monotonic() - self._last_active, FLOWER_TASK_POLL_S)
        if extra > 0.001:
            time.sleep(extra)

    def wait_for_capacity(self, task_type: Any = None, **kwargs: Any) -> None:
        del task_type, kwargs

    def launch(self, spec: Any) -> Any:
        if spec.task_type != self._client_task:
            return self._fallback.launch(spec)
        argv, quiet = flower_command(spec)
        try:
            finishing = self._ctx.Event()
            child = self._ctx.Process(target=_clientapp_child, args=(argv, quiet, finishing))
            child.start()
        except Exception as exc:  # noqa: BLE001 - a dead parent must not stop the node
            self._log(ERROR, "fedhet warm executor could not start task %d: %s", spec.task_id, exc)
            return self._result.failed(f"fedhet warm executor: {exc}")
        beat = self._heartbeat(spec) if self._heartbeat is not None else None
        self._children.append(
            TaskChild(spec.task_id, child, beat, time.monotonic() + TASK_BEAT_S, finishing)
        )
        self._last_active = time.monotonic()
        return self._result.accepted()

    def reconcile(self) -> None:
        """Collect finished children (a crashed or killed one is logged; its task fails
        through Flower's own token expiry, as with the stock executor), then
        :meth:`watch` the running ones."""
        running = []
        for task in self._children:
            code = task.process.exitcode
            if code is None:
                running.append(task)
                continue
            if task.terminated_at is not None:
                self._log(
                    INFO,
                    "fedhet warm executor: the child of finished task %d ended (exit code %s)",
                    task.task_id,
                    code,
                )
            elif code != 0:
                self._log(
                    WARNING,
                    "fedhet warm executor: task %d ended with exit code %s",
                    task.task_id,
                    code,
                )
            task.close()
        self._children = running
        self.watch()

    def watch(self) -> None:
        """End the children whose task the node has finished (its run was stopped).

        Every :data:`TASK_BEAT_S` a task heartbeat per running child; once the node
        answers that the task is finished, the child gets :data:`STOP_GRACE_S` to exit
        (a completed task is finished just before its child exits), then SIGTERM, and
        SIGKILL :data:`KILL_AFTER_S` later. A child whose heartbeat succeeds, or gets
        no answer, is left alone."""
        for task in self._children:
            now = time.monotonic()
            if task.process.exitcode is not None or now < task.due():
                continue
            if task.finished_at is None:
                task.next_beat = now + TASK_BEAT_S
                if task.beat is not None and task.beat() is False:
                    task.finished_at = now
            elif task.terminated_at is None:
                self._log(
                    INFO,
                    "fedhet warm executor: task %d was finished by its SuperNode (its run "
                    "stopped) while its child runs: SIGTERM",
                    task.task_id,
                )
                task.terminated_at = now
                with contextlib.suppress(Exception):
                    task.process.terminate()
            else:
                self._log(
                    WARNING,
                    "fedhet warm executor: the child of finished task %d outlived SIGTERM "
                    "by %.0f s: SIGKILL",
                    task.task_id,
                    KILL_AFTER_S,
                )
                task.killed = True
                with contextlib.suppress(Exception):
                    task.process.kill()

    def close(self) -> None:
        for task in self._children:
            with contextlib.suppress(Exception):
                task.process.terminate()
            with contextlib.suppress(Exception):
                getattr(task.beat, "close", lambda: None)()
        self._children = []


def _noop() -> None:
    """The first child: starts the warm parent at executor start-up."""


def exec_superexec(argv: list[str]) -> None:
    """Replace this process by ``python -m cli.warm superexec ...``: the fork server
    prepares every child by importing the parent's main module, which must be this
    one (standard library only), never a module that imports the app's packages
    (those must come from each run's FAB, not from what is installed)."""
    os.execv(sys.executable, [sys.executable, "-m", "cli.warm", "superexec", *argv])


def run_superexec(argv: list[str]) -> None:
    """Flower's ``flower-superexec`` with :class:`WarmExecutor` (same flags)."""
    os.environ.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", TASK_POLL_S)
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    module = importlib.import_module("flwr.supercore.superexec.run_superexec")
    stock = flower_internal("flwr.supercore.superexec.run_superexec", "get_executor")
    subprocess_type = flower_internal("flwr.supercore.constant", "ExecutorType").SUBPROCESS

    def get_executor(executor_type: Any, executor_config: Any = None, **kwargs: Any) -> Any:
        if executor_type == subprocess_type:
            return WarmExecutor()
        return stock(executor_type, executor_config, **kwargs)

    setattr(module, "get_executor", get_executor)  # noqa: B010
    sys.argv = ["flower-superexec", *argv]
    flower_internal("flwr.supercore.cli.flower_superexec", "flower_superexec")()


# --------------------------------------------------------------------- supernode


class PacedSleep(types.ModuleType):
    """``time`` for Flower's SuperNode loop: a wait inside a task (Flower asks for
    0.5 s) is capped at ``poll`` seconds and marks the node active; the idle wait
    between two pulls (Flower's 3 s) is :func:`idle_interval` since then."""

    def __init__(self, real: types.ModuleType, poll: float) -> None:
        super().__init__("time")
        self.__dict__.update(vars(real))
        self._real, self._poll = real, poll
        self.last_active = real.monotonic()
        self.sleep = self._sleep  # type: ignore[method-assign] # not the copied time.sleep

    def wait_for(self, seconds: float) -> float:
        """How long a ``sleep(seconds)`` of Flower's loop sleeps now."""
        now = self._real.monotonic()
        if seconds < FLOWER_IDLE_PULL_S:
            self.last_active = now
            return min(seconds, self._poll)
        return min(seconds, idle_interval(self._poll, now - self.last_active, seconds))

    def _sleep(self, seconds: float) -> None:
        self._real.sleep(self.wait_for(seconds))


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
    ) -> None:
        self._pull, self._push = pull, push
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

        def receive_and_note() -> Any:
            got = receive()
            if got is not None:
                received.append(got[0].metadata.message_id)
            return got

        bound.arguments["receive"] = receive_and_note
        self.get_run = bound.arguments["get_run"]
        run_id = self._pull(*bound.args, **bound.kwargs)
        self.run_id = run_id
        self.message_ids = received if run_id is not None else []
        return run_id

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


def run_supernode(argv: list[str], poll: float = SUPERNODE_POLL_S) -> None:
    """Flower's ``flower-supernode`` with its reply waits (0.5 s) capped at ``poll``
    seconds, its idle pull (3 s) paced by :func:`idle_interval`, its object pulls
    with :data:`PULL_BACKOFF`, and the run of its task in progress watched by
    :class:`RunWatch` (same flags)."""
    name = "flwr.supernode.start_client_internal"
    module = importlib.import_module(name)
    paced = PacedSleep(flower_internal(name, "time"), poll)
    setattr(module, "time", paced)  # noqa: B010
    fast_object_pulls(name, "pull_objects")
    watch = RunWatch(
        flower_internal(name, "_pull_and_store_message"),
        flower_internal(name, "_push_messages"),
        sleep=paced.sleep,
    )
    setattr(module, "_pull_and_store_message", watch.pull)  # noqa: B010
    setattr(module, "_push_messages", watch.push)  # noqa: B010
    sys.argv = ["flower-supernode", *argv]
    flower_internal("flwr.supernode.cli.flower_supernode", "flower_supernode")()


if __name__ == "__main__":
    if sys.argv[1:2] == ["superexec"]:
        run_superexec(sys.argv[2:])
    else:
        raise SystemExit("usage: python -m cli.warm superexec <flower-superexec flags>")
