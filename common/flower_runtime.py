"""What fedhet relies on in Flower 1.42's runtime, and the patch both sides apply.

The node side (``cli/warm.py``: the warm executor and its task children;
``cli/supernode.py``: the paced SuperNode) and the server side
(``server_app/grid.py``: the ServerApp's polling grid) replace a few of Flower's
module attributes at run time, never Flower's files. Every one they use or replace is
listed in :data:`FLOWER_INTERNALS` and checked by a test, which names any symbol a
future Flower moves.

This module imports only the standard library (Flower on first use): each warm task
child imports it before its ClientApp starts (and forgets it again: the ClientApp
imports the app's packages from its run's FAB), which must stay cheap.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import time
from logging import WARNING
from typing import Any

from common.flower_gate import replace

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
    ("flwr.supernode.servicer.runtime.runtime_handlers", "acquire_task"),
    ("flwr.supernode.servicer.runtime.runtime_handlers", "push_task_output"),
    ("flwr.supernode.nodestate.in_memory_nodestate", "CLIENT_APP_CRASHED_ERROR"),
    ("flwr.supernode.nodestate.in_memory_nodestate", "InMemoryNodeState"),
    ("flwr.proto.runtime_pb2", "PushTaskOutputRequest"),
    ("flwr.supercore.inflatable.inflatable_utils", "get_num_workers"),
    ("flwr.supercore.inflatable.inflatable_utils", "ObjectUnavailableError"),
    ("flwr.supercore.heartbeat", "HeartbeatSender"),
    ("flwr.supernode.start_client_internal", "push_object_contents_from_iterable"),
    ("flwr.superlink.grid.http_grid", "push_objects"),
    ("flwr.supernode.fleet_http_connection", "FleetHttpClient"),
)
"""``(module, attribute)`` pairs of Flower 1.42.0 that fedhet uses or replaces."""

PULL_BACKOFF = {"initial_backoff": 0.05, "backoff_cap": 0.5, "max_tries_per_object": 10_000}
"""Object pulls retry a missing object after 0.05 s, doubling to at most 0.5 s (Flower:
1 s doubling to 10 s, 500 tries; 10,000 tries at 0.5 s keep its patience of about
5,000 s). A SuperNode lists a task before it has pulled the message's objects from the
SuperLink, so a ClientApp that starts at once often finds an object missing and, with
Flower's backoff, waited 1 s or 1 + 2 s for it on every message."""


LOCAL_PULL_BACKOFF = {"initial_backoff": 0.02, "backoff_cap": 0.1, "max_tries_per_object": 100_000}
"""A ClientApp task's pulls from its own SuperNode (loopback): a ``fedhet supernode``
hands a task out as soon as its message is stored (``FEDHET_EARLY_TASK``), while the
message's objects still arrive from the SuperLink; the task asks again after 0.02 s,
doubling to 0.1 s (at most 0.1 s late; one local request per 0.1 s while it waits)."""

OBJECT_CONCURRENCY = 16
"""Objects a fedhet process moves at once (env ``FEDHET_OBJECT_CONCURRENCY``): the
SuperNode's pulls of a message's objects from the SuperLink and pushes of its reply's,
the ServerApp's pushes and reply pulls. Each object is one request, so at most this
many round trips' worth of requests travel together: a head-sized message (8 objects)
in one round trip, CNN-1 whole (24) in two. Flower moves
``FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PULLS`` / ``_PUSHES`` (2) at once, and never more
than the machine has cores (``get_num_workers``): on a 2-core node its variables
change nothing. 16 stays below the 20 connections Flower's HTTP client keeps open
(each object in flight needs one; a new connection costs a TCP and a TLS handshake)."""


def object_concurrency(default: int = OBJECT_CONCURRENCY) -> int | None:
    """``FEDHET_OBJECT_CONCURRENCY`` (objects at once, >= 1) or ``default``;
    ``flower``: None (Flower's own: 2, at most the cores)."""
    text = os.environ.get("FEDHET_OBJECT_CONCURRENCY", "").strip()
    if not text:
        return default
    if text == "flower":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise SystemExit(
            f"FEDHET_OBJECT_CONCURRENCY={text!r}: an integer >= 1 (objects moved at once), "
            "or 'flower'"
        )
    return value


