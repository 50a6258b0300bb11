"""fedl2g / fedl2gl (FedL2G-f and -l): the meta step's gradient with respect to the
guide table against the closed form of a linear model and against finite differences,
the server's rule against numpy (crafted replies), the replies it refuses, the client's
held-out quiz set, warm-up rounds and upload, and two rounds in process."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor, nn

import client_app.fedl2g as fedl2g_client
from client_app.base import ClientRun, open_run
from common import methods
from common.messages import GUIDE, GUIDE_GRAD
from common.records import to_numpy
from models.guide import Space, meta_gradient, quiz_direction, study_rows
from server_app.inprocess import client_context, run_inprocess
from strategies.fedl2g import FedL2G
from strategies.fedl2gl import FedL2GL
from strategies.testing import node, reply, sized, strategy


class Linear(nn.Module):
    """reps = A x, logits = B reps + b: a HetNet-like model with a closed form."""

    def __init__(self, a: Tensor, b: Tensor, bias: Tensor) -> None:
        super().__init__()
        self.a, self.b, self.bias = nn.Parameter(a), nn.Parameter(b), nn.Parameter(bias)

    def features(self, x: Tensor) -> Tensor:
        return x @ self.a.T

    def classify(self, reps: Tensor) -> Tensor:
        return reps @ self.b.T + self.bias


class BatchNet(nn.Module):
    """A ReLU network with BatchNorm: features = body, classify = head."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU())
        self.head = nn.Linear(6, 3)

    def features(self, x: Tensor) -> Tensor:
        return self.body(x)  # type: ignore[no-any-return]

    def classify(self, reps: Tensor) -> Tensor:
        return self.head(reps)  # type: ignore[no-any-return]


def _softmax_error(z: np.ndarray, y: np.ndarray) -> np.ndarray:
    """∂ mean CE / ∂ logits: (softmax(z) − onehot(y)) / n."""
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(y)), y] -= 1
    return p / len(y)


def _closed_form(a, b, bias, g, xs, ys, xq, yq, lr, space):  # type: ignore[no-untyped-def]
    """∂L_q/∂G of the linear model by hand (numpy, float64): the study step's
    gradients, the quiz gradient V at θ', and row c = 2·lr/(B·w) Σ_{y_b = c} J_b V."""
    n, w = len(ys), g.shape[1]
    r = xs @ a.T
    z = r @ b.T + bias
    e = _softmax_error(z, ys)
    out = r if space == "feature" else z
    m = 2.0 / (n * w) * (out - g[ys])  # ∂MSE/∂out
    if space == "feature":
        da, db, dbias = (e @ b + m).T @ xs, e.T @ r, e.sum(0)
    else:
        e2 = e + m
        da, db, dbias = (e2 @ b).T @ xs, e2.T @ r, e2.sum(0)
    a1, b1, bias1 = a - lr * da, b - lr * db, bias - lr * dbias
    rq = xq @ a1.T
    eq = _softmax_error(rq @ b1.T + bias1, yq)
    va, vb, vbias = (eq @ b1).T @ xq, eq.T @ rq, eq.sum(0)
    jv = xs @ va.T if space == "feature" else xs @ va.T @ b.T + r @ vb.T + vbias
    want = np.zeros_like(g)
    np.add.at(want, ys, 2.0 * lr / (n * w) * jv)
    return want


@pytest.mark.parametrize("space", ["feature", "logit"])
def test_the_meta_gradient_is_the_closed_form_of_a_linear_model(space: Space) -> None:
    rng = np.random.default_rng(0)
    k, d, c = 4, 3, 3
    a, b, bias = rng.normal(size=(d, k)), rng.normal(size=(c, d)), rng.normal(size=c)
    g = rng.normal(size=(c, d if space == "feature" else c))
    xs, ys = rng.normal(size=(5, k)), np.array([0, 2, 2, 0, 2])  # class 1 not studied
    xq, yq = rng.normal(size=(4, k)), np.array([1, 0, 2, 1])
    model = Linear(*(torch.from_numpy(v) for v in (a, b, bias)))
    t = torch.from_numpy
    got, quiz = meta_gradient(model, t(g), [(t(xs), t(ys))], [(t(xq), t(yq))], 0.1, space)
    want = _closed_form(a, b, bias, g, xs, ys, xq, yq, 0.1, space)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-10, atol=1e-14)
    assert not got[1].any() and got[0].abs().sum() > 0  # only the studied classes' rows
    assert quiz > 0
    np.testing.assert_array_equal(model.a.detach().numpy(), a)  # the model is untouched


