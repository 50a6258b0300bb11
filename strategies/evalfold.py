"""Evaluation inside the training message (``eval-mode = with-train``).

Round r's evaluation needs what the server would send after round r's aggregation;
round r+1's training message carries the same global state. So a node sampled for
round r+1 gets no ``evaluate.<name>`` message after round r: its training message
carries the evaluation's config (:data:`~common.messages.EVAL_CONFIG`, whose
``server-round`` is r) and, only when they differ from the training arrays, the
evaluation's arrays (:data:`~common.messages.EVAL_ARRAYS`). The node evaluates first,
exactly as an evaluation message would have it do, then trains, and replies with both
(:data:`~common.messages.EVAL_METRICS` beside the training reply's records).
"""

from __future__ import annotations

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord

from common.messages import EVAL_ARRAYS, EVAL_CONFIG, EVAL_METRICS
from common.records import payload_bytes

__all__ = ["fold", "folded_metrics", "same_arrays"]


def same_arrays(a: ArrayRecord, b: ArrayRecord) -> bool:
    """Whether two records hold the same arrays: keys, dtypes, shapes and bytes."""
    if a is b:
        return True
    if list(a) != list(b):
        return False
    return all(
        x.dtype == y.dtype and list(x.shape) == list(y.shape) and x.data == y.data
        for x, y in ((a[k], b[k]) for k in a)
    )


def fold(train: Message, evaluation: Message) -> int:
    """Put ``evaluation``'s content into ``train`` (same node); the bytes of the
    arrays it adds (0 when the training arrays serve the evaluation as well)."""
    content = train.content
    content.config_records[EVAL_CONFIG] = ConfigRecord(
        dict(evaluation.content.config_records["config"])
    )
    wanted = evaluation.content.array_records["arrays"]
    if same_arrays(wanted, content.array_records["arrays"]):
        return 0
    content.array_records[EVAL_ARRAYS] = wanted
    return payload_bytes(wanted)


def folded_metrics(reply: Message) -> MetricRecord | None:
    """The evaluation metrics a training reply carries (None: none, or an error)."""
    if reply.has_error():
        return None
    return reply.content.metric_records.get(EVAL_METRICS)
