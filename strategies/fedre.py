"""``fedre``: FedRE, a global head trained on entangled representations."""

from __future__ import annotations

from typing import Literal, Self, Unpack

import numpy as np

from common.config import RunConfig
from common.messages import REP, SOFT_LABEL
from common.records import Arrays, invalid_reason
from strategies.base import NodeInfo, RunSettings, Upload, run_settings
from strategies.fedproto import ClassScreened, screen_settings
from strategies.heads import head_diagnostics, initial_head, server_step
from strategies.robust import largest_row_norm, mixture_outliers


class FedRE(ClassScreened):
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

    ``robust.prototypes`` (``screen``; ``median`` screens the same way: a mixture has
    no class of its own to take a median of): no upload holds one class's prototype,
    so per class means per class *in the mixture*. Each class's reference is the
    coordinate-wise median of all rows weighted by their soft label's weight on the
    class; a reply is dropped when a row points away from (cosine below
    ``robust.prototype-min-cosine``), or is longer than ``robust.prototype-max-norm-ratio``
    times, the mix of class references its own soft label gives
    (:func:`strategies.robust.mixture_outliers`).
    """

    name = "fedre"

    def __init__(
        self,
        *,
        server_lr: float = 0.01,
        server_epochs: int = 1,
        server_batch_size: int = 32,
        server_loss: Literal["mean", "sum"] = "mean",
        reps_per_client: int = 1,
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
        self.server_loss = server_loss
        self.reps_per_client = reps_per_client

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Self:
        f = cfg.fedre
        return cls(
            server_lr=f.server_lr,
            server_epochs=f.server_epochs,
            server_batch_size=f.server_batch_size,
            server_loss=f.server_loss,
            reps_per_client=f.reps_per_client,
            **screen_settings(cfg),
            **run_settings(cfg),
        )

    def init_global(self) -> Arrays:
        return initial_head(self.nodes.values(), self.seed)

    def expected_upload(self, node: NodeInfo) -> dict[str, tuple[int, ...]]:
        n = self.reps_per_client
        return {REP: (n, node.feature_dim), SOFT_LABEL: (n, node.num_classes)}

    def check_upload(self, node: NodeInfo, arrays: Arrays) -> str | None:
        reason = invalid_reason(arrays, self.expected_upload(node))
        if reason is None:
            soft = arrays[SOFT_LABEL].astype(np.float64)
            sums = soft.sum(axis=1)
            if (soft < 0).any() or np.abs(sums - 1.0).max() > 1e-4:
                reason = f"soft label is not a distribution (sums {np.round(sums, 6).tolist()})"
        return reason

    def upload_size(self, upload: Upload) -> float | None:
        return largest_row_norm({REP: upload.arrays[REP]})

    def screen_classes(self, server_round: int, uploads: list[Upload]) -> list[Upload]:
        """Drop the replies :func:`strategies.robust.mixture_outliers` finds."""
        found = mixture_outliers(
            {u.node.node_id: u.arrays[REP] for u in uploads},
            {u.node.node_id: u.arrays[SOFT_LABEL] for u in uploads},
            self.prototype_min_cosine,
            self.prototype_max_norm_ratio,
        )
        for u in uploads:
            if u.node.node_id in found:
                self.record_screened(server_round, u, found[u.node.node_id])
        self.screened_items = len(found)
        return [u for u in uploads if u.node.node_id not in found]

    def aggregate(self, server_round: int, uploads: list[Upload]) -> Arrays | None:
        x = np.concatenate([u.arrays[REP] for u in uploads])
        y = np.concatenate([u.arrays[SOFT_LABEL] for u in uploads])
        head, before, after = server_step(self.global_arrays, x, y, self, self.seed, server_round)
        self.diagnostics = head_diagnostics(self.global_arrays, head, before, after)
        # the floor of the soft-label loss: CE(w, q) = H(w) + KL(w || q) >= H(w)
        self.diagnostics["label-entropy"] = label_entropy(y)
        self.diagnostics.update(self.screen_diagnostics())
        return head


def label_entropy(soft_labels: np.ndarray) -> float:
    """Mean entropy (nats) of the received soft labels: the lowest soft-label
    cross-entropy any head can reach on them (0 for one-hot labels)."""
    w = soft_labels.astype(np.float64)
    logw = np.log(np.where(w > 0, w, 1.0))
    return float(-(w * logw).sum(axis=1).mean())