def test_the_meta_gradient_matches_finite_differences_through_batch_norm() -> None:
    """A ReLU network with BatchNorm, two study and two quiz batches: central
    differences of the quiz loss in float64; running statistics stay as they were."""

    torch.manual_seed(0)
    net = BatchNet().double()
    gen = torch.Generator().manual_seed(1)
    table = torch.randn(3, 6, generator=gen, dtype=torch.float64)

    def batch(n: int) -> tuple[Tensor, Tensor]:
        x = torch.randn(n, 4, generator=gen, dtype=torch.float64)
        return x, torch.randint(0, 3, (n,), generator=gen)

    study, quiz = [batch(5), batch(5)], [batch(4), batch(4)]
    stats = {k: v.clone() for k, v in net.state_dict().items()}
    got, _ = meta_gradient(net, table, study, quiz, 0.05, "feature")
    assert all(torch.equal(stats[k], v) for k, v in net.state_dict().items())
    for c, j in [(0, 0), (1, 3), (2, 5)]:
        step = torch.zeros_like(table)
        step[c, j] = 1e-6
        up = meta_gradient(net, table + step, study, quiz, 0.05, "feature")[1]
        down = meta_gradient(net, table - step, study, quiz, 0.05, "feature")[1]
        assert float(got[c, j]) == pytest.approx((up - down) / 2e-6, rel=1e-4, abs=1e-9)


@pytest.mark.parametrize("space", ["feature", "logit"])
def test_the_rows_from_the_quiz_direction_are_the_meta_gradient(space: Space) -> None:
    """``study_rows`` (Σ J_b·v by forward mode, given v from ``quiz_direction``) equals
    the meta step's gradient through BatchNorm and two study batches, and is
    differentiable in the study images (the audit's attack optimises them)."""
    torch.manual_seed(0)
    net = BatchNet().double()
    gen = torch.Generator().manual_seed(2)
    table = torch.randn(3, 6 if space == "feature" else 3, generator=gen, dtype=torch.float64)

    def batch(n: int, y: list[int]) -> tuple[Tensor, Tensor]:
        return torch.randn(n, 4, generator=gen, dtype=torch.float64), torch.tensor(y)

    study, quiz = [batch(4, [0, 2, 2, 0]), batch(3, [2, 0, 0])], [batch(4, [1, 0, 2, 1])]
    want, _ = meta_gradient(net, table, study, quiz, 0.05, space)
    v = quiz_direction(net, table, study, quiz, 0.05, space)
    got = study_rows(net, study, v, 0.05, space, 3)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-15)
    assert not got[1].any() and got[0].abs().sum() > 0
    x = study[0][0].clone().requires_grad_(True)
    rows = study_rows(net, [(x, study[0][1]), study[1]], v, 0.05, space, 3)
    (dx,) = torch.autograd.grad(rows[2].sum(), x)
    assert dx.abs().sum() > 0 and torch.isfinite(dx).all()


def _rows(classes: list[int], rng: np.random.Generator, w: int, scale: float = 1.0):  # type: ignore[no-untyped-def]
    return {f"{GUIDE_GRAD}{c}": (scale * rng.normal(size=w)).astype(np.float32) for c in classes}


