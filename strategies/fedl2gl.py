"""``fedl2gl``: FedL2G-l (Zhang et al., 2024), FedL2G with guiding vectors in the logit
space: a C × C guide table."""

from __future__ import annotations

from common.config import RunConfig
from common.sections import FedL2GConfig
from strategies.base import NodeInfo
from strategies.fedl2g import FedL2G


class FedL2GL(FedL2G):
    """FedL2G-l: :class:`~strategies.fedl2g.FedL2G` with one guiding vector of C logits
    per class.

    Message contract: as ``fedl2g`` with ``train.fedl2gl``, the table ``{"guide": [C,
    C]}``, the client's guiding term MSE(logits, G[y]) (in training and in the meta
    step's study loss) and its reply ``{"guide-grad.<c>": [C]}``; settings
    ``fedl2gl.*``.
    """

    name = "fedl2gl"
    space = "logit"

    @classmethod
    def section(cls, cfg: RunConfig) -> FedL2GConfig:
        return cfg.fedl2gl

    def width(self, node: NodeInfo) -> int:
        """The length of a guiding vector: C."""
        return node.num_classes
