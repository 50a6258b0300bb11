"""Task heartbeats of the warm executor (``cli/warm.py``) for its task children.

Standard library only at import time (Flower and httpx on first use): ``cli/warm.py``,
the warm parent's main module, imports it, and so does every task child.
"""

from __future__ import annotations

import contextlib
from typing import Any


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

        from common.flower_runtime import flower_internal

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

    def fail(self, details: str) -> bool:
        """Finish the task as failed (what its child would have reported, had it not
        died): a ``fedhet supernode`` then replies with an error for its message.
        True when the node accepted it."""
        from common.flower_runtime import flower_internal

        try:
            if self._client is None:
                self._client = self._connect()
            request = flower_internal("flwr.proto.runtime_pb2", "PushTaskOutputRequest")
            failed = flower_internal("flwr.common.constant", "SubStatus").FAILED
            self._client.PushTaskOutput(request(sub_status=failed, details=details))
            return True
        except Exception:  # noqa: BLE001 - the node's token expiry still applies
            return False

    def _connect(self) -> Any:
        """A Runtime API client without retries (Flower's retry invoker would signal
        this process on a 401)."""
        from common.flower_runtime import flower_internal

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