@pytest.mark.parametrize("scale,clipped", [(1.0, False), (100.0, True)])
def test_the_table_steps_against_the_clipped_per_class_mean(scale: float, clipped: bool) -> None:
    """Per class, the unweighted mean of the rows the replies hold (zeros for the
    others), scaled to Frobenius norm 100 when above, one SGD step at lr 0.01."""
    counts = (10, 10, 10, 0, 0, 0, 0, 0, 0, 0)
    s = strategy(FedL2G, [node(10, 0, counts=counts), node(11, 1, counts=(5,) * 10)])
    s = sized(s, {10: 30, 11: 50})
    s.global_arrays = before = s.init_global()
    rng = np.random.default_rng(0)
    up0, up1 = _rows([0, 2], rng, 500, scale), _rows([0, 1, 7], rng, 500, scale)
    arrays, _ = s.aggregate_train(1, [reply(10, up0, 30), reply(11, up1, 50)])
    assert arrays is not None
    g = np.zeros((10, 500))
    g[0] = (up0[f"{GUIDE_GRAD}0"].astype(np.float64) + up1[f"{GUIDE_GRAD}0"]) / 2
    g[1], g[2], g[7] = up1[f"{GUIDE_GRAD}1"], up0[f"{GUIDE_GRAD}2"], up1[f"{GUIDE_GRAD}7"]
    norm = np.linalg.norm(g)
    assert bool(norm > 100) == clipped
    want = before[GUIDE] - 0.01 * g * min(1.0, 100 / norm)
    np.testing.assert_allclose(to_numpy(arrays)[GUIDE], want, rtol=1e-6, atol=1e-6)
    assert s.diagnostics["guide-clipped"] == float(clipped)
    assert s.diagnostics["guide-grad-norm"] == pytest.approx(norm, rel=1e-6)


def test_the_logit_table_is_c_by_c_and_its_rows_c_long() -> None:
    s = sized(strategy(FedL2GL, [node(10, 0), node(11, 1)]), {10: 100, 11: 100})
    s.global_arrays = before = s.init_global()
    assert before[GUIDE].shape == (10, 10) and before[GUIDE].dtype == np.float32
    rng = np.random.default_rng(2)
    arrays, _ = s.aggregate_train(1, [reply(10, _rows([3], rng, 10), 100)])
    assert arrays is not None
    new = to_numpy(arrays)[GUIDE]
    assert np.array_equal(np.delete(new, 3, 0), np.delete(before[GUIDE], 3, 0))
    arrays, _ = s.aggregate_train(2, [reply(11, _rows([3], rng, 500), 100)])
    assert arrays is None and "wrong shape" in s.rejected[-1][2]


def test_malformed_or_extreme_uploads_are_refused_and_robust_rules_apply() -> None:
    counts = (10, 10, 0, 0, 0, 0, 0, 0, 0, 0)
    nodes = [node(10 + i, i, counts=counts) for i in range(6)]
    s = sized(strategy(FedL2G, nodes), {10 + i: 20 for i in range(6)})
    s.global_arrays = s.init_global()
    rng = np.random.default_rng(3)
    good = [_rows([0, 1], rng, 500) for _ in range(3)]
    bad = {
        13: _rows([2], rng, 500),  # a class the node does not have
        14: {f"{GUIDE_GRAD}0": np.full(500, np.nan, np.float32)},
        15: {},  # nothing
    }
    replies = [reply(10 + i, up, 20) for i, up in enumerate(good)]
    replies += [reply(nid, up, 20) for nid, up in bad.items()]
    arrays, metrics = s.aggregate_train(1, replies)
    assert arrays is not None and metrics is not None and metrics["valid-replies"] == 3
    assert sorted(nid for _, nid, _ in s.rejected) == [13, 14, 15]
    # float64 rows are refused by the shared checks, a row 1000x the others by size
    s.rejected = []
    wide = {k: v.astype(np.float64) for k, v in good[0].items()}
    huge = {k: 1000 * v for k, v in good[1].items()}
    replies = [
        reply(10, wide, 20),
        reply(11, huge, 20),
        *(reply(12 + i, good[2], 20) for i in range(3)),
    ]
    s.aggregate_train(2, replies)
    assert sorted(nid for _, nid, _ in s.rejected) == [10, 11]
    # robust.aggregate = median: the per-class coordinate median of the rows
    s = sized(
        strategy(FedL2G, nodes[:3], **{"robust.aggregate": "median"}), {10: 20, 11: 20, 12: 20}
    )
    s.global_arrays = before = s.init_global()
    arrays, _ = s.aggregate_train(1, [reply(10 + i, up, 20) for i, up in enumerate(good)])
    assert arrays is not None
    median = np.median([up[f"{GUIDE_GRAD}1"] for up in good], axis=0)
    np.testing.assert_allclose(
        to_numpy(arrays)[GUIDE][1], before[GUIDE][1] - 0.01 * median, atol=1e-7
    )


