"""One gate for every Flower internal fedhet relies on, checked at process start.

fedhet's deployment speed rests on changes to Flower's own runtime (``cli/supernode.py``,
``cli/warm.py``, ``cli/taskbeat.py``, ``cli/executor_auth.py``, ``server_app/grid.py``):
module attributes replaced or wrapped at run time, never Flower's files. Each change is a
:class:`Part` here, with every private Flower name it uses (``module:attr`` or
``module:Class.attr``). A part's *fingerprint* is a digest of those names' source code
(functions, classes) or values (constants): a name that is gone, a signature that
changed, and a body that changed while its name stayed all change it. A part is used
only when its fingerprint is one recorded in ``flower_checked.json`` beside this file,
i.e. that code was read and run with fedhet (the file names the Flower version each
digest was checked on). Otherwise:

* a part with a stock fallback is switched off with one warning line naming the part,
  the Flower version, the first name that does not fit, and what is used instead
  (Flower's executor, Flower's polling intervals, Flower's object concurrency, ...);
  the run goes on;
* a part without one (the entry points fedhet starts) stops the process with one line.

``python -m common.flower_gate`` prints every part's verdict for the installed Flower;
``--record`` adds the installed Flower's fingerprints to ``flower_checked.json`` (only
after the parts were read against that Flower and its federation ran: see
docs/deployment.md, "Flower's runtime, changed").

Standard library only (Flower on first use): the warm executor's task children import it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHECKED_FILE = Path(__file__).with_name("flower_checked.json")
SUPERNODE = "flwr.supernode.start_client_internal"
NODE_HANDLERS = "flwr.supernode.servicer.runtime.runtime_handlers"
NODE_STATE = "flwr.supernode.nodestate.in_memory_nodestate"
OBJECTS = "flwr.supercore.inflatable.inflatable_utils"
RUN_CLIENTAPP = "flwr.supernode.runtime.run_clientapp"
CONTROL_MIDDLEWARES = "flwr.superlink.routers.control.middlewares"
MEMORY_STATE = "flwr.server.superlink.linkstate.in_memory_linkstate"
SQL_STATE = "flwr.server.superlink.linkstate.sql_linkstate"


@dataclass(frozen=True)
class Part:
    """One change fedhet makes to Flower's runtime."""

    name: str
    what: str
    """What it changes (one line)."""
    uses: tuple[str, ...]
    """Flower names it relies on: ``module:attr`` or ``module:Class.attr``."""
    fallback: str | None
    """What runs instead when it does not fit (None: nothing; the process stops)."""
    where: str
    """The fedhet process that applies it."""


