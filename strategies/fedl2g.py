"""``fedl2g``: FedL2G-f (Zhang et al., 2024), a guide table the clients learn to be
guided by: per-class gradients of a quiz loss up, one SGD step on the table."""

from __future__ import annotations

from typing import ClassVar, Self, Unpack

import numpy as np

from common.config import RunConfig
from common.messages import GUIDE, GUIDE_GRAD
from common.records import Arrays, invalid_reason
from common.sections import FedL2GConfig
from models.guide import initial_table, table_step
from strategies.base import HeteroStrategy, NodeInfo, RunSettings, Upload, run_settings
from strategies.fedproto import class_mean, class_of, present_classes
from strategies.heads import common_head_shape
from strategies.robust import largest_row_norm


def guide_rows(arrays: Arrays, width: int, num_classes: int) -> np.ndarray:
    """The per-class rows ``guide-grad.<c>`` as a table [C, width], zeros elsewhere."""
    table = np.zeros((num_classes, width), np.float64)
    for key, value in arrays.items():
        table[class_of(key)] = value
    return table


class FedL2G(HeteroStrategy):
    """FedL2G-f: a global guide table of one guiding vector per class in the
    representation space; clients are guided by it and tell the server how to change it.

    Message contract: ``train.fedl2g`` carries the guide table ``{"guide": [C, d]}``
    (N(0, 1) from the run's seed before round 1). The client trains its own model with
    CE + MSE(RM(g(x)), G[y]) on its training samples less a held-out quiz set
    (``fedl2g.quiz-batches`` batches, fixed per run and node), except in the first
    ``fedl2g.warm-up-rounds`` rounds, where it does not train. Then, with its trained
    model, the meta step: one differentiable SGD step (the client's learning rate) on
    the same loss over ``fedl2g.study-batches`` random training batches, and the
    cross-entropy of the stepped model on the quiz set; it replies with the gradient of
    that quiz loss with respect to the table, ``{"guide-grad.<c>": [d]}`` for the
    classes whose row is non-zero (those of its study batches: one to C keys, each a
    class the node has; any other key, shape or an empty upload is refused), and its
    ``quiz-loss``. Server: per class, the unweighted mean of the rows the replies hold
    (``robust.aggregate`` per coordinate), zeros for the other classes; the gradient
    table scaled to Frobenius norm ``fedl2g.grad-clip`` when above it; then
    G ← G − ``fedl2g.server-lr`` · g. ``evaluate.fedl2g`` carries the same table; the
    client evaluates its own model.
    """

    name = "fedl2g"
    space: ClassVar[str] = "feature"
    """Where the guiding vectors live (``models.guide.Space``)."""

    def __init__(
        self,
        *,
        server_lr: float = 0.01,
        grad_clip: float = 100.0,
        study_batches: int = 1,
        quiz_batches: int = 1,
        warm_up_rounds: int = 0,
        **kwargs: Unpack[RunSettings],
    ) -> None:
        super().__init__(**kwargs)
        self.server_lr = server_lr
        self.grad_clip = grad_clip
        # the client's settings, recorded with the run
        self.study_batches, self.quiz_batches = study_batches, quiz_batches
        self.warm_up_rounds = warm_up_rounds

    @classmethod
    def section(cls, cfg: RunConfig) -> FedL2GConfig:
        """This method's settings in the run config (``fedl2g.*``)."""
        return cfg.fedl2g

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Self:
        return cls(**cls.section(cfg).model_dump(), **run_settings(cfg))

    def width(self, node: NodeInfo) -> int:
        """The length of a guiding vector: d."""
        return node.feature_dim

    def init_global(self) -> Arrays:
        common_head_shape(self.nodes.values())  # one d and one C for every node
        node = next(iter(self.nodes.values()))
        return {GUIDE: initial_table(node.num_classes, self.width(node), self.seed)}

    def expected_upload(self, node: NodeInfo) -> dict[str, tuple[int, ...]] | None:
        return None  # the classes of a random study batch: checked in check_upload

    def check_upload(self, node: NodeInfo, arrays: Arrays) -> str | None:
        if not arrays:
            return "no guide gradient rows"
        width, classes = self.width(node), {f"{GUIDE_GRAD}{c}" for c in present_classes(node)}
        for key, value in arrays.items():
            if key not in classes:
                return f"unexpected key '{key}' (not a guide-gradient row of a class it has)"
            if value.shape != (width,):
                return f"wrong shape for '{key}': {value.shape} != ({width},)"
        return invalid_reason(arrays)

    def upload_size(self, upload: Upload) -> float | None:
        return largest_row_norm(upload.arrays)

    def aggregate(self, server_round: int, uploads: list[Upload]) -> Arrays | None:
        table = self.global_arrays[GUIDE]
        means = class_mean(uploads, self.robust_aggregate, self.robust_trim)
        gradient = guide_rows(means, table.shape[1], table.shape[0])
        new, norm, clipped = table_step(table, gradient, self.server_lr, self.grad_clip)
        change = float(np.linalg.norm(new.astype(np.float64) - table)) / max(
            float(np.linalg.norm(table.astype(np.float64))), 1e-30
        )
        self.diagnostics = {
            "guide-grad-norm": norm,
            "guide-clipped": float(clipped),
            "guide-change": change,
            "guide-classes": len(means),
        }
        return {GUIDE: new}
