"""``fedhet superexec``: deployment at simulation speed with a warm ClientApp executor.

Flower 1.42 runs every ClientApp task (train or evaluate, per node) in a fresh
``flwr-clientapp`` process that imports torch and flwr again (seconds on a Raspberry
Pi), and polls at fixed intervals: SuperNode idle pull 3 s, SuperExec task poll 1 s,
the ServerApp's HTTP grid 3 s. fedhet removes both costs without patching Flower's
files:

* :class:`WarmExecutor`: the SuperExec executor of ``fedhet superexec``. It keeps one
  warm parent per SuperNode (a ``multiprocessing`` fork server that has imported
  torch, numpy and flwr, and never the app's own modules, so the code that travels
  in each run's FAB is what every task imports) and starts each ClientApp task as a
  fresh child forked from it, running Flower's own ``flwr-clientapp`` entry with
  exactly the arguments Flower's subprocess executor would pass (TLS settings
  included). Every task still gets a fresh process; only the import cost is paid
  once. Other task types go to Flower's subprocess executor.
* :func:`run_superexec`: Flower's SuperExec with that executor. A ``fedhet
  supernode`` holds its request for a task until a message arrives
  (``cli/supernode.py``, :class:`~cli.supernode.HeldTasks`): the executor then asks
  again at once and polls nothing. Against a SuperNode that answers at once (Flower's
  own) it asks 0.05 s after the last task ended, later ever less often (see
  :func:`cli.pacing.idle_interval`). While a task's child runs it waits on that
  child instead of polling (a SuperNode hands out its next task only after the reply).
* ``flwr stop``: the SuperNode (``cli/supernode.py``) finishes a stopped run's tasks.
  The warm executor sends a task heartbeat for each running child every
  :data:`TASK_BEAT_S` seconds with the child's token and ends a child whose task the
  node has finished (:data:`STOP_GRACE_S`, then SIGTERM, then SIGKILL).
* ``cli/supernode.py``: the SuperNode's polls, paced; ``server_app/grid.py``: the
  ServerApp's replies collected every 0.1 s; both with the short object-pull backoff
  of ``common/flower_runtime.py``.

This module is the warm parent's main module (``python -m cli.warm superexec``): the
fork server prepares every task child by importing it, so at import time it imports
the standard library (and the stdlib-only ``cli/pacing.py`` and ``cli/taskbeat.py``),
never an app package: :mod:`common.flower_runtime` (what it relies on in
``flwr==1.42.0``, and the object-pull patch) is imported where it is used, and a task
child forgets it again before its ClientApp runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import multiprocessing
import multiprocessing.connection
import os
import sys
import time
import types
from collections.abc import Callable
from logging import ERROR, INFO, WARNING
from typing import Any

from cli.pacing import FAST_GROWTH, IDLE_GROWTH, fast_polls, idle_interval
from cli.taskbeat import TaskBeat

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
FLOWER_TASK_POLL_S = 1.0
"""The SuperExec's task poll in flwr 1.42.0 (``run_superexec``)."""
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
HELD_S = 0.5
"""A task request that took at least this long was held by the node (it answers when
a task is there): the executor asks again without waiting."""


def _clientapp_child(
    argv: list[str], quiet: bool, finishing: Any = None, cause: Any = None
) -> None:
    """A forked child: Flower's own ``flwr-clientapp`` for one task (its object pulls
    from its node with :data:`common.flower_runtime.LOCAL_PULL_BACKOFF`). ``finishing``
    (an event) is set as the child reports its task's end to the node: from then on the
    task is finished there while the child still exits, and the executor sends no more
    heartbeats for it. An exception that ends the child is written, as one line, to
    ``cause`` (a shared char array: the executor's report to the node carries it) and
    to the executor's log."""
    try:
        _run_clientapp_child(argv, quiet, finishing)
    except BaseException as exc:
        if isinstance(exc, SystemExit) and exc.code in (None, 0):
            raise
        line = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300]
        if cause is not None:
            cause.value = line.encode("utf-8", "replace")[: len(cause) - 1]
        with contextlib.suppress(OSError):
            os.write(_STDERR_FD, f"fedhet warm executor: task child failed: {line}\n".encode())
        raise


