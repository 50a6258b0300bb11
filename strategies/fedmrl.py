"""``fedmrl``: FedMRL, federated Matryoshka representation learning with a small shared
model and a personal projector."""

from __future__ import annotations

from typing import Self, Unpack

from common.config import ConfigError, RunConfig
from common.messages import SHARED
from common.records import Arrays
from strategies.base import HeteroStrategy, RunSettings, Upload, run_settings
from strategies.fml import float_state, shared_arch


class FedMRL(HeteroStrategy):
    """FedMRL: each client fuses its own extractor with a small shared model's.

    Message contract: ``train.fedmrl`` carries the global shared model ``{"shared.<key>"}``
    (its floating-point state: extractor and head ``Linear(s, C)``; architecture
    ``fedmrl.shared-arch``, default the family's smallest; its ``RM`` pools to ``s =
    fedmrl.rep-dim``). The client installs it beside its own model; a personal projector
    ``Linear(s + d, d)`` (kept across rounds, never sent) fuses the two representations
    into ``r`` [d]; its own head reads ``r``, the shared head ``r[:, :s]``; it trains
    all of it with the sum of the two cross-entropies and replies with the shared model
    in the same keys and shapes. Server: sample-weighted mean (``robust.aggregate``
    applies). ``evaluate.fedmrl`` carries the same model; the client predicts with its
    own head on ``r``.
    """

    name = "fedmrl"
    shares_model = True

    def __init__(
        self,
        *,
        shared_arch: str = "",
        rep_dim: int = 128,
        family: str = "cnn",
        **kwargs: Unpack[RunSettings],
    ) -> None:
        super().__init__(**kwargs)
        self.shared_arch = shared_arch
        """Architecture of the shared model; empty = the smallest of ``family``."""
        self.rep_dim = rep_dim
        """``s``: the shared model's representation size."""
        self.family = family
        """The federation's model family (``model.family``)."""

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Self:
        f = cfg.fedmrl
        return cls(
            shared_arch=f.shared_arch,
            rep_dim=f.rep_dim,
            family=cfg.model.family,
            **run_settings(cfg),
        )

    def init_global(self) -> Arrays:
        d = min(n.feature_dim for n in self.nodes.values())
        if self.rep_dim > d:
            raise ConfigError(f"fedmrl.rep-dim = {self.rep_dim} must be at most d = {d}")
        arch = shared_arch(self, self.shared_arch, self.family)
        return float_state(self.build_for_nodes(arch, self.rep_dim), SHARED)

    def aggregate(self, server_round: int, uploads: list[Upload]) -> Arrays | None:
        return self.mean_of(uploads)
