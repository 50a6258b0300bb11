"""``fml``: FML, federated mutual learning with a shared meme model."""

from __future__ import annotations

from common.records import Arrays
from models import smallest_arch
from strategies.base import HeteroStrategy, Upload

MEME = "meme."


def shared_arch(strategy: HeteroStrategy, configured: str) -> str:
    """``configured``, or the smallest architecture of ``model.family`` for the
    nodes' input."""
    if configured:
        return configured
    node = next(iter(strategy.nodes.values()))
    meta = node.extras
    return smallest_arch(
        strategy.cfg.model.family,
        int(meta["in-channels"]),
        int(meta["image-size"]),
        bool(meta.get("small-stem", 1)),
    )


def float_state(model, prefix: str) -> Arrays:  # type: ignore[no-untyped-def]
    """The model's floating-point state entries, keys prefixed (integer buffers such
    as BatchNorm's batch counters stay on the clients)."""
    return {
        prefix + k: v.detach().numpy().copy()
        for k, v in model.state_dict().items()
        if v.is_floating_point()
    }


class FML(HeteroStrategy):
    """FML: each client keeps its own model and a copy of one small shared model.

    Message contract: ``train.fml`` carries the global meme model ``{"meme.<key>"}``
    (its floating-point state; architecture ``fml.meme-arch``, default the family's
    smallest); the client installs it, trains both models together with
    ``α·CE + (1−α)·KL(meme‖local)`` for its own model and ``β·CE + (1−β)·KL(local‖meme)``
    for the meme, and replies with the meme in the same keys and shapes.
    Server: sample-weighted mean. Evaluation: the client's own model.
    """

    name = "fml"
    shares_model = True

    def init_global(self) -> Arrays:
        return float_state(self.build_for_nodes(shared_arch(self, self.cfg.fml.meme_arch)), MEME)

    def aggregate(self, server_round: int, uploads: list[Upload]) -> Arrays | None:
        return self.mean_of(uploads)
