"""The link emulator (``cli/linkproxy.py``): its delay, its rate, its shutdown, and a
federation whose nodes reach the SuperLink through it.

Timing checks use tolerances wide enough for a loaded machine on the upper side (a
late delivery is what load causes) and tight on the lower side (a chunk delivered
before its time is a bug that load cannot cause).
"""

from __future__ import annotations

import concurrent.futures
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
from typing import Any

import pytest

from cli.launch import free_port
from cli.linkproxy import Link, LinkProxy, node_links, wait_listening
from cli.supernode import HTTPCORE_INTERNALS

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


@pytest.mark.slow  # wall-clock bounds: in the full tier, never in the fast one
@pytest.mark.serial  # ... and alone (test.sh --all)
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


@pytest.mark.slow  # wall-clock bounds: in the full tier, never in the fast one
@pytest.mark.serial  # ... and alone (test.sh --all)
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


@pytest.mark.slow  # wall-clock bounds: in the full tier, never in the fast one
@pytest.mark.serial  # ... and alone (test.sh --all)
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
    # a fresh connection: the handshake (2d, which may be done before t0), the bytes at
    # the rate, their delay up, the answer's delay down. Load only makes it slower: the
    # lower bound is the mechanism's; the upper one is far below one delay per chunk
    # (18 s at 100 ms), a margin no load on a test machine crosses.
    transfer = size * 8 / (rate * 1e6)
    assert 2 * d + transfer * 0.98 <= took <= 3 * (4 * d + transfer) + 1.0
    assert proxy.stats.bytes_up == size


@pytest.mark.slow  # wall-clock bounds: in the full tier, never in the fast one
@pytest.mark.serial  # ... and alone (test.sh --all)
def test_the_connections_of_one_node_share_its_rate() -> None:
    """Two connections sending 1.5 MB each at once over a 24 Mbit/s link: 1 s for
    both (one link), not 0.5 s (a rate per connection)."""
    size, rate = 1_500_000, 24.0
    sink = _Server(expect=size)
    proxy = _proxy(sink, Link(up_mbps=rate, down_mbps=1000.0))
    took: list[float] = []

    def send() -> None:
        sock = _connect(proxy.port)
        t0 = time.perf_counter()
        sock.sendall(os.urandom(size))
        assert sock.recv(1) == b"!"
        took.append(time.perf_counter() - t0)
        sock.close()

    try:
        senders = [threading.Thread(target=send) for _ in range(2)]
        for t in senders:
            t.start()
        for t in senders:
            t.join(30)
    finally:
        proxy.stop_thread()
        sink.close()
    assert len(took) == 2
    assert max(took) >= 0.98 * 2 * size * 8 / (rate * 1e6)


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


# ------------------------------------------------------------------ the cuts on the node
def _barrier_mover(
    parties: int,
) -> tuple[threading.Barrier, object]:
    """A pull/push function whose calls only return once ``parties`` are in flight
    together (a barrier that breaks after 5 s otherwise)."""
    barrier = threading.Barrier(parties, timeout=5)

    def move(object_id: str, content: bytes = b"") -> bytes:
        barrier.wait()
        return b"content"

    return barrier, move