_STDERR_FD = os.dup(2) if hasattr(os, "dup") else 2
"""The executor's own stderr (its log), kept before a quiet child silences fd 2."""


def _run_clientapp_child(argv: list[str], quiet: bool, finishing: Any) -> None:
    os.environ["FLWR_TELEMETRY_ENABLED"] = "0"  # its exit path would wait up to 4 s
    before = set(sys.modules)
    from common.flower_runtime import LOCAL_PULL_BACKOFF, fast_object_pulls, flower_internal

    fast_object_pulls(
        "flwr.supernode.runtime.run_clientapp",
        "pull_and_inflate_object_from_tree",
        **LOCAL_PULL_BACKOFF,
    )
    if finishing is not None:
        module = importlib.import_module("flwr.supernode.runtime.run_clientapp")
        push_task_output = flower_internal(module.__name__, "push_task_output")

        def push_and_tell(*args: Any, **kwargs: Any) -> Any:
            finishing.set()
            return push_task_output(*args, **kwargs)

        from common.flower_gate import replace

        replace(module, "push_task_output", push_and_tell)
    # the ClientApp imports the app's packages from its run's FAB: forget the installed
    # ``common`` that this child imported for the patches above
    for name in set(sys.modules) - before:
        if name == "common" or name.startswith("common."):
            del sys.modules[name]
    if quiet:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    sys.argv = argv
    flower_internal("flwr.supernode.cli", "flwr_clientapp")()