PARTS: tuple[Part, ...] = (
    Part(
        "entry-points",
        "fedhet supernode / superexec start Flower's own SuperNode and SuperExec",
        (
            "flwr.supernode.cli.flower_supernode:flower_supernode",
            "flwr.supercore.cli.flower_superexec:flower_superexec",
        ),
        None,
        "supernode, superexec",
    ),
    Part(
        "node-polling",
        "the SuperNode's idle pull (3 s) paced by when its next message is due; reply "
        "waits 0.05 s instead of 0.5 s",
        (f"{SUPERNODE}:time", f"{SUPERNODE}:start_client_internal", f"{SUPERNODE}:_push_messages"),
        "Flower's polling intervals (3 s idle, 0.5 s reply waits)",
        "supernode",
    ),
    Part(
        "node-objects",
        "the SuperNode moves 16 objects at once, retried after 0.05 s (Flower: 2, 1 s)",
        (
            f"{SUPERNODE}:pull_objects",
            f"{SUPERNODE}:push_object_contents_from_iterable",
            f"{OBJECTS}:pull_objects",
            f"{OBJECTS}:push_object_contents_from_iterable",
            f"{OBJECTS}:get_num_workers",
        ),
        "Flower's object concurrency and backoff",
        "supernode",
    ),
    Part(
        "warm-connections",
        "the SuperNode opens the connections a wave of requests needs before it is due",
        (
            "flwr.supernode.fleet_http_connection:FleetHttpClient",
            "httpcore._sync.connection_pool:ConnectionPool.create_connection",
            "httpcore._sync.connection:HTTPConnection._connect",
            "httpcore._sync.http11:HTTP11Connection.is_available",
            "httpcore._models:Request.__init__",
        ),
        "connections opened when a request needs them",
        "supernode",
    ),
    Part(
        "held-tasks",
        "the SuperNode holds its executor's task request until a message arrives",
        (
            f"{NODE_HANDLERS}:acquire_task",
            "flwr.supercore.routers.runtime.router:acquire_task",
            "flwr.supercore.exit:add_exit_handler",
            "flwr.supernode.cli.flower_supernode:flower_supernode",
        ),
        "the executor polls for tasks",
        "supernode",
    ),
    Part(
        "failed-tasks",
        "a task the warm executor reports failed gets an error reply at once",
        (
            f"{NODE_HANDLERS}:push_task_output",
            f"{NODE_STATE}:CLIENT_APP_CRASHED_ERROR",
            f"{NODE_STATE}:InMemoryNodeState._store_error_replies",
        ),
        "Flower's task-token expiry (an error reply after about 60 s)",
        "supernode",
    ),
    Part(
        "run-watch",
        "the SuperNode asks every 2 s whether its task's run still runs (flwr stop); a task "
        "starts as its message is stored; confirmation sent along",
        (
            f"{SUPERNODE}:_pull_and_store_message",
            f"{SUPERNODE}:_push_messages",
            f"{SUPERNODE}:_insert_message",
            "flwr.supercore.inflatable.inflatable_object:no_object_id_recompute",
            "flwr.supercore.inflatable.inflatable_object:get_object_tree",
            "flwr.supercore.inflatable.inflatable_object:get_all_nested_objects",
            "flwr.supercore.corestate.in_memory_corestate:InMemoryCoreState.store_messages",
            "flwr.supercore.corestate.in_memory_corestate:InMemoryCoreState.get_messages",
            "flwr.supercore.corestate.in_memory_corestate:InMemoryCoreState.cancel_messages",
            f"{NODE_HANDLERS}:pull_messages",
            f"{NODE_HANDLERS}:push_messages",
            f"{NODE_STATE}:InMemoryNodeState.store_message",
            f"{NODE_STATE}:InMemoryNodeState.get_messages_legacy",
            f"{NODE_STATE}:InMemoryNodeState.delete_messages",
            "flwr.supercore.run:RunNotRunningException",
        ),
        "Flower's own loop (a stopped run's task runs to its end)",
        "supernode",
    ),
    Part(
        "warm-executor",
        "ClientApp tasks forked from a parent that imported torch and flwr once",
        (
            "flwr.supercore.superexec.run_superexec:run_superexec",
            "flwr.supercore.superexec.run_superexec:get_executor",
            "flwr.supercore.superexec.executor.subprocess_executor:SubprocessExecutor",
            "flwr.supercore.superexec.executor.subprocess_executor:subprocess",
            "flwr.supercore.superexec.executor.types:LaunchResult",
            "flwr.supercore.constant:ExecutorType",
            "flwr.supercore.constant:TaskType",
            "flwr.supernode.cli:flwr_clientapp",
            f"{RUN_CLIENTAPP}:run_clientapp",
            f"{RUN_CLIENTAPP}:pull_and_inflate_object_from_tree",
            f"{RUN_CLIENTAPP}:push_task_output",
        ),
        "Flower's subprocess executor (a fresh flwr-clientapp process per message)",
        "superexec",
    ),
    Part(
        "task-beats",
        "the warm executor heartbeats each task child and ends those of stopped runs",
        (
            "flwr.supercore.runtime:RuntimeHttpClient",
            "flwr.supercore.interceptors:RuntimeTokenHttpInterceptor",
            "flwr.supercore.interceptors:RuntimeVersionHttpInterceptor",
            "flwr.proto.runtime_pb2:SendTaskHeartbeatRequest",
            "flwr.proto.runtime_pb2:PushTaskOutputRequest",
            "flwr.common.constant:SubStatus",
        ),
        "task children unwatched (a dead child fails through Flower's token expiry)",
        "superexec",
    ),
    Part(
        "executor-auth-check",
        "an executor its SuperNode refuses says why and exits 3 (Flower: exit 0, no word)",
        (
            "flwr.supercore.cli.flower_superexec:_parse_args",
            "flwr.supercore.auth:load_superexec_auth_secret",
            "flwr.supercore.interceptors.http.superexec_auth:SuperExecAuthHttpInterceptor",
            "flwr.supercore.runtime:RuntimeHttpClient",
            "flwr.proto.runtime_pb2:AcquireTaskRequest",
        ),
        "no check before Flower's executor starts",
        "superexec",
    ),
    Part(
        "heartbeat-patience",
        "the SuperNode waits up to 30 s (Flower: 5 s) for its heartbeat's answer, so a "
        "busy SuperLink that answers late does not declare a live node unavailable",
        (
            "flwr.supernode.fleet_http_client:HEARTBEAT_CALL_TIMEOUT",
            "flwr.supernode.fleet_http_client:FleetHttpClient.SendNodeHeartbeat",
            "flwr.common.constant:HEARTBEAT_DEFAULT_INTERVAL",
            "flwr.common.constant:HEARTBEAT_PATIENCE",
        ),
        "Flower's 5 s heartbeat timeout",
        "supernode",
    ),
    Part(
        "load-aware-idle",
        "a node whose SuperLink answers late polls, sends its heartbeats and asks again "
        "for a message's missing objects less often; no heartbeat while its held polls, "
        "once the SuperLink offers it, stand for them (Flower: a heartbeat every ~20 s, "
        "a missing object every 0.5 s, whatever the load)",
        (
            "flwr.supernode.fleet_http_connection:HeartbeatSender",
            "flwr.supercore.protobuf.client:ProtobufClient.__init__",
            "flwr.supercore.protobuf.client:ProtobufClient._send",
            f"{OBJECTS}:ObjectUnavailableError",
            f"{OBJECTS}:pull_objects",
            f"{SUPERNODE}:_pull_and_store_message",
            "flwr.supernode.fleet_http_connection:http_request_response",
            "flwr.supercore.heartbeat:HeartbeatSender",
            "flwr.common.constant:HEARTBEAT_DEFAULT_INTERVAL",
            "flwr.common.constant:HEARTBEAT_CALL_TIMEOUT",
            "flwr.common.constant:HEARTBEAT_MAX_INTERVAL",
            "flwr.common.constant:HEARTBEAT_BASE_MULTIPLIER",
            "flwr.common.constant:HEARTBEAT_RANDOM_RANGE",
        ),
        "Flower's heartbeat interval; idle polls and object retries not slowed by the "
        "SuperLink's load",
        "supernode",
    ),
    Part(
        "superlink-entry",
        "fedhet superlink starts Flower's own SuperLink",
        ("flwr.superlink.cli:flower_superlink",),
        None,
        "superlink",
    ),
    Part(
        "superlink-fleet-path",
        "the SuperLink's Control API middlewares (cache headers, event log, licence, "
        "account authentication) run only on Control API paths, the Fleet event log only "
        "with its plugin (Flower: all eight middlewares on every request)",
        (
            "flwr.superlink.main:_get_middleware",
            "flwr.superlink.main:create_app",
            f"{CONTROL_MIDDLEWARES}:ControlSensitiveResponseMiddleware",
            f"{CONTROL_MIDDLEWARES}:ControlEventLogMiddleware",
            f"{CONTROL_MIDDLEWARES}:ControlLicenseMiddleware",
            f"{CONTROL_MIDDLEWARES}:ControlAuthenticationMiddleware",
            f"{CONTROL_MIDDLEWARES}:_is_control_path",
            f"{CONTROL_MIDDLEWARES}:CONTROL_SENSITIVE_ROUTE_KEYS",
            f"{CONTROL_MIDDLEWARES}:CONTROL_AUTH_ROUTE_KEYS",
            "flwr.superlink.routers.fleet.middlewares:FleetEventLogMiddleware",
        ),
        "Flower's middlewares on every request",
        "superlink",
    ),
    Part(
        "superlink-node-index",
        "the SuperLink's in-memory state finds a node's messages by its index (Flower: "
        "every poll checks every stored message), all of them checked every 30 s",
        (f"{MEMORY_STATE}:InMemoryLinkState", f"{MEMORY_STATE}:now"),
        "Flower's scan of every stored message on every poll",
        "superlink",
    ),
    Part(
        "superlink-whole-messages",
        "with superlink-node-index, a node's poll returns a message only once all its "
        "objects are on the SuperLink (Flower: as soon as the ServerApp registered it, "
        "so nodes ask for objects the ServerApp has not pushed yet)",
        (
            f"{MEMORY_STATE}:InMemoryLinkState.__init__",
            "flwr.supercore.object_store.in_memory_object_store:InMemoryObjectStore",
            "flwr.supercore.object_store.object_store:NoObjectInStoreError",
            "flwr.supercore.inflatable.inflatable_object:iterate_object_tree",
            "flwr.superlink.servicer.fleet.fleet_handlers:pull_messages",
        ),
        "nodes get a message before its objects and ask again for the missing ones",
        "superlink",
    ),
    Part(
        "superlink-database-index",
        "with the state in a database, the SuperLink also keeps each node's undelivered "
        "messages in memory: a poll for a node with none leaves the database alone, "
        "with superlink-whole-messages a message is returned only once all its objects "
        "are there, and held polls (superlink-held-pulls) apply (Flower: a claim query "
        "on every poll, a message returned before its objects)",
        (
            f"{SQL_STATE}:SqlLinkState.store_message_ins",
            f"{SQL_STATE}:SqlLinkState.store_message_and_object_tree",
            f"{SQL_STATE}:SqlLinkState.get_message_ins",
            f"{SQL_STATE}:SqlLinkState._claim_message_ins_rows",
            f"{SQL_STATE}:SqlLinkState.acknowledge_node_heartbeat",
            f"{SQL_STATE}:MessageInsModel",
            f"{SQL_STATE}:int64_to_uint64",
            "flwr.supercore.sql_mixin:SqlMixin.__init__",
            "flwr.supercore.sql_mixin:SqlMixin.session",
            "flwr.supercore.object_store.sql_object_store:SqlObjectStore.get_object_tree",
            "flwr.supercore.object_store.sql_object_store:SqlObjectStore.put",
            "flwr.supercore.state.schema.objectstore_models:StoredObject",
            "flwr.supercore.object_store.object_store:NoObjectInStoreError",
            "flwr.supercore.inflatable.inflatable_object:iterate_object_tree",
            "flwr.superlink.servicer.fleet.fleet_handlers:pull_messages",
            "flwr.superlink.servicer.runtime.runtime_handlers:pull_messages",
            "flwr.superlink.servicer.runtime.runtime_handlers:push_object",
        ),
        "Flower's claim query on every poll; no held polls with the state in a database",
        "superlink",
    ),
    Part(
        "superlink-database-reads",
        "with the state in a database, a run's status is read at most once a second per "
        "run and a node's id by its public key is remembered (a node deleted through "
        "the SuperLink forgotten at once; Flower: both read on every node request, the "
        "run status with two updates of expired task tokens, and on every object)",
        (
            f"{SQL_STATE}:SqlLinkState.get_run_status",
            f"{SQL_STATE}:SqlLinkState.get_node_id_by_public_key",
            f"{SQL_STATE}:SqlLinkState.delete_node",
            f"{SQL_STATE}:SqlLinkState.create_node",
            "flwr.server.superlink.utils:check_abort",
            "flwr.superlink.routers.fleet.node_auth:authenticate_node",
        ),
        "Flower's reads on every request",
        "superlink",
    ),
    Part(
        "superlink-database-lock",
        "with the state in a database, the SuperLink's threads take turns at it, a "
        "transaction at a time, and wait up to 20 s for a lock another process holds "
        "(Flower: threads meet at SQLite's lock, polled in sleeps, and fail with "
        "'database is locked' after 5 s)",
        (
            "flwr.supercore.sql_mixin:SQLITE_PRAGMAS",
            "flwr.supercore.sql_mixin:_set_sqlite_pragmas",
            "flwr.supercore.sql_mixin:SqlMixin.initialize",
            "flwr.supercore.sql_mixin:SqlMixin.session",
        ),
        "Flower's threads at SQLite's lock, 5 s",
        "superlink",
    ),
    Part(
        "superlink-kept-windows",
        "a node's heartbeat (a Fleet heartbeat, or a held poll standing for one) never "
        "shortens the window an earlier one granted (Flower: 2 x the latest one's "
        "interval, whatever an earlier one promised)",
        (
            f"{SQL_STATE}:SqlLinkState.acknowledge_node_heartbeat",
            f"{SQL_STATE}:NodeModel",
            f"{SQL_STATE}:uint64_to_int64",
            f"{MEMORY_STATE}:InMemoryLinkState.acknowledge_node_heartbeat",
            "flwr.common.constant:HEARTBEAT_PATIENCE",
        ),
        "the latest heartbeat's interval decides",
        "superlink",
    ),
    Part(
        "superlink-database-writes",
        "with the state in a database, traffic records (one per poll, push and object "
        "moved) summed per run and held polls' heartbeats gathered, written together "
        "once a second (Flower: a write transaction each)",
        (
            f"{SQL_STATE}:SqlLinkState.store_traffic",
            f"{SQL_STATE}:SqlLinkState.acknowledge_node_heartbeat",
            f"{SQL_STATE}:SqlLinkState.get_message_res",
            f"{SQL_STATE}:check_node_availability_for_in_message",
            "flwr.superlink.servicer.fleet.fleet_handlers:pull_messages",
            "flwr.superlink.servicer.fleet.fleet_handlers:push_messages",
            "flwr.superlink.servicer.fleet.fleet_handlers:pull_object",
            "flwr.superlink.servicer.fleet.fleet_handlers:push_object",
        ),
        "a write transaction for each",
        "superlink",
    ),
    Part(
        "superlink-released-claims",
        "a message marked delivered for a poll whose answer did not reach its node (the "
        "handler failed after the claim, or a held poll's node hung up) is made "
        "undelivered again (Flower: never handed out again; the ServerApp waits for "
        "its reply until the round's timeout)",
        (
            "flwr.superlink.servicer.fleet.fleet_handlers:pull_messages",
            f"{SQL_STATE}:SqlLinkState.get_message_ins",
            f"{SQL_STATE}:SqlLinkState._claim_message_ins_rows",
            f"{SQL_STATE}:MessageInsModel",
            f"{MEMORY_STATE}:InMemoryLinkState.get_message_ins",
        ),
        "a claimed message lost with its answer",
        "superlink",
    ),
    Part(
        "superlink-urgent-first",
        "the heartbeats (the ServerApp task's, the nodes') are answered in threads of "
        "their own and go first at the database lock (Flower: in line with every "
        "request; a task heartbeat answered after 60 s ends the ServerApp's task)",
        (
            "fastapi.routing:run_in_threadpool",
            "fastapi.routing:run_endpoint_function",
            "fastapi.dependencies.utils:run_in_threadpool",
            "fastapi.dependencies.utils:solve_dependencies",
            "flwr.supercore.protobuf.routing:run_in_threadpool",
            "flwr.supercore.protobuf.routing:ProtobufRoute.__init__",
            "flwr.superlink.routers.fleet.node_auth:run_in_threadpool",
            "flwr.superlink.routers.fleet.node_auth:NodeAuthMiddleware.dispatch",
            "flwr.superlink.routers.fleet.middlewares:run_in_threadpool",
            "flwr.superlink.routers.control.middlewares:run_in_threadpool",
            "flwr.supercore.routers.runtime.responses:run_in_threadpool",
            "flwr.superlink.routers.fleet.router:fleet_send_node_heartbeat",
            "flwr.supercore.routers.runtime.router:send_task_heartbeat",
            "flwr.supercore.corestate.sql_corestate:SqlCoreState.acknowledge_task_heartbeat",
            "flwr.common.constant:HEARTBEAT_PATIENCE",
            "flwr.common.constant:HEARTBEAT_DEFAULT_INTERVAL",
        ),
        "heartbeats in line with every other request",
        "superlink",
    ),
    Part(
        "superlink-keep-alive",
        "the SuperLink keeps an idle connection 60 s (FEDHET_KEEPALIVE_S) and names it in "
        "a Keep-Alive header that fedhet supernode follows (Flower: uvicorn's 5 s, so a "
        "node's idle polls and heartbeats each open a TCP and TLS connection)",
        (
            "flwr.superlink.cli.flower_superlink:_run_superlink_http_api",
            "flwr.superlink.main:_get_middleware",
            "flwr.superlink.main:create_app",
        ),
        "uvicorn's 5 s keep-alive",
        "superlink",
    ),
    Part(
        "superlink-held-pulls",
        "with superlink-node-index, a node's empty poll is held until a whole message "
        "for it is there (up to 45 s; fedhet supernode asks for it), then answered by "
        "Flower's handler, and is the node's heartbeat when it declares an interval "
        "(Flower: answered at once, the node polls again; heartbeats apart)",
        (
            "flwr.superlink.routers.fleet.router:fleet_pull_messages",
            "flwr.superlink.servicer.fleet.fleet_handlers:pull_messages",
            "flwr.proto.fleet_pb2:PullMessagesRequest",
            "flwr.proto.fleet_pb2:PullMessagesResponse",
            "flwr.superlink.main:_get_middleware",
            f"{MEMORY_STATE}:InMemoryLinkState.acknowledge_node_heartbeat",
            "flwr.superlink.routers.fleet.node_auth:NodeAuthMiddleware",
            "flwr.superlink.routers.fleet.node_auth:authenticate_node",
            "flwr.common.constant:HEARTBEAT_MIN_INTERVAL",
            "flwr.common.constant:HEARTBEAT_MAX_INTERVAL",
            "flwr.common.constant:HEARTBEAT_PATIENCE",
        ),
        "polls answered at once",
        "superlink",
    ),
    Part(
        "server-objects",
        "the ServerApp moves 16 objects at once, retried after 0.05 s (Flower: 2, 1 s)",
        (
            "flwr.superlink.grid.http_grid:pull_objects",
            "flwr.superlink.grid.http_grid:push_objects",
            f"{OBJECTS}:pull_objects",
            f"{OBJECTS}:push_objects",
            f"{OBJECTS}:get_num_workers",
        ),
        "Flower's object concurrency and backoff",
        "serverapp",
    ),
    Part(
        "superlink-carried-objects",
        "a message's objects move in the request or answer that moves the message: a "
        "poll (node or ServerApp) that asks gets them appended to its answer, a node's "
        "push may carry them, each read or stored by Flower's own object handlers "
        "(Flower: a request per object)",
        (
            "flwr.superlink.main:_get_middleware",
            "flwr.superlink.routers.fleet.router:fleet_pull_messages",
            "flwr.superlink.routers.fleet.router:fleet_push_messages",
            "flwr.supercore.routers.runtime.router:pull_messages",
            "flwr.superlink.servicer.fleet.fleet_handlers:pull_messages",
            "flwr.superlink.servicer.fleet.fleet_handlers:push_messages",
            "flwr.superlink.servicer.fleet.fleet_handlers:pull_object",
            "flwr.superlink.servicer.fleet.fleet_handlers:push_object",
            "flwr.superlink.servicer.runtime.runtime_handlers:pull_messages",
            "flwr.superlink.servicer.runtime.runtime_handlers:pull_object",
            "flwr.superlink.servicer.runtime.runtime_handlers:push_messages",
            "flwr.superlink.servicer.runtime.runtime_handlers:push_object",
            "flwr.supercore.routers.runtime.router:push_messages",
            "flwr.supercore.inflatable.inflatable_object:iterate_object_tree",
            "flwr.proto.message_pb2:PullObjectRequest",
            "flwr.proto.message_pb2:PushObjectRequest",
            "flwr.common.constant:SUPERLINK_NODE_ID",
        ),
        "a request per object",
        "superlink",
    ),
    Part(
        "superlink-carried-confirmations",
        "with superlink-carried-objects, a confirmation (node or ServerApp) or a node's "
        "reply push may name messages it confirms, each confirmed by Flower's own "
        "handler for the same caller (Flower: a request per message)",
        (
            "flwr.superlink.routers.fleet.router:fleet_confirm_message_received",
            "flwr.supercore.routers.runtime.router:confirm_message_received",
            "flwr.superlink.servicer.fleet.fleet_handlers:confirm_message_received",
            "flwr.superlink.servicer.runtime.runtime_handlers:confirm_message_received",
            "flwr.superlink.routers.fleet.router:fleet_push_messages",
            "flwr.superlink.servicer.fleet.fleet_handlers:push_messages",
            "flwr.proto.message_pb2:ConfirmMessageReceivedRequest",
        ),
        "a confirmation per message",
        "superlink",
    ),
    Part(
        "carried-objects",
        "a node's polls ask for their message's objects in the answer and its pushes "
        "carry the reply's; the ServerApp's reply pulls ask for theirs (when the "
        "SuperLink offers it; Flower: a request per object)",
        (
            f"{SUPERNODE}:pull_objects",
            f"{SUPERNODE}:_pull_and_store_message",
            f"{SUPERNODE}:_push_messages",
            "flwr.supernode.fleet_http_connection:FleetHttpClient",
            "flwr.supernode.fleet_http_client:FleetHttpClient.PullMessages",
            "flwr.supernode.fleet_http_client:FleetHttpClient.PushMessages",
            "flwr.supercore.protobuf.client:ProtobufClient._unary_unary",
            "flwr.supercore.protobuf.client:ProtobufClient._send",
            "flwr.superlink.grid.http_grid:HttpGrid.pull_messages",
            "flwr.superlink.grid.http_grid:pull_objects",
            "flwr.superlink.grid.http_grid:HttpGrid._try_push_messages",
            "flwr.superlink.grid.http_grid:get_all_nested_objects",
            "flwr.supercore.inflatable.inflatable_object:iterate_object_tree",
        ),
        "a request per object",
        "supernode, serverapp",
    ),
    Part(
        "unpack-on-arrival",
        "the ServerApp unpacks each packed reply as a pull inflates it, so that a pull "
        "of many replies holds one of them packed at a time",
        (
            "flwr.superlink.grid.http_grid:HttpGrid.pull_messages",
            "flwr.superlink.grid.http_grid:inflate_object_from_contents",
        ),
        "replies unpacked once the pull has inflated them all (each held twice)",
        "serverapp",
    ),
    Part(
        "carried-confirmations",
        "with carried-objects, the replies one pull of the ServerApp brought are "
        "confirmed in one request, and a node's confirmation goes with its reply's push "
        "(when the SuperLink offers it; Flower: a request per message)",
        (
            f"{SUPERNODE}:_push_messages",
            "flwr.supernode.fleet_http_connection:http_request_response",
            "flwr.supernode.fleet_http_client:FleetHttpClient.PushMessages",
            "flwr.superlink.grid.http_grid:HttpGrid.pull_messages",
            "flwr.superlink.grid.http_grid:HttpGrid._runtime_client",
            "flwr.supercore.runtime.runtime_http_client:RuntimeHttpClient.ConfirmMessageReceived",
            "flwr.proto.message_pb2:ConfirmMessageReceivedResponse",
        ),
        "a confirmation per message",
        "supernode, serverapp",
    ),
)
"""Every change, in the order a deployment applies them."""

