"""``lgfedavg``: LG-FedAvg, only the heads are shared (sample-weighted mean)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from common.records import Arrays, weighted_mean
from strategies.base import HeteroStrategy, NodeInfo, Upload


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

    def init_global(self) -> Arrays:
        return initial_head(self.nodes.values(), self.cfg.seed)

    def aggregate(self, server_round: int, uploads: list[Upload]) -> Arrays | None:
        return weighted_mean([u.arrays for u in uploads], [u.num_examples for u in uploads])


def initial_head(nodes: Iterable[NodeInfo], seed: int) -> Arrays:
    """A seeded ``Linear(d, C)`` initialisation shared by every head-sharing method."""
    d, c = common_head_shape(nodes)
    head = torch.nn.Linear(d, c)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head.reset_parameters()
    return {
        "head.weight": head.weight.detach().numpy().copy(),
        "head.bias": head.bias.detach().numpy().copy(),
    }


def common_head_shape(nodes: Iterable[NodeInfo]) -> tuple[int, int]:
    """The ``(d, C)`` every node agrees on; a clear error when they disagree."""
    dims = {(n.feature_dim, n.num_classes) for n in nodes}
    if len(dims) != 1:
        raise ValueError(
            f"nodes disagree on (feature-dim, num-classes): {sorted(dims)}; a shared "
            "head needs one model.feature-dim and one label set"
        )
    return dims.pop()
