"""Mutual learning with a small shared model (FML, FedKD) and FedKD's SVD compression.

Pure PyTorch; no Flower imports. ``KL(p‖q)`` is the per-sample Kullback-Leibler
divergence averaged over the batch ("batchmean"); the distribution being distilled
from is detached (each model learns from the other's current prediction).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from models.lowrank import top_svd


def kl_from(teacher_logits: Tensor, student_logits: Tensor) -> Tensor:
    """``KL(softmax(teacher) ‖ softmax(student))``, teacher detached, batch mean."""
    target = F.log_softmax(teacher_logits.detach(), dim=1)
    return F.kl_div(F.log_softmax(student_logits, dim=1), target, reduction="batchmean",
                    log_target=True)  # fmt: skip


def fml_loss(local: Tensor, meme: Tensor, y: Tensor, alpha: float, beta: float) -> Tensor:
    """FML's two objectives, summed (each model's gradient comes from its own):
    ``α·CE(local) + (1−α)·KL(meme‖local)`` and ``β·CE(meme) + (1−β)·KL(local‖meme)``."""
    own = alpha * F.cross_entropy(local, y) + (1 - alpha) * kl_from(meme, local)
    shared = beta * F.cross_entropy(meme, y) + (1 - beta) * kl_from(local, meme)
    return own + shared


def fedkd_loss(
    student: Tensor, mentee: Tensor, student_reps: Tensor, mentee_projected: Tensor, y: Tensor
) -> Tensor:
    """FedKD's adaptive mutual distillation, both models' losses summed.

    With ``w = 1 / (CE_s + CE_m)`` (detached: a weight, not a path for gradients),
    student ``CE_s + w·KL(m‖s) + w·H`` and mentee ``CE_m + w·KL(s‖m) + w·H``, where
    ``H = MSE(reps_s, W_h reps_m)`` aligns the hidden representations through the
    learned projection ``W_h``. Confident, correct models distil strongly; models
    that are still wrong barely influence each other."""
    ce_s, ce_m = F.cross_entropy(student, y), F.cross_entropy(mentee, y)
    w = 1.0 / (ce_s + ce_m).detach().clamp(min=1e-8)
    hidden = F.mse_loss(student_reps, mentee_projected)
    return ce_s + ce_m + w * (kl_from(mentee, student) + kl_from(student, mentee) + 2 * hidden)


def energy_rank(singular_values: Tensor, energy: float) -> int:
    """The smallest ``r`` with ``Σ_{i<r} σ_i² ≥ energy · Σ σ_i²`` (at least 1)."""
    sq = singular_values.double().square()
    total = float(sq.sum())
    if total == 0.0:
        return 1
    kept = torch.cumsum(sq, 0) >= energy * total * (1 - 1e-12)
    return int(torch.nonzero(kept)[0, 0]) + 1


def compress(update: Tensor, energy: float) -> tuple[Tensor, Tensor] | None:
    """``(U·S [m, r], Vᵀ [r, n])`` of the matrix form ``[shape[0], rest]`` of
    ``update``, truncated at :func:`energy_rank`; ``None`` when the factors would
    not be smaller than the dense array (send it whole)."""
    if update.dim() < 2:
        return None
    m = update.reshape(update.shape[0], -1).double()
    try:
        u, s, vt = torch.linalg.svd(m, full_matrices=False)
    except torch.linalg.LinAlgError:
        # LAPACK's divide-and-conquer SVD can fail to converge on an ill-conditioned
        # update (seen in a 30-round run); the Gram eigendecomposition does not
        u, s, vt = top_svd(m, min(m.shape))
    r = energy_rank(s, energy)
    if r * (m.shape[0] + m.shape[1]) >= m.numel():
        return None
    return (u[:, :r] * s[:r]).float(), vt[:r].float()


def decompress(us: Tensor, vt: Tensor, shape: tuple[int, ...]) -> Tensor:
    """The inverse of :func:`compress` (up to the truncation)."""
    return (us.double() @ vt.double()).reshape(shape)


def energy_at(round_: int, rounds: int, start: float, end: float) -> float:
    """The energy kept in round ``round_`` of ``rounds``: linear from ``start``
    (round 1) to ``end`` (the last round)."""
    if rounds <= 1:
        return end
    return start + (end - start) * (round_ - 1) / (rounds - 1)
