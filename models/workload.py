"""How much work a training step is, and how fast this process does it.

The virtual clock (``fleet``, ``round-deadline-s``) times a simulated device by the
CPU time a client's training took here, scaled by ``host speed / device speed``.
Speeds are *effective GFLOP/s on the reference workload*: SGD steps of ``cnn-1``
(batch 10, 1×28×28 inputs, 10 classes, ``d`` = 500; the Fashion-MNIST setting),
the FLOPs counted analytically (:func:`training_flops`). ``fedhet profile --measure``
runs the same workload on a device and prints its speed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import time
from pathlib import Path

import torch
from torch import nn

ARCH, BATCH, CHANNELS, IMAGE, CLASSES, DIM = "cnn-1", 10, 1, 28, 10, 500
"""The reference workload: ``cnn-1``, batch 10, 1×28×28 inputs, 10 classes, d = 500."""


def forward_flops(model: nn.Module, x: torch.Tensor) -> float:
    """FLOPs of one forward pass of ``x`` (2 per multiply-add of every Conv2d and
    Linear, counted from their shapes; activations, pooling and norms left out)."""
    total = 0.0

    def conv(module: nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        nonlocal total
        assert isinstance(module, nn.Conv2d)
        per_output = module.in_channels // module.groups * module.kernel_size[0]
        per_output *= module.kernel_size[1]
        total += 2.0 * out.numel() * per_output

    def linear(module: nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        nonlocal total
        assert isinstance(module, nn.Linear)
        total += 2.0 * out.numel() * module.in_features

    hooks = []
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            hooks.append(module.register_forward_hook(conv))
        elif isinstance(module, nn.Linear):
            hooks.append(module.register_forward_hook(linear))
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return total


def training_flops(model: nn.Module, x: torch.Tensor) -> float:
    """FLOPs of one SGD step on the batch ``x``: forward + backward ≈ 3 × forward
    (the backward pass computes two products per forward one: input and weight
    gradients)."""
    return 3.0 * forward_flops(model, x)


def reference_model() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The reference model (seeded) and one batch of inputs and labels."""
    from models import build_model

    model = build_model(
        ARCH, in_channels=CHANNELS, num_classes=CLASSES, image_size=IMAGE, feature_dim=DIM, seed=0
    )
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, CHANNELS, IMAGE, IMAGE, generator=gen)
    y = torch.randint(0, CLASSES, (BATCH,), generator=gen)
    return model, x, y


def measure_speed(seconds: float = 1.0, threads: int = 1) -> float:
    """Effective GFLOP/s of this process on the reference workload, per CPU second
    (``time.process_time``: stable when other work shares the cores), with
    ``threads`` torch threads (restored after)."""
    from models.threads import torch_threads

    model, x, y = reference_model()
    flops = training_flops(model, x)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    with torch_threads(threads):
        for _ in range(3):  # warm-up: allocator, kernels
            step()
        steps, start = 0, time.process_time()
        while True:
            step()
            steps += 1
            spent = time.process_time() - start
            if spent >= seconds and steps >= 5:
                break
    return flops * steps / spent / 1e9


CACHE_HOURS = 24.0
"""How long a machine's measured speed is reused (by every process on it)."""


@functools.cache
def host_speed(threads: int = 1) -> float:
    """This machine's speed with ``threads`` torch threads: ``FEDHET_HOST_SPEED`` if
    set, else the value another process measured in the last :data:`CACHE_HOURS`
    (``host-speed.json`` in ``FEDHET_CACHE_DIR``, default ``~/.cache/fedhet``; every
    process of a run then uses the same number), else :func:`measure_speed` (about a
    second), stored there."""
    if os.environ.get("FEDHET_HOST_SPEED"):
        return float(os.environ["FEDHET_HOST_SPEED"])
    path = Path(os.environ.get("FEDHET_CACHE_DIR", "~/.cache/fedhet")).expanduser()
    path = path / "host-speed.json"
    key = f"{platform.node()}|{torch.__version__}|{threads}"
    try:
        saved = json.loads(path.read_text()).get(key)
        if saved and time.time() - saved["at"] < CACHE_HOURS * 3600:
            return float(saved["speed"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    speed = measure_speed(threads=threads)
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            table = json.loads(path.read_text())
        except (OSError, ValueError):
            table = {}
        table[key] = {"speed": speed, "at": time.time()}
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table))
        os.replace(tmp, path)
    return speed
