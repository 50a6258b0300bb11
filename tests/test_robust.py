"""Robust aggregation: trimmed means and medians against closed forms, norm screening,
and the strategies that use them (crafted replies)."""

from __future__ import annotations

import numpy as np
import pytest

from common.records import to_record, weighted_mean
from strategies.fedgh import FedGH
from strategies.fedkd import FedKD
from strategies.fedproto import FedProto, class_mean
from strategies.lgfedavg import LGFedAvg
from strategies.robust import (
    largest_row_norm,
    norm_outliers,
    robust_mean,
    trimmed_mean,
    update_norm,
    weighted_median,
)
from strategies.testing import node, reply, strategy

RNG = np.random.default_rng(3)


def test_trimmed_mean_and_median_with_equal_weights_are_the_classic_ones() -> None:
    v = RNG.normal(size=(10, 4, 3))
    s = np.sort(v, axis=0)
    np.testing.assert_allclose(trimmed_mean(v, [1] * 10, 0.2), s[2:8].mean(axis=0))
    np.testing.assert_allclose(trimmed_mean(v, [1] * 10, 0.0), v.mean(axis=0))
    np.testing.assert_allclose(weighted_median(v, [1] * 10), np.median(v, axis=0))
    np.testing.assert_allclose(weighted_median(v[:7], [1] * 7), np.median(v[:7], axis=0))


def test_weights_decide_what_is_cut() -> None:
    v = np.array([[0.0], [1.0], [10.0]])
    # weights 1/4, 1/2, 1/4; a quarter cut from each end leaves the middle value
    assert trimmed_mean(v, [1, 2, 1], 0.25)[0] == pytest.approx(1.0)
    # a tenth cut from each end: 0 keeps 0.15, 1 keeps 0.5, 10 keeps 0.15 of 0.8
    assert trimmed_mean(v, [1, 2, 1], 0.1)[0] == pytest.approx((0.5 + 1.5) / 0.8)
    assert weighted_median(v, [1, 2, 1])[0] == 1.0
    assert weighted_median(v, [3, 1, 1])[0] == 0.0  # the heavy value holds half
    w = RNG.random(6)
    x = RNG.normal(size=(6, 5))
    np.testing.assert_allclose(trimmed_mean(x, w, 0.0), (x * w[:, None]).sum(0) / w.sum())


def test_robust_mean_keeps_dtypes_and_the_plain_mean_is_the_weighted_mean() -> None:
    arrays = [{"a": RNG.normal(size=(3, 2)).astype(np.float32)} for _ in range(5)]
    like = {"a": np.zeros((3, 2), np.float32)}
    weights = [1, 2, 3, 4, 5]
    got = robust_mean(arrays, weights, like, "mean", 0.1)
    np.testing.assert_allclose(got["a"], weighted_mean(arrays, weights, like)["a"], rtol=1e-6)
    assert robust_mean(arrays, weights, like, "median", 0.1)["a"].dtype == np.float32
    with pytest.raises(ValueError, match="robust.aggregate"):
        robust_mean(arrays, weights, like, "mode", 0.1)


def test_norm_outliers_against_the_median() -> None:
    norms = {1: 1.0, 2: 2.0, 3: 3.0, 4: 100.0}
    # median 2.5: 100 > 10 × 2.5, 3 is not
    assert set(norm_outliers(norms, 10.0)) == {4}
    assert "40.0×" in norm_outliers(norms, 10.0)[4]
    assert norm_outliers(norms, 0.0) == {}  # off
    assert norm_outliers({1: 1.0, 2: 1e9}, 10.0) == {}  # too few to tell
    assert update_norm({"w": np.array([3.0, 4.0])}, {"w": np.zeros(2)}) == 5.0
    assert largest_row_norm({"p": np.array([[3.0, 4.0], [0.0, 1.0]])}) == 5.0


def heads(n: int, scale: float = 1.0) -> list[dict[str, np.ndarray]]:
    return [
        {
            "head.weight": (RNG.normal(size=(10, 500)) * scale).astype(np.float32),
            "head.bias": (RNG.normal(size=(10,)) * scale).astype(np.float32),
        }
        for _ in range(n)
    ]


def test_a_huge_finite_reply_is_screened_out() -> None:
    nodes = [node(10 + i, i) for i in range(5)]
    s = strategy(LGFedAvg, nodes, **{"robust.max-norm-ratio": 10.0})
    s.global_arrays = s.init_global()
    hs = heads(5, 0.01)
    hs[2] = {k: v * 1e6 for k, v in hs[2].items()}
    s.aggregate_train(1, [reply(10 + i, h, 100) for i, h in enumerate(hs)])
    assert [r[1] for r in s.rejected] == [12] and "robust.max-norm-ratio" in s.rejected[0][2]
    want = weighted_mean([h for i, h in enumerate(hs) if i != 2], [1] * 4, s.global_arrays)
    np.testing.assert_allclose(s.global_arrays["head.bias"], want["head.bias"], rtol=1e-6)


