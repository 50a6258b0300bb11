"""``fedproto``: FedProto, per-class mean of client prototypes."""

from __future__ import annotations

from dataclasses import replace
from logging import WARNING
from typing import TypedDict, Unpack

import numpy as np
from flwr.common.logger import log

from common.config import RunConfig
from common.messages import PROTO
from common.records import Arrays
from strategies.base import HeteroStrategy, NodeInfo, RunSettings, Upload
from strategies.robust import PROTOTYPE_SCREENS, class_outliers, largest_row_norm, robust_mean


def present_classes(node: NodeInfo) -> list[int]:
    return [c for c, n in enumerate(node.class_counts) if n > 0]


def expected_prototypes(node: NodeInfo) -> dict[str, tuple[int, ...]]:
    """One ``proto.<c>`` [d] per class the node has: no more, no fewer."""
    return {f"{PROTO}{c}": (node.feature_dim,) for c in present_classes(node)}


def class_of(key: str) -> int:
    """The class a per-class key names (``proto.<c>``, ``logit.<c>``)."""
    return int(key.rsplit(".", 1)[-1])


def class_mean(uploads: list[Upload], rule: str = "mean", trim: float = 0.1) -> Arrays:
    """Unweighted per-class mean over the clients that have the class (``rule``:
    ``trimmed-mean`` or ``median`` per coordinate instead, see :mod:`strategies.robust`);
    keys are ``<prefix><c>`` (``proto.3``, ``logit.3``), returned in class order."""
    groups: dict[str, list[np.ndarray]] = {}
    for u in uploads:
        for key, value in u.arrays.items():
            groups.setdefault(key, []).append(value.astype(np.float64))
    order = sorted(groups, key=class_of)
    if rule == "mean":
        return {k: np.mean(groups[k], axis=0).astype(np.float32) for k in order}
    out: Arrays = {}
    for k in order:
        like = {k: np.zeros(0, np.float32)}
        items = [{k: v} for v in groups[k]]
        out[k] = robust_mean(items, [1.0] * len(items), like, rule, trim)[k]
    return out


class ScreenSettings(TypedDict, total=False):
    """The ``robust.prototypes`` settings of the servers that train on per-class uploads."""

    prototypes: str
    prototype_min_cosine: float
    prototype_max_norm_ratio: float


def screen_settings(cfg: RunConfig) -> ScreenSettings:
    """:class:`ScreenSettings` from the run config's ``robust.*`` keys."""
    return {
        "prototypes": cfg.robust.prototypes,
        "prototype_min_cosine": cfg.robust.prototype_min_cosine,
        "prototype_max_norm_ratio": cfg.robust.prototype_max_norm_ratio,
    }


class ClassScreened(HeteroStrategy):
    """A server that trains on per-class uploads (FedGH, FedTGP; FedRE's mixtures):
    ``robust.prototypes`` screens each class's uploads against that class before the
    server trains on them (docs/robustness.md).

    ``screen``: per class, the coordinate-wise median of the prototypes the round's
    replies hold for it is the class's reference (classes with prototypes from at
    least 3 replies); a prototype is dropped when its cosine with it is below
    ``prototype_min_cosine`` or its norm is above ``prototype_max_norm_ratio`` × the
    median norm of the class's prototypes. ``median``: the same screening, then the
    server trains on each class's coordinate-wise median of the prototypes kept, once
    per prototype kept (each class keeps its weight in the server's loss). ``none``:
    every valid upload is trained on as sent.

    A reply with dropped prototypes is logged (node and partition) and recorded in
    :attr:`rejected` with the classes and why; it keeps the prototypes that passed,
    and is dropped from aggregation when none did.
    """

    def __init__(
        self,
        *,
        prototypes: str = "screen",
        prototype_min_cosine: float = 0.0,
        prototype_max_norm_ratio: float = 10.0,
        **kwargs: Unpack[RunSettings],
    ) -> None:
        super().__init__(**kwargs)
        if prototypes not in PROTOTYPE_SCREENS:
            raise ValueError(
                f"robust.prototypes {prototypes!r}: choose one of {list(PROTOTYPE_SCREENS)}"
            )
        self.prototypes = prototypes
        """``robust.prototypes``: ``none``, ``screen`` or ``median``."""
        self.prototype_min_cosine = prototype_min_cosine
        """Drop a prototype whose cosine with its class's median is below this."""
        self.prototype_max_norm_ratio = prototype_max_norm_ratio
        """Drop a prototype beyond this × its class's median norm (0: no such test)."""
        self.screened_items = 0
        """Prototypes (FedRE: replies) this round's class screening dropped."""

    def _screen(self, server_round: int, uploads: list[Upload]) -> list[Upload]:
        kept = super()._screen(server_round, uploads)
        self.screened_items = 0
        if self.prototypes == "none":
            return kept
        return self.screen_classes(server_round, kept)

    def screen_classes(self, server_round: int, uploads: list[Upload]) -> list[Upload]:
        """Drop the prototypes :func:`strategies.robust.class_outliers` finds."""
        groups: dict[int, dict[int, np.ndarray]] = {}
        for u in uploads:
            for key, value in u.arrays.items():
                groups.setdefault(class_of(key), {})[u.node.node_id] = value
        found = class_outliers(groups, self.prototype_min_cosine, self.prototype_max_norm_ratio)
        kept = []
        for u in uploads:
            bad = found.get(u.node.node_id, {})
            if not bad:
                kept.append(u)
                continue
            self.screened_items += len(bad)
            left = {k: v for k, v in u.arrays.items() if class_of(k) not in bad}
            fate = (
                f"all {len(bad)} of its prototypes: reply dropped"
                if not left
                else f"{len(bad)} of {len(u.arrays)} prototypes dropped, the rest kept"
            )
            reason = (
                "class screening: "
                + "; ".join(f"class {c}: {why}" for c, why in sorted(bad.items()))
                + f" ({fate}; robust.prototypes {self.prototypes})"
            )
            self.record_screened(server_round, u, reason)
            if left:
                kept.append(replace(u, arrays=left))
        return kept

    def record_screened(self, server_round: int, upload: Upload, reason: str) -> None:
        """Log and record what class screening dropped of ``upload``."""
        log(
            WARNING,
            "round %d: node %d (partition %d): %s",
            server_round,
            upload.node.node_id,
            upload.node.partition_id,
            reason,
        )
        self.rejected.append((server_round, upload.node.node_id, reason))

    def training_pairs(self, uploads: list[Upload]) -> tuple[np.ndarray, list[int]]:
        """The (prototype, class) pairs the server trains on, reply by reply: the
        prototypes as sent, or under ``median`` each replaced by its class's
        coordinate-wise median."""
        medians = class_mean(uploads, "median") if self.prototypes == "median" else {}
        protos, labels = [], []
        for u in uploads:
            for key, value in u.arrays.items():
                protos.append(medians.get(key, value))
                labels.append(class_of(key))
        return np.stack(protos), labels

    def screen_diagnostics(self) -> dict[str, float]:
        """``prototypes-screened`` this round (when screening is on)."""
        if self.prototypes == "none":
            return {}
        return {"prototypes-screened": self.screened_items}


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
        return dict(sorted(new.items(), key=lambda kv: class_of(kv[0])))
