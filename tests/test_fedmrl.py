"""fedmrl: the nested forward and the two-head loss against closed forms on a tiny model,
the server's mean against numpy (crafted replies), what a client uploads, a projector
that persists across rounds, and two rounds in process."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord
from torch import nn

from client_app.app import train as train_message
from client_app.base import open_run
from common import methods
from common.config import ConfigError
from common.messages import SHARED
from common.records import to_numpy, to_record
from models.matryoshka import MatryoshkaNet
from models.nets import HetNet
from models.train import SGDSettings, train
from server_app.inprocess import client_context, run_inprocess
from strategies.fedmrl import FedMRL
from strategies.testing import node, reply, sized, strategy

D, S, C = 6, 2, 3


def tiny(seed: int = 0) -> MatryoshkaNet:
    """Local extractor Linear(6, 6) (d = 6); shared: Linear(6, 4) pooled to s = 2;
    projector Linear(8, 6); heads Linear(6, 3) and Linear(2, 3)."""
    torch.manual_seed(seed)
    local = HetNet(nn.Linear(D, D), D, C)
    shared = HetNet(nn.Linear(D, 4), S, C)
    return MatryoshkaNet(local, shared, nn.Linear(S + D, D))


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().numpy()


def _closed_form(model: MatryoshkaNet, x: torch.Tensor) -> tuple[np.ndarray, ...]:
    """``r``, local and shared logits in numpy from the weights."""
    xs = x.double().numpy()
    own, theirs = model.extractor, model.shared.extractor
    assert isinstance(own, nn.Linear) and isinstance(theirs, nn.Linear)
    g = xs @ _np(theirs.weight).T + _np(theirs.bias)
    g = g.reshape(len(xs), S, 2).mean(2)  # RM: adaptive average pooling 4 → 2
    f = xs @ _np(own.weight).T + _np(own.bias)
    r = np.concatenate([g, f], 1) @ _np(model.projector.weight).T + _np(model.projector.bias)
    local = r @ _np(model.head.weight).T + _np(model.head.bias)
    shared = r[:, :S] @ _np(model.shared.head.weight).T + _np(model.shared.head.bias)
    return r, local, shared


def _ce(logits: np.ndarray, y: np.ndarray) -> float:
    m = logits.max(1, keepdims=True)
    log_p = logits - m - np.log(np.exp(logits - m).sum(1, keepdims=True))
    return float(-log_p[np.arange(len(y)), y].mean())


def test_the_shared_head_reads_exactly_the_first_s_coordinates_of_the_fused_representation() -> (
    None
):
    model = tiny()
    x = torch.randn(5, D, generator=torch.Generator().manual_seed(1))
    r = model.features(x)
    want_r, want_local, want_shared = _closed_form(model, x)
    assert r.shape == (5, D) and model.projector.weight.shape == (D, S + D)
    np.testing.assert_allclose(_np(r), want_r, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_np(model(x)), want_local, rtol=1e-5, atol=1e-6)  # prediction
    np.testing.assert_allclose(_np(model.shared_logits(r)), want_shared, rtol=1e-5, atol=1e-6)
    # the shared head ignores the coordinates past s; the local head does not
    moved = r.clone()
    moved[:, S:] += 1.0
    torch.testing.assert_close(model.shared_logits(moved), model.shared_logits(r))
    assert not torch.allclose(model.head(moved), model.head(r))
    assert sorted({k.split(".")[0] for k in model.state_dict()}) == [
        "extractor", "head", "projector", "shared",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="must fit in d"):
        MatryoshkaNet(HetNet(nn.Flatten(1), 2, C), HetNet(nn.Flatten(1), 3, C), nn.Linear(5, 2))


def test_the_training_loss_is_the_sum_of_the_two_cross_entropies_and_trains_every_part() -> None:
    model = tiny()
    hook = methods.get("fedmrl").client_hook()
    loss = hook.extra_loss(SimpleNamespace(model=model))  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, D, generator=g), torch.randint(0, C, (8,), generator=g)
    _, local, shared = _closed_form(model, x)
    want = _ce(local, y.numpy()) + _ce(shared, y.numpy())
    # lr 0: one full batch, the loop's reported loss is the objective itself
    frozen = train(model, x, y, SGDSettings(batch_size=8, lr=0.0), g, extra_loss=loss)
    assert frozen.loss == pytest.approx(want, rel=1e-5)
    # one step: every part (both extractors, both heads, the projector) moves by the
    # gradient of CE(h_k(r)) + CE(h(r[:, :s])), the shared head's term included
    twin = copy.deepcopy(model)
    r = twin.projector(torch.cat((twin.shared.features(x), twin.extractor(x)), 1))
    total = F.cross_entropy(twin.head(r), y) + F.cross_entropy(twin.shared.head(r[:, :S]), y)
    total.backward()
    train(model, x, y, SGDSettings(batch_size=8, lr=0.1), g, extra_loss=loss)
    stepped = dict(model.named_parameters())
    for key, p in twin.named_parameters():
        assert p.grad is not None and bool(p.grad.abs().sum() > 0), key
        torch.testing.assert_close(stepped[key], p - 0.1 * p.grad, rtol=1e-5, atol=1e-7)


def test_the_global_shared_model_is_the_sample_weighted_mean_and_robust_rules_apply() -> None:
    nodes = [node(10 + i, i) for i in range(3)]
    s = sized(strategy(FedMRL, nodes), {10: 10, 11: 30, 12: 60})
    s.global_arrays = s.init_global()
    assert s.global_arrays["shared.head.weight"].shape == (10, 128)
    assert all(k.startswith(SHARED) for k in s.global_arrays)
    rng = np.random.default_rng(0)
    ups = [
        {k: rng.normal(size=v.shape).astype(np.float32) for k, v in s.global_arrays.items()}
        for _ in nodes
    ]
    replies = [
        reply(n.node_id, u, (10, 30, 60)[i])
        for i, (n, u) in enumerate(zip(nodes, ups, strict=True))
    ]
    arrays, metrics = s.aggregate_train(1, replies)
    assert arrays is not None and metrics is not None and metrics["valid-replies"] == 3
    got = to_numpy(arrays)
    assert list(got) == list(s.global_arrays)
    for k in got:
        want = (10 * ups[0][k] + 30 * ups[1][k] + 60 * ups[2][k]) / 100
        np.testing.assert_allclose(got[k], want, rtol=1e-5, atol=1e-6)
    # robust.aggregate = median (equal shares: numpy's median)
    m = sized(strategy(FedMRL, nodes, **{"robust.aggregate": "median"}), {10: 20, 11: 20, 12: 20})
    m.global_arrays = s.global_arrays
    arrays, _ = m.aggregate_train(
        1, [reply(n.node_id, u, 20) for n, u in zip(nodes, ups, strict=True)]
    )
    assert arrays is not None
    for k, v in to_numpy(arrays).items():
        np.testing.assert_array_equal(v, np.median([u[k] for u in ups], axis=0))


def test_malformed_or_non_finite_uploads_are_refused_and_too_few_keep_the_model() -> None:
    nodes = [node(10 + i, i) for i in range(4)]
    s = sized(strategy(FedMRL, nodes), {10: 20, 11: 20, 12: 20, 13: 20})
    s.global_arrays = before = s.init_global()
    s.awaiting = {10, 11, 12, 13}
    good = {k: v + 1 for k, v in before.items()}
    nan = {k: np.full(v.shape, np.nan, np.float32) for k, v in before.items()}
    projector = {**good, "projector.weight": np.zeros((500, 628), np.float32)}  # personal
    wide = {k: np.zeros((*v.shape[:-1], v.shape[-1] + 1), np.float32) for k, v in good.items()}
    bad = [reply(11, nan, 20), reply(12, projector, 20), reply(13, wide, 20)]
    arrays, _ = s.aggregate_train(1, [reply(10, good, 20), *bad])
    # one valid reply of four is below shares_model's quorum (half): the model stays
    assert arrays is None and s.global_arrays is before
    assert sorted(nid for _, nid, _ in s.rejected) == [11, 12, 13]


def test_a_representation_wider_than_d_is_refused(tmp_path: Path) -> None:
    s = strategy(FedMRL, [node(10, 0, d=64)], **{"fedmrl.rep-dim": 65})
    with pytest.raises(ConfigError, match="fedmrl.rep-dim = 65 must be at most d = 64"):
        s.init_global()
    wide: dict[str, Any] = {"model.feature-dim": 64, "fedmrl.rep-dim": 65}
    ctx = client_context(tmp_path, "fedmrl", **wide)
    with pytest.raises(ValueError, match="fedmrl.rep-dim = 65 must be at most d = 64"):
        open_run(ctx, 1, methods.get("fedmrl").client_hook())


def test_the_upload_is_the_shared_model_in_the_keys_and_shapes_the_server_sent(
    tmp_path: Path,
) -> None:
    hook = methods.get("fedmrl").client_hook()
    run = open_run(client_context(tmp_path, "fedmrl", pid=1), 1, hook)
    assert isinstance(run.model, MatryoshkaNet)
    assert run.node.arch == "cnn-2" and run.model.shared.arch == "cnn-5"  # the smallest
    s = strategy(FedMRL, [node(10, 1, arch="cnn-2")])
    sent = s.init_global()
    run.received = {k: torch.from_numpy(v) for k, v in sent.items()}
    hook.install(run, run.received)
    hook.train(run)
    up = hook.upload(run)
    assert {k: tuple(v.shape) for k, v in up.items()} == {k: v.shape for k, v in sent.items()}
    assert not any(k.startswith(("projector.", "extractor.", "head.")) for k in up)
    assert all(not torch.equal(up[k], run.received[k]) for k in up if k.endswith("weight"))


@pytest.mark.parametrize("on_disk", [False, True], ids=["context-state", "state-dir"])
def test_the_trained_projector_is_where_the_next_round_starts(
    tmp_path: Path, on_disk: bool
) -> None:
    """Round 1 trains the projector; round 2 opens the node with that projector (and its
    own trained extractor and head), installs the server's shared model over its copy,
    and leaves the projector as round 1 left it."""
    hook = methods.get("fedmrl").client_hook()
    ctx = client_context(tmp_path, "fedmrl", pid=0)
    fresh = open_run(ctx, 1, hook).model.state_dict()
    sent = {k: v.clone() for k, v in hook.shared_state(open_run(ctx, 1, hook)).items()}
    clients = {"clients-dir": str(tmp_path / "clients")} if on_disk else {}
    reply1 = train_message(hook, ConfigRecord({"server-round": 1, **clients}), to_record(sent), ctx)
    trained = to_numpy(reply1.array_records["arrays"])
    second = open_run(ctx, 2, hook, str(tmp_path / "clients") if on_disk else "")
    assert isinstance(second.model, MatryoshkaNet)
    kept = {k: v.clone() for k, v in second.model.state_dict().items()}
    for key in ("projector.weight", "projector.bias", "head.weight"):
        assert not torch.equal(kept[key], fresh[key]), key  # trained, not a fresh init
    global2 = {k: torch.full_like(v, 0.01) for k, v in sent.items()}
    projector = second.model.projector.weight.detach().clone()
    hook.install(second, global2)
    torch.testing.assert_close(second.model.projector.weight, projector, rtol=0, atol=0)
    for key, value in global2.items():
        torch.testing.assert_close(second.model.state_dict()[key], value, rtol=0, atol=0)
    # what round 1 uploaded is the shared model round 2 found in its personal state
    for key, uploaded in trained.items():
        np.testing.assert_array_equal(kept[key].numpy(), uploaded)


@pytest.mark.parametrize("predict_with", ["sent", "trained"])
def test_prediction_uses_the_shared_model_predict_with_names(
    tmp_path: Path, predict_with: str
) -> None:
    """An evaluation predicts with the server's shared model (``sent``) or the node's own
    trained copy (``trained``), keeps that model for export, and reports the other as
    accuracy-without-shared and each head's accuracy alone as diagnostics."""
    hook = methods.get("fedmrl").client_hook()
    ctx = client_context(
        tmp_path,
        "fedmrl",
        pid=0,
        **{"fedmrl.predict-with": predict_with, "fedmrl.predict-head": "own"},
    )
    sent = {k: v.clone() for k, v in hook.shared_state(open_run(ctx, 1, hook)).items()}
    train_message(hook, ConfigRecord({"server-round": 1}), to_record(sent), ctx)
    run = open_run(ctx, 1, hook, training=False)
    own = {k: v.clone() for k, v in hook.shared_state(run).items()}
    assert not all(torch.equal(own[k], sent[k]) for k in sent)  # trained in round 1
    server = {k: v + 0.05 * torch.randn_like(v) for k, v in sent.items()}
    run.received = dict(server)
    hook.install(run, run.received)
    x, y = run.data.x_test, run.data.y_test
    with torch.no_grad():  # the own head calls the test split's rarest class: heads differ
        run.model.head.bias[int(torch.bincount(y).argmin())] += 100.0

    def scored_with(shared: dict[str, torch.Tensor]) -> tuple[float, float, float]:
        """The own head's summed CE loss, the shared head's and the own head's accuracy."""
        model = copy.deepcopy(run.model)
        model.load_state_dict(shared, strict=False)
        model.eval()
        with torch.no_grad():
            reps = model.features(x)
            own_logits = model.head(reps)
            loss = float(F.cross_entropy(own_logits, y, reduction="sum"))
            shared_head = float((model.shared_logits(reps).argmax(1) == y).float().mean())
            own_head = float((own_logits.argmax(1) == y).float().mean())
        return loss, shared_head, own_head

    predicted, other = (server, own) if predict_with == "sent" else (own, server)
    assert abs(scored_with(predicted)[0] - scored_with(other)[0]) > 1e-3  # they differ
    stats = hook.evaluate(run, x, y)
    want, want_shared_head, want_own_head = scored_with(predicted)
    assert stats.loss_sum == pytest.approx(want, rel=1e-5)
    assert run.metrics["shared-head-accuracy"] == pytest.approx(want_shared_head, abs=1e-6)
    assert run.metrics["own-head-accuracy"] == pytest.approx(want_own_head, abs=1e-6)
    assert want_own_head != want_shared_head
    without = hook.evaluate_without_shared(run, x, y)
    assert without is not None
    assert without.loss_sum == pytest.approx(scored_with(other)[0], rel=1e-5)
    for key, value in predicted.items():  # what stays installed (kept for export)
        torch.testing.assert_close(run.model.state_dict()[key], value, rtol=0, atol=0)


