"""Crafted client replies for a strategy, no ClientApp involved (as Flower's own
strategy tests build them): node descriptions, a strategy that knows them, and
train replies (arrays + metrics) or error replies from a node.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from flwr.app import ConfigRecord, Error, Message, MetricRecord, RecordDict

from common.config import parse_run_config
from common.records import Arrays, to_record
from strategies.base import HeteroStrategy, NodeInfo


def node(
    nid: int,
    pid: int,
    *,
    arch: str = "cnn-1",
    num_train: int = 100,
    d: int = 500,
    classes: int = 10,
    counts: tuple[int, ...] | None = None,
    **extras: Any,
) -> NodeInfo:
    """Node ``nid`` (partition ``pid``) as its profile reply describes it: a 28x28
    single-channel model ``arch`` with feature dimension ``d``, ``num_train``
    training samples spread evenly over ``classes`` unless ``counts`` says otherwise."""
    return NodeInfo(
        node_id=nid,
        partition_id=pid,
        arch=arch,
        num_train=num_train,
        num_test=num_train // 3,
        num_classes=classes,
        feature_dim=d,
        class_counts=counts or (num_train // classes,) * classes,
        extras={"in-channels": 1, "image-size": 28, **extras},
    )


def strategy(cls: type[HeteroStrategy], nodes: list[NodeInfo], **cfg: Any) -> HeteroStrategy:
    """``cls`` built from the flat run config ``cfg``, knowing ``nodes``."""
    s = cls.from_config(parse_run_config(cfg))
    s.nodes = {n.node_id: n for n in nodes}
    return s


def sized(s: HeteroStrategy, sizes: dict[int, int]) -> HeteroStrategy:
    """Set the nodes' reported training-set sizes (a reply's num-examples must match)."""
    for nid, n in sizes.items():
        s.nodes[nid] = replace(s.nodes[nid], num_train=n)
    return s


def reply(
    nid: int, arrays: Arrays, num_examples: int, kind: str = "train.x", **metrics: float
) -> Message:
    """Node ``nid``'s reply to a ``kind`` message: ``arrays`` and the train metrics."""
    sent = Message(RecordDict({"config": ConfigRecord()}), dst_node_id=nid, message_type=kind)
    content = RecordDict(
        {
            "arrays": to_record(arrays),
            "metrics": MetricRecord(
                {
                    "num-examples": num_examples,
                    "train-loss": 1.0,
                    "train-time-s": 0.1,
                    **metrics,
                }
            ),
        }
    )
    return Message(content, reply_to=sent)


def error_reply(nid: int, reason: str = "boom") -> Message:
    """Node ``nid``'s error reply to a train message."""
    sent = Message(RecordDict(), dst_node_id=nid, message_type="train.x")
    return Message(Error(code=0, reason=reason), reply_to=sent)
