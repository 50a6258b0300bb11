"""Device classes for the virtual clock: compute speed, links, latency.

A device's round time = its training's CPU time on this machine scaled by
``host speed / device speed``, plus the bytes it receives and sends over its links,
plus one latency (:meth:`Device.round_seconds`). Speeds are effective GFLOP/s on
the reference workload of :mod:`models.workload` (SGD steps of ``cnn-1`` at batch 10
on 28×28 inputs); ``fedhet profile --measure`` prints a machine's.

The defaults below are estimates from published figures, derived in docs/fleet.md:
the reference workload runs at 0.39 × a core's double-precision GEMM rate on the
machine they were measured on, and a device's published HPL (Linpack) rate is
scaled by the same factor. Node-config ``speed``, ``uplink-mbps``, ``downlink-mbps``
and ``latency-ms`` override any of them for a real device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

WORKLOAD_PER_HPL = 0.39
"""Reference-workload GFLOP/s per HPL (dgemm) GFLOP/s, measured on one core of the
machine the defaults were made on (docs/fleet.md)."""


@dataclass(frozen=True)
class Device:
    """One device class as the virtual clock sees it."""

    name: str
    speed: float
    """Effective GFLOP/s on the reference workload."""
    uplink_mbps: float
    """Device to server, Mbit/s."""
    downlink_mbps: float
    """Server to device, Mbit/s."""
    latency_ms: float
    """Added once per round's message exchange (request + reply), ms."""

    def compute_seconds(self, cpu_seconds: float, host_speed: float) -> float:
        """``cpu_seconds`` of work on a host of ``host_speed``, on this device."""
        return cpu_seconds * host_speed / self.speed

    def transfer_seconds(self, bytes_down: float, bytes_up: float) -> float:
        """Both transfers over this device's links, plus its latency."""
        return (
            bytes_down * 8 / (self.downlink_mbps * 1e6)
            + bytes_up * 8 / (self.uplink_mbps * 1e6)
            + self.latency_ms / 1e3
        )

    def round_seconds(self, compute_s: float, bytes_down: float, bytes_up: float) -> float:
        """Virtual seconds of one training round on this device."""
        return compute_s + self.transfer_seconds(bytes_down, bytes_up)


DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        # Raspberry Pi 4 (4× Cortex-A72, 1.5 GHz): HPL ≈ 8 GFLOP/s; home broadband
        # over Wi-Fi at the upload/download speeds of a typical mobile link
        Device(
            "rpi4", speed=8.0 * WORKLOAD_PER_HPL, uplink_mbps=10, downlink_mbps=50, latency_ms=50
        ),
        # Raspberry Pi 5 (4× Cortex-A76, 2.4 GHz): 2–3× a Pi 4's CPU (Raspberry Pi
        # Ltd): 2.5× here; fixed broadband
        Device(
            "rpi5",
            speed=2.5 * 8.0 * WORKLOAD_PER_HPL,
            uplink_mbps=40,
            downlink_mbps=90,
            latency_ms=20,
        ),
        # Jetson Orin Nano (1024-core Ampere GPU at 625 MHz: 1.28 TFLOP/s FP32 peak);
        # a batch-10 CNN keeps a GPU mostly idle: 5 % of peak assumed
        Device(
            "jetson-orin-nano", speed=0.05 * 1280.0, uplink_mbps=40, downlink_mbps=90, latency_ms=20
        ),
        # a server client process: 4 cores of the reference machine (single-core
        # workload rate 18 GFLOP/s measured there), data-centre links
        Device("server", speed=4 * 18.0, uplink_mbps=1000, downlink_mbps=1000, latency_ms=2),
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
    return Device(
        name=base.name,
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