BY_NAME = {p.name: p for p in PARTS}


ORIGINALS = "__fedhet_originals__"
"""Attribute of a Flower module that :func:`replace` changed: ``{name: Flower's own
object}``. Kept on Flower's module (not here) so it survives this module being imported
again (a warm task child forgets fedhet's packages): a part's fingerprint is of
Flower's code, whatever this process changed."""


def replace(module: Any, name: str, value: Any) -> None:
    """``module.name = value``, keeping Flower's original for the fingerprints (every
    runtime change of fedhet goes through here)."""
    kept = module.__dict__.setdefault(ORIGINALS, {})
    kept.setdefault(name, getattr(module, name))
    setattr(module, name, value)


def original(module: Any, name: str) -> Any:
    """Flower's own ``module.name`` (before any :func:`replace`)."""
    return module.__dict__.get(ORIGINALS, {}).get(name, getattr(module, name))


class Unfit(Exception):
    """A name a part uses is gone (the message says which)."""


def flower_version() -> str:
    """The installed Flower's version (``flwr`` or ``flwr-nightly``)."""
    from importlib import metadata

    for dist in ("flwr", "flwr-nightly"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def _resolve(use: str) -> Any:
    module_name, _, path = use.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise Unfit(f"{module_name} cannot be imported ({exc})") from None
    first, *rest = path.split(".")
    if not hasattr(obj, first):
        raise Unfit(f"{module_name}.{path} is gone")
    obj = original(obj, first)
    for attr in rest:
        if not hasattr(obj, attr):
            raise Unfit(f"{module_name}.{path} is gone")
        obj = inspect.getattr_static(obj, attr)
    return obj


def _text(obj: Any) -> str:
    """What of ``obj`` the fingerprint covers: its source when it has one."""
    while callable(getattr(obj, "func", None)):  # fedhet's wrappers, partials: the function
        obj = obj.func
    obj = getattr(obj, "__wrapped__", obj)
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property) and obj.fget is not None:  # its getter's source
        obj = obj.fget
    if inspect.ismodule(obj):
        return f"module {obj.__name__}"
    if isinstance(obj, (set, frozenset)):  # its repr's order changes with the hash seed
        return f"{type(obj).__name__} {sorted(map(repr, obj))}"
    descriptor = getattr(obj, "DESCRIPTOR", None)
    if descriptor is not None and hasattr(descriptor, "fields"):  # a protobuf message
        return " ".join(f"{f.name}:{f.number}:{f.type}" for f in descriptor.fields)
    if inspect.isfunction(obj) or inspect.isclass(obj) or inspect.ismethod(obj):
        try:
            return inspect.getsource(obj)
        except (OSError, TypeError):
            try:
                return repr(inspect.signature(obj))
            except (TypeError, ValueError):
                return repr(obj)
    return f"{type(obj).__name__} {obj!r}"