@pytest.mark.parametrize("rule", ["median", "trimmed-mean"])
def test_a_robust_rule_is_not_dragged_by_a_flipped_minority(rule: str) -> None:
    nodes = [node(10 + i, i) for i in range(5)]
    s = strategy(
        LGFedAvg,
        nodes,
        **{"robust.aggregate": rule, "robust.trim": 0.2, "robust.max-norm-ratio": 0.0},
    )
    s.global_arrays = s.init_global()
    hs = heads(5)
    for i in (0, 1):  # 40 % sign-flipped and scaled up
        hs[i] = {k: -50 * v for k, v in hs[i].items()}
    s.aggregate_train(1, [reply(10 + i, h, 100) for i, h in enumerate(hs)])
    stacked = np.stack([h["head.bias"] for h in hs])
    if rule == "median":
        want = np.median(stacked, axis=0)
    else:
        want = np.sort(stacked, axis=0)[1:4].mean(axis=0)
    np.testing.assert_allclose(s.global_arrays["head.bias"], want, rtol=1e-5)


def test_fedproto_takes_a_per_class_median_over_clients() -> None:
    nodes = [node(10 + i, i, d=4, classes=2) for i in range(3)]
    s = strategy(FedProto, nodes, **{"robust.aggregate": "median", "robust.max-norm-ratio": 0})
    protos = [{f"proto.{c}": RNG.normal(size=4).astype(np.float32) for c in (0, 1)} for _ in nodes]
    protos[1]["proto.0"] *= 1000
    s.aggregate_train(1, [reply(10 + i, p, 100) for i, p in enumerate(protos)])
    want = np.median(np.stack([p["proto.0"] for p in protos]), axis=0)
    np.testing.assert_allclose(s.global_arrays["proto.0"], want, rtol=1e-6)
    assert set(class_mean([], "median")) == set()


def test_prototype_uploads_are_screened_by_their_largest_norm() -> None:
    nodes = [node(10 + i, i, d=500, classes=10) for i in range(4)]
    s = strategy(FedGH, nodes, **{"robust.max-norm-ratio": 10.0, "fedgh.server-epochs": 1})
    s.global_arrays = s.init_global()
    protos = [
        {f"proto.{c}": RNG.normal(size=500).astype(np.float32) for c in range(10)} for _ in nodes
    ]
    protos[3]["proto.7"] *= 1e6
    s.aggregate_train(1, [reply(10 + i, p, 100) for i, p in enumerate(protos)])
    assert [r[1] for r in s.rejected] == [13]


def test_screening_is_on_by_default() -> None:
    """The default ``robust.max-norm-ratio`` (50) rejects a 1e6-scaled reply and keeps
    replies within 50x the median."""
    nodes = [node(10 + i, i) for i in range(5)]
    s = strategy(LGFedAvg, nodes)
    assert s.max_norm_ratio == 50.0
    s.global_arrays = s.init_global()
    hs = heads(5, 0.01)
    hs[1] = {k: v * 30 for k, v in hs[1].items()}  # large but within the default
    hs[3] = {k: v * 1e6 for k, v in hs[3].items()}
    s.aggregate_train(1, [reply(10 + i, h, 100) for i, h in enumerate(hs)])
    assert [r[1] for r in s.rejected] == [13]


def test_fedkd_median_of_updates() -> None:
    nodes = [node(10 + i, i) for i in range(3)]
    s = strategy(FedKD, nodes, **{"robust.aggregate": "median", "robust.max-norm-ratio": 0})
    s.global_arrays = {"mentee.b": np.zeros(4, np.float32)}
    updates = [np.array([1, 2, 3, 4.0]), np.array([2, 2, 2, 2.0]), np.array([-900, 5, 0, 9.0])]
    replies = [
        reply(10 + i, {"mentee.b": u.astype(np.float32)}, 100) for i, u in enumerate(updates)
    ]
    s.aggregate_train(1, replies)
    np.testing.assert_allclose(s.global_arrays["mentee.b"], np.median(np.stack(updates), axis=0))


