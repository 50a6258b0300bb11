"""Replies that passed the checks before: wrong dtypes, inflated sample counts, one
client dominating a mean, one surviving low-rank reply replacing the extractor."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array

from common.records import to_numpy
from strategies.fedara import FedARA
from strategies.lgfedavg import LGFedAvg
from strategies.testing import node, reply, sized, strategy


def _lg(**cfg):  # type: ignore[no-untyped-def]
    s = strategy(LGFedAvg, [node(10 + i, i, num_train=100) for i in range(3)], **cfg)
    s.global_arrays = s.init_global()
    return s


def _head(value: float, dtype: type = np.float32) -> dict[str, np.ndarray]:
    return {"head.weight": np.full((10, 500), value, dtype), "head.bias": np.full(10, value, dtype)}


@pytest.mark.parametrize("dtype", [np.int64, np.float64, np.complex64])
def test_a_reply_in_another_dtype_is_rejected_and_the_global_stays_float32(dtype: type) -> None:
    s = _lg()
    hostile = _head(0, dtype)  # first in partition order
    arrays, _ = s.aggregate_train(1, [reply(10, hostile, 100), reply(11, _head(0.7), 100)])
    got = to_numpy(arrays)
    assert all(v.dtype == np.float32 for v in got.values())
    np.testing.assert_allclose(got["head.bias"], 0.7, rtol=1e-6)
    assert [(n, why.split(" ")[0]) for _, n, why in s.rejected] == [(10, "dtype")]


def test_a_reply_whose_array_bytes_are_not_npy_is_rejected_not_a_crash() -> None:
    """Undecodable bytes used to raise out of ``aggregate_train`` and stop the run."""
    s = _lg()
    hostile = reply(10, _head(0.0), 100)
    record = hostile.content.array_records["arrays"]
    record["head.bias"] = Array(dtype="float32", shape=(10,), stype="numpy.ndarray", data=b"\x93N")
    arrays, _ = s.aggregate_train(1, [hostile, reply(11, _head(0.7), 100)])
    np.testing.assert_allclose(to_numpy(arrays)["head.bias"], 0.7, rtol=1e-6)
    assert len(s.rejected) == 1 and s.rejected[0][1] == 10
    assert "'head.bias'" in s.rejected[0][2] and "not a .npy payload" in s.rejected[0][2]


def test_an_inflated_sample_count_is_rejected() -> None:
    """Claiming 10¹² examples used to make a client the whole mean."""
    s = _lg()
    replies = [reply(10, _head(1.0), 100), reply(11, _head(0.0), 10**12)]
    arrays, _ = s.aggregate_train(1, replies)
    np.testing.assert_allclose(to_numpy(arrays)["head.bias"], 1.0)
    assert s.rejected and "num-train 100" in s.rejected[0][2]


def test_max_weight_share_caps_one_clients_share_of_the_mean() -> None:
    s = sized(_lg(**{"max-weight-share": 0.5}), {10: 10, 11: 10, 12: 80})
    replies = [reply(10, _head(0.0), 10), reply(11, _head(0.0), 10), reply(12, _head(1.0), 80)]
    arrays, _ = s.aggregate_train(1, replies)
    np.testing.assert_allclose(to_numpy(arrays)["head.bias"], 0.5, rtol=1e-6)  # not 0.8


def _fedara(**cfg) -> FedARA:  # type: ignore[no-untyped-def]
    ratios = [1.0, 0.5, 0.25, 0.125, 0.0625]
    nodes = [
        node(100 + i, i, **{"rank-ratio": r, "layers": "fc1,fc2"}) for i, r in enumerate(ratios)
    ]
    s = strategy(FedARA, nodes, **cfg)
    s.global_arrays = s.init_global()
    s.awaiting = set(s.nodes)  # all five were sampled this round
    return s


def test_one_surviving_low_rank_reply_does_not_replace_the_extractor() -> None:
    """Default min-valid-replies for a shared model: half of the sampled nodes."""
    s = _fedara()
    lone = reply(104, s.payload(1, s.nodes[104]), 100)  # the rank-1/16 node
    arrays, metrics = s.aggregate_train(1, [lone])
    assert arrays is None and metrics is None and s.min_valid() == 3
    # with three of five, the round goes through
    replies = [reply(n, s.payload(1, s.nodes[n]), 100) for n in (102, 103, 104)]
    arrays, _ = s.aggregate_train(1, replies)
    assert arrays is not None


@pytest.mark.parametrize(
    ("value", "of_five", "of_three"),
    [(1, 1, 1), (4, 4, 4), (0.2, 1, 1), (0.6, 3, 2), (0, 3, 2)],  # 0: ceil(half)
)
def test_min_valid_replies_is_a_count_or_a_fraction_of_the_sampled(
    value: float, of_five: int, of_three: int
) -> None:
    assert _fedara(**{"min-valid-replies": value}).min_valid() == of_five
    lg = _lg(**{"min-valid-replies": value})
    lg.awaiting = set(lg.nodes)
    assert lg.min_valid() == of_three
