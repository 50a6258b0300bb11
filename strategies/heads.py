"""The global head shared by ``lgfedavg``, ``fedgh`` and ``fedre``: its seeded
initialisation and the server-side training step of FedGH and FedRE."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import numpy as np
import torch

from common.messages import HEAD
from common.records import Arrays
from models.entangle import train_head
from models.threads import torch_threads
from strategies.base import NodeInfo

WEIGHT, BIAS = HEAD + "weight", HEAD + "bias"
"""The global head's two arrays, ``[C, d]`` and ``[C]``."""


class HeadTraining(Protocol):
    """The server-side head training settings (FedGH and FedRE strategies have them)."""

    @property
    def server_lr(self) -> float: ...
    @property
    def server_epochs(self) -> int: ...
    @property
    def server_batch_size(self) -> int: ...


def common_head_shape(nodes: Iterable[NodeInfo]) -> tuple[int, int]:
    """The ``(d, C)`` every node agrees on; a clear error when they disagree."""
    dims = {(n.feature_dim, n.num_classes) for n in nodes}
    if len(dims) != 1:
        raise ValueError(
            f"nodes disagree on (feature-dim, num-classes): {sorted(dims)}; a shared "
            "head needs one model.feature-dim and one label set"
        )
    return dims.pop()


def initial_head(nodes: Iterable[NodeInfo], seed: int) -> Arrays:
    """A seeded ``Linear(d, C)`` initialisation."""
    d, c = common_head_shape(nodes)
    head = torch.nn.Linear(d, c)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head.reset_parameters()
    return {
        WEIGHT: head.weight.detach().numpy().copy(),
        BIAS: head.bias.detach().numpy().copy(),
    }


def server_step(
    head: Arrays,
    inputs: np.ndarray,
    soft_labels: np.ndarray,
    settings: HeadTraining,
    seed: int,
    server_round: int,
) -> tuple[Arrays, float, float]:
    """Train the global head on (input, soft label) pairs; shuffled by (seed, round).

    Returns the new head and the soft-label cross-entropy on all pairs before and
    after the step. ``settings.server_loss`` (where it exists) is the batch loss's
    reduction.
    """
    gen = torch.Generator().manual_seed(seed * 100_003 + server_round)
    with torch_threads(1):  # thousands of tiny steps: threads only add overhead
        w, b, before, after = train_head(
            torch.from_numpy(head[WEIGHT]),
            torch.from_numpy(head[BIAS]),
            torch.from_numpy(inputs),
            torch.from_numpy(soft_labels),
            lr=settings.server_lr,
            epochs=settings.server_epochs,
            batch_size=settings.server_batch_size,
            generator=gen,
            reduction=getattr(settings, "server_loss", "mean"),
        )
    return {WEIGHT: w.numpy(), BIAS: b.numpy()}, before, after


def head_diagnostics(old: Arrays, new: Arrays, before: float, after: float) -> dict[str, float]:
    """The server step's own record: loss on the received pairs before/after it and
    the relative change of the head ‖Δ[W b]‖_F / ‖[W b]‖_F."""

    def flat(h: Arrays) -> np.ndarray:
        return np.concatenate([h[WEIGHT].ravel(), h[BIAS].ravel()]).astype(np.float64)

    change = float(np.linalg.norm(flat(new) - flat(old))) / max(
        float(np.linalg.norm(flat(old))), 1e-30
    )
    return {"server-loss-before": before, "server-loss-after": after, "head-change": change}