def fingerprint(part: Part) -> str:
    """A digest of the Flower code ``part`` relies on; :class:`Unfit` names a missing one."""
    digest = hashlib.sha256()
    for use in part.uses:
        digest.update(use.encode() + b"\0" + _text(_resolve(use)).encode() + b"\0")
    return digest.hexdigest()[:16]


@functools.cache
def _checked_file() -> dict[str, Any]:
    return json.loads(CHECKED_FILE.read_text())


def checked() -> dict[str, dict[str, str]]:
    """``flower_checked.json``: part -> {fingerprint: Flower version it was checked on}."""
    return _checked_file()["parts"]


def fact(name: str, key: str) -> str:
    """What ``flower_checked.json`` says of the checked Flower version part ``name``
    fits (``facts``: version -> {key: value}), e.g. where its SuperNode keeps messages."""
    found = verdict(name)
    if not found.fits or found.version is None:
        raise RuntimeError(f"fedhet: {name} does not fit flwr {flower_version()}")
    return str(_checked_file()["facts"][found.version][key])


@dataclass(frozen=True)
class Verdict:
    part: Part
    fits: bool
    version: str | None
    """The checked Flower version whose code this is (None: none)."""
    reason: str

    def line(self) -> str:
        """One line: what does not fit, and what runs instead (or the way out)."""
        head = f"fedhet: flwr {flower_version()}: {self.reason}"
        if self.part.fallback is None:
            return (
                f"{head}; fedhet cannot run on this Flower: use `pip install flwr==1.42.0` "
                "(the pin) or a version listed in common/flower_checked.json"
            )
        return f"{head}; {self.part.name} off, using {self.part.fallback}"


