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
* ``server_app.grid.PollingGrid`` (server side): ``send_and_receive`` that polls
  replies every 0.1 s through Flower's public Grid API.

What it relies on in ``flwr==1.42.0`` is listed in :data:`FLOWER_INTERNALS` and
checked by a test, which names any symbol a future Flower moves.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import multiprocessing
import multiprocessing.connection
import os
import sys
import time
import types
from logging import ERROR, INFO, WARNING
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
    ("flwr.superlink.grid.http_grid", "pull_objects"),
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


def idle_interval(base: float, idle_s: float, cap: float) -> float:
    """The poll interval after ``idle_s`` seconds without a task."""
    return min(cap, base + IDLE_GROWTH * max(0.0, idle_s))


PULL_BACKOFF = {"initial_backoff": 0.05, "backoff_cap": 0.5, "max_tries_per_object": 10_000}
"""Object pulls retry a missing object after 0.05 s, doubling to at most 0.5 s (Flower:
1 s doubling to 10 s, 500 tries; 10,000 tries at 0.5 s keep its patience of about
5,000 s). A SuperNode lists a task before it has pulled the message's objects from the
SuperLink, so a ClientApp that starts at once often finds an object missing and, with
Flower's backoff, waited 1 s or 1 + 2 s for it on every message."""


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


def _clientapp_child(argv: list[str], quiet: bool) -> None:
    """A forked child: Flower's own ``flwr-clientapp`` for one task (its object pulls
    with :data:`PULL_BACKOFF`)."""
    os.environ["FLWR_TELEMETRY_ENABLED"] = "0"  # its exit path would wait up to 4 s
    fast_object_pulls("flwr.supernode.runtime.run_clientapp", "pull_and_inflate_object_from_tree")
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


class WarmExecutor:
    """SuperExec executor: ClientApp tasks as children of a warm fork server."""

    def __init__(self) -> None:
        from flwr.supercore import log

        self._log = log
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(PRELOAD)
        self._children: list[Any] = []
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

        While a child runs, wait for it to end (at most Flower's own poll interval):
        the SuperNode pulls its next message only after it has this task's reply, so
        there is nothing to ask for. Idle, add :func:`idle_interval` beyond the
        loop's 0.05 s sleep."""
        running = [child.sentinel for _, child in self._children if child.exitcode is None]
        if running:
            multiprocessing.connection.wait(running, timeout=FLOWER_TASK_POLL_S)
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
            child = self._ctx.Process(target=_clientapp_child, args=(argv, quiet))
            child.start()
        except Exception as exc:  # noqa: BLE001 - a dead parent must not stop the node
            self._log(ERROR, "fedhet warm executor could not start task %d: %s", spec.task_id, exc)
            return self._result.failed(f"fedhet warm executor: {exc}")
        self._children.append((spec.task_id, child))
        self._last_active = time.monotonic()
        return self._result.accepted()

    def reconcile(self) -> None:
        """Collect finished children; a crashed or killed one is logged (its task
        fails through Flower's own token expiry, as with the stock executor)."""
        running = []
        for task_id, child in self._children:
            if child.exitcode is None:
                running.append((task_id, child))
                continue
            if child.exitcode != 0:
                self._log(
                    WARNING,
                    "fedhet warm executor: task %d ended with exit code %s",
                    task_id,
                    child.exitcode,
                )
            child.close()
        self._children = running

    def close(self) -> None:
        for _, child in self._children:
            with contextlib.suppress(Exception):
                child.terminate()
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


def run_supernode(argv: list[str], poll: float = SUPERNODE_POLL_S) -> None:
    """Flower's ``flower-supernode`` with its reply waits (0.5 s) capped at ``poll``
    seconds, its idle pull (3 s) paced by :func:`idle_interval`, and its object
    pulls with :data:`PULL_BACKOFF` (same flags)."""
    module = importlib.import_module("flwr.supernode.start_client_internal")
    real = flower_internal("flwr.supernode.start_client_internal", "time")
    setattr(module, "time", PacedSleep(real, poll))  # noqa: B010
    fast_object_pulls("flwr.supernode.start_client_internal", "pull_objects")
    sys.argv = ["flower-supernode", *argv]
    flower_internal("flwr.supernode.cli.flower_supernode", "flower_supernode")()


if __name__ == "__main__":
    if sys.argv[1:2] == ["superexec"]:
        run_superexec(sys.argv[2:])
    else:
        raise SystemExit("usage: python -m cli.warm superexec <flower-superexec flags>")
