"""Edge device profiles: what a node runs, chosen by node-config ``profile``.

A profile sets the node's architecture (per model family), its FedARA rank ratio,
batch size, torch threads and device. ``profile="auto"`` measures the node (CPUs,
available memory, CUDA) and picks the largest profile that fits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Profile:
    """One device class."""

    name: str
    archs: dict[str, str] = field(default_factory=dict)
    """model.family -> architecture for this device (families not listed: round-robin)."""
    rank_ratio: float = 1.0
    batch_size: int = 10
    threads: int = 0
    device: str = "cpu"
    min_cpus: int = 1
    min_memory_gb: float = 0.5
    needs_cuda: bool = False


def _archs(cnn: str, htfe: str) -> dict[str, str]:
    return {"cnn": cnn, "htfe": htfe, "htfe8": htfe}


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            "rpi4",
            _archs("cnn-5", "fedavgcnn"),
            rank_ratio=0.125,
            batch_size=10,
            threads=4,
            min_cpus=4,
            min_memory_gb=0.5,
        ),
        Profile(
            "rpi5",
            _archs("cnn-4", "shufflenet_v2"),
            rank_ratio=0.25,
            batch_size=16,
            threads=4,
            min_cpus=4,
            min_memory_gb=1.5,
        ),
        Profile(
            "jetson-orin-nano",
            _archs("cnn-2", "mobilenet_v2"),
            rank_ratio=0.5,
            batch_size=32,
            threads=6,
            device="cuda",
            min_cpus=6,
            min_memory_gb=3.0,
            needs_cuda=True,
        ),
        Profile(
            "server",
            _archs("cnn-1", "resnet18"),
            rank_ratio=1.0,
            batch_size=10,
            threads=0,
            device="auto",
            min_cpus=2,
            min_memory_gb=4.0,
        ),
    )
}
"""Smallest first: ``auto`` takes the last one that fits."""


def available_memory_gb() -> float:
    """MemAvailable from /proc/meminfo (total physical memory where unavailable)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def pick_auto(cpus: int, memory_gb: float, cuda: bool) -> Profile:
    """The largest profile whose needs the measured node meets."""
    fits = [
        p
        for p in PROFILES.values()
        if cpus >= p.min_cpus and memory_gb >= p.min_memory_gb and (cuda or not p.needs_cuda)
    ]
    if not fits:
        return PROFILES["rpi4"]
    return fits[-1]


CUSTOM = Profile("custom")
"""``profile="custom"``: no architecture or rank of its own; the device is described
by node-config ``speed`` (and ``uplink-mbps``, ``downlink-mbps``, ``latency-ms``)."""


def resolve(name: str, check_device: bool = True) -> Profile:
    """The profile for node-config ``profile`` (``auto`` measures this machine);
    ``check_device=False`` for a simulated device (no CUDA needed to time a Jetson)."""
    if name == "custom":
        return CUSTOM
    if name == "auto":
        return pick_auto(cpu_count(), available_memory_gb(), cuda_available())
    try:
        profile = PROFILES[name]
    except KeyError:
        raise ValueError(
            f"node-config profile={name!r} is unknown; choose one of "
            f"{', '.join(PROFILES)}, 'custom' or 'auto'"
        ) from None
    if check_device and profile.needs_cuda and not cuda_available():
        raise ValueError(
            f"node-config profile={name!r} runs on CUDA, but "
            "torch.cuda.is_available() is False on this node"
        )
    return profile