@functools.cache
def verdict(name: str) -> Verdict:
    """Whether part ``name`` fits the installed Flower (cached per process)."""
    part = BY_NAME[name]
    forced = {n.strip() for n in os.environ.get("FEDHET_FLOWER_PARTS_OFF", "").split(",")}
    if name in forced or ("all" in forced and part.fallback is not None):
        return Verdict(part, False, None, f"{name} switched off (FEDHET_FLOWER_PARTS_OFF)")
    try:
        digest = fingerprint(part)
    except Unfit as exc:
        return Verdict(part, False, None, f"{name} needs {exc}")
    try:
        known = checked().get(name, {})
    except OSError:
        return Verdict(
            part, False, None, f"{CHECKED_FILE} is missing (an install without fedhet's data)"
        )
    if digest in known:
        return Verdict(part, True, known[digest], "fits")
    versions = sorted(set(known.values()))
    return Verdict(
        part,
        False,
        None,
        f"{name}: the Flower code it changes is not the code it was checked against "
        f"(checked: {', '.join(versions) or 'none'}; fingerprint {digest})",
    )


def use(name: str) -> bool:
    """True when part ``name`` fits. Otherwise one warning line and False (a part with
    a fallback) or one error line and ``SystemExit(1)`` (a part without one)."""
    found = verdict(name)
    if found.fits:
        return True
    _say(found)
    if found.part.fallback is None:
        raise SystemExit(1)
    return False


