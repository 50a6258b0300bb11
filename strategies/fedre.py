"""``fedre``: FedRE, a global head trained on entangled representations."""

from __future__ import annotations

import numpy as np

from common.records import Arrays, invalid_reason
from strategies.base import HeteroStrategy, NodeInfo, Upload
from strategies.heads import initial_head, server_step


class FedRE(HeteroStrategy):
    """FedRE: one entangled representation per client per round.

    Message contract: ``train.fedre`` carries the global head ``{"head.weight"
    [C, d], "head.bias" [C]}``; the client replaces its head with it, trains with CE,
    computes class prototypes with the trained model and replies with exactly
    ``{"rep": [d], "soft-label": [C]}``: ``rep = Σ_c w_c p_c`` and ``soft-label = w``
    with ``w_c ~ U[0, 1)`` over its present classes, normalised (``fedre.mix``
    selects the paper's ablations). Upload = (d + C) × 4 bytes.
    Server: SGD with soft-label cross-entropy on the K received pairs
    (``fedre.server-lr``, ``fedre.server-epochs``, ``fedre.server-batch-size``),
    starting from the previous round's head (no optimizer state is kept), then
    broadcast in the next ``train.fedre`` and in ``evaluate.fedre``.
    A soft label that is negative or does not sum to 1 is rejected.
    """

    name = "fedre"

    def __init__(self, cfg) -> None:  # type: ignore[no-untyped-def]
        super().__init__(cfg)
        self.server_loss: dict[int, tuple[float, float]] = {}
        """Round -> soft-label loss on the received pairs before/after training."""

    def init_global(self) -> Arrays:
        return initial_head(self.nodes.values(), self.cfg.seed)

    def expected_upload(self, node: NodeInfo) -> dict[str, tuple[int, ...]]:
        return {"rep": (node.feature_dim,), "soft-label": (node.num_classes,)}

    def check_upload(self, node: NodeInfo, arrays: Arrays) -> str | None:
        reason = invalid_reason(arrays, self.expected_upload(node))
        if reason is None:
            soft = arrays["soft-label"].astype(np.float64)
            if (soft < 0).any() or abs(soft.sum() - 1.0) > 1e-4:
                reason = f"soft label is not a distribution (sum {soft.sum():.6f})"
        return reason

    def aggregate(self, server_round: int, uploads: list[Upload]) -> Arrays | None:
        x = np.stack([u.arrays["rep"] for u in uploads])
        y = np.stack([u.arrays["soft-label"] for u in uploads])
        head, before, after = server_step(
            self.global_arrays, x, y, self.cfg.fedre, self.cfg.seed, server_round
        )
        self.server_loss[server_round] = (before, after)
        return head
