"""``fedgh``: FedGH, a global head trained on the server from client prototypes."""

from __future__ import annotations

import numpy as np
import torch

from common.records import Arrays
from models.entangle import train_head
from strategies.base import HeteroStrategy, NodeInfo, Upload
from strategies.fedproto import PROTO, expected_prototypes
from strategies.lgfedavg import initial_head


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

    def init_global(self) -> Arrays:
        return initial_head(self.nodes.values(), self.cfg.seed)

    def expected_upload(self, node: NodeInfo) -> dict[str, tuple[int, ...]]:
        return expected_prototypes(node)

    def aggregate(self, server_round: int, uploads: list[Upload]) -> Arrays | None:
        reps, labels = [], []
        for u in uploads:
            for key, value in u.arrays.items():
                reps.append(value)
                labels.append(int(key.removeprefix(PROTO)))
        num_classes = self.global_arrays["head.bias"].shape[0]
        x = torch.from_numpy(np.stack(reps))
        y = torch.nn.functional.one_hot(torch.tensor(labels), num_classes).float()
        gen = torch.Generator().manual_seed(self.cfg.seed * 100_003 + server_round)
        g = self.cfg.fedgh
        w, b, _, _ = train_head(
            torch.from_numpy(self.global_arrays["head.weight"]),
            torch.from_numpy(self.global_arrays["head.bias"]),
            x,
            y,
            lr=g.server_lr,
            epochs=g.server_epochs,
            batch_size=g.server_batch_size,
            generator=gen,
        )
        return {"head.weight": w.numpy(), "head.bias": b.numpy()}
