"""``fedlora``: FedLoRA (pFedLoRA), sample-weighted mean of homogeneous adapters."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Self, Unpack

import torch

from common.config import RunConfig
from common.records import Arrays
from models.adapter import ADAPTERS, LoRA, module_key
from strategies.base import HeteroStrategy, RunSettings, Upload, run_settings
from strategies.heads import common_head_shape


class FedLoRA(HeteroStrategy):
    """FedLoRA: a small adapter of identical shape in every heterogeneous model.

    Message contract: ``train.fedlora`` carries the global adapter
    ``{"adapters.<target>.A" [r, d], "adapters.<target>.B" [m, r]}`` (m = C for the
    head, d for ``rep`` and for a d→d layer); the client replaces its adapter with it, trains its
    local model with the adapter frozen, then the adapter with the local model
    frozen, and replies with its adapter (same keys and shapes). Server:
    sample-weighted mean. Only the adapter crosses the network.
    """

    name = "fedlora"
    shares_model = True

    def __init__(
        self,
        *,
        rank: int = 8,
        alpha: float = 8.0,
        targets: Sequence[str] = ("head",),
        **kwargs: Unpack[RunSettings],
    ) -> None:
        super().__init__(**kwargs)
        self.rank = rank
        self.alpha = alpha
        self.targets = tuple(targets)
        """Where the adapters sit: ``head``, ``rep`` or d→d Linear layers."""

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Self:
        f = cfg.fedlora
        return cls(rank=f.rank, alpha=f.alpha, targets=f.target_list(), **run_settings(cfg))

    def init_global(self) -> Arrays:
        d, c = common_head_shape(self.nodes.values())
        out: Arrays = {}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            for target in self.targets:
                lora = LoRA(d, c if target == "head" else d, self.rank, self.alpha)
                for name, p in lora.state_dict().items():
                    out[f"{ADAPTERS}.{module_key(target)}.{name}"] = p.numpy().copy()
        return out

    def aggregate(self, server_round: int, uploads: list[Upload]) -> Arrays | None:
        return self.mean_of(uploads)
