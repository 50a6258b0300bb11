"""``fedgh``: FedGH, a global head trained on the server from client prototypes."""

from __future__ import annotations

from typing import Self, Unpack

import numpy as np

from common.config import RunConfig
from common.records import Arrays
from strategies.base import NodeInfo, RunSettings, Upload, run_settings
from strategies.fedproto import ClassScreened, expected_prototypes, screen_settings
from strategies.heads import BIAS, head_diagnostics, initial_head, server_step
from strategies.robust import largest_row_norm


class FedGH(ClassScreened):
    """FedGH: clients upload class prototypes, the server trains the shared head.

    Message contract: ``train.fedgh`` carries the global head ``{"head.weight"
    [C, d], "head.bias" [C]}``; the client replaces its head with it, trains with CE
    and replies with ``{"proto.<c>": [d]}`` for exactly the classes it has (after
    training). Server: SGD with cross-entropy on all (prototype, class) pairs,
    ``fedgh.server-lr``, ``fedgh.server-epochs``, batches of
    ``fedgh.server-batch-size``, shuffled by (seed, round); ``robust.prototypes``
    screens each class's prototypes first (:class:`ClassScreened`).
    """

    name = "fedgh"

    def __init__(
        self,
        *,
        server_lr: float = 0.01,
        server_epochs: int = 100,
        server_batch_size: int = 10,
        prototypes: str = "screen",
        prototype_min_cosine: float = 0.0,
        prototype_max_norm_ratio: float = 10.0,
        **kwargs: Unpack[RunSettings],
    ) -> None:
        super().__init__(
            prototypes=prototypes,
            prototype_min_cosine=prototype_min_cosine,
            prototype_max_norm_ratio=prototype_max_norm_ratio,
            **kwargs,
        )
        self.server_lr = server_lr
        self.server_epochs = server_epochs
        self.server_batch_size = server_batch_size

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Self:
        f = cfg.fedgh
        return cls(
            server_lr=f.server_lr,
            server_epochs=f.server_epochs,
            server_batch_size=f.server_batch_size,
            **screen_settings(cfg),
            **run_settings(cfg),
        )

    def init_global(self) -> Arrays:
        return initial_head(self.nodes.values(), self.seed)

    def expected_upload(self, node: NodeInfo) -> dict[str, tuple[int, ...]]:
        return expected_prototypes(node)

    def upload_size(self, upload: Upload) -> float | None:
        return largest_row_norm(upload.arrays)

    def aggregate(self, server_round: int, uploads: list[Upload]) -> Arrays | None:
        reps, labels = self.training_pairs(uploads)
        num_classes = self.global_arrays[BIAS].shape[0]
        onehot = np.eye(num_classes, dtype=np.float32)[labels]
        head, before, after = server_step(
            self.global_arrays, reps, onehot, self, self.seed, server_round
        )
        self.diagnostics = head_diagnostics(self.global_arrays, head, before, after)
        self.diagnostics.update(self.screen_diagnostics())
        return head
