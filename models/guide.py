"""FedL2G's guiding vectors: the guiding term of local training, the meta step that
gives the gradient of a quiz loss with respect to the guide table, and the server's
step on that table.

Pure functions, no Flower imports. The meta step differentiates through one SGD step
with ``torch.func`` (``functional_call`` and nested ``grad``): no copy of the model,
no extra dependency.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, grad_and_value, jvp

Space = Literal["feature", "logit"]
"""Where the guiding vectors live: the representation ``RM(g(x))`` [d] (FedL2G-f)
or the logits [C] (FedL2G-l)."""
Batch = tuple[Tensor, Tensor]


def guided(reps: Tensor, logits: Tensor, space: Space) -> Tensor:
    """The output the guiding term pulls: ``reps`` [B, d] or ``logits`` [B, C]."""
    return reps if space == "feature" else logits


def guide_loss(out: Tensor, table: Tensor, y: Tensor) -> Tensor:
    """The guiding term ``MSE(out, G[y])``: the mean over the B × w elements of the
    squared difference between each sample's output and its class's guiding vector."""
    return F.mse_loss(out, table[y])


class _Outputs(nn.Module):
    """A HetNet-like model's ``(reps, logits)`` as one forward (for ``functional_call``)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        reps = self.net.features(x)  # type: ignore[operator]
        return reps, self.net.classify(reps)  # type: ignore[operator]


