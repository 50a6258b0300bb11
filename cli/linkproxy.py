"""A network link in user space: a TCP proxy between a SuperNode and its SuperLink.

The kernel here has no ``netem``; ``fedhet federation --link ...`` puts each node
behind one of these instead. Every byte chunk is delivered after its direction's
one-way delay, and no sooner than the direction's rate lets it leave:

* a chunk read at ``t`` starts to leave when the link is free (``start = max(t,
  free)``), takes ``8 · len / rate`` seconds to send (``free = start + ...``) and
  arrives ``delay`` later (``free + delay``); the next chunk is read meanwhile, so the
  link is a pipeline: a transfer at a high round-trip time is limited by the rate,
  not by one round trip per chunk. All the node's connections share the rate (one
  link, several TCP connections);
* a new connection's first bytes from the node arrive no sooner than a TCP handshake
  allows (``up + down`` delay, then the ``up`` delay of the bytes themselves);
* an end of stream travels like data (after the chunks before it).

Standard library only. ``python -m cli.linkproxy --listen HOST:PORT --target
HOST:PORT --delay-ms D [--up-mbps U] [--down-mbps W] [--stats FILE]``; SIGTERM or
SIGINT stops it. ``--stats`` keeps a JSON file of the connections and bytes it
carried (every 0.5 s and at exit).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

CHUNK = 16384
"""Bytes read at a time: a chunk arrives whole (at 10 Mbit/s one takes 13 ms)."""
BUFFER = 4 * 2**20
"""Bytes one direction holds before it stops reading (as a socket's buffers would)."""


@dataclass(frozen=True)
class Link:
    """One node's link: one-way delay per direction, and a rate per direction
    (Mbit/s; None: as fast as loopback)."""

    delay_ms: float = 0.0
    up_mbps: float | None = None
    """Node to server."""
    down_mbps: float | None = None
    """Server to node."""

    def __post_init__(self) -> None:
        if not self.delay_ms >= 0:
            raise ValueError(f"delay-ms {self.delay_ms!r}: must be >= 0")
        for name, rate in (("up-mbps", self.up_mbps), ("down-mbps", self.down_mbps)):
            if rate is not None and not rate > 0:
                raise ValueError(f"{name} {rate!r}: must be > 0")

    @classmethod
    def of_device(cls, name: str) -> Link:
        """The link of device class ``name`` (``common.devices``): its round-trip
        ``latency_ms`` split evenly between the two directions, its rates."""
        from common.devices import DEVICES

        device = DEVICES[name]
        return cls(device.latency_ms / 2, device.uplink_mbps, device.downlink_mbps)

    @property
    def rtt_ms(self) -> float:
        return 2 * self.delay_ms

    def argv(self) -> list[str]:
        """This link as :func:`main`'s options."""
        out = ["--delay-ms", f"{self.delay_ms:g}"]
        if self.up_mbps is not None:
            out += ["--up-mbps", f"{self.up_mbps:g}"]
        if self.down_mbps is not None:
            out += ["--down-mbps", f"{self.down_mbps:g}"]
        return out

    def __str__(self) -> str:
        def rate(r: float | None) -> str:
            return "unlimited" if r is None else f"{r:g} Mbit/s"

        return (
            f"{self.delay_ms:g} ms each way (round trip {self.rtt_ms:g} ms), up "
            f"{rate(self.up_mbps)}, down {rate(self.down_mbps)}"
        )


def node_links(
    nodes: int,
    classes: str = "",
    delay_ms: float | None = None,
    up_mbps: float | None = None,
    down_mbps: float | None = None,
) -> list[Link | None]:
    """Each node's link for ``fedhet federation``: ``classes`` (comma-separated device
    classes of :mod:`common.devices`, assigned round-robin; ``none``: no link) give a
    node its class's link (half its round-trip ``latency-ms`` each way, its uplink and
    downlink); ``delay_ms`` / ``up_mbps`` / ``down_mbps`` set those fields for every
    node (alone: a link with only them). Empty when nothing is asked."""
    from common.devices import DEVICES

    names = [c.strip() for c in classes.split(",") if c.strip()]
    custom = (delay_ms, up_mbps, down_mbps) != (None, None, None)
    if not names and not custom:
        return []
    unknown = [n for n in names if n != "none" and n not in DEVICES]
    if unknown:
        raise ValueError(
            f"--link {unknown[0]!r}: unknown device class; choose from {', '.join(DEVICES)} or none"
        )
    out: list[Link | None] = []
    for i in range(nodes):
        name = names[i % len(names)] if names else ""
        if name == "none":
            out.append(None)
            continue
        base = Link.of_device(name) if name else Link()
        out.append(
            Link(
                base.delay_ms if delay_ms is None else delay_ms,
                base.up_mbps if up_mbps is None else up_mbps,
                base.down_mbps if down_mbps is None else down_mbps,
            )
        )
    return out


@dataclass
class Stats:
    """What a proxy carried."""

    connections: int = 0
    bytes_up: int = 0
    bytes_down: int = 0

    def add_up(self, n: int) -> None:
        self.bytes_up += n

    def add_down(self, n: int) -> None:
        self.bytes_down += n

    def as_dict(self) -> dict[str, int]:
        return {
            "connections": self.connections,
            "bytes-up": self.bytes_up,
            "bytes-down": self.bytes_down,
        }


class _Wire:
    """One direction of the link, shared by all its connections: when it is free to
    send the next chunk (so that the connections of a node share its rate)."""

    def __init__(self, mbps: float | None) -> None:
        self.seconds_per_byte = 0.0 if mbps is None else 8 / (mbps * 1e6)
        self.free = 0.0

    def send(self, at: float, size: int) -> float:
        """A chunk of ``size`` bytes ready at ``at``: when its last byte has left."""
        start = max(at, self.free)
        self.free = start + size * self.seconds_per_byte
        return self.free


class _Direction:
    """One direction of one connection: read, stamp each chunk with its arrival
    time (its turn on the shared wire, then the delay), deliver it then."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        delay_s: float,
        wire: _Wire,
        not_before: float,
        count: Callable[[int], None],
        trace: Callable[[str], None] | None = None,
    ) -> None:
        self.reader, self.writer = reader, writer
        self.trace = trace
        self.delay_s = delay_s
        self.wire = wire
        self.free = not_before
        """When this connection's last chunk has left (its first: after the handshake)."""
        self.count = count
        self.queue: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue()
        self.held = 0
        self.room = asyncio.Event()
        self.room.set()

    async def read(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                await self.room.wait()
                data = await self.reader.read(CHUNK)
                if not data:
                    break
                self.free = self.wire.send(max(loop.time(), self.free), len(data))
                self.held += len(data)
                if self.held >= BUFFER:
                    self.room.clear()
                self.queue.put_nowait((self.free + self.delay_s, data))
        except (ConnectionError, OSError):
            pass
        self.queue.put_nowait((max(loop.time(), self.free) + self.delay_s, None))

    async def deliver(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                at, data = await self.queue.get()
                wait = at - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if data is None:
                    if self.trace is not None:
                        self.trace("eof")
                    if self.writer.can_write_eof():
                        self.writer.write_eof()
                    return
                if self.trace is not None and data[:5] in (b"POST ", b"GET /", b"HTTP/"):
                    self.trace(data.split(b"\r\n", 1)[0].decode("latin-1")[:100])
                # counted as it is handed on, before the receiver can have it (counted
                # after drain(), a receiver that answers at once raced the count)
                self.count(len(data))
                self.writer.write(data)
                await self.writer.drain()
                self.held -= len(data)
                if self.held < BUFFER:
                    self.room.set()
        except (ConnectionError, OSError):
            pass

    async def run(self) -> None:
        reading = asyncio.ensure_future(self.read())
        try:
            await self.deliver()
        finally:
            reading.cancel()
            with contextlib.suppress(BaseException):
                await reading


class LinkProxy:
    """Listens on ``listen`` (host, port; port 0: any free one, see :attr:`port`) and
    forwards each connection to ``target`` over ``link``. Use :meth:`serve` in an
    event loop, or :meth:`start_thread` / :meth:`stop_thread` from synchronous code."""

    def __init__(
        self,
        listen: tuple[str, int],
        target: tuple[str, int],
        link: Link,
        trace: TextIO | None = None,
    ) -> None:
        self.listen, self.target, self.link = listen, target, link
        self.trace = trace
        """Where each delivered HTTP request and response line goes (plain HTTP
        only: a TLS connection shows only its connections), with the wall-clock time
        of its delivery and its connection's number."""
        self.stats = Stats()
        self._up, self._down = _Wire(link.up_mbps), _Wire(link.down_mbps)
        self.port = listen[1]
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Event | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        self._server = await asyncio.start_server(self._handle, *self.listen)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def serve(self) -> None:
        """Start, then serve until :meth:`close` is called."""
        if self._server is None:
            await self.start()
        assert self._stopped is not None
        await self._stopped.wait()

    async def close(self) -> None:
        """Stop listening and end every connection."""
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        if self._server is not None:
            await self._server.wait_closed()
        if self._stopped is not None:
            self._stopped.set()

    async def _handle(self, node_r: asyncio.StreamReader, node_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # type: ignore[arg-type]
        loop = asyncio.get_running_loop()
        accepted = loop.time()
        server_w: asyncio.StreamWriter | None = None
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
            self.stats.connections += 1
            delay = self.link.delay_ms / 1e3
            number = self.stats.connections
            up = _Direction(
                node_r,
                server_w,
                delay,
                self._up,
                accepted + 2 * delay,
                self.stats.add_up,
                self._tracer(number, ">"),
            )
            down = _Direction(
                server_r,
                node_w,
                delay,
                self._down,
                accepted,
                self.stats.add_down,
                self._tracer(number, "<"),
            )
            if self.trace is not None:
                self.trace.write(f"{time.time():.4f} {number} + connection\n")
            await asyncio.gather(up.run(), down.run())
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass  # a connection that ends, or the proxy closing: the task ends quietly
        finally:
            for writer in (node_w, server_w):
                if writer is not None:
                    writer.close()
                    with contextlib.suppress(BaseException):
                        await writer.wait_closed()
            self._tasks.discard(task)  # type: ignore[arg-type]

    def _tracer(self, number: int, arrow: str) -> Callable[[str], None] | None:
        out = self.trace
        if out is None:
            return None

        def write(line: str) -> None:
            out.write(f"{time.time():.4f} {number} {arrow} {line}\n")

        return write

    # ------------------------------------------------------------ from a thread
    def start_thread(self) -> LinkProxy:
        """Serve in a daemon thread of this process (tests); returns once listening."""
        ready = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            async def main() -> None:
                try:
                    await self.start()
                except BaseException as exc:
                    failed.append(exc)
                    raise
                finally:
                    ready.set()
                await self.serve()

            with contextlib.suppress(BaseException):
                asyncio.run(main())

        self._thread = threading.Thread(target=run, daemon=True, name="linkproxy")
        self._thread.start()
        ready.wait(10)
        if failed:
            raise failed[0]
        return self

    def stop_thread(self, timeout: float = 10.0) -> None:
        """Stop a proxy started by :meth:`start_thread` and wait for its thread."""
        if self._loop is not None and self._thread is not None:
            future = asyncio.run_coroutine_threadsafe(self.close(), self._loop)
            with contextlib.suppress(BaseException):
                future.result(timeout)
            self._thread.join(timeout)


def address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port); a clear error otherwise."""
    host, colon, port = text.rpartition(":")
    if not colon or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host, int(port)


def wait_listening(port: int, timeout: float = 10.0, host: str = "127.0.0.1") -> None:
    """Return once something accepts connections on ``host:port``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no link proxy listening on {host}:{port}") from None
            time.sleep(0.05)


async def _main(args: argparse.Namespace) -> None:
    link = Link(args.delay_ms, args.up_mbps, args.down_mbps)
    trace = args.trace.open("a", buffering=1) if args.trace else None
    proxy = LinkProxy(args.listen, args.target, link, trace)
    await proxy.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(proxy.close()))
    print(
        f"fedhet link: {args.listen[0]}:{proxy.port} -> {args.target[0]}:{args.target[1]}, {link}",
        flush=True,
    )

    async def write_stats() -> None:
        while True:
            _write(args.stats, proxy.stats)
            await asyncio.sleep(0.5)

    writer = asyncio.ensure_future(write_stats()) if args.stats else None
    try:
        await proxy.serve()
    finally:
        if writer is not None:
            writer.cancel()
            _write(args.stats, proxy.stats)


def _write(path: Path, stats: Stats) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(stats.as_dict()))
    tmp.replace(path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m cli.linkproxy", description=__doc__.split("\n")[0])
    ap.add_argument("--listen", type=address, required=True, help="HOST:PORT to accept nodes on")
    ap.add_argument("--target", type=address, required=True, help="the SuperLink's HOST:PORT")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay, each direction")
    ap.add_argument("--up-mbps", type=float, default=None, help="node -> server rate")
    ap.add_argument("--down-mbps", type=float, default=None, help="server -> node rate")
    ap.add_argument("--stats", type=Path, default=None, help="JSON file of what it carried")
    ap.add_argument(
        "--trace", type=Path, default=None, help="append each request / response line (plain HTTP)"
    )
    args = ap.parse_args(argv)
    try:
        Link(args.delay_ms, args.up_mbps, args.down_mbps)
    except ValueError as exc:
        ap.error(str(exc))
    asyncio.run(_main(args))


if __name__ == "__main__":
    main()
