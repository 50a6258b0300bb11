"""The executor's secret: a SuperNode hands tasks only to the executor that holds it.

``flower-supernode --isolation process --superexec-auth-secret-file F`` (and so
``fedhet supernode``) answers a task request (``AcquireTask``, the Runtime API's one
protected call) only when it is signed with a key derived from the bytes of ``F``;
``flower-superexec`` / ``fedhet superexec`` sign with their own
``--superexec-auth-secret-file``. A task's later calls use the token that came with the
task, so an executor without the secret never runs anything on the node.

Flower's executor answers a refusal (HTTP 401) by stopping itself with SIGINT, which
ends as a graceful exit, status 0, with no word on why. :func:`check_access` asks the
node once before the executor's loop starts (a request without capacity: answered at
once, never a task) and stops with a message that names the cause and status
:data:`REFUSED_EXIT`. Standard library only at import time (Flower on first use).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

AUTH_INTERNALS = (
    ("flwr.supercore.cli.flower_superexec", "_parse_args"),
    ("flwr.supercore.auth", "load_superexec_auth_secret"),
    ("flwr.supercore.interceptors.http.superexec_auth", "SuperExecAuthHttpInterceptor"),
    ("flwr.supercore.runtime", "RuntimeHttpClient"),
    ("flwr.supercore.interceptors", "RuntimeVersionHttpInterceptor"),
    ("flwr.proto.runtime_pb2", "AcquireTaskRequest"),
)
"""``(module, attribute)`` pairs of Flower 1.42.0 that :func:`check_access` uses."""

ACQUIRE_TASK = "/flwr.proto.Runtime/AcquireTask"
REFUSED_EXIT = 3
"""Exit status of an executor its SuperNode refused (Flower's own: 0)."""


class ExecutorRefused(SystemExit):
    """The SuperNode refused this executor; the message says why."""

    def __init__(self, message: str) -> None:
        super().__init__(REFUSED_EXIT)
        self.message = message


def refusal_message(address: str, secret_file: str | None) -> str:
    """Why the node at ``address`` refused an executor with ``secret_file``."""
    head = (
        f"fedhet superexec: the SuperNode at {address} refused this executor "
        "(SuperExec authentication failed), so it gets no task: "
    )
    if secret_file is None:
        return head + (
            "the node requires its executor secret; start the executor with "
            "--superexec-auth-secret-file FILE, FILE being the node's secret (the file its "
            "SuperNode was started with, node-<i>.superexec-secret from `fedhet keys`)"
        )
    return head + (
        f"{secret_file} is not the secret the SuperNode was started with; give both the "
        "same file (--superexec-auth-secret-file, node-<i>.superexec-secret from "
        "`fedhet keys`)"
    )


def check_access(
    argv: Sequence[str],
    *,
    retry_s: float = 1.0,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Ask the SuperNode named by ``argv`` (``flower-superexec`` flags) for a task
    without capacity, waiting while it is not reachable yet. Returns when it answers;
    raises :class:`ExecutorRefused` when it refuses this executor's signature (or the
    lack of one). Anything else (bad flags, an unreadable secret, TLS errors) is left
    to Flower's own executor, which reports it."""
    import httpx

    from common.flower_runtime import flower_internal

    args, _ = flower_internal(*AUTH_INTERNALS[0])().parse_known_args(list(argv))
    interceptors: list[Any] = [flower_internal(*AUTH_INTERNALS[4])(component_name="SuperExec")]
    if args.superexec_auth_secret_file is not None:
        try:
            secret = flower_internal(*AUTH_INTERNALS[1])(args.superexec_auth_secret_file)
        except ValueError:
            return  # unreadable or empty: Flower's executor says so and exits
        interceptor = flower_internal(*AUTH_INTERNALS[2])
        interceptors.append(interceptor(master_secret=secret, protected_methods={ACQUIRE_TASK}))
    root = None
    if not args.insecure and args.root_certificates:
        try:
            with open(args.root_certificates, "rb") as fh:
                root = fh.read()
        except OSError:
            return
    client = flower_internal(*AUTH_INTERNALS[3]).from_server_address(
        server_address=args.runtime_api_address,
        insecure=args.insecure,
        root_certificates=root,
        interceptors=interceptors,
    )
    request = flower_internal(*AUTH_INTERNALS[5])()
    try:
        while True:
            try:
                client.AcquireTask(request)
                return
            except httpx.HTTPStatusError as exc:
                if exc.response.status_code == httpx.codes.UNAUTHORIZED:
                    raise ExecutorRefused(
                        refusal_message(args.runtime_api_address, args.superexec_auth_secret_file)
                    ) from None
                return
            except httpx.TransportError as exc:
                if any(word in str(exc).lower() for word in ("certificate", "ssl", "tls")):
                    return
                sleep(retry_s)  # the SuperNode is not listening yet
    finally:
        client.close()
