"""``local``: every client trains alone; nothing is exchanged."""

from __future__ import annotations

from common.records import Arrays
from strategies.base import HeteroStrategy, NodeInfo, Upload


class Local(HeteroStrategy):
    """Local training only (the no-collaboration baseline).

    Message contract: ``train.local`` / ``evaluate.local`` carry an empty ArrayRecord;
    replies carry an empty ArrayRecord and the usual metrics. Zero bytes either way.
    """

    name = "local"

    def expected_upload(self, node: NodeInfo) -> dict[str, tuple[int, ...]]:
        return {}

    def aggregate(self, server_round: int, uploads: list[Upload]) -> Arrays | None:
        return None
