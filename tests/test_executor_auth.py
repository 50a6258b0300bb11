"""The executor's secret: each SuperNode hands its tasks only to the executor that holds
the node's own secret (``--superexec-auth-secret-file`` on both); an executor without
it, or with another node's, gets no task and says why."""

from __future__ import annotations

import http.server
import re
import threading
import time
from pathlib import Path

import pytest

from cli.executor_auth import (
    AUTH_INTERNALS,
    REFUSED_EXIT,
    ExecutorRefused,
    check_access,
    refusal_message,
)
from cli.federation import Federation, superexec_command, supernode_command
from common.flower_runtime import flower_internal
from tests.federation_support import run_overrides

ROOT = Path(__file__).resolve().parent.parent
ONE_NODE = {
    "num-server-rounds": 1,
    "min-train-nodes": 1,
    "min-evaluate-nodes": 1,
    "min-available-nodes": 1,
}


@pytest.mark.parametrize(("module", "name"), AUTH_INTERNALS)
def test_the_flower_internals_the_access_check_uses_exist(module: str, name: str) -> None:
    assert flower_internal(module, name) is not None


def test_the_warm_node_and_its_executor_get_the_same_secret_and_the_cold_node_none() -> None:
    secret = Path("/keys/node-0.superexec-secret")
    warm = supernode_command(
        superlink="sl:9092",
        host="127.0.0.1",
        port=9094,
        ca=None,
        key=None,
        node_config={},
        superexec_secret=secret,
    )
    assert warm[warm.index("--superexec-auth-secret-file") + 1] == str(secret)
    assert warm[warm.index("--isolation") + 1] == "process"
    executor = superexec_command(runtime_api="127.0.0.1:9094", secret=secret)
    assert executor[executor.index("--superexec-auth-secret-file") + 1] == str(secret)
    # Flower's stock node starts its own executor (subprocess isolation): no secret
    cold = supernode_command(
        superlink="sl:9092",
        host="127.0.0.1",
        port=9094,
        ca=None,
        key=None,
        node_config={},
        superexec_secret=secret,
        warm=False,
    )
    assert "--superexec-auth-secret-file" not in cold


def test_a_federation_gives_every_warm_node_a_secret_of_its_own(tmp_path: Path) -> None:
    fed = Federation(tmp_path, [{"partition-id": i} for i in range(3)], ROOT, secure=False)
    paths = [fed.secret(i) for i in range(3)]
    assert len(set(paths)) == 3
    assert [
        fed.node_command(i)[fed.node_command(i).index("--superexec-auth-secret-file") + 1]
        for i in range(3)
    ] == [str(p) for p in paths]
    cold = Federation(tmp_path / "cold", [{"partition-id": 0}], ROOT, secure=False, warm=False)
    assert cold.secret(0) is None and "--superexec-auth-secret-file" not in cold.node_command(0)


class Refusing(http.server.BaseHTTPRequestHandler):
    """A Runtime API that refuses every request as Flower's node refuses an executor
    whose signature is missing or wrong (HTTP 401); records the headers it got."""

    seen: list[dict[str, str]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        Refusing.seen.append({k.lower(): v for k, v in self.headers.items()})
        body = b'{"code": 1008, "message": "Authentication failed."}'
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def refusing_node():  # type: ignore[no-untyped-def]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    Refusing.seen = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("with_secret", [False, True])
def test_a_refused_executor_stops_naming_the_cause(
    refusing_node: str, tmp_path: Path, with_secret: bool
) -> None:
    argv = ["--insecure", "--runtime-api-address", refusing_node]
    secret = tmp_path / "node-0.superexec-secret"
    secret.write_bytes(b"x" * 64)
    if with_secret:
        argv += ["--superexec-auth-secret-file", str(secret)]
    with pytest.raises(ExecutorRefused) as refused:
        check_access(argv, sleep=lambda s: None)
    assert refused.value.code == REFUSED_EXIT
    assert refused.value.message == refusal_message(
        refusing_node, str(secret) if with_secret else None
    )
    assert "refused this executor" in refused.value.message
    if with_secret:
        assert f"{secret} is not the secret the SuperNode was started with" in refused.value.message
        assert "flwr-superexec-signature" in Refusing.seen[0]  # it did sign its request
    else:
        assert "requires its executor secret" in refused.value.message
        assert "flwr-superexec-signature" not in Refusing.seen[0]


def _supernode_log(fed: Federation, i: int) -> str:
    return (fed.workdir / "logs" / f"supernode-{i}.log").read_text(errors="replace")


@pytest.mark.e2e
def test_only_the_executor_with_the_nodes_secret_gets_its_task(tmp_path: Path) -> None:
    """A real node (insecure, memory state) whose own executor is stopped; a run that
    waits for it. Executors without the secret and with a wrong one, and a signed task
    request with capacity, get no task (401; the executors stop with status 3 and say
    why); the node's own executor, started with its secret, then runs the run through."""
    from flwr.proto.runtime_pb2 import AcquireTaskRequest

    configs = [{"partition-id": 0, "num-partitions": 1}]
    with Federation(tmp_path / "fed", configs, ROOT, secure=False, durable=False) as fed:
        fed.procs.stop("superexec-0")
        address = f"127.0.0.1:{fed.node_ports[0]}"
        outcome: dict[str, object] = {}
        runner = threading.Thread(
            target=lambda: outcome.update(
                run=fed.run(run_overrides(fed, "out", "local", **ONE_NODE))
            ),
            daemon=True,
        )
        runner.start()
        deadline = time.monotonic() + 180
        while "Received successfully" not in _supernode_log(fed, 0):
            assert time.monotonic() < deadline, _supernode_log(fed, 0)[-3000:]
            time.sleep(0.2)

        # a task request with capacity, signed with a wrong secret: refused, no task
        import httpx

        runtime = flower_internal("flwr.supercore.runtime", "RuntimeHttpClient")
        signer = flower_internal(*AUTH_INTERNALS[2])
        client_app = flower_internal("flwr.supercore.constant", "TaskType").CLIENT_APP
        for interceptors in (
            [],
            [signer(master_secret=b"wrong", protected_methods={"/flwr.proto.Runtime/AcquireTask"})],
        ):
            client = runtime.from_server_address(
                server_address=address,
                insecure=True,
                root_certificates=None,
                interceptors=interceptors,
            )
            with pytest.raises(httpx.HTTPStatusError) as denied:
                client.AcquireTask(AcquireTaskRequest(supported_task_types=[client_app]))
            client.close()
            assert denied.value.response.status_code == 401

        wrong = tmp_path / "wrong-secret"
        wrong.write_bytes(b"not node 0's secret")
        for name, secret in (("no-secret", None), ("wrong-secret", wrong)):
            intruder = fed.procs.start(name, superexec_command(runtime_api=address, secret=secret))
            assert intruder.wait(timeout=120) == REFUSED_EXIT, name
            log = (fed.workdir / "logs" / f"{name}.log").read_text()
            assert refusal_message(address, None if secret is None else str(secret)) in log
        assert "finished" not in str(outcome.get("run", ""))  # nobody ran its task
        assert len(re.findall("SuperExec authentication failed", _supernode_log(fed, 0))) >= 4

        fed.procs.start("superexec-0", superexec_command(runtime_api=address, secret=fed.secret(0)))
        runner.join(timeout=600)
        run = outcome["run"]
        assert run.ok, run.log_path.read_text()[-3000:]  # type: ignore[attr-defined]