@pytest.mark.parametrize("head", ["own", "shared", "both"])
def test_prediction_uses_the_heads_predict_head_names_and_the_export_the_same(
    tmp_path: Path, head: str
) -> None:
    """``fedmrl.predict-head``: own h_k(r), shared h(r[:, :s]) or their sum; the
    evaluation's loss is that of those logits and the exported module gives them."""
    from client_app.export import predictor

    hook = methods.get("fedmrl").client_hook()
    ctx = client_context(tmp_path, "fedmrl", pid=0, **{"fedmrl.predict-head": head})
    sent = {k: v.clone() for k, v in hook.shared_state(open_run(ctx, 1, hook)).items()}
    train_message(hook, ConfigRecord({"server-round": 1}), to_record(sent), ctx)
    run = open_run(ctx, 1, hook, training=False)
    run.received = dict(sent)
    hook.install(run, run.received)
    model, x, y = run.model, run.data.x_test, run.data.y_test
    assert isinstance(model, MatryoshkaNet)
    model.eval()
    with torch.no_grad():
        reps = model.features(x)
        own, shared = model.head(reps), model.shared_logits(reps)
        want = {"own": own, "shared": shared, "both": own + shared}[head]
        exported = predictor(hook, run)(x)
    stats = hook.evaluate(run, x, y)
    assert stats.loss_sum == pytest.approx(
        float(F.cross_entropy(want, y, reduction="sum")), rel=1e-5
    )
    assert stats.correct == int((want.argmax(1) == y).sum())
    torch.testing.assert_close(exported, want)


@pytest.mark.slow  # the full tier also runs fedmrl end to end (test_eval_mode, test_reference)
def test_two_rounds_in_process_learn(tmp_path: Path) -> None:
    res, _ = run_inprocess(tmp_path, algorithm="fedmrl")  # 3 nodes, synthetic data
    assert [r["round"] for r in res["rounds"]] == [1, 2]
    for row in res["rounds"]:
        assert sorted(row["client-train"]) == ["0", "1", "2"] and row["valid-replies"] == 3
    assert res["rounds"][-1]["accuracy"] > 0.2
