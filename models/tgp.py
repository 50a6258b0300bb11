"""FedTGP's server side: trainable global prototypes with an adaptive margin.

Pure PyTorch with explicit generators; no Flower imports.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class PrototypeGenerator(nn.Module):
    """``class id -> prototype``: a learnable embedding per class (``[C, d]``)
    followed by ``Linear(d, hidden) -> ReLU -> Linear(hidden, d)``."""

    def __init__(self, num_classes: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(num_classes, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))

    def forward(self) -> Tensor:
        """All ``C`` generated prototypes, ``[C, d]``."""
        return self.mlp(self.embedding.weight)


def adaptive_margin(centres: Tensor, threshold: float) -> float:
    """``min(max_k min_{j≠k} ‖c_k − c_j‖, threshold)`` over the received class
    centres ``[K, d]`` (each the mean of the clients' prototypes of one class);
    0 when fewer than two classes were received."""
    if len(centres) < 2:
        return 0.0
    dist = torch.cdist(centres.double(), centres.double())
    dist.fill_diagonal_(float("inf"))
    return float(min(float(dist.min(dim=1).values.max()), threshold))


def margin_loss(protos: Tensor, labels: Tensor, generated: Tensor, margin: float) -> Tensor:
    """Cross-entropy of ``−(‖p − g_c‖ + margin·[c = y])`` over classes c: pull each
    received prototype to its class's generated prototype, at least ``margin``
    closer than to any other."""
    dist = torch.cdist(protos, generated)
    dist = dist + margin * F.one_hot(labels, generated.shape[0]).to(dist.dtype)
    return F.cross_entropy(-dist, labels)


def train_generator(
    gen: PrototypeGenerator,
    protos: Tensor,
    labels: Tensor,
    margin: float,
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    generator: torch.Generator,
) -> tuple[float, float]:
    """SGD on :func:`margin_loss`; returns the loss on all pairs before and after."""
    opt = torch.optim.SGD(gen.parameters(), lr=lr)
    with torch.no_grad():
        before = float(margin_loss(protos, labels, gen(), margin))
    for _ in range(epochs):
        order = torch.randperm(len(labels), generator=generator)
        for i in range(0, len(labels), batch_size):
            idx = order[i : i + batch_size]
            loss = margin_loss(protos[idx], labels[idx], gen(), margin)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    with torch.no_grad():
        after = float(margin_loss(protos, labels, gen(), margin))
    return before, after
