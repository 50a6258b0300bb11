"""``fedproto``: FedProto, per-class mean of client prototypes."""

from __future__ import annotations

import numpy as np

from common.messages import PROTO
from common.records import Arrays
from strategies.base import HeteroStrategy, NodeInfo, Upload
from strategies.robust import largest_row_norm, robust_mean


def present_classes(node: NodeInfo) -> list[int]:
    return [c for c, n in enumerate(node.class_counts) if n > 0]


def expected_prototypes(node: NodeInfo) -> dict[str, tuple[int, ...]]:
    """One ``proto.<c>`` [d] per class the node has: no more, no fewer."""
    return {f"{PROTO}{c}": (node.feature_dim,) for c in present_classes(node)}


def class_mean(uploads: list[Upload], rule: str = "mean", trim: float = 0.1) -> Arrays:
    """Unweighted per-class mean over the clients that have the class (``rule``:
    ``trimmed-mean`` or ``median`` per coordinate instead, see :mod:`strategies.robust`)."""
    groups: dict[str, list[np.ndarray]] = {}
    for u in uploads:
        for key, value in u.arrays.items():
            groups.setdefault(key, []).append(value.astype(np.float64))
    order = sorted(groups, key=lambda k: int(k.removeprefix(PROTO)))
    if rule == "mean":
        return {k: np.mean(groups[k], axis=0).astype(np.float32) for k in order}
    out: Arrays = {}
    for k in order:
        like = {k: np.zeros(0, np.float32)}
        items = [{k: v} for v in groups[k]]
        out[k] = robust_mean(items, [1.0] * len(items), like, rule, trim)[k]
    return out


class FedProto(HeteroStrategy):
    """FedProto: global class prototypes; no model parameters are exchanged.

    Message contract: ``train.fedproto`` carries the global prototypes
    ``{"proto.<c>": [d]}`` known so far (none in round 1); the client trains with
    CE + λ·MSE(rep, proto[y]) (samples whose class has no global prototype get only
    CE) and replies with ``{"proto.<c>": [d]}`` for exactly the classes it has,
    computed after training. Server: per-class mean over the clients that have the
    class (unweighted, as in the FedProto paper); classes nobody has stay absent.
    Global prototypes of classes absent from this round's replies are kept.
    """

    name = "fedproto"

    def expected_upload(self, node: NodeInfo) -> dict[str, tuple[int, ...]]:
        return expected_prototypes(node)

    def upload_size(self, upload: Upload) -> float | None:
        return largest_row_norm(upload.arrays)

    def aggregate(self, server_round: int, uploads: list[Upload]) -> Arrays | None:
        new = dict(self.global_arrays)
        new.update(class_mean(uploads, self.robust_aggregate, self.robust_trim))
        return dict(sorted(new.items(), key=lambda kv: int(kv[0].removeprefix(PROTO))))
