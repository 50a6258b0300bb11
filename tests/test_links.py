"""The link emulator (``cli/linkproxy.py``): its delay, its rate, its shutdown, and a
federation whose nodes reach the SuperLink through it.

Timing checks use tolerances wide enough for a loaded machine on the upper side (a
late delivery is what load causes) and tight on the lower side (a chunk delivered
before its time is a bug that load cannot cause).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli.launch import free_port
from cli.linkproxy import Link, LinkProxy, node_links, wait_listening

ROOT = Path(__file__).resolve().parent.parent


class _Server:
    """A loopback TCP server: echoes every byte (``echo``), or counts what it gets
    and answers one byte once ``expect`` bytes came."""

    def __init__(self, expect: int | None = None) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = int(self.sock.getsockname()[1])
        self.expect = expect
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        got = 0
        with conn:
            while data := conn.recv(65536):
                if self.expect is None:
                    conn.sendall(data)
                    continue
                got += len(data)
                if got >= self.expect:
                    conn.sendall(b"!")
                    got = 0

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def echo() -> Iterator[_Server]:
    server = _Server()
    yield server
    server.close()


def _proxy(server: _Server, link: Link) -> LinkProxy:
    return LinkProxy(("127.0.0.1", 0), ("127.0.0.1", server.port), link).start_thread()


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _round_trip(sock: socket.socket, payload: bytes = b"x") -> float:
    t0 = time.perf_counter()
    sock.sendall(payload)
    got = b""
    while len(got) < len(payload):
        got += sock.recv(65536)
    return time.perf_counter() - t0


def test_a_request_and_its_answer_take_twice_the_one_way_delay(echo: _Server) -> None:
    """One request/response round trip over a link of delay d each way takes 2d; a
    new connection's first one also pays the TCP handshake (another 2d)."""
    delay = 0.06
    proxy = _proxy(echo, Link(delay_ms=delay * 1e3))
    try:
        t0 = time.perf_counter()
        sock = _connect(proxy.port)  # the proxy accepts at once: the handshake comes next
        _round_trip(sock)
        first = time.perf_counter() - t0
        trips = [_round_trip(sock) for _ in range(5)]
        # counted as it goes (a kept-alive connection is never closed in a run)
        assert proxy.stats.bytes_up == proxy.stats.bytes_down == 6
        sock.close()
    finally:
        proxy.stop_thread()
    assert 2 * delay <= statistics.median(trips) <= 2 * delay + 0.04
    assert 4 * delay <= first <= 4 * delay + 0.08


def test_without_a_link_the_proxy_adds_next_to_nothing(echo: _Server) -> None:
    proxy = _proxy(echo, Link())
    try:
        sock = _connect(proxy.port)
        _round_trip(sock)
        trips = [_round_trip(sock) for _ in range(5)]
        sock.close()
    finally:
        proxy.stop_thread()
    assert statistics.median(trips) < 0.02


@pytest.mark.parametrize("delay_ms", [0.0, 100.0])
def test_a_transfer_takes_its_bytes_over_the_rate_whatever_the_delay(delay_ms: float) -> None:
    """3 MB up at 24 Mbit/s take 1 s, plus the delays: the link is a pipeline, so a
    long delay costs its round trips once, not once per chunk (at 100 ms, one per
    16 KB chunk would be 18 s)."""
    size, rate, d = 3_000_000, 24.0, delay_ms / 1e3
    sink = _Server(expect=size)
    proxy = _proxy(sink, Link(delay_ms=delay_ms, up_mbps=rate, down_mbps=1000.0))
    try:
        sock = _connect(proxy.port)
        payload = os.urandom(size)
        t0 = time.perf_counter()
        sock.sendall(payload)
        assert sock.recv(1) == b"!"
        took = time.perf_counter() - t0
        sock.close()
    finally:
        proxy.stop_thread()
        sink.close()
    # a fresh connection: the handshake (2d), the bytes at the rate, their delay up,
    # the answer's delay down
    expected = 4 * d + size * 8 / (rate * 1e6)
    assert expected * 0.98 <= took <= expected * 1.15 + 0.2
    assert proxy.stats.bytes_up == size


