"""Device classes for the virtual clock: compute speed, links, round-trip time.

A device's round time (:meth:`Device.round_seconds`) = its training's (and, when the
training message carries an evaluation, that evaluation's) CPU time on this machine
scaled by ``host speed / device speed``, plus what one training message costs beyond
that (:meth:`Device.transfer_seconds`):

* the task's own work: start, loading, reply, and the node's own processes
  (:attr:`Device.task_gflop` on the reference workload, at :attr:`Device.cpu_speed`);
* the protocol: :data:`ROUND_TRIPS_PER_MESSAGE` round trips at the device's
  round-trip time, plus :data:`PROTOCOL_S` (a message's time in the protocol at no
  round-trip time);
* the bytes it receives and sends over its links.

Speeds are effective GFLOP/s on the reference workload of :mod:`models.workload` (SGD
steps of ``cnn-1`` at batch 10 on 28×28 inputs); ``fedhet profile --measure`` prints a
machine's. The defaults below are estimates from published figures, derived in
docs/fleet.md: the reference workload runs at 0.39 × a core's double-precision GEMM
rate on the machine they were measured on, and a device's published HPL (Linpack)
rate is scaled by the same factor. The protocol's constants were measured on loopback
links (docs/fleet.md, "The virtual clock"). Node-config ``speed``, ``uplink-mbps``,
``downlink-mbps`` and ``latency-ms`` override any of them for a real device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

WORKLOAD_PER_HPL = 0.39
"""Reference-workload GFLOP/s per HPL (dgemm) GFLOP/s, measured on one core of the
machine the defaults were made on (docs/fleet.md)."""

ROUND_TRIPS_PER_MESSAGE = 4.0
"""Round trips on a round's critical path per training message with fedhet's
defaults (``eval-mode = "with-train"``: one message per node-round): the message's
pull (and the wait for the poll that finds it), its objects (one wave), the reply's
push and its objects (one wave). Measured: ``python -m benchmarks.links``
(docs/deployment.md, "Rounds over real links")."""
PROTOCOL_S = 0.2
"""Seconds a training message spends in the protocol at no round-trip time beyond
the task: the SuperLink's requests, the node's and the ServerApp's polls, the task's
hand-over to the executor, the reply's way to the ServerApp. Measured on this
machine's loopback federation (``python -m benchmarks.throttled --task-cost``: 0.02-0.28
s by class, median 0.24; docs/results/throttled-task-cost.json): a busier or faster
server moves it."""
PROTOCOL_BYTES_DOWN = 100e3
"""Bytes a node receives per training message beyond its arrays: the message, its
object tree, HTTP and TLS framing of every request, the polls' answers. Measured by
``python -m benchmarks.links`` (what the link proxies carried, less the arrays)."""
PROTOCOL_BYTES_UP = 40e3
"""The same, sent by the node."""
TASK_GFLOP = 4.8
"""Work of one ClientApp task beyond its training and evaluation, on the reference
workload: the task process's start (fork, Flower's task input, the run's bundle), the
app's modules, the node's data, model and personal state, its reply, and the node's
own processes meanwhile. Measured per device class on this machine (``python -m
benchmarks.throttled --task-cost``: 0.23-0.28 CPU s with each class's model,
docs/results/throttled-task-cost.json) as CPU seconds x this machine's speed (18.53
GFLOP/s); this value (about their median) for a custom device."""


@dataclass(frozen=True)
class Device:
    """One device class as the virtual clock sees it."""

    name: str
    speed: float
    """Effective GFLOP/s on the reference workload (training, evaluation)."""
    uplink_mbps: float
    """Device to server, Mbit/s."""
    downlink_mbps: float
    """Server to device, Mbit/s."""
    latency_ms: float
    """Round-trip time to the server, ms (what ``ping`` shows)."""
    task_gflop: float = TASK_GFLOP
    """A task's work beyond training and evaluation (see :data:`TASK_GFLOP`)."""
    cpu_speed: float | None = None
    """The speed a task's work beyond training runs at (None: ``speed``). That work is
    single-threaded interpreted code, not matrix products: how a device runs it
    relative to the reference workload is estimated, not measured (docs/fleet.md)."""

    def compute_seconds(self, cpu_seconds: float, host_speed: float) -> float:
        """``cpu_seconds`` of work on a host of ``host_speed``, on this device."""
        return cpu_seconds * host_speed / self.speed

    def task_seconds(self) -> float:
        """One task's start, loading and reply on this device."""
        return self.task_gflop / (self.cpu_speed or self.speed)

    def link_seconds(self, bytes_down: float, bytes_up: float) -> float:
        """One message's protocol (its round trips, its time at no round-trip time)
        and its bytes (arrays and the protocol's own) over this device's links."""
        return (
            ROUND_TRIPS_PER_MESSAGE * self.latency_ms / 1e3
            + PROTOCOL_S
            + (bytes_down + PROTOCOL_BYTES_DOWN) * 8 / (self.downlink_mbps * 1e6)
            + (bytes_up + PROTOCOL_BYTES_UP) * 8 / (self.uplink_mbps * 1e6)
        )

    def transfer_seconds(self, bytes_down: float, bytes_up: float) -> float:
        """Everything one training message costs beyond its training and evaluation:
        the task (:meth:`task_seconds`) and the link (:meth:`link_seconds`). What the
        deadline policies add to their compute prediction."""
        return self.task_seconds() + self.link_seconds(bytes_down, bytes_up)

    def round_seconds(self, compute_s: float, bytes_down: float, bytes_up: float) -> float:
        """Virtual seconds of one training round on this device (``compute_s``: its
        training and the evaluation its message carried, on this device)."""
        return compute_s + self.transfer_seconds(bytes_down, bytes_up)


DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        # Raspberry Pi 4 (4× Cortex-A72, 1.5 GHz): HPL ≈ 8 GFLOP/s; home broadband
        # over Wi-Fi at the upload/download speeds of a typical mobile link
        Device(
            "rpi4",
            speed=8.0 * WORKLOAD_PER_HPL,
            uplink_mbps=10,
            downlink_mbps=50,
            latency_ms=50,
            task_gflop=4.6,
        ),
        # Raspberry Pi 5 (4× Cortex-A76, 2.4 GHz): 2–3× a Pi 4's CPU (Raspberry Pi
        # Ltd): 2.5× here; fixed broadband
        Device(
            "rpi5",
            speed=2.5 * 8.0 * WORKLOAD_PER_HPL,
            uplink_mbps=40,
            downlink_mbps=90,
            latency_ms=20,
            task_gflop=4.3,
        ),
        # Jetson Orin Nano (1024-core Ampere GPU at 625 MHz: 1.28 TFLOP/s FP32 peak);
        # a batch-10 CNN keeps a GPU mostly idle: 5 % of peak assumed
        # its 6 Cortex-A78AE cores do a task's other work: taken as a Pi 5's CPU
        Device(
            "jetson-orin-nano",
            speed=0.05 * 1280.0,
            uplink_mbps=40,
            downlink_mbps=90,
            latency_ms=20,
            task_gflop=5.1,
            cpu_speed=2.5 * 8.0 * WORKLOAD_PER_HPL,
        ),
        # a server client process: 4 cores of the reference machine (single-core
        # workload rate 18 GFLOP/s measured there), data-centre links; a task's other
        # work runs on one of them, as measured
        Device(
            "server",
            speed=4 * 18.0,
            uplink_mbps=1000,
            downlink_mbps=1000,
            latency_ms=2,
            task_gflop=5.2,
            cpu_speed=18.0,
        ),
    )
}
"""The default device of each profile (same names as ``client_app.profiles``)."""

OVERRIDES = {
    "speed": "speed",
    "uplink-mbps": "uplink_mbps",
    "downlink-mbps": "downlink_mbps",
    "latency-ms": "latency_ms",
}
"""Node-config keys that override a device's fields."""


def device_for(name: str, node_config: Mapping[str, object] | None = None) -> Device:
    """The device class ``name`` with node-config overrides; ``custom`` takes every
    field from node-config (``speed`` required)."""
    options = dict(node_config or {})
    if name == "custom":
        if "speed" not in options:
            raise ValueError(
                "node-config profile='custom' needs speed=<GFLOP/s> (fedhet profile --measure "
                "prints it); uplink-mbps, downlink-mbps, latency-ms are optional"
            )
        base = Device("custom", speed=1.0, uplink_mbps=100, downlink_mbps=100, latency_ms=10)
    else:
        try:
            base = DEVICES[name]
        except KeyError:
            raise ValueError(
                f"unknown device class {name!r}; choose one of {', '.join(DEVICES)} or 'custom'"
            ) from None
    changes: dict[str, float] = {}
    for key, attr in OVERRIDES.items():
        if key in options:
            value = float(options[key])  # type: ignore[arg-type]
            least_ok = value >= 0 if key == "latency-ms" else value > 0
            if not least_ok:
                raise ValueError(f"node-config {key}={options[key]!r} must be > 0")
            changes[attr] = value
    return replace(
        base,
        speed=changes.get("speed", base.speed),
        uplink_mbps=changes.get("uplink_mbps", base.uplink_mbps),
        downlink_mbps=changes.get("downlink_mbps", base.downlink_mbps),
        latency_ms=changes.get("latency_ms", base.latency_ms),
    )


def parse_fleet(text: str) -> list[tuple[str, int]]:
    """``"rpi4:8,rpi5:6"`` -> ``[("rpi4", 8), ("rpi5", 6)]``; a clear error otherwise."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, colon, count = part.partition(":")
        name = name.strip()
        if name not in DEVICES:
            raise ValueError(f"unknown device class {name!r}; choose from {', '.join(DEVICES)}")
        try:
            n = int(count) if colon else 1
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"'{part}': the count after ':' must be a positive integer")
        out.append((name, n))
    if not out:
        raise ValueError("is empty; e.g. 'rpi4:8,rpi5:6,jetson-orin-nano:4,server:2'")
    return out


def fleet_class(fleet: str, partition_id: int) -> str:
    """The device class of a simulated node: the fleet's classes in order, each
    repeated by its count, cycled over partition ids (``rpi4:2,server:1``: 0, 1 ->
    rpi4, 2 -> server, 3, 4 -> rpi4, ...)."""
    expanded = [name for name, n in parse_fleet(fleet) for _ in range(n)]
    return expanded[partition_id % len(expanded)]
