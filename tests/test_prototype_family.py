"""FedRE, FedProto and FedGH: entanglement math, strategies, client behaviour."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, RecordDict

from client_app.app import app as client_app
from client_app.base import open_run
from client_app.prototypes import entangled, prototypes
from common import methods
from common.records import to_numpy, to_record
from models.entangle import entangle_prototypes, random_weights, soft_cross_entropy
from server_app.inprocess import client_context, run_inprocess
from strategies.fedgh import FedGH
from strategies.fedproto import FedProto
from strategies.fedre import FedRE
from strategies.testing import node, reply, strategy

# ----------------------------------------------------------------- entanglement math


def test_weights_are_a_distribution_on_present_classes_only() -> None:
    present = torch.tensor([True, False, True, True, False, False, True, False, False, True])
    for seed in range(20):
        w = random_weights(present, torch.Generator().manual_seed(seed))
        assert (w >= 0).all()
        assert abs(float(w.sum()) - 1.0) < 1e-12
        assert (w[~present] == 0).all() and (w[present] > 0).all()


def test_rep_is_the_weighted_sum_and_soft_label_the_weights() -> None:
    rng = np.random.default_rng(3)
    protos = rng.normal(size=(10, 7)).astype(np.float32)
    present = torch.tensor([c % 3 != 0 for c in range(10)])
    protos[~present.numpy()] = 1e6  # absent rows must not leak in
    rep, soft = entangle_prototypes(
        torch.from_numpy(protos), present, "rap", torch.Generator().manual_seed(5)
    )
    w = random_weights(present, torch.Generator().manual_seed(5)).numpy()
    np.testing.assert_allclose(soft.numpy(), w, rtol=1e-6)
    want = (w[:, None] * np.where(present.numpy()[:, None], protos, 0)).sum(0)
    np.testing.assert_allclose(rep.numpy(), want, rtol=1e-5, atol=1e-6)


def test_vap_uses_equal_weights() -> None:
    present = torch.tensor([True, True, False, True])
    _, soft = entangle_prototypes(torch.ones(4, 3), present, "vap", torch.Generator())
    np.testing.assert_allclose(soft.numpy(), [1 / 3, 1 / 3, 0, 1 / 3])


# ----------------------------------------------------------------- client side


def _run(tmp_path: Path, server_round: int, pid: int = 0, **cfg):  # type: ignore[no-untyped-def]
    return open_run(
        client_context(tmp_path, "fedre", pid=pid, **cfg),
        server_round,
        methods.get("fedre").client_hook(),
    )


def test_client_rep_matches_its_prototypes_and_seed(tmp_path: Path) -> None:
    run = _run(tmp_path, server_round=4)
    reps, softs = entangled(run)
    assert reps.shape == (1, 500) and softs.shape == (1, 10)
    rep, soft = reps[0], softs[0]
    means, present = prototypes(run)
    w = random_weights(present, run.generator(purpose=1)).float()
    np.testing.assert_allclose(soft.numpy(), w.numpy(), rtol=1e-6)
    np.testing.assert_allclose(
        rep.numpy(), (w[:, None] * means).sum(0).numpy(), rtol=1e-4, atol=1e-5
    )
    assert set(np.flatnonzero(soft.numpy())) == set(np.flatnonzero(present.numpy()))


def test_same_seed_round_node_same_weights_other_round_differs(tmp_path: Path) -> None:
    _, a = entangled(_run(tmp_path, server_round=2))
    _, b = entangled(_run(tmp_path, server_round=2))
    _, c = entangled(_run(tmp_path, server_round=3))
    _, d = entangled(_run(tmp_path, server_round=2, pid=1))
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)
    assert not torch.allclose(a[a > 0].sort().values[:2], d[d > 0].sort().values[:2])


def test_client_evaluates_with_the_broadcast_head(tmp_path: Path) -> None:
    ctx = client_context(tmp_path, "fedre", pid=1)
    run = open_run(ctx, 1, methods.get("fedre").client_hook())
    weight = np.zeros((10, 500), np.float32)
    bias = np.zeros(10, np.float32)
    bias[3] = 100.0  # this head always answers class 3
    msg = Message(
        RecordDict(
            {
                "arrays": to_record({"head.weight": weight, "head.bias": bias}),
                "config": ConfigRecord({"server-round": 1}),
            }
        ),
        dst_node_id=ctx.node_id,
        message_type="evaluate.fedre",
    )
    out = client_app(msg, ctx)
    y = run.data.y_test.numpy()
    assert out.content["metrics"]["correct"] == int((y == 3).sum())
    assert out.content["metrics"]["num-examples"] == len(y)


# ----------------------------------------------------------------- strategies


def _fedre(num: int = 4) -> FedRE:
    s = strategy(FedRE, [node(10 + i, i) for i in range(num)])
    s.global_arrays = s.init_global()
    return s


def _pair(seed: int, n: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = rng.random((n, 10))
    return {
        "rep": rng.normal(size=(n, 500)).astype(np.float32),
        "soft-label": (w / w.sum(1, keepdims=True)).astype(np.float32),
    }


def test_server_step_lowers_the_soft_label_loss_on_received_pairs() -> None:
    s = _fedre()
    pairs = [_pair(i) for i in range(4)]
    before = s.global_arrays
    arrays, _ = s.aggregate_train(1, [reply(10 + i, p, 100) for i, p in enumerate(pairs)])
    x = torch.from_numpy(np.concatenate([p["rep"] for p in pairs]))
    y = torch.from_numpy(np.concatenate([p["soft-label"] for p in pairs]))

    def loss(h: dict) -> float:
        logits = x @ torch.from_numpy(h["head.weight"]).T + torch.from_numpy(h["head.bias"])
        return float(soft_cross_entropy(logits, y))

    after = to_numpy(arrays)
    assert loss(after) < loss(before)
    diag = s.diagnostics
    assert diag["server-loss-after"] < diag["server-loss-before"]
    assert diag["server-loss-before"] == pytest.approx(loss(before), rel=1e-5)
    assert diag["server-loss-after"] == pytest.approx(loss(after), rel=1e-5)
    change = np.linalg.norm(
        np.concatenate([(after[k] - before[k]).ravel() for k in ("head.weight", "head.bias")])
    ) / np.linalg.norm(np.concatenate([before[k].ravel() for k in ("head.weight", "head.bias")]))
    assert diag["head-change"] == pytest.approx(change, rel=1e-5)
    ent = -(y.double() * torch.log(y.double())).sum(1).mean()
    assert diag["label-entropy"] == pytest.approx(float(ent), rel=1e-9)
    assert diag["server-loss-after"] >= diag["label-entropy"]


def test_label_entropy_closed_forms() -> None:
    from strategies.fedre import label_entropy

    assert label_entropy(np.eye(10)) == 0.0
    assert label_entropy(np.full((3, 10), 0.1)) == pytest.approx(np.log(10), rel=1e-12)
    assert label_entropy(np.array([[0.5, 0.5, 0.0]])) == pytest.approx(np.log(2), rel=1e-12)


@pytest.mark.parametrize("poison", ["nan", "shape", "not-a-distribution", "extra-key"])
def test_fedre_poisoned_reply_is_ignored(poison: str) -> None:
    good = [_pair(i) for i in range(3)]
    ref = _fedre()
    want, _ = ref.aggregate_train(1, [reply(10 + i, p, 100) for i, p in enumerate(good)])
    bad = _pair(9)
    if poison == "nan":
        bad["rep"][0, 0] = np.nan
    elif poison == "shape":
        bad["rep"] = bad["rep"][:, :10]
    elif poison == "not-a-distribution":
        bad["soft-label"] = bad["soft-label"] * 3
    else:
        bad["extra"] = bad["rep"]
    s = _fedre()
    got, _ = s.aggregate_train(
        1, [reply(10 + i, p, 100) for i, p in enumerate(good)] + [reply(13, bad, 100)]
    )
    for k in want:
        np.testing.assert_array_equal(got[k].numpy(), want[k].numpy())
    assert [n for _, n, _ in s.rejected] == [13]


def test_fedproto_per_class_mean_with_disjoint_class_sets() -> None:
    a = node(10, 0, counts=(5, 5, 0, 0))
    b = node(11, 1, counts=(0, 0, 5, 5))
    c = node(12, 2, counts=(0, 5, 5, 0))
    s = strategy(FedProto, [a, b, c])
    rng = np.random.default_rng(0)
    up = {
        n.node_id: {
            f"proto.{k}": rng.normal(size=500).astype(np.float32)
            for k, cnt in enumerate(n.class_counts)
            if cnt
        }
        for n in (a, b, c)
    }
    arrays, _ = s.aggregate_train(1, [reply(nid, u, 100) for nid, u in up.items()])
    got = to_numpy(arrays)
    assert sorted(got) == ["proto.0", "proto.1", "proto.2", "proto.3"]
    np.testing.assert_allclose(got["proto.0"], up[10]["proto.0"], rtol=1e-6)
    np.testing.assert_allclose(
        got["proto.1"],
        (up[10]["proto.1"] + up[12]["proto.1"]) / 2,
        rtol=1e-5,
        atol=1e-6,
    )
    np.testing.assert_allclose(
        got["proto.2"],
        (up[11]["proto.2"] + up[12]["proto.2"]) / 2,
        rtol=1e-5,
        atol=1e-6,
    )
    np.testing.assert_allclose(got["proto.3"], up[11]["proto.3"], rtol=1e-6)


def test_fedproto_rejects_prototypes_of_classes_a_client_lacks() -> None:
    a = node(10, 0, counts=(5, 5, 0, 0))
    s = strategy(FedProto, [a])
    z = np.zeros(500, np.float32)
    s.aggregate_train(1, [reply(10, {"proto.0": z, "proto.1": z, "proto.2": z}, 100)])
    assert s.rejected and "wrong keys" in s.rejected[0][2]


def test_fedgh_trains_the_head_on_prototypes() -> None:
    nodes = [node(10, 0, counts=(5, 5, 0)), node(11, 1, counts=(0, 5, 5))]
    nodes = [n.__class__(**{**n.__dict__, "num_classes": 3}) for n in nodes]
    s = strategy(FedGH, nodes)
    s.global_arrays = s.init_global()
    rng = np.random.default_rng(1)
    ups = {
        10: {"proto.0": rng.normal(size=500), "proto.1": rng.normal(size=500)},
        11: {"proto.1": rng.normal(size=500), "proto.2": rng.normal(size=500)},
    }
    ups = {k: {kk: vv.astype(np.float32) for kk, vv in v.items()} for k, v in ups.items()}
    before = s.global_arrays
    arrays, _ = s.aggregate_train(
        1,
        [reply(k, v, 100) for k, v in ups.items()]
        + [reply(11, {"proto.0": ups[10]["proto.0"]}, 100)],
    )
    after = to_numpy(arrays)
    x = torch.from_numpy(
        np.stack(
            [
                ups[10]["proto.0"],
                ups[10]["proto.1"],
                ups[11]["proto.1"],
                ups[11]["proto.2"],
            ]
        )
    )
    y = torch.tensor([0, 1, 1, 2])

    def ce(h: dict) -> float:
        logits = x @ torch.from_numpy(h["head.weight"]).T + torch.from_numpy(h["head.bias"])
        return float(torch.nn.functional.cross_entropy(logits, y))

    assert ce(after) < ce(before)
    assert [n for _, n, _ in s.rejected] == [11]  # the second reply lacks its classes


# ----------------------------------------------------------------- in-process rounds


@pytest.mark.parametrize("algorithm", ["fedre", "fedproto", "fedgh"])
def test_two_rounds(tmp_path: Path, algorithm: str) -> None:
    res, _ = run_inprocess(tmp_path, algorithm=algorithm)
    assert [r["round"] for r in res["rounds"]] == [1, 2]
    assert all(r["valid-replies"] == 3 for r in res["rounds"])
    assert all(0 <= r["accuracy"] <= 1 for r in res["rounds"])


@pytest.mark.parametrize("reps", [1, 3])
def test_fedre_uploads_exactly_n_times_d_plus_c_floats(tmp_path: Path, reps: int) -> None:
    res, _ = run_inprocess(tmp_path, algorithm="fedre", **{"fedre.reps-per-client": reps})
    assert all(r["bytes-up-per-client"] == reps * (500 + 10) * 4 for r in res["rounds"])
    assert all(r["valid-replies"] == 3 for r in res["rounds"])


def test_fedre_vap_uploads_the_plain_mean_of_the_present_prototypes(tmp_path: Path) -> None:
    run = _run(tmp_path, server_round=2, **{"fedre.mix": "vap"})
    reps, softs = entangled(run)
    means, present = prototypes(run)
    equal = present.float() / present.float().sum()
    np.testing.assert_allclose(softs[0].numpy(), equal.numpy(), rtol=1e-6)
    np.testing.assert_allclose(
        reps[0].numpy(), means[present].mean(0).numpy(), rtol=1e-4, atol=1e-5
    )


def test_fedre_rsr_entangles_raw_samples_with_random_weights(tmp_path: Path) -> None:
    run = _run(tmp_path, server_round=2, **{"fedre.mix": "rsr"})
    reps, softs = entangled(run)
    y = run.data.y_train
    w = random_weights(torch.ones(len(y), dtype=torch.bool), run.generator(purpose=1))
    with torch.no_grad():
        run.model.eval()
        features = run.model.features(run.data.x_train).double()
    np.testing.assert_allclose(reps[0].numpy(), (w @ features).numpy(), rtol=1e-4, atol=1e-5)
    by_class = torch.zeros(run.data.num_classes, dtype=torch.float64).index_add_(0, y, w)
    np.testing.assert_allclose(softs[0].numpy(), by_class.numpy(), rtol=1e-5, atol=1e-7)
    # not the prototype mix: RAP's soft label has one weight per present class
    rap = entangled(_run(tmp_path, server_round=2))[1][0]
    assert not np.allclose(rap.numpy(), softs[0].numpy())


@pytest.mark.slow  # two whole runs: the full tier
@pytest.mark.parametrize("mix", ["vap", "rsr"])
def test_fedre_ablation_variants_run(tmp_path: Path, mix: str) -> None:
    res, _ = run_inprocess(tmp_path, algorithm="fedre", **{"fedre.mix": mix})
    assert all(r["valid-replies"] == 3 for r in res["rounds"])
    # the server trained its head on other pairs than the default (RAP) run's
    rap, _ = run_inprocess(tmp_path / "rap", algorithm="fedre")
    for mixed, default in zip(res["rounds"], rap["rounds"], strict=True):
        a, b = mixed["server-diagnostics"], default["server-diagnostics"]
        assert a["server-loss-before"] != b["server-loss-before"]
        assert a["label-entropy"] != b["label-entropy"]


def test_fedproto_nearest_prototype_inference(tmp_path: Path) -> None:
    """Better than each client predicting its majority class, and not the head's
    predictions under another name."""
    res, _ = run_inprocess(tmp_path, algorithm="fedproto", **{"fedproto.infer": "proto"})
    assert res["rounds"][-1]["accuracy"] > res["summary"]["accuracy-prior"]
    head, _ = run_inprocess(tmp_path / "head", algorithm="fedproto")
    assert res["rounds"][-1]["accuracy"] != head["rounds"][-1]["accuracy"]