_said: set[str] = set()


def _say(found: Verdict) -> None:
    if found.part.name in _said:
        return
    _said.add(found.part.name)
    line = found.line()
    try:
        from logging import ERROR, WARNING

        from flwr.common.logger import log

        log(ERROR if found.part.fallback is None else WARNING, "%s", line)
    except Exception:  # noqa: BLE001 - Flower's logger gone: stderr
        print(line, file=sys.stderr)


def record() -> dict[str, str]:
    """Add the installed Flower's fingerprints to ``flower_checked.json``."""
    data = json.loads(CHECKED_FILE.read_text())
    version = flower_version()
    data.setdefault("facts", {}).setdefault(version, {})
    added = {}
    for part in PARTS:
        digest = fingerprint(part)
        if data["parts"].setdefault(part.name, {}).get(digest) is None:
            data["parts"][part.name][digest] = version
            added[part.name] = digest
    CHECKED_FILE.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return added


def main(argv: list[str]) -> int:
    """Print every part's verdict (``--record``: record the installed Flower first);
    exit 1 when a part without a fallback does not fit."""
    if "--record" in argv:
        print("recorded:", record() or "nothing new")
    rows = [verdict(p.name) for p in PARTS]
    print(f"flwr {flower_version()}")
    for row in rows:
        state = f"fits ({row.version})" if row.fits else f"OFF: {row.line()}"
        print(f"  {row.part.name:24s} {row.part.where:11s} {state}")
    return 1 if any(not r.fits and r.part.fallback is None for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
