"""``lgfedavg``: LG-FedAvg, only the heads are shared (sample-weighted mean)."""

from __future__ import annotations

from common.records import Arrays
from strategies.base import HeteroStrategy, Upload
from strategies.heads import initial_head


class LGFedAvg(HeteroStrategy):
    """LG-FedAvg: personal extractors, one global head.

    Message contract: ``train.lgfedavg`` carries the global head ``{"head.weight"
    [C, d], "head.bias" [C]}``; the client installs it, trains its whole model and
    replies with its trained head (same keys and shapes) and ``num-examples`` (its
    training samples). Server: sample-weighted mean of the heads.
    ``evaluate.lgfedavg`` carries the same head; the client evaluates its extractor
    with it.
    """

    name = "lgfedavg"
    shares_model = True

    def init_global(self) -> Arrays:
        return initial_head(self.nodes.values(), self.seed)

    def aggregate(self, server_round: int, uploads: list[Upload]) -> Arrays | None:
        return self.mean_of(uploads)
