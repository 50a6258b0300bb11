"""``fml``: FML, federated mutual learning with a shared meme model."""

from __future__ import annotations

from typing import Self, Unpack

import torch

from common.config import RunConfig
from common.messages import MEME
from common.records import Arrays
from models import smallest_arch
from strategies.base import HeteroStrategy, RunSettings, Upload, run_settings


def shared_arch(strategy: HeteroStrategy, configured: str, family: str) -> str:
    """``configured``, or the smallest architecture of ``family`` for the nodes'
    input."""
    if configured:
        return configured
    node = next(iter(strategy.nodes.values()))
    meta = node.extras
    return smallest_arch(
        family,
        int(meta["in-channels"]),
        int(meta["image-size"]),
        bool(meta.get("small-stem", 1)),
    )


def float_state(model: torch.nn.Module, prefix: str) -> Arrays:
    """The model's floating-point state entries, keys prefixed (integer buffers such
    as BatchNorm's batch counters stay on the clients)."""
    return {
        prefix + k: v.detach().numpy().copy()
        for k, v in model.state_dict().items()
        if v.is_floating_point()
    }


class FML(HeteroStrategy):
    """FML: each client keeps its own model and a copy of one small shared model.

    Message contract: ``train.fml`` carries the global meme model ``{"meme.<key>"}``
    (its floating-point state; architecture ``fml.meme-arch``, default the family's
    smallest); the client installs it, trains both models together with
    ``α·CE + (1−α)·KL(meme‖local)`` for its own model and ``β·CE + (1−β)·KL(local‖meme)``
    for the meme, and replies with the meme in the same keys and shapes.
    Server: sample-weighted mean. Evaluation: the client's own model.
    """

    name = "fml"
    shares_model = True

    def __init__(
        self, *, meme_arch: str = "", family: str = "cnn", **kwargs: Unpack[RunSettings]
    ) -> None:
        super().__init__(**kwargs)
        self.meme_arch = meme_arch
        """Architecture of the meme model; empty = the smallest of ``family``."""
        self.family = family
        """The federation's model family (``model.family``)."""

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Self:
        return cls(meme_arch=cfg.fml.meme_arch, family=cfg.model.family, **run_settings(cfg))

    def init_global(self) -> Arrays:
        arch = shared_arch(self, self.meme_arch, self.family)
        return float_state(self.build_for_nodes(arch), MEME)

    def aggregate(self, server_round: int, uploads: list[Upload]) -> Arrays | None:
        return self.mean_of(uploads)
