"""``fedre``: FedRE, a global head trained on entangled representations."""

from __future__ import annotations

import numpy as np

from common.records import Arrays, invalid_reason
from strategies.base import HeteroStrategy, NodeInfo, Upload
from strategies.heads import head_diagnostics, initial_head, server_step


class FedRE(HeteroStrategy):
    """FedRE: one entangled representation per client per round.

    Message contract: ``train.fedre`` carries the global head ``{"head.weight"
    [C, d], "head.bias" [C]}``; the client replaces its head with it, trains with CE,
    computes class prototypes with the trained model and replies with exactly
    ``{"rep": [n, d], "soft-label": [n, C]}`` (n = ``fedre.reps-per-client``, 1 in
    the paper): row i is ``Σ_c w_c p_c`` and its soft label ``w``, with
    ``w_c ~ U[0, 1)`` over its present classes, normalised, a new draw per row
    (``fedre.mix`` selects the paper's ablations). Upload = n (d + C) × 4 bytes.
    Server: SGD with soft-label cross-entropy on the n·K received pairs
    (``fedre.server-lr``, ``fedre.server-epochs``, ``fedre.server-batch-size``,
    ``fedre.server-loss``), starting from the previous round's head (no optimizer
    state is kept), then broadcast in the next ``train.fedre`` and in
    ``evaluate.fedre``. A soft label that is negative or does not sum to 1 is
    rejected.
    """

    name = "fedre"

    def init_global(self) -> Arrays:
        return initial_head(self.nodes.values(), self.cfg.seed)

    def expected_upload(self, node: NodeInfo) -> dict[str, tuple[int, ...]]:
        n = self.cfg.fedre.reps_per_client
        return {"rep": (n, node.feature_dim), "soft-label": (n, node.num_classes)}

    def check_upload(self, node: NodeInfo, arrays: Arrays) -> str | None:
        reason = invalid_reason(arrays, self.expected_upload(node))
        if reason is None:
            soft = arrays["soft-label"].astype(np.float64)
            sums = soft.sum(axis=1)
            if (soft < 0).any() or np.abs(sums - 1.0).max() > 1e-4:
                reason = f"soft label is not a distribution (sums {np.round(sums, 6).tolist()})"
        return reason

    def aggregate(self, server_round: int, uploads: list[Upload]) -> Arrays | None:
        x = np.concatenate([u.arrays["rep"] for u in uploads])
        y = np.concatenate([u.arrays["soft-label"] for u in uploads])
        head, before, after = server_step(
            self.global_arrays, x, y, self.cfg.fedre, self.cfg.seed, server_round
        )
        self.diagnostics = head_diagnostics(self.global_arrays, head, before, after)
        # the floor of the soft-label loss: CE(w, q) = H(w) + KL(w || q) >= H(w)
        self.diagnostics["label-entropy"] = label_entropy(y)
        return head


def label_entropy(soft_labels: np.ndarray) -> float:
    """Mean entropy (nats) of the received soft labels: the lowest soft-label
    cross-entropy any head can reach on them (0 for one-hot labels)."""
    w = soft_labels.astype(np.float64)
    logw = np.log(np.where(w > 0, w, 1.0))
    return float(-(w * logw).sum(axis=1).mean())
