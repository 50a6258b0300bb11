"""The server's part of the virtual clock: each client's round time, the round's.

A client's round time = the compute time it reported for its device
(``virtual-compute-s``, see :mod:`client_app.clock`) + the bytes it was sent over
its downlink + the bytes it replied over its uplink + its latency. A round lasts
as long as the slowest client the server waits for: with ``round-deadline-s``, no
longer than the deadline (a client past it is a straggler, not aggregated); then
the server step.
"""

from __future__ import annotations

from collections.abc import Mapping

from common.devices import Device
from strategies.replies import NodeInfo


def node_device(node: NodeInfo) -> Device | None:
    """The device class a node reported in its profile (None: no virtual clock)."""
    extras = node.extras
    if "device" not in extras or "speed" not in extras:
        return None
    return Device(
        name=str(extras["device"]),
        speed=float(extras["speed"]),
        uplink_mbps=float(extras["uplink-mbps"]),
        downlink_mbps=float(extras["downlink-mbps"]),
        latency_ms=float(extras["latency-ms"]),
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
