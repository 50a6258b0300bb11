"""Client part of ``fedlora``: local model and homogeneous adapter, trained in turn."""

from __future__ import annotations

from dataclasses import replace

from torch import Tensor

from client_app.base import ClientHook, ClientRun
from models.adapter import (
    ADAPTERS,
    adapter_parameters,
    attach_adapters,
    local_parameters,
)
from models.train import TrainStats, train


class FedLoRAHook(ClientHook):
    """``fedlora``: install the global adapter; phase 1 trains the local model with
    the adapter frozen (``fedlora.local-epochs``), phase 2 the adapter with the local
    model frozen (``fedlora.adapter-epochs``); upload the adapter only."""

    name = "fedlora"

    def prepare(self, run: ClientRun) -> None:
        f = run.cfg.fedlora
        attach_adapters(run.model, f.target_list(), f.rank, f.alpha)

    def train(self, run: ClientRun) -> TrainStats:
        one, two = train_local_model(run), train_adapter(run)
        steps = one.steps + two.steps
        return TrainStats(
            loss=(one.loss * one.steps + two.loss * two.steps) / max(steps, 1),
            num_examples=one.num_examples + two.num_examples,
            steps=steps,
            seconds=one.seconds + two.seconds,
        )

    def upload(self, run: ClientRun) -> dict[str, Tensor]:
        return {k: v for k, v in run.model.state_dict().items() if k.startswith(ADAPTERS + ".")}


def train_local_model(run: ClientRun) -> TrainStats:
    """Phase 1: the local model learns, the adapter is frozen."""
    return _train_only(run, local_parameters(run.model), run.cfg.fedlora.local_epochs, 0)


def train_adapter(run: ClientRun) -> TrainStats:
    """Phase 2: the adapter learns, the local model is frozen."""
    return _train_only(run, adapter_parameters(run.model), run.cfg.fedlora.adapter_epochs, 2)


def _train_only(run: ClientRun, params: list, epochs: int, purpose: int) -> TrainStats:  # type: ignore[type-arg]
    try:
        return train(
            run.model,
            run.data.x_train,
            run.data.y_train,
            replace(run.sgd, epochs=epochs),
            run.generator(purpose),
            params=_frozen_except(params, run),
        )
    finally:
        for p in run.model.parameters():
            p.requires_grad_(True)


def _frozen_except(trainable: list, run: ClientRun) -> list:  # type: ignore[type-arg]
    """Freeze every parameter but ``trainable`` (no wasted gradients); return them."""
    keep = {id(p) for p in trainable}
    for p in run.model.parameters():
        p.requires_grad_(id(p) in keep)
    return trainable