@contextlib.contextmanager
def batch_statistics(model: nn.Module) -> Iterator[None]:
    """Train mode with BatchNorm on the batch's own statistics and its running
    statistics left as they are (restored after; the meta step must not change the
    personal model)."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    tracked = [m.track_running_stats for m in norms]
    was_training = model.training
    model.train()
    for m in norms:
        m.track_running_stats = False
    try:
        yield
    finally:
        for m, t in zip(norms, tracked, strict=True):
            m.track_running_stats = t
        model.train(was_training)


def meta_gradient(
    model: nn.Module,
    table: Tensor,
    study: Sequence[Batch],
    quiz: Sequence[Batch],
    lr: float,
    space: Space,
) -> tuple[Tensor, float]:
    """The gradient of the quiz loss with respect to the guide table, and that loss.

    With θ the model's parameters and G the table [C, w]:

    - study loss  L_s(θ, G) = mean over the study batches of
      CE(h(x), y) + MSE(out(x), G[y])  (``out``: ``space``'s output);
    - one SGD step  θ' = θ − lr · ∇_θ L_s(θ, G), kept differentiable in G;
    - quiz loss  L_q(G) = mean over the quiz batches of CE(h_θ'(x), y);

    returns ``(∂L_q/∂G [C, w], L_q)``. Only the rows of classes in the study batches
    can be non-zero. Closed form (G enters L_s only through the MSE term):
    ``∂L_q/∂G_c = lr · 2/(B·w) / S · Σ_{study samples b of class c} J_b · ∇_θ' L_q``,
    J_b the Jacobian of sample b's output in θ, B its batch's size, S the number of
    study batches. The model runs in train mode with BatchNorm on batch statistics;
    its parameters and buffers are not changed.
    """
    if not study or not quiz:
        raise ValueError("the meta step needs a study batch and a quiz batch")
    outputs, params = _functional(model)
    study_loss, quiz_at = _losses(outputs, study, quiz, space)

    def quiz_loss(g: Tensor) -> Tensor:
        step = grad(study_loss)(params, g)
        return quiz_at({k: params[k] - lr * step[k] for k in params})

    with batch_statistics(model):
        gradient, value = grad_and_value(quiz_loss)(table.detach())
    return gradient.detach(), float(value)


def _functional(model: nn.Module) -> tuple[_Outputs, dict[str, Tensor]]:
    """``model``'s ``(reps, logits)`` forward and its parameters, detached, for
    ``functional_call``."""
    outputs = _Outputs(model)
    return outputs, {k: p.detach() for k, p in outputs.named_parameters()}


def _losses(outputs: _Outputs, study: Sequence[Batch], quiz: Sequence[Batch], space: Space):  # type: ignore[no-untyped-def]
    """``(L_s(θ, G), L_q(θ))`` of :func:`meta_gradient` as functions of the parameters."""

    def study_loss(p: dict[str, Tensor], g: Tensor) -> Tensor:
        total = torch.zeros((), device=g.device, dtype=g.dtype)
        for x, y in study:
            reps, logits = functional_call(outputs, p, (x,))
            total = (
                total + F.cross_entropy(logits, y) + guide_loss(guided(reps, logits, space), g, y)
            )
        return total / len(study)

    def quiz_loss(p: dict[str, Tensor]) -> Tensor:
        first = next(iter(p.values()))
        total = torch.zeros((), device=first.device, dtype=first.dtype)
        for x, y in quiz:
            _, logits = functional_call(outputs, p, (x,))
            total = total + F.cross_entropy(logits, y)
        return total / len(quiz)

    return study_loss, quiz_loss


def quiz_direction(
    model: nn.Module,
    table: Tensor,
    study: Sequence[Batch],
    quiz: Sequence[Batch],
    lr: float,
    space: Space,
) -> dict[str, Tensor]:
    """``v = ∇L_q(θ')`` at the stepped parameters ``θ' = θ − lr · ∇_θ L_s(θ, G)`` of
    :func:`meta_gradient` (per parameter name): the direction its closed form applies
    each study sample's Jacobian to."""
    outputs, params = _functional(model)
    study_loss, quiz_loss = _losses(outputs, study, quiz, space)
    with batch_statistics(model):
        step = grad(study_loss)(params, table.detach())
        moved = {k: params[k] - lr * step[k] for k in params}
        return {k: v.detach() for k, v in grad(quiz_loss)(moved).items()}


def study_rows(
    model: nn.Module,
    study: Sequence[Batch],
    direction: dict[str, Tensor],
    lr: float,
    space: Space,
    num_classes: int,
) -> Tensor:
    """:func:`meta_gradient`'s closed form given the quiz direction ``v``
    (:func:`quiz_direction`): ``lr · 2/(B·w) / S · Σ_{b of class c} J_b · v`` [C, w],
    each ``J_b · v`` a forward-mode product (``torch.func.jvp``). Differentiable in the
    study images: what an attack that knows ``v`` optimises (``fedhet audit``)."""
    outputs, params = _functional(model)
    tangent = {k: direction[k] for k in params}
    rows: Tensor | None = None
    with batch_statistics(model):
        for x, y in study:

            def out(p: dict[str, Tensor], x: Tensor = x) -> Tensor:
                reps, logits = functional_call(outputs, p, (x,))
                return guided(reps, logits, space)

            jv = jvp(out, (params,), (tangent,))[1]
            part = jv.new_zeros(num_classes, jv.shape[1]).index_add(
                0, y, jv * (2 * lr / (len(y) * jv.shape[1]) / len(study))
            )
            rows = part if rows is None else rows + part
    assert rows is not None, "no study batch"
    return rows


def table_step(
    table: np.ndarray, gradient: np.ndarray, lr: float, clip: float
) -> tuple[np.ndarray, float, bool]:
    """The server's SGD step on the guide table: ``G − lr · s · g`` with
    ``s = min(1, clip / ‖g‖_F)`` (the Frobenius norm of the whole gradient table, as
    ``torch.nn.utils.clip_grad_norm_`` over one parameter; ``clip`` 0: no clipping).

    Returns ``(new table in the table's dtype, ‖g‖_F before clipping, clipped)``."""
    g = gradient.astype(np.float64)
    norm = float(np.linalg.norm(g))
    scale = min(1.0, clip / norm) if clip > 0 and norm > 0 else 1.0
    new = table.astype(np.float64) - lr * scale * g
    return new.astype(table.dtype), norm, scale < 1.0


def initial_table(num_classes: int, width: int, seed: int) -> np.ndarray:
    """The guide table before any step: N(0, 1) entries [C, w] (``nn.Embedding``'s
    initialisation, as HtFLlib), drawn from a generator seeded by ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_classes, width, generator=gen).numpy()
