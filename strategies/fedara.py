"""``fedara``: FedARA, server-side low-rank decomposition and reconstruction."""

from __future__ import annotations

import numpy as np
import torch

from common.records import Arrays, shapes
from models.lowrank import Svd, factorisable_layers, layer_rank, top_svd, torch_threads
from models.lowrank_state import decompose_state, weighted_reconstruction
from strategies.base import HeteroStrategy, NodeInfo, Upload

EXTRACTOR = "extractor."
Tier = tuple[float, tuple[str, ...]]


class FedARA(HeteroStrategy):
    """FedARA: one full-rank global extractor, served to each node at its rank.

    Message contract: ``train.fedara`` carries the node's extractor ``{"extractor.*"}``
    decomposed at its (rank ratio, layer set) tier — factors ``U``, ``V`` for the
    factorised layers, full weights for the others (rank ratio 1: the full
    extractor). The client installs it, computes anchors from it (round ≥ 2), trains
    extractor + personal head, and replies with its extractor in the same keys and
    shapes. Server: reconstruct each reply to full rank, sample-weighted mean.
    Decomposition (truncated SVD, balanced split) runs once per distinct tier per
    global state and is shared by every node of the tier. Nodes report their tier
    in ``query.profile`` (``rank-ratio``, ``layers``); all must share one base
    architecture.
    """

    name = "fedara"

    def __init__(self, cfg) -> None:  # type: ignore[no-untyped-def]
        super().__init__(cfg)
        self._served: dict[Tier, Arrays] = {}
        self._svds: dict[str, Svd] = {}
        self.svd_calls: dict[int, int] = {}
        """Version -> SVDs computed (one per decomposed layer, shared by all tiers)."""
        self.version = 0
        """Global extractor version: 0 initially, +1 per aggregation."""
        self.decompositions: dict[int, int] = {}
        """Version -> decompositions computed from it (one per distinct tier, r < 1)."""
        self.layer_shapes: dict[str, tuple[int, ...]] = {}

    def tier(self, node: NodeInfo) -> Tier:
        layers = tuple(sorted(str(node.extras.get("layers", "")).split(",")))
        return float(node.extras["rank-ratio"]), tuple(name for name in layers if name)

    def init_global(self) -> Arrays:
        model = self.shared_model("fedara (one base architecture, see fedara.base-arch)")
        self.layer_shapes = factorisable_layers(model.extractor)
        return {
            EXTRACTOR + k: v.detach().numpy().copy()
            for k, v in model.extractor.state_dict().items()
        }

    def _extractor(self) -> dict[str, torch.Tensor]:
        return {
            k.removeprefix(EXTRACTOR): torch.from_numpy(v) for k, v in self.global_arrays.items()
        }

    def served(self, tier: Tier) -> Arrays:
        """The global extractor decomposed for ``tier`` (cached per global state)."""
        if tier not in self._served:
            ratio, layers = tier
            if ratio >= 1:
                self._served[tier] = self.global_arrays
            else:
                wanted = {name: self.layer_shapes[name] for name in layers}
                extractor = self._extractor()
                with torch_threads(1):
                    for name, shape in wanted.items():
                        cached = self._svds.get(name)
                        if cached is None or cached[1].numel() < layer_rank(shape, ratio):
                            # one per layer, deep enough for every tier of the known nodes
                            depth = max(
                                layer_rank(shape, t) for t in self.ratios_below_one() | {ratio}
                            )
                            self._svds[name] = top_svd(extractor[f"{name}.weight"], depth)
                            self.svd_calls[self.version] = self.svd_calls.get(self.version, 0) + 1
                    state = decompose_state(extractor, wanted, ratio, self._svds)
                self._served[tier] = {EXTRACTOR + k: v.numpy() for k, v in state.items()}
                self.decompositions[self.version] = self.decompositions.get(self.version, 0) + 1
        return self._served[tier]

    def ratios_below_one(self) -> set[float]:
        """Every tier ratio the known nodes use that needs a decomposition."""
        return {r for r, _ in (self.tier(n) for n in self.nodes.values()) if r < 1}

    def payload(self, server_round: int, node: NodeInfo) -> Arrays:
        return self.served(self.tier(node))

    def expected_upload(self, node: NodeInfo) -> dict[str, tuple[int, ...]]:
        return shapes(self.served(self.tier(node)))

    def aggregate(self, server_round: int, uploads: list[Upload]) -> Arrays | None:
        states = [
            {k.removeprefix(EXTRACTOR): torch.from_numpy(v) for k, v in u.arrays.items()}
            for u in uploads
        ]
        mean = weighted_reconstruction(states, [u.num_examples for u in uploads], self.layer_shapes)
        self._served, self._svds = {}, {}  # new global state: decompose again on demand
        self.version += 1
        return {
            key: mean[key.removeprefix(EXTRACTOR)].numpy().astype(np.float32)
            for key in self.global_arrays
        }
