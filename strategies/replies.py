"""What nodes send back, parsed and checked: profiles, training uploads, evaluations.

Each function takes one reply and returns either the parsed value or a short reason
why the reply is unusable; the strategy logs the reason with the node id and moves on.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import NamedTuple

from flwr.app import ConfigRecord, Message, MetricRecord

from common.records import Arrays, MalformedArray, to_numpy


@dataclass(frozen=True)
class NodeInfo:
    """What a node reported about itself in reply to ``query.profile``."""

    node_id: int
    partition_id: int
    arch: str
    num_train: int
    num_test: int
    num_classes: int
    feature_dim: int
    class_counts: tuple[int, ...]
    extras: dict[str, float | int | str] = field(default_factory=dict)
    test_class_counts: tuple[int, ...] = ()

    @classmethod
    def from_metrics(cls, node_id: int, cfg: ConfigRecord) -> NodeInfo:
        known = {f.replace("_", "-") for f in cls.__dataclass_fields__}
        return cls(
            node_id=node_id,
            partition_id=int(cfg["partition-id"]),  # type: ignore[arg-type]
            arch=str(cfg["arch"]),
            num_train=int(cfg["num-train"]),  # type: ignore[arg-type]
            num_test=int(cfg["num-test"]),  # type: ignore[arg-type]
            num_classes=int(cfg["num-classes"]),  # type: ignore[arg-type]
            feature_dim=int(cfg["feature-dim"]),  # type: ignore[arg-type]
            class_counts=tuple(int(c) for c in cfg["class-counts"]),  # type: ignore[union-attr]
            test_class_counts=tuple(int(c) for c in cfg.get("test-class-counts", [])),  # type: ignore[union-attr]
            extras={k: v for k, v in cfg.items() if k not in known},  # type: ignore[misc]
        )


EVAL_KEYS = (
    "num-examples",
    "correct",
    "loss-sum",
    "accuracy",
    "global-num-examples",
    "global-correct",
)
"""Evaluation-reply metrics with a fixed meaning; any other finite number is a
diagnostic (averaged over clients, sample-weighted)."""


class EvalRow(NamedTuple):
    """One usable evaluation reply."""

    node_id: int
    n: int
    correct: int
    loss: float
    global_n: int = 0
    global_correct: int = 0
    extra: tuple[tuple[str, float], ...] = ()
    """Diagnostics, e.g. ``correct-without-shared`` or ``logit-share``."""


def eval_row(reply: Message) -> tuple[EvalRow | None, str]:
    """Parse and check an evaluation reply: (row, "") or (None, why not)."""
    if reply.has_error():
        return None, f"error reply: {reply.error.reason}"
    if "metrics" not in reply.content.metric_records:
        return None, "no metrics"
    return metrics_row(reply.content.metric_records["metrics"])


def metrics_row(m: MetricRecord) -> tuple[EvalRow | None, str]:
    """Parse and check an evaluation's metrics (an evaluation reply's ``metrics``, or
    those a training reply carries for ``eval-mode = with-train``)."""
    try:
        n, correct, loss = int(m["num-examples"]), int(m["correct"]), float(m["loss-sum"])  # type: ignore[arg-type]
        g_n = int(m.get("global-num-examples", 0))  # type: ignore[arg-type]
        g_c = int(m.get("global-correct", 0))  # type: ignore[arg-type]
    except (KeyError, TypeError, ValueError) as exc:
        return None, f"malformed metrics ({exc})"
    if n <= 0 or not 0 <= correct <= n or not math.isfinite(loss) or not 0 <= g_c <= max(g_n, 0):
        return None, f"inconsistent metrics (n={n}, correct={correct}, loss={loss})"
    extra = tuple(
        (k, float(v))
        for k, v in sorted(m.items())
        if k not in EVAL_KEYS
        and isinstance(v, int | float)
        and not isinstance(v, bool)
        and math.isfinite(v)
    )
    if not 0 <= dict(extra).get("correct-without-shared", 0) <= n:
        return None, "inconsistent metrics (correct-without-shared)"
    return EvalRow(0, n, correct, loss, g_n, g_c, extra), ""


@dataclass(frozen=True)
class Upload:
    """One valid training reply."""

    node: NodeInfo
    arrays: Arrays
    num_examples: int
    metrics: dict[str, float]
    weight: float = 0.0
    """Share of this reply in a weighted mean (its examples' share, capped at
    ``max-weight-share``; the valid replies of a round sum to 1)."""


def train_upload(reply: Message, node: NodeInfo | None) -> tuple[Upload | None, str | None]:
    """A training reply as an :class:`Upload`, or why it cannot be one.

    Array keys, shapes and values are checked by the strategy (``check_upload``).
    The arrays are read-only views of the reply's bytes (a strategy reads an upload,
    never writes it): decoding copies nothing, and a round of 1,000 FedARA replies
    (3.6 GB) does not allocate them twice.
    """
    if reply.has_error():
        return None, f"error reply: {reply.error.reason}"
    if node is None:
        return None, "unknown node"
    content = reply.content
    if "arrays" not in content.array_records or "metrics" not in content.metric_records:
        return None, "reply lacks 'arrays' or 'metrics'"
    metrics = {
        k: float(v)
        for k, v in content.metric_records["metrics"].items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }
    num = metrics.get("num-examples")
    if num is None or not math.isfinite(num) or num <= 0:
        return None, f"bad num-examples {content.metric_records['metrics'].get('num-examples')!r}"
    if node.num_train > 0 and num != node.num_train:
        return None, f"num-examples {num:g} != the node's reported num-train {node.num_train}"
    try:
        arrays = to_numpy(content.array_records["arrays"], copy=False)
    except MalformedArray as exc:
        return None, str(exc)
    return Upload(node=node, arrays=arrays, num_examples=int(num), metrics=metrics), None


def eval_metrics(rows: list[EvalRow]) -> MetricRecord:
    """Σcorrect/Σsamples, mean and std over clients, loss; ``accuracy-global`` when
    every client also evaluated on the official test set."""
    accs = [r.correct / r.n for r in rows]
    total = sum(r.n for r in rows)
    out = MetricRecord(
        {
            "accuracy": sum(r.correct for r in rows) / total,
            "accuracy-mean": statistics.fmean(accs),
            "accuracy-std": statistics.pstdev(accs),
            "loss": sum(r.loss for r in rows) / total,
            "eval-clients": len(rows),
        }
    )
    if all(r.global_n > 0 for r in rows):
        out["accuracy-global"] = sum(r.global_correct for r in rows) / sum(r.global_n for r in rows)
    extras = [dict(r.extra) for r in rows]
    for key in sorted({k for e in extras for k in e}):
        if not all(key in e for e in extras):
            continue
        if key == "correct-without-shared":
            out["accuracy-without-shared"] = sum(e[key] for e in extras) / total
        else:
            out[key] = sum(e[key] * r.n for e, r in zip(extras, rows, strict=True)) / total
    return out
