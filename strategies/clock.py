"""The server's part of the virtual clock: each client's round time, the round's.

A client's round time (:meth:`common.devices.Device.round_seconds`) = the compute
time it reported for its device (``virtual-compute-s``, see :mod:`client_app.clock`)
+ the evaluation its training message carried (``eval-cpu-s`` scaled the same way) +
what the message cost beyond that: the task's start, loading and reply, the
protocol's round trips at the device's round-trip time, and the bytes it was sent
over its downlink and replied over its uplink. A round lasts as long as the slowest
client the server waits for: with ``round-deadline-s``, no longer than the deadline
(a client past it is a straggler, not aggregated); then the server step.
"""

from __future__ import annotations

from collections.abc import Mapping

from common.devices import DEVICES, Device
from strategies.replies import NodeInfo


def node_device(node: NodeInfo) -> Device | None:
    """The device class a node reported in its profile (None: no virtual clock); the
    class's task cost and CPU speed where it is one of :data:`DEVICES`."""
    extras = node.extras
    if "device" not in extras or "speed" not in extras:
        return None
    name = str(extras["device"])
    known = DEVICES.get(name, Device(name, 1.0, 1.0, 1.0, 0.0))
    return Device(
        name=name,
        speed=float(extras["speed"]),
        uplink_mbps=float(extras["uplink-mbps"]),
        downlink_mbps=float(extras["downlink-mbps"]),
        latency_ms=float(extras["latency-ms"]),
        task_gflop=known.task_gflop,
        cpu_speed=known.cpu_speed,
    )


def client_seconds(
    node: NodeInfo, metrics: Mapping[str, float], bytes_down: int, bytes_up: int
) -> float | None:
    """One client's virtual round time; None when it has no device or reported no
    compute time."""
    device = node_device(node)
    compute = metrics.get("virtual-compute-s")
    if device is None or compute is None:
        return None
    evaluation = float(metrics.get("eval-cpu-s") or 0.0)
    if evaluation:
        compute += device.compute_seconds(evaluation, float(metrics["host-speed"]))
    return device.round_seconds(compute, bytes_down, bytes_up)


def round_seconds(client_s: list[float], deadline_s: float, server_s: float) -> float:
    """The round's virtual time: the slowest client waited for (the deadline when a
    client missed it), plus the server step."""
    if not client_s:
        return server_s
    slowest = max(client_s)
    if deadline_s > 0 and slowest > deadline_s:
        slowest = deadline_s
    return slowest + server_s
