"""Entangled representations (FedRE) and server-side head training on them.

Pure functions with explicit generators; no Flower imports.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

Mix = Literal["rap", "vap", "rsr"]


def random_weights(present: Tensor, generator: torch.Generator) -> Tensor:
    """``w_c ~ U[0, 1)`` on the ``present`` entries (bool mask), 0 elsewhere, Σw = 1.

    Draws exactly ``present.numel()`` uniforms so the result for a given generator
    state does not depend on which entries are present.
    """
    if not bool(present.any()):
        raise ValueError("no class present: nothing to entangle")
    raw = torch.rand(present.numel(), generator=generator, dtype=torch.float64)
    raw = raw * present.double()
    total = raw.sum()
    if float(total) == 0.0:  # all drawn weights were exactly 0: fall back to equal
        raw = present.double()
        total = raw.sum()
    return raw / total


def equal_weights(present: Tensor) -> Tensor:
    """``1 / #present`` on the present entries (the paper's VAP variant)."""
    w = present.double()
    return w / w.sum()


def entangle(vectors: Tensor, targets: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """``(Σ_i w_i v_i, Σ_i w_i t_i)``: one representation and its soft label.

    ``vectors`` [n, d], ``targets`` [n, C] (one-hot rows), ``weights`` [n] with Σ = 1.
    """
    w = weights.double()
    return (w @ vectors.double()).float(), (w @ targets.double()).float()


def entangle_prototypes(
    protos: Tensor, present: Tensor, mix: Mix, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """FedRE's RAP (random weights) or VAP (equal weights) over class prototypes.

    ``protos`` [C, d] (rows of absent classes ignored), ``present`` bool [C].
    The soft label equals the weights: Σ_c w_c onehot(c) = w.
    """
    if mix == "rap":
        w = random_weights(present, generator)
    elif mix == "vap":
        w = equal_weights(present)
    else:
        raise ValueError(f"entangle_prototypes does not do mix={mix!r}")
    eye = torch.eye(len(present), dtype=torch.float64)
    return entangle(protos, eye, w)


def entangle_samples(
    reps: Tensor, labels: Tensor, num_classes: int, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """FedRE's RSR: random weights over raw sample representations ``reps`` [n, d]."""
    w = random_weights(torch.ones(len(labels), dtype=torch.bool), generator)
    onehot = F.one_hot(labels, num_classes).double()
    return entangle(reps, onehot, w)


def soft_cross_entropy(logits: Tensor, soft: Tensor, reduction: str = "mean") -> Tensor:
    """``−Σ_c soft_c · log softmax(logits)_c`` per row, averaged (``mean``) or summed
    (``sum``) over the rows."""
    per_row = -(soft * F.log_softmax(logits, dim=1)).sum(dim=1)
    return per_row.mean() if reduction == "mean" else per_row.sum()


def train_head(
    weight: Tensor,
    bias: Tensor,
    inputs: Tensor,
    soft_labels: Tensor,
    *,
    lr: float,
    epochs: int,
    batch_size: int,
    generator: torch.Generator,
    reduction: str = "mean",
) -> tuple[Tensor, Tensor, float, float]:
    """Plain SGD on a linear head with soft-label cross-entropy.

    Returns the new ``(weight, bias)`` and the mean loss on all pairs before and
    after training. One-hot ``soft_labels`` make this ordinary cross-entropy (FedGH).
    ``reduction`` is the batch loss's (``sum``: the gradient of the summed loss).
    """
    w = weight.detach().clone().float().requires_grad_(True)
    b = bias.detach().clone().float().requires_grad_(True)
    x, y = inputs.float(), soft_labels.float()
    with torch.no_grad():
        before = float(soft_cross_entropy(F.linear(x, w, b), y))
    opt = torch.optim.SGD([w, b], lr=lr)
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=generator)
        for i in range(0, len(x), batch_size):
            idx = order[i : i + batch_size]
            loss = soft_cross_entropy(F.linear(x[idx], w, b), y[idx], reduction)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    with torch.no_grad():
        after = float(soft_cross_entropy(F.linear(x, w, b), y))
    return w.detach(), b.detach(), before, after