def test_objects_move_together_not_two_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flower moves 2 objects at once, and never more than the machine's cores; with
    :func:`concurrent_objects` a message's 8 objects are in flight together (one round
    trip instead of four)."""
    import types as pytypes

    from flwr.supercore.inflatable import inflatable_utils as iu

    from common.flower_runtime import concurrent_objects

    monkeypatch.setattr(iu, "get_num_workers", iu.get_num_workers)  # restored afterwards
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    fake = pytypes.ModuleType("fake_flower_transfers")
    fake.pull_objects = iu.pull_objects  # type: ignore[attr-defined]
    fake.push = iu.push_object_contents_from_iterable  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_flower_transfers", fake)
    ids = [f"{i:064x}" for i in range(8)]

    _, move = _barrier_mover(8)
    with pytest.raises(threading.BrokenBarrierError):
        fake.pull_objects(ids, move)  # Flower's own: 2 at once

    concurrent_objects("fake_flower_transfers", "pull_objects", "push", count=16)
    _, move = _barrier_mover(8)
    assert fake.pull_objects(ids, move) == dict.fromkeys(ids, b"content")
    _, move = _barrier_mover(8)
    fake.push(((i, b"x") for i in ids), move)
    # the pulls keep the short backoff for a missing object
    assert fake.pull_objects.keywords["initial_backoff"] == 0.05


def _confirming_watch(along: bool):  # type: ignore[no-untyped-def]
    """A RunWatch over a pull that confirms its message, a confirmation that waits
    for ``release``; (watch, started, release, done)."""
    from cli.supernode import RunWatch

    started, release = threading.Event(), threading.Event()
    done: list[str] = []

    def confirm(run_id: int, message_id: str) -> None:
        started.set()
        release.wait(5)
        done.append(message_id)

    def pull(*, state, receive, get_run, confirm_message_received):  # type: ignore[no-untyped-def]
        confirm_message_received(1, "m1")
        return 1

    pushed: list[list[str]] = []

    def push(*, state, object_store):  # type: ignore[no-untyped-def]
        pushed.append(list(done))  # what was confirmed when the reply went out

    watch = RunWatch(pull, push, confirm_along=along)
    call = {"state": object(), "receive": lambda: None, "get_run": None}
    return watch, call, started, release, done, confirm, pushed


def test_the_confirmation_travels_along_with_the_task() -> None:
    """With ``confirm_along`` the loop goes on (the task starts) while the message's
    confirmation is in flight; the reply goes out only after it is done."""
    from types import SimpleNamespace

    watch, call, started, release, done, confirm, pushed = _confirming_watch(True)
    assert watch.pull(**call, confirm_message_received=confirm) == 1
    assert started.wait(5) and done == []  # pulled and returned; still confirming
    threading.Timer(0.2, release.set).start()
    reply = SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id="m1"))
    state = SimpleNamespace(get_messages_legacy=lambda **kw: [reply])
    watch.push(state=state, object_store=None)
    assert pushed == [["m1"]]


def test_without_it_the_pull_waits_for_the_confirmation() -> None:
    watch, call, started, release, done, confirm, _ = _confirming_watch(False)
    threading.Timer(0.2, release.set).start()
    assert watch.pull(**call, confirm_message_received=confirm) == 1
    assert done == ["m1"]


@pytest.mark.parametrize("offered", [True, False])
def test_a_confirmation_goes_with_the_reply_push_once_offered(offered: bool) -> None:
    """Part carried-confirmations on a node: once the SuperLink takes confirmations
    along, the message's confirmation is no request of its own but names the message
    in the reply's push; a push that fails sends it by itself. Not offered: sent as
    before."""
    from types import SimpleNamespace

    from cli.supernode import RunWatch
    from common import carry

    sent: list[str] = []
    named: list[list[str] | None] = []

    def confirm(run_id: int, message_id: str) -> None:
        sent.append(message_id)

    def pull(*, state, receive, get_run, confirm_message_received):  # type: ignore[no-untyped-def]
        confirm_message_received(1, "m1")
        return 1

    failing = [False]

    def push(*, state, object_store):  # type: ignore[no-untyped-def]
        named.append(carry.LOCAL.confirmed)
        if failing[0]:
            raise ConnectionError("the push did not go")

    watch = RunWatch(pull, push, confirm_along=True, confirm_on_push=True)
    call = {"state": object(), "receive": lambda: None, "get_run": None}
    reply = SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id="m1"))
    state = SimpleNamespace(get_messages_legacy=lambda **kw: [reply])
    carry.LOCAL.confirms_offered = offered
    try:
        watch.pull(**call, confirm_message_received=confirm)
        watch.push(state=state, object_store=None)
        if offered:
            assert sent == [] and named == [["m1"]]  # no request: named in the push
        else:
            assert sent == ["m1"] and named == [None]
        assert carry.LOCAL.confirmed is None
        sent.clear()
        failing[0] = True
        watch.pull(**call, confirm_message_received=confirm)
        with pytest.raises(ConnectionError):
            watch.push(state=state, object_store=None)
        watch.confirmed()
        assert sent == ["m1"]  # sent by itself (offered) or as before
    finally:
        carry.LOCAL.confirms_offered = False
        carry.LOCAL.confirmed = None


def test_a_stored_instruction_rings_for_its_task_a_reply_does_not() -> None:
    from types import SimpleNamespace

    from cli.supernode import _RingsOnStore

    rings: list[int] = []
    stored: list[object] = []
    state = _RingsOnStore(
        SimpleNamespace(store_message=stored.append, get_node_id=lambda: 7),
        lambda: rings.append(1),
    )
    instruction = SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=""))
    reply = SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id="m1"))
    state.store_message(instruction)
    assert rings == [1]
    state.store_message(reply)
    assert rings == [1] and stored == [instruction, reply]
    assert state.get_node_id() == 7  # everything else is the state's


# ------------------------------------------------------------------ connections opened ahead
class _CountingHttp:
    """A local HTTP/1.1 server (keep-alive) counting the connections it accepted and
    the requests it answered; a POST waits at ``barrier`` (when set) before it
    answers, so that requests are in flight together."""

    def __init__(self, certs: dict[str, Path] | None = None) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.connections = 0
        self.requests = 0
        self.barrier: threading.Barrier | None = None
        self.keep_alive: str | None = None
        """A ``Keep-Alive`` header to send with each answer (None: none)."""
        self.extra: dict[str, str] = {}
        """More headers to send with each answer."""
        self.status = 200
        """The status of each answer."""
        self.seen: list[tuple[str, dict[str, str]]] = []
        """Each request's path and headers."""
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                server.connections += 1

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                self.rfile.read(int(self.headers.get("content-length") or 0))
                server.requests += 1
                server.seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
                if server.barrier is not None:
                    server.barrier.wait()
                self.send_response(server.status)
                self.send_header("content-length", "2")
                if server.keep_alive is not None:
                    self.send_header("keep-alive", server.keep_alive)
                for name, value in server.extra.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        scheme = "http"
        if certs is not None:  # TLS 1.3: session tickets follow the handshake
            import ssl

            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(certs["server.pem"], certs["server.key"])
            self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
            scheme = "https"
        self.url = f"{scheme}://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def counting_http() -> Iterator[_CountingHttp]:
    server = _CountingHttp()
    yield server
    server.close()


