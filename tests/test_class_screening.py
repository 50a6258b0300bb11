"""``robust.prototypes``: per-class screening (and per-class medians) before the
servers of FedGH, FedTGP and FedRE train on the uploads, against closed forms with
crafted replies; and FedARA's direction screening on the tensors every tier sends
whole."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from common.config import ConfigError, parse_run_config
from strategies.fedgh import FedGH
from strategies.fedre import FedRE
from strategies.fedtgp import FedTGP
from strategies.heads import BIAS, WEIGHT, server_step
from strategies.replies import train_upload
from strategies.robust import class_outliers, mixture_outliers
from strategies.testing import node, reply, strategy

D, C = 6, 2


def honest_protos(rng: np.random.Generator, n: int) -> list[dict[str, np.ndarray]]:
    """Non-negative prototypes (features are after a ReLU) around one centre per class."""
    centres = [rng.random(D) + 0.5 for _ in range(C)]
    return [
        {f"proto.{c}": (centres[c] + 0.1 * rng.random(D)).astype(np.float32) for c in range(C)}
        for _ in range(n)
    ]


def test_class_outliers_against_the_class_median() -> None:
    """Class 0: three honest prototypes, one flipped, one 10.5x pushed; the median
    and the norms by hand. Class 1 has two prototypes: no reference, nothing judged."""
    h = [np.array([1.0, 0.2, 0.0]), np.array([0.8, 0.4, 0.1]), np.array([1.0, 0.1, 0.2])]
    flipped, pushed = -h[0], np.array([0.0, 0.0, 10.5])
    groups = {0: {1: h[0], 2: h[1], 3: h[2], 4: flipped, 5: pushed}, 1: {1: -h[0], 2: h[1]}}
    median = np.array([0.8, 0.1, 0.1])  # coordinate by coordinate
    norms = sorted(float(np.linalg.norm(v)) for v in groups[0].values())
    out = class_outliers(groups, 0.0, 10.0)
    assert set(out) == {4, 5} and set(out[4]) == {0} and set(out[5]) == {0}
    cos_flip = flipped @ median / (np.linalg.norm(flipped) * np.linalg.norm(median))
    assert f"cosine {cos_flip:.2f}" in out[4][0] and "norm" not in out[4][0]
    cos_push = pushed @ median / (10.5 * np.linalg.norm(median))
    assert cos_push > 0  # the push is caught by its size, not its direction
    assert f"norm {10.5 / norms[2]:.1f}×" in out[5][0] and "cosine" not in out[5][0]
    assert set(class_outliers(groups, 0.0, 0.0)) == {4}  # no norm test
    assert class_outliers(groups, -1.0, 0.0) == {}
    assert set(class_outliers(groups, 0.99, 0.0)[1]) == {0}  # node 1's [1, .2, 0]: 0.98


def gh(n: int, mode: str, **cfg: object) -> FedGH:
    nodes = [node(10 + i, i, d=D, classes=C) for i in range(n)]
    s = strategy(
        FedGH,
        nodes,
        **{
            "robust.prototypes": mode,
            "robust.max-norm-ratio": 0,
            "fedgh.server-epochs": 3,
            "fedgh.server-batch-size": 2,
            **cfg,
        },
    )
    s.global_arrays = s.init_global()
    return s  # type: ignore[return-value]


def uploads_of(s: FedGH | FedTGP | FedRE, protos: list[dict[str, np.ndarray]]) -> list:  # type: ignore[type-arg]
    out = []
    for i, arrays in enumerate(protos):
        upload = train_upload(reply(10 + i, arrays, 100), s.nodes[10 + i])[0]
        assert upload is not None
        out.append(upload)
    return out


def test_fedgh_drops_a_flipped_prototype_and_trains_on_the_rest() -> None:
    """Node 13 flips its class-0 prototype: that prototype is dropped and recorded
    (node, class, reason), its class-1 prototype kept; the head equals the server step
    on exactly the kept (prototype, class) pairs, reply by reply."""
    rng = np.random.default_rng(0)
    protos = honest_protos(rng, 5)
    protos[3]["proto.0"] = -protos[3]["proto.0"]
    s = gh(5, "screen")
    start = {k: v.copy() for k, v in s.global_arrays.items()}
    s.aggregate_train(1, [reply(10 + i, p, 100) for i, p in enumerate(protos)])
    assert [(r, n) for r, n, _ in s.rejected] == [(1, 13)]
    why = s.rejected[0][2]
    assert why.startswith("class screening: class 0: cosine") and "1 of 2" in why
    assert s.diagnostics["prototypes-screened"] == 1
    pairs = [
        (p[k], int(k[-1])) for i, p in enumerate(protos) for k in p if (i, k) != (3, "proto.0")
    ]
    x = np.stack([v for v, _ in pairs])
    y = np.eye(C, dtype=np.float32)[[c for _, c in pairs]]
    want, _, _ = server_step(start, x, y, s, s.seed, 1)
    np.testing.assert_allclose(s.global_arrays[WEIGHT], want[WEIGHT], rtol=1e-6)
    np.testing.assert_allclose(s.global_arrays[BIAS], want[BIAS], rtol=1e-6)


def test_fedgh_median_trains_on_each_class_median_once_per_prototype() -> None:
    rng = np.random.default_rng(1)
    protos = honest_protos(rng, 4)
    s = gh(4, "median")
    start = {k: v.copy() for k, v in s.global_arrays.items()}
    s.aggregate_train(1, [reply(10 + i, p, 100) for i, p in enumerate(protos)])
    assert s.rejected == []
    medians = {k: np.median(np.stack([p[k] for p in protos]), axis=0) for k in protos[0]}
    x = np.stack([medians[k] for p in protos for k in p]).astype(np.float32)
    y = np.eye(C, dtype=np.float32)[[int(k[-1]) for p in protos for k in p]]
    want, _, _ = server_step(start, x, y, s, s.seed, 1)
    np.testing.assert_allclose(s.global_arrays[WEIGHT], want[WEIGHT], rtol=1e-5, atol=1e-7)


def test_fedgh_without_screening_trains_on_every_prototype() -> None:
    rng = np.random.default_rng(0)
    protos = honest_protos(rng, 5)
    protos[3]["proto.0"] = -protos[3]["proto.0"]
    s = gh(5, "none")
    assert s.prototypes == "none"  # the default
    s.aggregate_train(1, [reply(10 + i, p, 100) for i, p in enumerate(protos)])
    assert s.rejected == [] and "prototypes-screened" not in s.diagnostics


def test_fedtgp_drops_a_pushed_class_and_equals_training_without_it() -> None:
    """A prototype pushed to 20x its class's median norm is dropped; the generator
    then learns exactly what it learns from the uploads without it."""
    rng = np.random.default_rng(2)
    protos = honest_protos(rng, 5)
    push = rng.standard_normal(D).astype(np.float32)
    protos[1]["proto.1"] = protos[1]["proto.1"] + 20 * np.linalg.norm(protos[1]["proto.1"]) * (
        push / np.linalg.norm(push)
    )
    nodes = [node(10 + i, i, d=D, classes=C) for i in range(5)]
    cfg = {"robust.max-norm-ratio": 0, "fedtgp.server-epochs": 3}
    screened = strategy(FedTGP, nodes, **{"robust.prototypes": "screen", **cfg})
    plain = strategy(FedTGP, nodes, **cfg)
    for s in (screened, plain):
        s.global_arrays = s.init_global()
    screened.aggregate_train(1, [reply(10 + i, p, 100) for i, p in enumerate(protos)])
    assert [n for _, n, _ in screened.rejected] == [11]
    assert "class 1: " in screened.rejected[0][2]
    assert "the class's median norm" in screened.rejected[0][2]
    ups = uploads_of(plain, protos)  # type: ignore[arg-type]
    ups[1] = replace(ups[1], arrays={"proto.0": protos[1]["proto.0"]})
    want = plain.aggregate(1, ups)
    assert want is not None
    for k, v in want.items():
        np.testing.assert_allclose(screened.global_arrays[k], v, rtol=1e-6)
    assert screened.diagnostics["margin"] == plain.diagnostics["margin"]


def test_a_reply_with_every_prototype_dropped_is_out_of_aggregation() -> None:
    rng = np.random.default_rng(3)
    protos = honest_protos(rng, 5)
    protos[2] = {k: -v for k, v in protos[2].items()}
    s = gh(5, "screen")
    _, metrics = s.aggregate_train(1, [reply(10 + i, p, 100) for i, p in enumerate(protos)])
    assert metrics is not None and metrics["valid-replies"] == 4
    assert [n for _, n, _ in s.rejected] == [12] and "reply dropped" in s.rejected[0][2]


def test_mixture_outliers_against_the_soft_label_weighted_medians() -> None:
    """Three nodes hold class 0 only, three class 1 only, one mixes both half and
    half: the class medians by hand; a row flipped is caught by direction, one 30x
    longer by size."""
    a, b = np.array([1.0, 0.0, 0.5]), np.array([0.0, 1.0, 0.5])
    reps = {1: a, 2: a * 1.1, 3: a * 0.9, 4: b, 5: b * 1.2, 6: b * 0.8, 7: (a + b) / 2}
    labels = {n: np.array([[1.0, 0.0]]) for n in (1, 2, 3)}
    labels |= {n: np.array([[0.0, 1.0]]) for n in (4, 5, 6)} | {7: np.array([[0.5, 0.5]])}
    rows = {n: v[None] for n, v in reps.items()}
    assert mixture_outliers(rows, labels, 0.0, 10.0) == {}
    flipped = {**rows, 2: -rows[2]}
    out = mixture_outliers(flipped, labels, 0.0, 10.0)
    assert set(out) == {2} and "cosine" in out[2] and "median norms" not in out[2]
    # class 0's median norm over nodes 1, 2, 3 (weight 1; norms 0.9, 1, 1.1 |a|) and 7
    # (weight 1/2; 30 |(a + b) / 2|): the value at half the weight, |a| (class 1's:
    # |b| = |a|); node 7's expected norm 0.5 |a| + 0.5 |b|
    pushed = {**rows, 7: 30 * rows[7]}
    out = mixture_outliers(pushed, labels, 0.0, 10.0)
    want = 30 * np.linalg.norm((a + b) / 2) / np.linalg.norm(a)
    assert set(out) == {7} and f"norm {want:.1f}× its" in out[7] and "class medians" not in out[7]
    assert mixture_outliers(pushed, labels, 0.0, want + 0.1) == {}
    # sparse rows, each mostly on a coordinate of its own: their coordinate-wise median
    # is 0.1 everywhere, about a sixth of any row's length, while every row is as long
    # as the others: nobody is too long
    sparse = {n: (np.eye(3)[n - 1] + 0.1)[None] for n in (1, 2, 3)}
    one = {n: np.array([[1.0, 0.0]]) for n in (1, 2, 3)}
    assert mixture_outliers(sparse, one, -1.0, 1.5) == {}
    assert mixture_outliers({1: rows[1], 2: rows[2]}, labels, 0.0, 10.0) == {}


def test_fedre_drops_a_flipped_representation_and_equals_training_without_it() -> None:
    rng = np.random.default_rng(4)
    nodes = [node(10 + i, i, d=D, classes=C) for i in range(5)]
    centres = [rng.random(D) + 0.5 for _ in range(C)]
    arrays = []
    for i in range(5):
        w = np.array([[0.3 + 0.1 * i, 0.7 - 0.1 * i]], np.float32)
        rep = (w @ np.stack(centres)).astype(np.float32)
        arrays.append({"rep": rep, "soft-label": w})
    arrays[4] = {**arrays[4], "rep": -arrays[4]["rep"]}
    cfg = {"robust.max-norm-ratio": 0, "fedre.server-epochs": 3}
    screened = strategy(FedRE, nodes, **{"robust.prototypes": "screen", **cfg})
    plain = strategy(FedRE, nodes, **cfg)
    for s in (screened, plain):
        s.global_arrays = s.init_global()
    screened.aggregate_train(1, [reply(10 + i, a, 100) for i, a in enumerate(arrays)])
    assert [n for _, n, _ in screened.rejected] == [14]
    assert screened.rejected[0][2].startswith("class screening: row 0: cosine")
    want = plain.aggregate(1, uploads_of(plain, arrays[:4]))  # type: ignore[arg-type]
    assert want is not None
    np.testing.assert_allclose(screened.global_arrays[WEIGHT], want[WEIGHT], rtol=1e-6)


def test_the_option_is_checked() -> None:
    with pytest.raises(ConfigError, match="robust.prototypes"):
        parse_run_config({"robust.prototypes": "trimmed"})
    with pytest.raises(ValueError, match="robust.prototypes"):
        FedGH(prototypes="trimmed")
    cfg = parse_run_config({})
    assert cfg.robust.prototypes == "screen"


def test_fedara_screens_a_flip_on_the_tensors_every_tier_sends_whole() -> None:
    """Three rank-0.5 replies move the whole tensors (conv layers, biases) one way
    and leave their factors as served; the full-rank reply moves them the other way
    and its fc1 weight far off in a direction of its own. Its reconstructed update is
    nearly orthogonal to the round's median (cosine about -0.01, above the threshold
    -0.05); on the whole tensors it is -1 and it is rejected there."""
    from strategies.fedara import FedARA

    tiers: list[dict[str, Any]] = [
        {"rank-ratio": r, "layers": "fc1,fc2"} for r in (0.5,) * 3 + (1.0,)
    ]
    nodes = [node(100 + i, i, **extras) for i, extras in enumerate(tiers)]
    s = strategy(FedARA, nodes, **{"robust.min-cosine": -0.05, "robust.max-norm-ratio": 0})
    s.global_arrays = s.init_global()
    rng = np.random.default_rng(5)
    whole = [k for k in s.global_arrays if not k.endswith(("fc1.weight", "fc2.weight"))]
    step = {k: rng.standard_normal(s.global_arrays[k].shape) * 0.01 for k in whole}
    replies = []
    for n in nodes:
        served = s.payload(1, n)
        sign = -1.0 if n.extras["rank-ratio"] == 1.0 else 1.0
        up = {k: v.astype(np.float64) for k, v in served.items()}
        for k in whole:
            up[k] = up[k] + sign * step[k]
        if sign < 0:
            up["extractor.fc1.weight"] += 50.0 * rng.standard_normal(
                up["extractor.fc1.weight"].shape
            )
        replies.append(reply(n.node_id, {k: v.astype(np.float32) for k, v in up.items()}, 100))
    s.aggregate_train(1, replies)
    assert [n for _, n, _ in s.rejected] == [103]
    assert "the tensors every tier sends whole" in s.rejected[0][2]
    assert "cosine -1.00" in s.rejected[0][2]
