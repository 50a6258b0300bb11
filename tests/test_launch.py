"""Launch helpers: ports handed out once; a node that dies is reported at once."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

import cli.launch
from cli.federation import Federation

ROOT = Path(__file__).resolve().parent.parent


class _FakeSocket:
    """A socket whose kernel hands out the ports of ``ports`` in order."""

    ports: list[int] = []

    def __enter__(self) -> _FakeSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def bind(self, address: tuple[str, int]) -> None:
        self.port = self.ports.pop(0)

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)


def test_free_port_never_hands_out_a_port_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli.launch, "_PORTS_GIVEN", set())
    monkeypatch.setattr(cli.launch.socket, "socket", _FakeSocket)
    _FakeSocket.ports = [41000, 41000, 41000, 41001, 41000, 41002]
    assert [cli.launch.free_port() for _ in range(3)] == [41000, 41001, 41002]


def test_a_node_that_exits_is_named_at_once_not_after_the_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fed = Federation(tmp_path, [{"partition-id": 0}, {"partition-id": 1}], ROOT, secure=False)
    monkeypatch.setattr(fed, "online_nodes", lambda: 0)
    monkeypatch.setattr(fed, "node_status", lambda: {})
    fed.procs.start("supernode-0", [sys.executable, "-c", "import time; time.sleep(30)"])
    dead = fed.procs.start("supernode-1", [sys.executable, "-c", "print('port taken'); exit(3)"])
    dead.wait(timeout=30)
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="supernode-1 exited with code 3") as err:
            fed.wait_online(2, timeout=60)
        assert time.monotonic() - start < 10
        assert "port taken" in str(err.value)  # its log's end
        assert "supernode-0 exited" not in str(err.value)
    finally:
        fed.procs.stop_all(grace=1)