def test_direction_outliers_against_the_median_update() -> None:
    from strategies.robust import direction_outliers, flat_update

    ups = {1: np.array([1.0, 0.0]), 2: np.array([1.0, 1.0]), 3: np.array([2.0, 0.5])}
    ups[4] = -ups[2]
    median = np.median(np.stack(list(ups.values())), axis=0)  # [1, 0.25]
    out = direction_outliers(ups, 0.0)
    assert set(out) == {4} and "cosine" in out[4]
    assert np.linalg.norm(median) > 0
    # the verdict is the second pass's: against the median of 1, 2 and 3, [1, 0.5]
    again = np.array([1.0, 0.5])
    cos = ups[4] @ again / (np.linalg.norm(ups[4]) * np.linalg.norm(again))
    assert f"{cos:.2f}" in out[4]
    assert direction_outliers({1: ups[1], 2: ups[2]}, 0.0) == {}  # fewer than 3
    assert set(direction_outliers(ups, 0.99)) == {1, 2, 4}  # [2, 0.5] is parallel to it
    got = flat_update(
        {"b": np.ones(2, np.float32), "a": np.zeros((1, 2), np.float32)},
        {"a": np.ones((1, 2), np.float32), "b": np.zeros(2, np.float32)},
    )
    np.testing.assert_array_equal(got, [-1, -1, 1, 1])  # key order: a, then b


def test_direction_screening_judges_again_against_the_median_of_those_it_kept() -> None:
    """Two flipped updates drag the median of all six to [0.15, 0], against which the
    honest [-0.5, 1.4] has cosine -0.34; against the median of the three the first
    pass kept, [0.9, 0.5], it has 0.16 and stays, while the flipped ones still go."""
    from strategies.robust import direction_outliers

    honest = [np.array(v) for v in ([2.0, 0.5], [0.8, 1.1], [-0.5, 1.4], [0.9, -0.5])]
    ups = {i: v for i, v in enumerate(honest)} | {4: -honest[0], 5: -honest[1]}
    first = np.median(np.stack(list(ups.values())), axis=0)
    np.testing.assert_allclose(first, [0.15, 0.0])
    cos_first = ups[2] @ first / (np.linalg.norm(ups[2]) * np.linalg.norm(first))
    assert cos_first == pytest.approx(-0.336, abs=1e-3)
    out = direction_outliers(ups, 0.0)
    assert set(out) == {4, 5}
    second = np.array([0.9, 0.5])  # the median of [2, .5], [.8, 1.1], [.9, -.5]
    cos = ups[4] @ second / (np.linalg.norm(ups[4]) * np.linalg.norm(second))
    assert f"cosine {cos:.2f}" in out[4]


def test_a_sign_flipped_update_is_screened_by_direction() -> None:
    nodes = [node(10 + i, i) for i in range(5)]
    s = strategy(LGFedAvg, nodes, **{"robust.min-cosine": 0.0})
    s.global_arrays = s.init_global()
    common = {k: RNG.normal(size=v.shape) for k, v in s.global_arrays.items()}
    hs = [
        {
            k: (s.global_arrays[k] + common[k] + 0.3 * RNG.normal(size=v.shape)).astype(np.float32)
            for k, v in s.global_arrays.items()
        }
        for _ in nodes
    ]
    hs[4] = {k: (2 * s.global_arrays[k] - v).astype(np.float32) for k, v in hs[4].items()}
    s.aggregate_train(1, [reply(10 + i, h, 100) for i, h in enumerate(hs)])
    assert [r[1] for r in s.rejected] == [14] and "robust.min-cosine" in s.rejected[0][2]
    off = strategy(LGFedAvg, nodes)
    off.global_arrays = off.init_global()
    assert off.min_cosine == -1.0  # off by default


def test_the_fault_benchmarks_crafted_replies_keep_the_evaluation_they_carry() -> None:
    """benchmarks/faults.py changes only a reply's arrays: the evaluation a training
    reply carries (eval-mode with-train) stays, so an attacked node is evaluated."""
    from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

    from benchmarks.faults import ATTACKS, FAULTS
    from common.messages import EVAL_METRICS, PROTO

    served = {"w": np.ones((3, 2), np.float32)}
    for name, fault in {**FAULTS, **ATTACKS}.items():
        if name == "error":
            continue
        sent = Message(
            RecordDict({"config": ConfigRecord(), "arrays": to_record(served)}),
            dst_node_id=7,
            message_type="train.x",
        )
        honest = {"w": np.full((3, 2), 2.0, np.float32), f"{PROTO}0": np.ones(4, np.float32)}
        evaluation = MetricRecord({"num-examples": 5, "correct": 3})
        content = RecordDict(
            {
                "arrays": to_record(honest),
                "metrics": MetricRecord({"num-examples": 10}),
                EVAL_METRICS: evaluation,
            }
        )
        crafted = fault(Message(content, reply_to=sent), sent)
        assert dict(crafted.content.metric_records[EVAL_METRICS]) == dict(evaluation), name
        assert crafted.content.metric_records["metrics"]["num-examples"] in (10, 1e12), name
