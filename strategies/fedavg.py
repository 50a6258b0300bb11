"""``fedavg``: FedAvg over whole models (homogeneous families only)."""

from __future__ import annotations

from common.records import Arrays
from strategies.base import HeteroStrategy, Upload


class FedAvg(HeteroStrategy):
    """FedAvg: one global model, sample-weighted mean of full state dicts.

    Message contract: ``train.fedavg`` carries the full global state dict; the client
    loads it, trains, and replies with its full state dict (same keys and shapes).
    Needs every node on the same architecture: a heterogeneous federation is refused
    at start with an error naming the architectures found.
    """

    name = "fedavg"
    shares_model = True

    def init_global(self) -> Arrays:
        model = self.shared_model(
            "algorithm 'fedavg' (a homogeneous model.family such as 'fedavgcnn')"
        )
        return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}

    def aggregate(self, server_round: int, uploads: list[Upload]) -> Arrays | None:
        return self.mean_of(uploads)
