"""``fedgh``: FedGH, a global head trained on the server from client prototypes."""

from __future__ import annotations

import numpy as np

from common.records import Arrays
from strategies.base import HeteroStrategy, NodeInfo, Upload
from strategies.fedproto import PROTO, expected_prototypes
from strategies.heads import head_diagnostics, initial_head, server_step


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
        onehot = np.eye(num_classes, dtype=np.float32)[labels]
        head, before, after = server_step(
            self.global_arrays, np.stack(reps), onehot, self.cfg.fedgh, self.cfg.seed, server_round
        )
        self.diagnostics = head_diagnostics(self.global_arrays, head, before, after)
        return head