def _wait_opened(
    warm: object, count: int, server: _CountingHttp | None = None, accepted: int = 0
) -> None:
    """Until ``warm`` opened ``count`` connections and, with ``server``, the server
    has accepted ``accepted`` (default ``count``; its handler threads count them a
    moment after the client is connected)."""
    accepted = accepted or count
    deadline = time.monotonic() + 5
    while warm.opened < count and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.01)
    while server is not None and server.connections < accepted and time.monotonic() < deadline:
        time.sleep(0.01)


def test_connections_are_opened_before_the_requests_that_need_them(
    counting_http: _CountingHttp,
) -> None:
    """:class:`WarmConnections` opens the connections of a wave ahead (no request on
    them); four requests in flight together then use those four and open none."""
    import httpx

    from cli.supernode import WarmConnections

    warm = WarmConnections(limit=16)
    with httpx.Client() as client:
        warm.attach(client, counting_http.url)
        assert warm.ensure(4) == 4
        _wait_opened(warm, 4, counting_http)
        assert counting_http.connections == 4 and counting_http.requests == 0
        assert warm.ensure(4) == 0  # all there: nothing opened twice
        counting_http.barrier = threading.Barrier(4, timeout=5)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda i: client.post(f"{counting_http.url}/{i}"), range(4)))
        assert [a.status_code for a in answers] == [200] * 4
        assert counting_http.connections == 4  # the wave opened none of its own
        assert counting_http.requests == 4


def test_a_tls_connection_opened_ahead_is_kept_by_the_pool(tmp_path: Path) -> None:
    """With TLS 1.3 the server's session tickets arrive after the handshake; unread,
    they make an idle connection look closed to the pool, which would drop it and
    open another for the request. Opened ahead, the connection is used."""
    import ssl

    import httpx

    from cli.security import make_certificates
    from cli.supernode import WarmConnections

    certs = make_certificates(tmp_path / "certs", ["127.0.0.1"])
    server = _CountingHttp(certs)
    try:
        warm = WarmConnections(limit=16)
        verify = ssl.create_default_context(cafile=str(certs["ca.crt"]))
        with httpx.Client(verify=verify) as client:
            warm.attach(client, server.url)
            warm.ensure(2)
            _wait_opened(warm, 2, server)
            time.sleep(0.2)
            assert server.connections == 2
            for _ in range(2):
                assert client.post(server.url).status_code == 200
            assert server.connections == 2  # the requests took the connections opened ahead
    finally:
        server.close()


@pytest.mark.parametrize(
    ("header", "seconds"),
    [
        ("timeout=60", 60.0),
        ("timeout=60, max=1000", 60.0),
        ("max=5,timeout = 12.5", 12.5),
        ("Timeout=60", 60.0),  # parameter names are case-insensitive (RFC 9110 5.6.6)
        ("xtimeout=60", None),
        ("max=100", None),
        ("", None),
        ("timeout=abc", None),
    ],
)
def test_the_keep_alive_header_is_read(header: str, seconds: float | None) -> None:
    from cli.supernode import keep_alive_of

    class Answer:
        headers = {"keep-alive": header} if header else {}

    assert keep_alive_of(Answer()) == seconds


