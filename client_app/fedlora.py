"""Client part of ``fedlora``: local model and homogeneous adapter, trained in turn."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from client_app.base import ClientHook, ClientRun
from models.adapter import (
    ADAPTERS,
    adapter_parameters,
    adapter_weight_ratios,
    adapters_disabled,
    attach_adapters,
    local_parameters,
)
from models.train import EvalStats, TrainStats, evaluate, train


class FedLoRAHook(ClientHook):
    """``fedlora``: install the global adapter; phase 1 trains the local model with
    the adapter frozen (``fedlora.local-epochs``), phase 2 the adapter with the local
    model frozen (``fedlora.adapter-epochs``, ``fedlora.lr``); upload the adapter only."""

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
            backoffs=one.backoffs + two.backoffs,
            gave_up=one.gave_up or two.gave_up,
        )

    def upload(self, run: ClientRun) -> dict[str, Tensor]:
        return {k: v for k, v in run.model.state_dict().items() if k.startswith(ADAPTERS + ".")}

    def evaluate_without_shared(self, run: ClientRun, x: Tensor, y: Tensor) -> EvalStats:
        """The same model with every adapter branch switched off; also records the
        adapter's share of the logits and of its layer's weight."""
        with adapters_disabled(run.model):
            without = evaluate(run.model, x, y)
        run.metrics.update(adapter_share(run, x))
        return without


def adapter_share(run: ClientRun, x: Tensor) -> dict[str, float]:
    """``logit-share`` ‖Δlogits‖ / ‖logits‖ on ``x`` (Δ: the adapters' contribution)
    and ``adapter-weight-ratio`` ‖(α/r)·B A‖_F / ‖W‖_F of the layer it is attached to
    (the head, or the identity for ``rep``), averaged over targets."""
    model = run.model.eval()
    with torch.no_grad():
        device = next(model.parameters()).device
        xb = x[:500].to(device)
        full = model(xb)
        with adapters_disabled(model):
            bare = model(xb)
        ratios = list(adapter_weight_ratios(model).values())
    return {
        "logit-share": float((full - bare).norm() / bare.norm().clamp(min=1e-30)),
        "adapter-weight-ratio": sum(ratios) / max(len(ratios), 1),
    }


def train_local_model(run: ClientRun) -> TrainStats:
    """Phase 1: the local model learns, the adapter is frozen."""
    return _train_part(run, adapters=False)


def train_adapter(run: ClientRun) -> TrainStats:
    """Phase 2: the adapter learns, the local model is frozen (in eval mode, so its
    BatchNorm statistics do not move either)."""
    return _train_part(run, adapters=True)


def _train_part(run: ClientRun, adapters: bool) -> TrainStats:
    f, model = run.cfg.fedlora, run.model
    adapter_module = model.get_submodule(ADAPTERS)
    if adapters:
        params, epochs, lr, purpose = adapter_parameters(model), f.adapter_epochs, f.lr, 2
    else:
        params, epochs, lr, purpose = local_parameters(model), f.local_epochs, 0.0, 0
    keep = {id(p) for p in params}
    for p in model.parameters():  # no wasted gradients on the frozen part
        p.requires_grad_(id(p) in keep)
    try:
        return train(
            model,
            run.data.x_train,
            run.data.y_train,
            replace(run.sgd, epochs=epochs, lr=lr or run.sgd.lr),
            run.generator(purpose),
            params=params,
            frozen=[m for m in model.children() if (m is adapter_module) != adapters],
        )
    finally:
        for p in model.parameters():
            p.requires_grad_(True)
