"""``fedgh``: FedGH, a global head trained on the server from client prototypes."""

from __future__ import annotations

from typing import Self, Unpack

import numpy as np

from common.config import RunConfig
from common.messages import PROTO
from common.records import Arrays
from strategies.base import HeteroStrategy, NodeInfo, RunSettings, Upload, run_settings
from strategies.fedproto import expected_prototypes
from strategies.heads import BIAS, head_diagnostics, initial_head, server_step
from strategies.robust import largest_row_norm


class FedGH(HeteroStrategy):
    """FedGH: clients upload class prototypes, the server trains the shared head.

    Message contract: ``train.fedgh`` carries the global head ``{"head.weight"
    [C, d], "head.bias" [C]}``; the client replaces its head with it, trains with CE
    and replies with ``{"proto.<c>": [d]}`` for exactly the classes it has (after
    training). Server: SGD with cross-entropy on all (prototype, class) pairs,
    ``fedgh.server-lr``, ``fedgh.server-epochs``, batches of
    ``fedgh.server-batch-size``, shuffled by (seed, round).
    """

    name = "fedgh"

    def __init__(
        self,
        *,
        server_lr: float = 0.01,
        server_epochs: int = 100,
        server_batch_size: int = 10,
        **kwargs: Unpack[RunSettings],
    ) -> None:
        super().__init__(**kwargs)
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
            **run_settings(cfg),
        )

    def init_global(self) -> Arrays:
        return initial_head(self.nodes.values(), self.seed)

    def expected_upload(self, node: NodeInfo) -> dict[str, tuple[int, ...]]:
        return expected_prototypes(node)

    def upload_size(self, upload: Upload) -> float | None:
        return largest_row_norm(upload.arrays)

    def aggregate(self, server_round: int, uploads: list[Upload]) -> Arrays | None:
        reps, labels = [], []
        for u in uploads:
            for key, value in u.arrays.items():
                reps.append(value)
                labels.append(int(key.removeprefix(PROTO)))
        num_classes = self.global_arrays[BIAS].shape[0]
        onehot = np.eye(num_classes, dtype=np.float32)[labels]
        head, before, after = server_step(
            self.global_arrays, np.stack(reps), onehot, self, self.seed, server_round
        )
        self.diagnostics = head_diagnostics(self.global_arrays, head, before, after)
        return head
