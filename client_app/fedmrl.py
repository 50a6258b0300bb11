"""Client part of ``fedmrl``: the local model, the shared small model and a personal
projector fused into one :class:`~models.matryoshka.MatryoshkaNet`.

The shared model and the projector are submodules of the client's model, so both are
kept with the personal state across rounds; the server's shared model replaces the
node's copy at every installation, the projector is never sent and never replaced.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from client_app.base import ClientRun, initial_seed
from client_app.mutual import MutualHook
from common.messages import SHARED
from models.matryoshka import MatryoshkaNet
from models.train import ExtraLoss


class FedMRLHook(MutualHook):
    """``fedmrl``: train the fused model with ``CE(h_k(r)) + CE(h(r[:, :s]))``; upload
    the shared model; predict with the local head (:class:`MatryoshkaNet`'s forward)."""

    name = "fedmrl"
    prefix = SHARED.rstrip(".")

    def shared_arch(self, run: ClientRun) -> str:
        return run.cfg.fedmrl.shared_arch

    def prepare(self, run: ClientRun) -> None:
        d, s = run.model.feature_dim, run.cfg.fedmrl.rep_dim
        if s > d:
            raise ValueError(f"fedmrl.rep-dim = {s} must be at most d = {d} (model.feature-dim)")
        shared = self.build_shared(run, s)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(initial_seed(run.cfg, run.node) + 2)
            projector = nn.Linear(s + d, d)
        run.model = MatryoshkaNet(run.model, shared, projector)

    def extra_loss(self, run: ClientRun) -> ExtraLoss | None:
        model = run.model
        if not isinstance(model, MatryoshkaNet):
            raise TypeError("fedmrl's model is not prepared (no MatryoshkaNet)")

        def loss(reps: Tensor, logits: Tensor, y: Tensor, x: Tensor) -> Tensor:
            # the loop's CE is the local head's on r; this is the shared head's on r[:, :s]
            return F.cross_entropy(model.shared_logits(reps), y)

        return loss

    def upload(self, run: ClientRun) -> dict[str, Tensor]:
        return self.shared_state(run)
