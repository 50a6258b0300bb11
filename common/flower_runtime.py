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
    ("flwr.supernode.servicer.runtime.runtime_handlers", "acquire_task"),
    ("flwr.supernode.servicer.runtime.runtime_handlers", "push_task_output"),
    ("flwr.supernode.nodestate.in_memory_nodestate", "CLIENT_APP_CRASHED_ERROR"),
    ("flwr.supernode.nodestate.in_memory_nodestate", "InMemoryNodeState"),
    ("flwr.proto.runtime_pb2", "PushTaskOutputRequest"),
)
"""``(module, attribute)`` pairs of Flower 1.42.0 that fedhet uses or replaces."""

PULL_BACKOFF = {"initial_backoff": 0.05, "backoff_cap": 0.5, "max_tries_per_object": 10_000}
"""Object pulls retry a missing object after 0.05 s, doubling to at most 0.5 s (Flower:
1 s doubling to 10 s, 500 tries; 10,000 tries at 0.5 s keep its patience of about
5,000 s). A SuperNode lists a task before it has pulled the message's objects from the
SuperLink, so a ClientApp that starts at once often finds an object missing and, with
Flower's backoff, waited 1 s or 1 + 2 s for it on every message."""


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
