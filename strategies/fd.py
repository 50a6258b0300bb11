"""``fd``: federated distillation (Jeong et al., 2018), per-class mean logits."""

from __future__ import annotations

from typing import Self, Unpack

from common.config import RunConfig
from common.messages import LOGIT
from strategies.base import NodeInfo, RunSettings, run_settings
from strategies.fedproto import FedProto, present_classes


def expected_logits(node: NodeInfo) -> dict[str, tuple[int, ...]]:
    """One ``logit.<c>`` [C] per class the node has: no more, no fewer."""
    return {f"{LOGIT}{c}": (node.num_classes,) for c in present_classes(node)}


class FD(FedProto):
    """FD: global per-class mean logits; no model parameters are exchanged.

    Message contract: ``train.fd`` carries the global mean logit vectors
    ``{"logit.<c>": [C]}`` known so far (none in round 1). The client trains with
    CE + λ·D(logits, global[y]) (``fd.lambda``; D: ``fd.loss``, KL from the softmax of
    the global logits of the sample's class, or the MSE of the logit vectors; samples
    whose class has no global logits get only CE) and, *during* that training, records
    the mean logit vector of each class over the batches it trained on (the paper's
    rule: the logits as the model produced them while it learned). It replies with
    ``{"logit.<c>": [C]}`` for exactly the classes it has. Server: per class, the
    unweighted mean over the clients that have the class (the paper's and HtFLlib's;
    ``robust.aggregate`` makes it a trimmed mean or a median per coordinate); classes
    absent from this round's replies keep their last global logits. Evaluation: each
    client's own model. The rule is FedProto's (:meth:`FedProto.aggregate`), on logits.
    """

    name = "fd"

    def __init__(self, *, lam: float = 1.0, loss: str = "kl", **kwargs: Unpack[RunSettings]):
        super().__init__(**kwargs)
        self.lam, self.loss = lam, loss  # the client's settings, recorded with the run

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Self:
        return cls(lam=cfg.fd.lam, loss=cfg.fd.loss, **run_settings(cfg))

    def expected_upload(self, node: NodeInfo) -> dict[str, tuple[int, ...]]:
        return expected_logits(node)
