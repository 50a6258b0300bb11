"""The client's part of the virtual clock: what its training cost, and what a model
would cost on its device.

A node with a device class (:class:`common.devices.Device`) reports, with every
training reply, the CPU seconds its training took in this process
(``train-cpu-s``), this process's speed on the reference workload
(``host-speed``) and their product on its device (``virtual-compute-s`` =
``train-cpu-s · host-speed / device speed``). A training message that carries an
evaluation also reports that evaluation's CPU seconds (``eval-cpu-s``). The server
adds what the message cost beyond them: the task's start, loading and reply, the
protocol's round trips and the transfers (:mod:`strategies.clock`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from common.devices import Device
from models import build_model
from models.nets import input_shape
from models.workload import training_flops


@functools.lru_cache(maxsize=64)
def flops_per_sample(
    arch: str,
    in_channels: int,
    num_classes: int,
    image_size: int,
    feature_dim: int,
    small_stem: bool,
    rank_ratio: float = 1.0,
    layers: tuple[str, ...] = (),
) -> float:
    """Training FLOPs of one sample through ``arch`` (factorised at ``rank_ratio``
    over ``layers`` when below 1), counted analytically."""
    from models.lowrank import factorise

    model = build_model(
        arch,
        in_channels=in_channels,
        num_classes=num_classes,
        image_size=image_size,
        feature_dim=feature_dim,
        small_stem=small_stem,
        seed=0,
    )
    if rank_ratio < 1 and layers:
        model.extractor = factorise(model.extractor, list(layers), rank_ratio, svd=False)
    x = torch.zeros(1, *input_shape(in_channels, image_size))
    model.eval()
    return training_flops(model, x)


def predicted_compute_s(flops: float, samples: int, epochs: int, device: Device) -> float:
    """Seconds ``epochs`` passes over ``samples`` of ``flops`` each take on ``device``
    at its reference-workload speed."""
    return flops * samples * epochs / (device.speed * 1e9)


def choose_arch(
    archs: Sequence[str],
    flops: dict[str, float],
    samples: int,
    epochs: int,
    device: Device,
    deadline_s: float,
    fixed_bytes: float,
) -> str:
    """The architecture with the most FLOPs whose predicted round time (compute, plus
    what the message costs beyond it with ``fixed_bytes`` each way:
    :meth:`~common.devices.Device.transfer_seconds`) meets ``deadline_s``; the
    cheapest one when none does."""
    by_cost = sorted(archs, key=lambda a: flops[a])
    fits = [
        a
        for a in by_cost
        if predicted_compute_s(flops[a], samples, epochs, device)
        + device.transfer_seconds(fixed_bytes, fixed_bytes)
        <= deadline_s
    ]
    return fits[-1] if fits else by_cost[0]


def timing_metrics(cpu_s: float, device: Device, speed: float) -> dict[str, float]:
    """What a training reply reports for the virtual clock (``speed``: this
    process's, :func:`models.workload.host_speed`)."""
    return {
        "train-cpu-s": cpu_s,
        "host-speed": speed,
        "virtual-compute-s": device.compute_seconds(cpu_s, speed),
    }