def _run(tmp_path: Path, algorithm: str, server_round: int, **cfg: object) -> ClientRun:
    hook = methods.get(algorithm).client_hook()
    run = open_run(client_context(tmp_path, algorithm, pid=0, **cfg), server_round, hook)
    c = run.data.num_classes
    w = run.model.feature_dim if algorithm == "fedl2g" else c
    run.received = {GUIDE: torch.randn(c, w, generator=torch.Generator().manual_seed(0))}
    hook.install(run, run.received)
    return run


def test_the_quiz_set_is_held_out_and_the_upload_holds_the_study_classes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hook = methods.get("fedl2g").client_hook()
    run = _run(tmp_path, "fedl2g", 1)
    keep, quiz = hook.split(run)
    n, size = len(run.data.y_train), run.sgd.batch_size
    assert len(quiz) == min(size, n // 2) and len(keep) + len(quiz) == n
    assert not set(keep.tolist()) & set(quiz.tolist())
    assert torch.equal(hook.split(_run(tmp_path, "fedl2g", 2))[1], quiz)  # fixed over rounds
    seen = []
    trained = fedl2g_client.train

    def spy(model: nn.Module, x: Tensor, y: Tensor, *args: object, **kwargs: object) -> object:
        seen.append((x, y))
        return trained(model, x, y, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(fedl2g_client, "train", spy)
    hook.train(run)  # the quiz samples are never trained on
    assert torch.equal(seen[0][0], run.data.x_train[keep])
    assert torch.equal(seen[0][1], run.data.y_train[keep])
    up = hook.upload(run)
    order = keep[torch.randperm(len(keep), generator=run.generator(5))]
    studied = sorted(set(run.data.y_train[order[:size]].tolist()))
    assert sorted(int(k.removeprefix(GUIDE_GRAD)) for k in up) == studied
    assert all(
        v.shape == (run.model.feature_dim,) and v.dtype == torch.float32 for v in up.values()
    )
    assert run.metrics["quiz-loss"] > 0
    run.received = {GUIDE: torch.zeros(3, 3)}
    with pytest.raises(ValueError, match="expected only 'guide'"):
        hook.install(run, run.received)


def test_a_warm_up_round_does_not_train(tmp_path: Path) -> None:
    run = _run(tmp_path, "fedl2gl", 1, **{"fedl2gl.warm-up-rounds": 1})
    hook = methods.get("fedl2gl").client_hook()
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    assert hook.train(run).steps == 0
    assert all(torch.equal(before[k], v) for k, v in run.model.state_dict().items())
    up = hook.upload(run)
    assert up and all(v.shape == (run.data.num_classes,) for v in up.values())


@pytest.mark.slow  # the full tier also runs both end to end (test_eval_mode, test_reference)
@pytest.mark.parametrize("algorithm", ["fedl2g", "fedl2gl"])
def test_two_rounds_in_process_learn(tmp_path: Path, algorithm: str) -> None:
    res, _ = run_inprocess(tmp_path, algorithm=algorithm)  # 3 nodes, synthetic data
    assert [r["round"] for r in res["rounds"]] == [1, 2]
    for row in res["rounds"]:
        assert sorted(row["client-train"]) == ["0", "1", "2"]
        assert all(m["quiz-loss"] > 0 for m in row["client-train"].values())
        assert row["server-diagnostics"]["guide-change"] > 0
    assert res["rounds"][-1]["accuracy"] > 0.2