def test_a_node_follows_the_keep_alive_its_superlink_names(
    counting_http: _CountingHttp,
) -> None:
    """fedhet superlink names its keep-alive in each answer: the node reuses an idle
    connection for it less a margin and a round trip (capped at KEEPALIVE_MAX_S), from
    the answer that names it on; an answer without the header changes nothing."""
    import httpx

    from cli.supernode import KEEPALIVE_MAX_S, KEEPALIVE_S, WARM_MARGIN_S, WarmConnections

    warm = WarmConnections(limit=4)
    with httpx.Client() as client:
        warm.attach(client, counting_http.url)
        client.post(counting_http.url)
        assert warm.keepalive == KEEPALIVE_S
        counting_http.keep_alive = "timeout=60"
        before = time.monotonic()
        client.post(counting_http.url)
        after = time.monotonic()
        assert warm.keepalive == 60.0
        assert warm.expiry() == pytest.approx(60.0 - WARM_MARGIN_S - warm.rtt())
        (conn,) = client._transport._pool._connections  # the same connection, reused
        expire_at = conn._connection._expire_at
        assert before + warm.expiry() - 1e-6 <= expire_at <= after + warm.expiry() + 1e-6
        counting_http.keep_alive = None
        client.post(counting_http.url)
        assert warm.keepalive == 60.0
        counting_http.keep_alive = "timeout=100000"
        client.post(counting_http.url)
        assert warm.keepalive == KEEPALIVE_MAX_S
    assert counting_http.connections == 1


@pytest.mark.parametrize("asking", [True, False])
def test_a_node_asks_for_the_hold_its_superlink_offers_on_polls_only(
    counting_http: _CountingHttp, asking: bool
) -> None:
    """Once an answer names ``x-fedhet-holds`` (fedhet superlink), each poll asks for
    that hold (capped) with a read timeout longer by as much; other requests do not;
    the poll's ``x-fedhet-held`` is what held_s() says (0 for a poll not held).
    A held poll waits HELD_POLL_GRACE_S past its hold. FEDHET_HELD_PULLS=0 (``asking``
    False): no poll asks."""
    import httpx

    from cli.supernode import HELD_POLL_GRACE_S, HOLD_MAX_S, PULL_PATH, follow_superlink, held_s

    pulls = counting_http.url.rstrip("/") + PULL_PATH
    timeouts: list[Any] = []
    with httpx.Client(timeout=30.0) as client:
        follow_superlink(client, lambda s: None, hold=asking)
        client.event_hooks["request"].append(lambda r: timeouts.append(r.extensions["timeout"]))
        client.post(pulls)  # nothing offered yet
        counting_http.extra = {"x-fedhet-holds": "20", "x-fedhet-held": "12.5"}
        client.post(counting_http.url + "/v1/fleet/push-messages")  # learns the offer
        client.post(pulls)
        held_after_poll = held_s()
        counting_http.extra = {"x-fedhet-holds": "999"}
        client.post(pulls)
        client.post(pulls)
        held_after_unheld = held_s()
    asked = [h.get("x-fedhet-hold") for _, h in counting_http.seen]
    if asking:
        assert asked == [None, None, "20", "20", f"{HOLD_MAX_S:g}"]
        late = HELD_POLL_GRACE_S  # past the hold: an answer a busy SuperLink makes late
        assert [t["read"] for t in timeouts] == [
            30.0,
            30.0,
            20 + late,
            20 + late,
            late + HOLD_MAX_S,
        ]
    else:
        assert asked == [None] * 5
        assert [t["read"] for t in timeouts] == [30.0] * 5
    assert held_after_poll == 12.5 and held_after_unheld == 0.0