def test_the_proxy_stops_cleanly_with_connections_open(echo: _Server) -> None:
    proxy = _proxy(echo, Link(delay_ms=20))
    sock = _connect(proxy.port)
    _round_trip(sock)
    t0 = time.perf_counter()
    proxy.stop_thread()
    assert time.perf_counter() - t0 < 2
    assert proxy._thread is not None and not proxy._thread.is_alive()
    sock.settimeout(5)
    assert sock.recv(10) == b""  # the node's side is closed
    sock.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", proxy.port), timeout=1).close()


def test_the_proxy_process_stops_on_sigterm_and_leaves_its_counts(
    echo: _Server, tmp_path: Path
) -> None:
    port, stats = free_port(), tmp_path / "link.json"
    cmd = [sys.executable, "-m", "cli.linkproxy", "--listen", f"127.0.0.1:{port}"]
    cmd += ["--target", f"127.0.0.1:{echo.port}", "--delay-ms", "5", "--stats", str(stats)]
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)
    try:
        wait_listening(port)
        sock = _connect(port)
        _round_trip(sock, b"hello")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        sock.close()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    counts = json.loads(stats.read_text())
    assert counts["bytes-up"] == counts["bytes-down"] == 5
    assert counts["connections"] == 2  # wait_listening's probe, then ours


def test_node_links_from_device_classes_and_options() -> None:
    rpi4, server = node_links(3, "rpi4,server")[:2]
    assert rpi4 == Link(delay_ms=25.0, up_mbps=10.0, down_mbps=50.0)  # 50 ms round trip
    assert server == Link(delay_ms=1.0, up_mbps=1000.0, down_mbps=1000.0)
    assert node_links(3, "rpi4,server")[2] == rpi4
    assert node_links(2, "rpi4,none")[1] is None
    assert node_links(2, "rpi4", delay_ms=200)[0] == Link(200.0, 10.0, 50.0)
    assert node_links(2, "", delay_ms=50, up_mbps=10) == [Link(50.0, 10.0, None)] * 2
    assert node_links(2) == []
    with pytest.raises(ValueError, match=r"--link 'pi4'.*rpi4"):
        node_links(2, "pi4")
    with pytest.raises(ValueError, match="up-mbps"):
        node_links(2, "", up_mbps=0)


@pytest.mark.e2e
def test_a_federation_behind_links_completes(tmp_path: Path) -> None:
    """Two nodes behind 40 ms round-trip links (TLS and node auth through the proxy):
    the run completes, and every byte of the nodes went through their proxies."""
    from cli.federation import Federation

    configs = [{"partition-id": i, "num-partitions": 2} for i in range(2)]
    links = [Link(delay_ms=20, up_mbps=50, down_mbps=50), Link(delay_ms=20)]
    with Federation(tmp_path / "fed", configs, ROOT, links=links) as fed:
        outcome = fed.run(
            {
                "algorithm": "lgfedavg",
                "num-server-rounds": 2,
                "data.fraction": 0.05,
                "data.cache-dir": str(tmp_path / "cache"),
                "round-timeout": 300.0,
                "out-dir": str(tmp_path / "out"),
            },
            timeout=600,
        )
        time.sleep(0.7)  # the proxies write their counts every 0.5 s
        counts = [json.loads((fed.workdir / "logs" / f"link-{i}.json").read_text()) for i in (0, 1)]
    assert outcome.ok, outcome.status
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert len(results["rounds"]) == 2
    for c in counts:
        # each node pulled at least its two rounds' arrays down and pushed them up
        assert c["bytes-down"] > results["summary"]["bytes-down-total"] / 2
        assert c["bytes-up"] > results["summary"]["bytes-up-total"] / 2
