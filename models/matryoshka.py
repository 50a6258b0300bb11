"""FedMRL's client model: a local and a shared extractor fused by a personal projector,
and two heads on nested slices of the fused representation (Matryoshka).

Pure PyTorch; no Flower imports.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from models.nets import HetNet


class MatryoshkaNet(HetNet):
    """``r = P([RM_s(g(x)), RM(g_k(x))])`` [B, d]; the local head reads all of ``r``,
    the shared head its first ``s`` coordinates.

    ``g`` is the shared model's extractor (its ``RM`` pools to ``s``), ``g_k`` the local
    one (``RM`` to ``d``), ``P = Linear(s + d, d)`` the projector, ``[·, ·]`` the
    concatenation, shared part first. ``forward`` is the prediction: the local head's
    logits ``h_k(r)``; :meth:`shared_logits` are the shared head's ``h(r[:, :s])``.

    The state dict holds the local model's keys as they were (``extractor.*``,
    ``head.*``), the shared model's under ``shared.`` and ``projector.weight`` [d, s + d],
    ``projector.bias`` [d].
    """

    def __init__(self, local: HetNet, shared: HetNet, projector: nn.Linear) -> None:
        s, d = shared.feature_dim, local.feature_dim
        if s > d:
            raise ValueError(f"the shared representation ({s}) must fit in d = {d}")
        if (projector.in_features, projector.out_features) != (s + d, d):
            raise ValueError(
                f"the projector maps {projector.in_features}→{projector.out_features}, "
                f"not s + d → d ({s + d}→{d})"
            )
        # HetNet.__init__ would build a new head: take the local model's modules instead
        nn.Module.__init__(self)
        self.extractor = local.extractor
        self.head = local.head
        self.feature_dim = d
        self.num_classes = local.num_classes
        self.arch = local.arch
        self.shared = shared
        self.projector = projector

    def features(self, x: Tensor) -> Tensor:
        """The fused representation ``r`` [B, d]."""
        both = torch.cat((self.shared.features(x), super().features(x)), dim=1)
        return self.projector(both)  # type: ignore[no-any-return]

    def shared_logits(self, reps: Tensor) -> Tensor:
        """The shared head's logits on the first ``s`` coordinates of ``reps`` [B, d]."""
        return self.shared.classify(reps[:, : self.shared.feature_dim])

    def predict(self, x: Tensor, head: str = "own") -> Tensor:
        """The logits a node predicts with: ``own`` ``h_k(r)`` (:meth:`forward`),
        ``shared`` ``h(r[:, :s])`` or ``both``, their sum."""
        reps = self.features(x)
        if head == "own":
            return self.classify(reps)
        if head == "shared":
            return self.shared_logits(reps)
        if head == "both":
            return self.classify(reps) + self.shared_logits(reps)
        raise ValueError(f"unknown head {head!r}: own, shared or both")


class MatryoshkaPredictor(nn.Module):
    """A :class:`MatryoshkaNet` whose forward is :meth:`MatryoshkaNet.predict` with
    ``head`` (what ``fedhet export`` writes for ``fedmrl.predict-head`` other than
    ``own``)."""

    def __init__(self, net: MatryoshkaNet, head: str) -> None:
        super().__init__()
        self.net = net
        self.head = head

    def forward(self, x: Tensor) -> Tensor:
        return self.net.predict(x, self.head)


__all__ = ["MatryoshkaNet", "MatryoshkaPredictor"]