@pytest.fixture
def declared(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    """Polls declare the interval this list ends with (as load_aware_heartbeats'
    ``declared`` would say)."""
    from cli import supernode as sn

    intervals = [42.5]
    monkeypatch.setattr(sn.AliveInterval, "declared", lambda: intervals[-1])
    yield intervals


def test_once_offered_a_held_poll_declares_the_nodes_heartbeat_interval(
    counting_http: _CountingHttp, declared: list[float]
) -> None:
    """Once the SuperLink's answers name ``x-fedhet-alive-polls: 1``, each held poll
    carries ``x-fedhet-alive`` with the interval a heartbeat would declare now, and
    the client's PollAlive notes when it was sent (in flight until its answer, then
    answered); other requests, and polls before the offer, carry none."""
    import httpx

    from cli.supernode import POLL_ALIVE, PULL_PATH, follow_superlink

    pulls = counting_http.url + PULL_PATH
    with httpx.Client() as client:
        follow_superlink(client, lambda s: None, hold=True)
        alive = POLL_ALIVE[client]
        counting_http.extra = {"x-fedhet-holds": "20"}
        client.post(pulls)  # learns the hold; no alive offer yet
        client.post(pulls)
        assert alive.view() == (None, 0.0, False, None)
        counting_http.extra = {"x-fedhet-holds": "20", "x-fedhet-alive-polls": "1"}
        client.post(counting_http.url + "/v1/fleet/push-messages")  # learns the offer
        seen: list[tuple[float | None, bool]] = []

        def noted(request: httpx.Request) -> None:  # after follow_superlink's hook
            if request.url.path == PULL_PATH:
                seen.append((alive.sent, alive.in_flight))

        client.event_hooks["request"].append(noted)
        before = time.monotonic()
        client.post(pulls)
        after = time.monotonic()
        declared.append(61.0)
        client.post(counting_http.url + "/v1/fleet/send-node-heartbeat")
        client.post(pulls)
    asked = [h.get("x-fedhet-alive") for _, h in counting_http.seen]
    assert asked == [None, None, None, "42.5", None, "61"]
    sent, interval, in_flight, answered = alive.view()
    assert interval == 61.0 and not in_flight and answered == (sent, 61.0)
    first_sent, first_in_flight = seen[0]
    assert first_in_flight and first_sent is not None and before <= first_sent <= after


def test_a_poll_not_held_declares_nothing(
    counting_http: _CountingHttp, declared: list[float]
) -> None:
    """FEDHET_HELD_PULLS=0 (``hold`` False): no poll asks to be held, none declares."""
    import httpx

    from cli.supernode import POLL_ALIVE, PULL_PATH, follow_superlink

    counting_http.extra = {"x-fedhet-holds": "20", "x-fedhet-alive-polls": "1"}
    with httpx.Client() as client:
        follow_superlink(client, lambda s: None, hold=False)
        client.post(counting_http.url + PULL_PATH)
        client.post(counting_http.url + PULL_PATH)
        assert POLL_ALIVE[client].sent is None
    assert [h.get("x-fedhet-alive") for _, h in counting_http.seen] == [None, None]


@pytest.mark.parametrize("how", ["status", "transport", "offer-gone"])
def test_a_poll_that_failed_stands_for_no_heartbeat(
    counting_http: _CountingHttp, declared: list[float], how: str
) -> None:
    """A declaring poll answered with a non-2xx status, one that never got an answer
    (the SuperLink gone), or one whose answer no longer offers it (a SuperLink
    started again without the part): the client's PollAlive forgets it."""
    import httpx

    from cli.supernode import POLL_ALIVE, PULL_PATH, follow_superlink

    offer = {"x-fedhet-holds": "20", "x-fedhet-alive-polls": "1"}
    counting_http.extra = offer
    with httpx.Client() as client:
        follow_superlink(client, lambda s: None, hold=True)
        alive = POLL_ALIVE[client]
        client.post(counting_http.url + PULL_PATH)  # learns the offer
        client.post(counting_http.url + PULL_PATH)
        assert alive.sent is not None and alive.answered is not None
        if how == "status":
            counting_http.status = 503
            client.post(counting_http.url + PULL_PATH)
        elif how == "offer-gone":
            counting_http.extra = {"x-fedhet-holds": "20"}
            client.post(counting_http.url + PULL_PATH)
        else:  # nobody listens there: refused
            with pytest.raises(httpx.TransportError):
                client.post(f"http://127.0.0.1:{free_port()}{PULL_PATH}")
        sent, _, in_flight, answered = alive.view()
        assert sent is None and not in_flight and answered is not None  # the earlier one
    if how != "transport":
        assert counting_http.seen[-1][1].get("x-fedhet-alive") == "42.5"


def test_two_clients_of_one_process_keep_their_own_polls(
    counting_http: _CountingHttp, declared: list[float]
) -> None:
    """The fleet emulator runs many nodes in one process: a poll of one client is
    noted for that client only."""
    import httpx

    from cli.supernode import POLL_ALIVE, PULL_PATH, follow_superlink

    counting_http.extra = {"x-fedhet-holds": "20", "x-fedhet-alive-polls": "1"}
    with httpx.Client() as one, httpx.Client() as two:
        for client in (one, two):
            follow_superlink(client, lambda s: None, hold=True)
            client.post(counting_http.url + "/v1/fleet/get-run")  # learns the offer
        one.post(counting_http.url + PULL_PATH)
        assert POLL_ALIVE[one].sent is not None and POLL_ALIVE[two].sent is None
        assert POLL_ALIVE[one] is not POLL_ALIVE[two]


def _heartbeat_senders(
    monkeypatch: pytest.MonkeyPatch, polls: bool | None
) -> tuple[Any, list[object]]:
    """Flower's heartbeat sender class made by load_aware_heartbeats (restored after
    the test), and the list each heartbeat function appends its client to."""
    from flwr.supernode import fleet_http_connection as conn

    from cli import supernode as sn
    from cli.pacing import ServerLoad

    monkeypatch.setattr(conn, "HeartbeatSender", conn.HeartbeatSender)
    monkeypatch.setattr(conn, "HEARTBEAT_DEFAULT_INTERVAL", conn.HEARTBEAT_DEFAULT_INTERVAL)
    monkeypatch.setattr(sn.AliveInterval, "declared", None)
    sn.load_aware_heartbeats(ServerLoad(), polls=polls)
    return conn.HeartbeatSender, []


def _beat_for(fleet: object, beats: list[object]) -> Any:
    """A heartbeat function shaped as Flower's ``send_node_heartbeat``: a closure over
    its Fleet API client, named ``client``."""
    client = fleet

    def send_node_heartbeat() -> bool:
        beats.append(client)
        return True

    return send_node_heartbeat


def first_wait(sender: Any) -> float:
    """The first wait ``_run`` takes (it stops there)."""
    seen: list[float] = []

    def wait(seconds: float) -> bool:
        seen.append(seconds)
        sender._stop_event.set()
        return True

    sender._stop_event = threading.Event()
    sender._stop_event.wait = wait
    sender._run()
    return seen[0]


def _node(http: object) -> Any:
    """A Fleet API client as Flower's (its httpx client in ``_client``), with a
    PollAlive for it."""
    from types import SimpleNamespace

    from cli.supernode import POLL_ALIVE, PollAlive

    POLL_ALIVE[http] = PollAlive()
    return SimpleNamespace(_client=http)


class _Http:
    """Stands for an ``httpx.Client`` (a key of POLL_ALIVE)."""


def _answered(alive: Any, interval: float, sent: float, held: float = 0.0, ok: bool = True) -> None:
    """A held poll declaring ``interval``, sent at ``sent`` and answered (``ok``: 2xx
    after ``held`` seconds; else failed), noted in ``alive`` (a PollAlive)."""
    poll = object()
    alive.sending(poll, interval, sent)
    alive.ended(poll, ok, held)


def test_a_recent_held_poll_stands_for_its_own_clients_heartbeat(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """load-aware-idle with poll heartbeats: the sender of a node whose client sent a
    declaring poll less than the heartbeat's wait ago sends nothing and waits until
    that poll's time + the wait; the sender of another client of the same process,
    whose poll is older than that, sends its heartbeat; a sender whose client has no
    PollAlive (none found) sends as before."""
    from cli import supernode as sn

    senders, beats = _heartbeat_senders(monkeypatch, polls=True)
    assert sn.AliveInterval.declared is not None and sn.AliveInterval.declared() == 30.0
    recent, old, unknown = _node(_Http()), _node(_Http()), object()
    now = time.monotonic()
    for fleet, at in ((recent, now - 1.0), (old, now - 30.0)):
        _answered(sn.POLL_ALIVE[fleet._client], 30.0, at)
    wait = first_wait(senders(_beat_for(recent, beats)))
    assert beats == []
    # until the poll's time + Flower's wait for its interval: (30 - 5) x (0.8 +- 0.1) - 1,
    # less the time this took
    assert 0 < wait <= 0.9 * 25 - 1.0
    for fleet in (old, unknown):
        wait = first_wait(senders(_beat_for(fleet, beats)))
        assert beats[-1] is fleet and 0.7 * 25 <= wait <= 0.9 * 25
    assert beats == [old, unknown]


def test_a_poll_in_flight_stands_for_a_heartbeat_only_as_far_as_the_last_known_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A poll not answered yet may not have reached the SuperLink: it stands for a
    heartbeat only up to one interval after the latest answered poll (or heartbeat).
    After one answered 2 s ago: skipped; after one answered 100 s ago, or none: sent.
    The process's tally counts the heartbeats sent, and as late the one sent 100 s
    after the last acknowledgement the node knew of (past 2 x 30 s)."""
    from cli import supernode as sn

    monkeypatch.setattr(sn, "HEARTBEATS", sn.HeartbeatTally())
    senders, beats = _heartbeat_senders(monkeypatch, polls=True)
    for answered_ago, skipped in ((2.0, True), (100.0, False), (None, False)):
        fleet = _node(_Http())
        alive = sn.POLL_ALIVE[fleet._client]
        now = time.monotonic()
        if answered_ago is not None:
            _answered(alive, 30.0, now - answered_ago)
        alive.sending(object(), 30.0, now - 1.0)  # in flight
        before = len(beats)
        first_wait(senders(_beat_for(fleet, beats)))
        assert (len(beats) == before) is skipped, answered_ago
    tally = sn.HEARTBEATS.view()
    assert (tally["sent"], tally["failed"], tally["late"]) == (2, 0, 1)
    assert 100.0 <= tally["longest-gap-s"] < 110.0


def test_the_latest_acknowledgement_sets_when_the_heartbeat_is_due(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The SuperLink holds a node online for 2 x the interval of its latest
    acknowledgement, so the heartbeat follows that one: after a poll answered 10 s
    ago that declared 90 s and a heartbeat 5 s ago that declared 30 s, the next is
    due within the heartbeat's wait (not the poll's: the node would be offline from
    55 s on); with a poll in flight sent 9 s ago declaring 30 s after a heartbeat 10 s
    ago that declared 60 s, no later than the poll's own interval + wait (it may have
    arrived and shortened the window to 60 s)."""
    from cli import supernode as sn

    senders, beats = _heartbeat_senders(monkeypatch, polls=True)
    now = time.monotonic()
    fleet = _node(_Http())
    alive = sn.POLL_ALIVE[fleet._client]
    _answered(alive, 90.0, now - 10.0)
    sender = senders(_beat_for(fleet, beats))
    sender.beat = (now - 5.0, 30.0)
    assert 0 < first_wait(sender) <= 0.9 * 25 - 5.0 and beats == []
    fleet = _node(_Http())
    alive = sn.POLL_ALIVE[fleet._client]
    alive.sending(object(), 30.0, now - 9.0)  # in flight
    sender = senders(_beat_for(fleet, beats))
    sender.beat = (now - 10.0, 60.0)
    assert 30.0 - 9.0 < first_wait(sender) <= 30.0 + 0.9 * 25 - 9.0 and beats == []


def test_polls_held_back_to_back_leave_no_heartbeat_to_send(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The SuperLink acknowledges a held poll again as it answers it: an answered poll
    sent 60 s ago and held 59 s stands for the heartbeat as one sent 1 s ago; a poll
    still held 40 s after it was sent stands for it while the last acknowledgement the
    node knows of (the poll before, answered 41 s ago) + its interval + the wait is
    ahead (so with 45 s holds and 30 s intervals no heartbeat goes out), not once that
    is past (answered 55 s ago: a lost poll must not leave the node offline)."""
    from cli import supernode as sn

    senders, beats = _heartbeat_senders(monkeypatch, polls=True)
    now = time.monotonic()
    fleet = _node(_Http())
    alive = sn.POLL_ALIVE[fleet._client]
    _answered(alive, 30.0, now - 60.0, held=59.0)
    first_wait(senders(_beat_for(fleet, beats)))
    assert beats == []
    for answered_ago, skipped in ((41.0, True), (55.0, False)):
        fleet = _node(_Http())
        alive = sn.POLL_ALIVE[fleet._client]
        _answered(alive, 30.0, now - answered_ago - 45.0, held=45.0)
        alive.sending(object(), 30.0, now - 40.0)  # in flight, beyond its own wait
        before = len(beats)
        first_wait(senders(_beat_for(fleet, beats)))
        assert (len(beats) == before) is skipped, answered_ago


@pytest.mark.parametrize("how", ["failed", "switched-off"])
def test_without_a_standing_poll_the_heartbeat_is_sent(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A recent poll that failed stands for nothing; FEDHET_POLL_HEARTBEATS=0 turns
    the node side off (polls declare nothing, every heartbeat is sent)."""
    from cli import supernode as sn

    if how == "switched-off":
        monkeypatch.setenv("FEDHET_POLL_HEARTBEATS", "0")
    senders, beats = _heartbeat_senders(monkeypatch, polls=None)
    fleet = _node(_Http())
    _answered(sn.POLL_ALIVE[fleet._client], 30.0, time.monotonic() - 1.0, ok=how != "failed")
    wait = first_wait(senders(_beat_for(fleet, beats)))
    assert beats == [fleet] and 0.7 * 25 <= wait <= 0.9 * 25
    assert (sn.AliveInterval.declared is None) is (how == "switched-off")


def test_a_connection_is_reused_while_a_request_reaches_the_superlink_in_time(
    counting_http: _CountingHttp,
) -> None:
    """The SuperLink closes a connection KEEPALIVE_S after its last answer; the node
    reuses one for a round trip and a margin less (:meth:`WarmConnections.expiry`),
    so that no request goes out on a connection the SuperLink is closing. A used
    connection is not one of the fresh ones: a wave after it expired gets fresh ones."""
    import httpx

    from cli.supernode import KEEPALIVE_S, WARM_MARGIN_S, WarmConnections

    warm = WarmConnections(limit=16)
    with httpx.Client() as client:
        warm.attach(client, counting_http.url)
        assert warm.expiry() == KEEPALIVE_S - WARM_MARGIN_S
        warm.note_rtt(1.0)  # a one-second round trip: a second less
        assert warm.expiry() == pytest.approx(KEEPALIVE_S - WARM_MARGIN_S - 1.0)
        before = time.monotonic()
        client.post(counting_http.url)
        after = time.monotonic()
        (conn,) = client._transport._pool._connections
        # set when the answer came: between the two clock readings, whatever the load
        expire_at = conn._connection._expire_at
        assert before + warm.expiry() - 1e-6 <= expire_at <= after + warm.expiry() + 1e-6
        assert warm.fresh() == 0
        assert warm.ensure(1) == 1
        _wait_opened(warm, 1, counting_http, accepted=2)
        assert warm.fresh() == 1 and warm.ensure(1) == 0
        assert counting_http.connections == 2
        client.post(counting_http.url)  # the pool takes the older connection first
        assert warm.fresh() == 1 and counting_http.connections == 2


def test_the_node_counts_what_its_waves_moved() -> None:
    from cli.supernode import WarmConnections

    warm = WarmConnections(limit=16)
    moved: list[object] = []
    pull, push = warm.counting(
        lambda ids, **kw: dict.fromkeys(ids), lambda it, **kw: moved.extend(it)
    )
    pull([f"{i}" for i in range(8)], pull_object_fn=None)
    push(((f"{i}", b"x") for i in range(5)), push_object_fn=None)
    assert (warm.pull_count, warm.push_count, len(moved)) == (8, 5, 5)
    pull([f"{i}" for i in range(24)], pull_object_fn=None)
    assert warm.pull_count == 16  # never more than move at once


def test_connections_for_the_next_message_are_opened_once_it_is_due() -> None:
    """Before an idle wait the node opens its next message's connections only when
    the message is due within the wait and the margin (or it has no history)."""
    from types import SimpleNamespace

    from cli.supernode import warm_before_idle

    calls: list[int] = []
    warm = SimpleNamespace(pull_count=8, lead=lambda: 1.0, ensure=calls.append)
    before = warm_before_idle(warm)  # type: ignore[arg-type]
    before(2.0, 10.0)  # due in 10 s, next look in 2 s: not yet
    assert calls == []
    before(2.0, 2.5)
    before(0.05, -1.0)  # past due
    before(3.0, None)  # no history
    assert calls == [9, 9, 9]


def test_paced_sleep_tells_when_the_next_message_is_due() -> None:
    import time as real_time

    from cli.pacing import LEAD
    from cli.supernode import FLOWER_IDLE_PULL_S, PacedSleep

    paced = PacedSleep(real_time, poll=0.05)  # type: ignore[arg-type]
    seen: list[tuple[float, float | None]] = []
    paced.before_idle = lambda wait, due_in: seen.append((wait, due_in))
    paced.wait_for(FLOWER_IDLE_PULL_S)
    assert seen[-1][1] is None  # no history
    paced.replied = "train"
    paced.gaps.add("train", 10.0)
    paced.last_active = real_time.monotonic()
    wait = paced.wait_for(FLOWER_IDLE_PULL_S)
    assert seen[-1][0] == wait
    assert seen[-1][1] == pytest.approx(LEAD * 10.0, abs=0.05)
    paced.wait_for(0.5)  # a wait inside a task: no call
    assert len(seen) == 2
    paced.last_active = real_time.monotonic() - 25.0  # overdue by more than its gap
    paced.wait_for(FLOWER_IDLE_PULL_S)
    assert len(seen) == 2


@pytest.mark.parametrize(("module", "cls", "attr"), HTTPCORE_INTERNALS)
def test_httpcore_has_what_warm_connections_use(module: str, cls: str, attr: str) -> None:
    import importlib

    assert hasattr(getattr(importlib.import_module(module), cls), attr)
