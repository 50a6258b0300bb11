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
from models.matryoshka import MatryoshkaNet, MatryoshkaPredictor
from models.train import EvalStats, ExtraLoss, evaluate

OWN_SHARED = "own-shared"
"""run.notes key: the node's copy of the shared model as its last training left it,
kept by :meth:`FedMRLHook.install` before the server's replaces it."""
SENT_SHARED = "sent-shared"
"""run.notes key: the server's shared model, as installed."""


class FedMRLHook(MutualHook):
    """``fedmrl``: train the fused model with ``CE(h_k(r)) + CE(h(r[:, :s]))``; upload
    the shared model; predict with the head(s) ``fedmrl.predict-head`` names (the
    shared one ``h(r[:, :s])``, the local one ``h_k(r)``, :class:`MatryoshkaNet`'s
    forward, or their sum) and, by ``fedmrl.predict-with``, the server's shared model
    or the node's own trained copy of it.

    Evaluation diagnostics: ``accuracy-without-shared`` is the prediction with the
    node's own trained copy instead of the server's (``predict-with = sent``) or the
    other way round (``trained``); ``shared-head-accuracy`` and ``own-head-accuracy``
    are each head's prediction alone, with the shared model the prediction uses."""

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

    def install(self, run: ClientRun, arrays: dict[str, Tensor]) -> None:
        run.notes[OWN_SHARED] = self._shared_copy(run)
        super().install(run, arrays)
        run.notes[SENT_SHARED] = self._shared_copy(run)

    def evaluate(self, run: ClientRun, x: Tensor, y: Tensor) -> EvalStats:
        if run.cfg.fedmrl.predict_with == "trained" and OWN_SHARED in run.notes:
            run.model.load_state_dict(run.notes[OWN_SHARED], strict=False)  # kept so
        stats = self._evaluate(run, x, y)
        for head in ("shared", "own"):  # the local test split's, each head alone
            if f"{head}-head-accuracy" not in run.metrics:
                alone = stats if head == run.cfg.fedmrl.predict_head else None
                run.metrics[f"{head}-head-accuracy"] = (
                    alone or self._evaluate(run, x, y, head)
                ).accuracy
        return stats

    def evaluate_without_shared(self, run: ClientRun, x: Tensor, y: Tensor) -> EvalStats | None:
        other = OWN_SHARED if run.cfg.fedmrl.predict_with == "sent" else SENT_SHARED
        if other not in run.notes:
            return None
        now = self._shared_copy(run)
        run.model.load_state_dict(run.notes[other], strict=False)
        try:
            return self._evaluate(run, x, y)
        finally:
            run.model.load_state_dict(now, strict=False)

    @staticmethod
    def _evaluate(run: ClientRun, x: Tensor, y: Tensor, head: str = "") -> EvalStats:
        """With ``head`` (default: ``fedmrl.predict-head``), as the export predicts."""
        model, head = run.model, head or run.cfg.fedmrl.predict_head
        if head == "own" or not isinstance(model, MatryoshkaNet):
            return evaluate(model, x, y)
        return evaluate(MatryoshkaPredictor(model, head), x, y)

    def _shared_copy(self, run: ClientRun) -> dict[str, Tensor]:
        return {k: v.clone() for k, v in self.shared_state(run).items()}
