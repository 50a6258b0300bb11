"""Client part of ``fedl2g`` and ``fedl2gl``: train guided by the server's table (CE +
MSE to the guiding vector of each sample's class) on all but a held-out quiz set, then
the meta step: the gradient of the quiz loss after one differentiable study step with
respect to the table, its non-zero rows uploaded."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from client_app.base import ClientHook, ClientRun, derive_seed
from client_app.prototypes import protected
from common.messages import GUIDE, GUIDE_GRAD
from common.sections import FedL2GConfig
from models.guide import Batch, Space, guide_loss, guided, meta_gradient
from models.train import ExtraLoss, TrainStats, train

QUIZ_PURPOSE, STUDY_PURPOSE = 6, 5
"""Seed purposes: the quiz set (drawn once per run and node, from (seed, partition,
6)) and the study batches (``run.generator(5)``, a fresh draw each round)."""


def quiz_split(n: int, quiz: int, seed: int) -> tuple[Tensor, Tensor]:
    """``(training indices, quiz indices)`` of n samples: ``quiz`` of them (at most
    n // 2) drawn with a generator seeded by ``seed``, each part in index order."""
    q = min(quiz, n // 2)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return order[q:].sort().values, order[:q].sort().values


def batches(x: Tensor, y: Tensor, idx: Tensor, size: int) -> list[Batch]:
    """``(x, y)`` of ``idx`` in consecutive batches of ``size`` (the last may be short)."""
    return [(x[idx[i : i + size]], y[idx[i : i + size]]) for i in range(0, len(idx), size)]


class FedL2GHook(ClientHook):
    """``fedl2g``: guided training, then the meta step; uploads ``guide-grad.<c>`` rows
    (``privacy.*`` applied to each) and reports ``quiz-loss``."""

    name = "fedl2g"
    space: ClassVar[Space] = "feature"

    def settings(self, run: ClientRun) -> FedL2GConfig:
        return run.cfg.fedl2g

    def width(self, run: ClientRun) -> int:
        return run.model.feature_dim if self.space == "feature" else run.data.num_classes

    def table(self, run: ClientRun) -> Tensor:
        """The guide table the server sent [C, w]; a ValueError for anything else."""
        want = (run.data.num_classes, self.width(run))
        other = sorted(set(run.received) - {GUIDE})
        table = run.received.get(GUIDE)
        if other or table is None or tuple(table.shape) != want:
            shape = None if table is None else tuple(table.shape)
            raise ValueError(f"expected only '{GUIDE}' {want} from the server, got {shape} {other}")
        return table

    def install(self, run: ClientRun, arrays: dict[str, Tensor]) -> None:
        self.table(run)  # validates; training and the meta step read run.received

    def split(self, run: ClientRun) -> tuple[Tensor, Tensor]:
        """This node's (training, quiz) indices, the same in every round."""
        quiz = self.settings(run).quiz_batches * run.sgd.batch_size
        seed = derive_seed(run.cfg.seed, run.node.partition_id, QUIZ_PURPOSE)
        return quiz_split(len(run.data.y_train), quiz, seed)

    def extra_loss(self, run: ClientRun) -> ExtraLoss | None:
        table = self.table(run).to(run.data.x_train.device)
        space = self.space

        def loss(reps: Tensor, logits: Tensor, y: Tensor, x: Tensor) -> Tensor:
            return guide_loss(guided(reps, logits, space), table.to(reps.device), y)

        return loss

    def train(self, run: ClientRun) -> TrainStats:
        """Guided training on the training part; nothing in a warm-up round."""
        if run.server_round <= self.settings(run).warm_up_rounds:
            return TrainStats(loss=0.0, num_examples=0, steps=0, seconds=0.0)
        keep, _ = self.split(run)
        return train(
            run.model,
            run.data.x_train[keep],
            run.data.y_train[keep],
            run.sgd,
            run.generator(),
            extra_loss=self.extra_loss(run),
        )

    def meta_batches(self, run: ClientRun) -> tuple[list[Batch], list[Batch]]:
        """The round's (study batches, quiz batches) of the meta step, on the model's
        device: study batches drawn afresh each round from the training part."""
        keep, quiz = self.split(run)
        f, size = self.settings(run), run.sgd.batch_size
        order = keep[torch.randperm(len(keep), generator=run.generator(STUDY_PURPOSE))]
        device = next(run.model.parameters()).device
        x, y = run.data.x_train, run.data.y_train
        study = batches(x, y, order[: f.study_batches * size], size)
        quiz_set = batches(x, y, quiz, size)
        return (
            [(a.to(device), b.to(device)) for a, b in study],
            [(a.to(device), b.to(device)) for a, b in quiz_set],
        )

    def upload(self, run: ClientRun) -> dict[str, Tensor]:
        study, quiz_set = self.meta_batches(run)
        device = next(run.model.parameters()).device
        gradient, quiz_loss = meta_gradient(
            run.model, self.table(run).to(device), study, quiz_set, run.sgd.lr, self.space
        )
        run.metrics["quiz-loss"] = quiz_loss
        gradient = gradient.cpu()
        classes = [c for c in range(len(gradient)) if bool(gradient[c].abs().sum() > 0)]
        rows = protected(run, gradient[classes])
        return {f"{GUIDE_GRAD}{c}": rows[i] for i, c in enumerate(classes)}


class FedL2GLHook(FedL2GHook):
    """``fedl2gl``: the same in the logit space (a C × C table), ``fedl2gl.*``."""

    name = "fedl2gl"
    space = "logit"

    def settings(self, run: ClientRun) -> FedL2GConfig:
        return run.cfg.fedl2gl
