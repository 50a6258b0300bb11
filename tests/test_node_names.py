"""A node the server drops is named by its partition and profile, not only by the
Flower node id a user cannot map to a device."""

from __future__ import annotations

import logging

import pytest

from strategies.lgfedavg import LGFedAvg
from strategies.testing import error_reply, node, reply, strategy


def test_a_dropped_reply_names_partition_and_profile(caplog: pytest.LogCaptureFixture) -> None:
    nodes = [node(16434016380838274882, 2, profile="rpi4"), node(11, 1), node(12, 0)]
    s = strategy(LGFedAvg, nodes)
    s.global_arrays = g = s.init_global()
    s.awaiting = {n.node_id for n in nodes}
    with caplog.at_level(logging.WARNING, logger="flwr"):
        s.aggregate_train(1, [error_reply(16434016380838274882, "died"), reply(11, g, 100)])
    text = caplog.text
    assert "node 16434016380838274882 (partition 2, rpi4): error reply: died" in text
    # node 12 sent nothing: named the same way, by its architecture when it has no profile
    assert "from node 12 (partition 0, cnn-1)" in text


def test_describe_without_a_profile_reply_falls_back_to_the_id() -> None:
    s = strategy(LGFedAvg, [node(11, 1)])
    assert s.describe(99) == "node 99"
    assert s.describe(11) == "node 11 (partition 1, cnn-1)"