def concurrent_objects(
    module_name: str, pull: str | None = None, push: str | None = None, *, count: int
) -> None:
    """``count`` objects at once where ``module_name`` pulls (``pull``: its
    ``pull_objects``, with :data:`PULL_BACKOFF`) and pushes (``push``: its
    ``push_objects`` or ``push_object_contents_from_iterable``), and no cap by the
    number of cores in this process (``get_num_workers``)."""
    utils = importlib.import_module("flwr.supercore.inflatable.inflatable_utils")
    cap = flower_internal(utils.__name__, "get_num_workers")
    if not isinstance(cap, _Uncapped):
        replace(utils, "get_num_workers", _Uncapped(cap))
    if pull is not None:
        fast_object_pulls(module_name, pull, max_concurrent_pulls=count)
    if push is not None:
        _with_keywords(module_name, push, {"max_concurrent_pushes": count})
        module = importlib.import_module(module_name)
        if not isinstance(getattr(module, push), RetriedPushes):
            replace(module, push, RetriedPushes(getattr(module, push)))


PUSH_RETRIES = (0.5, 1.0, 2.0)
"""Waits before the retries of one object push that failed (a SuperLink answering 500:
its SQLite state locked under load, measured at 100 nodes). Flower's node drops the
whole reply when one of its objects fails to push; a push is idempotent (objects are
stored by content id)."""


class RetriedPushes:
    """``push_object_contents_from_iterable`` whose single-object pushes are retried
    after :data:`PUSH_RETRIES` before they fail the reply."""

    def __init__(self, function: Any) -> None:
        self.func = function

    def __call__(self, object_contents: Any, push_object_fn: Any, **kwargs: Any) -> Any:
        def retried(object_id: str, content: bytes) -> None:
            for wait in (*PUSH_RETRIES, None):
                try:
                    push_object_fn(object_id, content)
                    return
                except Exception as exc:  # noqa: BLE001 - retried, then raised as before
                    if wait is None:
                        raise
                    log(
                        WARNING,
                        "fedhet: pushing object %s failed (%s); again in %.1f s",
                        object_id[:12],
                        exc,
                        wait,
                    )
                    time.sleep(wait)

        return self.func(object_contents, retried, **kwargs)


class _Uncapped:
    """Flower's ``get_num_workers`` without its cap at the number of cores: moving
    objects waits on the network, not on a core."""

    def __init__(self, capped: Any) -> None:
        self.capped = capped

    def __call__(self, max_concurrent: int) -> int:
        return max(1, int(max_concurrent))


def _with_keywords(module_name: str, name: str, keywords: dict[str, Any]) -> None:
    """Replace ``module_name.name`` by the same function with ``keywords`` (once)."""
    module = importlib.import_module(module_name)
    function = flower_internal(module_name, name)
    if isinstance(function, functools.partial):
        return  # already done in this process
    try:
        inspect.signature(function).bind_partial(**keywords)
    except TypeError as exc:
        raise RuntimeError(
            f"fedhet needs flwr==1.42.0: {module_name}.{name} no longer takes "
            f"{sorted(keywords)} ({exc})"
        ) from None
    replace(module, name, functools.partial(function, **keywords))


def log(level: int, msg: str, *args: Any) -> None:
    """Flower's logger, imported on first use (this module imports only the standard
    library at import time)."""
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


def fast_object_pulls(module_name: str, name: str, **extra: Any) -> None:
    """Replace ``module_name.name`` (Flower's ``pull_objects`` or
    ``pull_and_inflate_object_from_tree``, as that module imported it) by the same
    function with :data:`PULL_BACKOFF` (and ``extra`` keywords); only that module's
    reference changes."""
    _with_keywords(module_name, name, {**PULL_BACKOFF, **extra})