def flower_command(spec: Any) -> tuple[list[str], bool]:
    """The ``flwr-clientapp`` command line Flower's subprocess executor would run for
    ``spec`` (captured from that executor itself), and whether output is suppressed."""
    from common.flower_runtime import flower_internal

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
    cause: Any = None
    """The error that ended the child, as one line (a shared char array)."""
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
        # the task heartbeats are a gated part of their own: without it, no heartbeats
        from common import flower_gate

        if heartbeat is TaskBeat and not flower_gate.use("task-beats"):
            heartbeat = None
        from common.flower_runtime import flower_internal, log

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
        self._asked_at: float | None = None
        self._ignore_answer = False
        self.node_holds = False
        """Whether the node held the last task request (see :data:`HELD_S`)."""
        self._fast = fast_polls()
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
        if any(t.process.exitcode is None for t in self._children):
            # busy: ask for nothing, so a node that holds task requests answers at once
            # and the running children are watched (heartbeats, a stop, a death)
            self._ignore_answer = True  # answered at once: tells nothing about holding
            return set(), set()
        return supported_task_types, set()

    def pace(self) -> None:
        """Called once per loop of Flower's SuperExec, before it asks for a task.

        While a child runs, wait for it to end (at most Flower's own poll interval,
        less when :meth:`watch` is due sooner): the SuperNode pulls its next message
        only after it has this task's reply (or the task's run has stopped), so there
        is nothing to ask for. Idle, ask again at once when the node holds task
        requests, else add :func:`idle_interval` beyond the loop's 0.05 s sleep."""
        running = [t for t in self._children if t.process.exitcode is None]
        self._asked_at, self._ignore_answer = time.monotonic(), False
        if running:
            due = min(t.due() for t in running) - time.monotonic()
            timeout = min(FLOWER_TASK_POLL_S, max(0.0, due))
            multiprocessing.connection.wait([t.process.sentinel for t in running], timeout)
            self._last_active = self._asked_at = time.monotonic()
            return
        if self.node_holds:
            return
        growth = FAST_GROWTH if self._fast else IDLE_GROWTH
        extra = idle_interval(0.0, time.monotonic() - self._last_active, FLOWER_TASK_POLL_S, growth)
        if extra > 0.001:
            time.sleep(extra)
            self._asked_at = time.monotonic()

    def _note_answer(self) -> None:
        """At the top of Flower's loop: how long the last task request took (not
        after a launch or a request without capacity)."""
        if self._asked_at is None or self._ignore_answer or self._fast:
            return
        self.node_holds = time.monotonic() - self._asked_at >= HELD_S

    def wait_for_capacity(self, task_type: Any = None, **kwargs: Any) -> None:
        del task_type, kwargs

    def launch(self, spec: Any) -> Any:
        if spec.task_type != self._client_task:
            return self._fallback.launch(spec)
        self._ignore_answer = True
        argv, quiet = flower_command(spec)
        try:
            finishing = self._ctx.Event()
            cause = self._ctx.Array("c", 512)
            child = self._ctx.Process(target=_clientapp_child, args=(argv, quiet, finishing, cause))
            child.start()
        except Exception as exc:  # noqa: BLE001 - a dead parent must not stop the node
            self._log(ERROR, "fedhet warm executor could not start task %d: %s", spec.task_id, exc)
            return self._result.failed(f"fedhet warm executor: {exc}")
        beat = self._heartbeat(spec) if self._heartbeat is not None else None
        self._children.append(
            TaskChild(spec.task_id, child, beat, time.monotonic() + TASK_BEAT_S, finishing, cause)
        )
        self._last_active = time.monotonic()
        return self._result.accepted()

    def reconcile(self) -> None:
        """Collect finished children (a crashed or killed one is logged; its task fails
        through Flower's own token expiry, as with the stock executor), then
        :meth:`watch` the running ones."""
        self._note_answer()
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
            elif not (task.finishing is not None and task.finishing.is_set()):
                self._report_died(task, code)
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

    def _report_died(self, task: TaskChild, code: int | None) -> None:
        """A child that ended before reporting its task's end (killed, out of memory,
        crashed): finish its task as failed on the node, which then replies with an
        error for its message at once (Flower's own path waits for the task token to
        expire, about 60 s)."""
        details = f"the ClientApp task process died (exit code {code})"
        why = task.cause.value.decode("utf-8", "replace") if task.cause is not None else ""
        if why:
            details += f": {why}"
        fail = getattr(task.beat, "fail", None)
        told = bool(fail(details)) if fail is not None else False
        self._log(
            WARNING,
            "fedhet warm executor: task %d ended with exit code %s before its reply; %s",
            task.task_id,
            code,
            "reported it to the node as failed"
            if told
            else "the node will notice when its token expires",
        )

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
    one (no app package at import time), never a module that imports the app's
    packages (those must come from each run's FAB, not from what is installed)."""
    os.execv(sys.executable, [sys.executable, "-m", "cli.warm", "superexec", *argv])


def run_superexec(argv: list[str]) -> None:
    """Flower's ``flower-superexec`` with :class:`WarmExecutor` (same flags); Flower's
    own executor where the ``warm-executor`` part does not fit the installed Flower
    (:mod:`common.flower_gate`: one warning line)."""
    from common import flower_gate
    from common.flower_runtime import flower_internal

    flower_gate.use("entry-points")
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    if flower_gate.use("warm-executor"):
        os.environ.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", TASK_POLL_S)
        module = importlib.import_module("flwr.supercore.superexec.run_superexec")
        stock = flower_internal("flwr.supercore.superexec.run_superexec", "get_executor")
        subprocess_type = flower_internal("flwr.supercore.constant", "ExecutorType").SUBPROCESS

        def get_executor(executor_type: Any, executor_config: Any = None, **kwargs: Any) -> Any:
            if executor_type == subprocess_type:
                return WarmExecutor()
            return stock(executor_type, executor_config, **kwargs)

        flower_gate.replace(module, "get_executor", get_executor)
    sys.argv = ["flower-superexec", *argv]
    if not {"-h", "--help", "-V", "--version"} & set(argv) and flower_gate.use(
        "executor-auth-check"
    ):
        from cli.executor_auth import ExecutorRefused, check_access

        try:
            check_access(argv)  # a node that refuses this executor: say why, status 3
        except ExecutorRefused as refused:
            flower_internal("flwr.common.logger", "log")(ERROR, "%s", refused.message)
            raise
    flower_internal("flwr.supercore.cli.flower_superexec", "flower_superexec")()


if __name__ == "__main__":
    if sys.argv[1:2] == ["superexec"]:
        run_superexec(sys.argv[2:])
    else:
        raise SystemExit("usage: python -m cli.warm superexec <flower-superexec flags>")
