"""``fedtgp``: FedTGP, trainable global prototypes with an adaptive margin."""

from __future__ import annotations

from typing import Any, Self, Unpack

import numpy as np
import torch

from common.config import RunConfig
from common.messages import PROTO
from common.records import Arrays
from models.tgp import PrototypeGenerator, adaptive_margin, train_generator
from models.threads import torch_threads
from strategies.base import NodeInfo, RunSettings, Upload, run_settings
from strategies.fedproto import ClassScreened, class_mean, expected_prototypes, screen_settings
from strategies.heads import common_head_shape
from strategies.robust import largest_row_norm


class FedTGP(ClassScreened):
    """FedTGP: the server learns one prototype per class from the clients' ones.

    Message contract: as ``fedproto``. ``train.fedtgp`` carries the generated global
    prototypes ``{"proto.<c>": [d]}`` for every class (none in round 1); the client
    trains with CE + λ·MSE(rep, proto[y]) (``fedtgp.lambda``) and replies with
    ``{"proto.<c>": [d]}`` for exactly the classes it has, computed with the model
    *after* this round's training. Server: a generator (a learnable embedding per
    class, then Linear(d, hidden)-ReLU-Linear(hidden, d)) kept across rounds is
    trained ``fedtgp.server-epochs`` epochs (SGD, ``fedtgp.server-lr``, batches of
    ``fedtgp.server-batch-size``) on the received (prototype, class) pairs with
    cross-entropy over ``−(‖p − g_c‖ + margin·[c = y])``; the margin is
    ``min(max_k min_{j≠k} ‖c_k − c_j‖, fedtgp.margin-threshold)`` over the centres
    ``c_k`` (per-class means) of this round's received prototypes. Broadcast: the
    generated prototypes of every class. ``robust.prototypes`` screens each class's
    prototypes first (:class:`ClassScreened`; under ``median`` the centres are the
    per-class medians too).
    """

    name = "fedtgp"

    def __init__(
        self,
        *,
        server_epochs: int = 100,
        server_lr: float = 0.01,
        server_batch_size: int = 10,
        margin_threshold: float = 100.0,
        hidden_dim: int = 0,
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
        self.server_epochs = server_epochs
        self.server_lr = server_lr
        self.server_batch_size = server_batch_size
        self.margin_threshold = margin_threshold
        """Upper bound of the adaptive margin."""
        self.hidden_dim = hidden_dim
        """Width of the generator's hidden layer; 0 = d."""
        self.generator: PrototypeGenerator | None = None

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Self:
        f = cfg.fedtgp
        return cls(
            server_epochs=f.server_epochs,
            server_lr=f.server_lr,
            server_batch_size=f.server_batch_size,
            margin_threshold=f.margin_threshold,
            hidden_dim=f.hidden_dim,
            **screen_settings(cfg),
            **run_settings(cfg),
        )

    def init_global(self) -> Arrays:
        d, c = common_head_shape(self.nodes.values())
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            self.generator = PrototypeGenerator(c, d, self.hidden_dim or d)
        return {}

    def extra_state(self) -> dict[str, Any]:
        assert self.generator is not None
        return {"generator": self.generator.state_dict()}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        assert self.generator is not None
        self.generator.load_state_dict(state["generator"])

    def expected_upload(self, node: NodeInfo) -> dict[str, tuple[int, ...]]:
        return expected_prototypes(node)

    def upload_size(self, upload: Upload) -> float | None:
        return largest_row_norm(upload.arrays)

    def aggregate(self, server_round: int, uploads: list[Upload]) -> Arrays | None:
        assert self.generator is not None
        protos, labels = self.training_pairs(uploads)
        rule = "median" if self.prototypes == "median" else "mean"
        centres = np.stack(list(class_mean(uploads, rule).values()))
        margin = adaptive_margin(torch.from_numpy(centres), self.margin_threshold)
        gen = torch.Generator().manual_seed(self.seed * 100_003 + server_round)
        with torch_threads(1):  # thousands of tiny steps: threads only add overhead
            before, after = train_generator(
                self.generator,
                torch.from_numpy(protos).float(),
                torch.tensor(labels),
                margin,
                epochs=self.server_epochs,
                lr=self.server_lr,
                batch_size=self.server_batch_size,
                generator=gen,
            )
        self.diagnostics = {
            "margin": margin,
            "server-loss-before": before,
            "server-loss-after": after,
            **self.screen_diagnostics(),
        }
        with torch.no_grad():
            table = self.generator().numpy()
        return {f"{PROTO}{c}": table[c].copy() for c in range(len(table))}
