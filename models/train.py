"""The one local training loop every algorithm shares, and evaluation.

Algorithms do not copy this loop: they pass an ``extra_loss`` hook (a loss term added
to cross-entropy), choose which parameters are trained, or both.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ExtraLoss = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
"""``extra_loss(reps, logits, y, x) -> scalar`` added to the cross-entropy of a batch
(``x``: the batch's inputs, for a hook that runs a second model on them)."""
AfterStep = Callable[[bool], None]
"""``after_step(epoch_end)``: called after every optimiser step; ``epoch_end`` is True
after the last step of an epoch."""


@dataclass(frozen=True)
class SGDSettings:
    """Optimiser and loop settings of one local training call."""

    epochs: int = 1
    batch_size: int = 10
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0


@dataclass(frozen=True)
class TrainStats:
    """What one local training call did."""

    loss: float
    """Mean total loss (cross-entropy + extra terms) over all steps."""
    num_examples: int
    steps: int
    seconds: float
    backoffs: int = 0
    """Epochs redone at half the learning rate after training went non-finite."""
    gave_up: bool = False
    """True when training still went non-finite after ``max_backoffs`` halvings: the
    model was put back to the start of the failing epoch and training stopped there."""


@dataclass(frozen=True)
class EvalStats:
    """Evaluation counts: accuracy = correct / num_examples."""

    correct: int
    loss_sum: float
    num_examples: int

    @property
    def accuracy(self) -> float:
        return self.correct / max(self.num_examples, 1)


def logits_and_reps(model: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
    """``(reps, logits)`` of a :class:`models.nets.HetNet`-like model in one pass."""
    reps = model.features(x)  # type: ignore[operator]
    return reps, model.classify(reps)  # type: ignore[operator]


def train(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    settings: SGDSettings,
    generator: torch.Generator,
    *,
    params: Iterable[nn.Parameter] | None = None,
    extra_loss: ExtraLoss | None = None,
    after_step: AfterStep | None = None,
    frozen: Iterable[nn.Module] = (),
    max_backoffs: int = 4,
) -> TrainStats:
    """Train ``model`` in place with SGD on ``(x, y)``; return statistics.

    Parameters
    ----------
    params
        Parameters to optimise; default every parameter with ``requires_grad``.
        Parameters not listed keep their values bit for bit.
    extra_loss
        Added to the cross-entropy of every batch.
    after_step
        Called after every optimiser step (e.g. an amortised regulariser step).
    frozen
        Modules kept in eval mode while the rest trains (BatchNorm statistics and
        dropout of a frozen part must not change either).
    generator
        Seeds the shuffling: the same generator state gives the same batches.
    max_backoffs
        Divergence guard. When a batch loss, or a trained parameter at the end of an
        epoch, is NaN/Inf, the model (parameters and buffers) goes back to its state at
        the start of that epoch, the learning rate is halved for the rest of the call,
        the momentum is cleared, and the epoch is redone (with the next shuffle). After
        ``max_backoffs`` halvings that still diverge, the model is left at the start of
        the failing epoch and training stops (``TrainStats.gave_up``). A call that
        never diverges runs exactly as without the guard.
    """
    trainable = [p for p in (params or model.parameters()) if p.requires_grad]
    if not trainable:
        raise ValueError("nothing to train: no parameter requires grad")
    opt = torch.optim.SGD(
        trainable,
        lr=settings.lr,
        momentum=settings.momentum,
        weight_decay=settings.weight_decay,
    )
    device = next(model.parameters()).device
    model.train()
    for module in frozen:
        module.eval()
    start, total, steps, n = time.perf_counter(), 0.0, 0, len(y)
    backoffs, gave_up, epoch = 0, False, 0
    while epoch < settings.epochs:
        snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
        order = torch.randperm(n, generator=generator)
        values: list[float] = []
        finite = True
        for i in range(0, n, settings.batch_size):
            idx = order[i : i + settings.batch_size]
            xb, yb = x[idx].to(device), y[idx].to(device)
            reps, logits = logits_and_reps(model, xb)
            loss = F.cross_entropy(logits, yb)
            if extra_loss is not None:
                loss = loss + extra_loss(reps, logits, yb, xb)
            value = float(loss.detach())
            if not math.isfinite(value):
                finite = False
                break
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if after_step is not None:
                after_step(i + settings.batch_size >= n)
            values.append(value)
        if finite:
            finite = all(bool(torch.isfinite(p).all()) for p in trainable)
        if not finite:
            with torch.no_grad():
                model.load_state_dict(snapshot)
            opt.state.clear()
            if backoffs >= max_backoffs:
                gave_up = True
                break
            backoffs += 1
            for group in opt.param_groups:
                group["lr"] = group["lr"] / 2
            continue
        for value in values:  # the same summation order as a loop without the guard
            total += value
        steps += len(values)
        epoch += 1
    return TrainStats(
        loss=total / max(steps, 1),
        num_examples=n * settings.epochs,
        steps=steps,
        seconds=time.perf_counter() - start,
        backoffs=backoffs,
        gave_up=gave_up,
    )


@torch.no_grad()
def evaluate(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    batch_size: int = 500,
    predict: Callable[[Tensor], Tensor] | None = None,
) -> EvalStats:
    """Accuracy and summed cross-entropy of ``model`` on ``(x, y)``.

    ``predict`` may replace the model's logits (e.g. nearest-prototype scores).
    """
    model.eval()
    device = next(model.parameters()).device
    correct, loss_sum = 0, 0.0
    for i in range(0, len(y), batch_size):
        xb, yb = x[i : i + batch_size].to(device), y[i : i + batch_size].to(device)
        logits = predict(xb) if predict is not None else model(xb)
        loss_sum += float(F.cross_entropy(logits, yb, reduction="sum"))
        correct += int((logits.argmax(1) == yb).sum())
    return EvalStats(correct=correct, loss_sum=loss_sum, num_examples=len(y))


@torch.no_grad()
def class_means(
    model: nn.Module, x: Tensor, y: Tensor, num_classes: int, batch_size: int = 500
) -> tuple[Tensor, Tensor]:
    """Per-class mean representation ``RM(g(x))`` in eval mode.

    Returns ``(means [C, d], counts [C])``; rows of absent classes are zero and have
    count 0 (callers must use ``counts > 0`` to select present classes).
    """
    model.eval()
    device = next(model.parameters()).device
    sums: Tensor | None = None
    counts = torch.zeros(num_classes, dtype=torch.long)
    for i in range(0, len(y), batch_size):
        reps = model.features(x[i : i + batch_size].to(device)).double().cpu()  # type: ignore[operator]
        yb = y[i : i + batch_size]
        if sums is None:
            sums = torch.zeros(num_classes, reps.shape[1], dtype=torch.float64)
        sums.index_add_(0, yb, reps)
        counts += torch.bincount(yb, minlength=num_classes)
    if sums is None:
        raise ValueError("class_means of an empty dataset")
    means = sums / counts.clamp(min=1).unsqueeze(1).double()
    return means.float(), counts
