"""FedTGP, FedKD and FML: closed forms, strategies with fake replies, the clients."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from client_app.base import open_run
from common import methods
from common.records import to_numpy
from models.mutual import compress, decompress, energy_at, energy_rank, fedkd_loss, fml_loss
from models.tgp import PrototypeGenerator, adaptive_margin, margin_loss, train_generator
from server_app.inprocess import client_context, run_inprocess
from strategies.fedkd import FedKD
from strategies.fedtgp import FedTGP
from strategies.fml import FML
from strategies.testing import node, reply, sized, strategy

# ------------------------------------------------------------------ FedTGP


@pytest.mark.parametrize(("threshold", "want"), [(100.0, math.sqrt(18)), (2.0, 2.0)])
def test_adaptive_margin_is_the_largest_nearest_centre_distance_capped(
    threshold: float, want: float
) -> None:
    # nearest other centre: c0 -> c2 (1), c1 -> c2 (√18), c2 -> c0 (1); the largest: √18
    centres = torch.tensor([[0.0, 0.0], [3.0, 4.0], [0.0, 1.0]])
    assert adaptive_margin(centres, threshold) == pytest.approx(want)
    assert adaptive_margin(centres[:1], threshold) == 0.0


def test_margin_loss_against_numpy() -> None:
    protos = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    labels = torch.tensor([0, 1])
    gen = torch.tensor([[1.0, 1.0], [0.0, 0.0], [2.0, 2.0]])
    margin = 0.5
    p, g = protos.numpy().astype(np.float64), gen.numpy().astype(np.float64)
    dist = np.linalg.norm(p[:, None, :] - g[None, :, :], axis=2)
    dist[np.arange(2), labels.numpy()] += margin
    logits = -dist
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    want = -logp[np.arange(2), labels.numpy()].mean()
    assert float(margin_loss(protos, labels, gen, margin)) == pytest.approx(want, rel=1e-6)


def test_one_server_step_is_one_sgd_step_on_the_margin_loss() -> None:
    torch.manual_seed(0)
    gen = PrototypeGenerator(3, 4, 5)
    protos, labels = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    ref = [p.detach().clone() for p in gen.parameters()]
    loss = margin_loss(protos, labels, gen(), 1.5)
    grads = torch.autograd.grad(loss, list(gen.parameters()))
    before, after = train_generator(
        gen, protos, labels, 1.5, epochs=1, lr=0.1, batch_size=6,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    for p, r, g in zip(gen.parameters(), ref, grads, strict=True):
        torch.testing.assert_close(p.detach(), r - 0.1 * g)
    assert before == pytest.approx(float(loss)) and after < before


def test_fedtgp_strategy_broadcasts_every_class_and_records_the_margin() -> None:
    a, b = (
        node(10, 0, counts=(5, 5, 0, 0), classes=4, d=3),
        node(11, 1, counts=(0, 5, 5, 0), classes=4, d=3),
    )
    s = strategy(FedTGP, [a, b], **{"fedtgp.server-epochs": 3})
    s.global_arrays = s.init_global()
    assert s.global_arrays == {}  # round 1: no prototypes yet
    up_a = {"proto.0": np.array([0, 0, 0], np.float32), "proto.1": np.array([2, 0, 0], np.float32)}
    up_b = {"proto.1": np.array([4, 0, 0], np.float32), "proto.2": np.array([3, 4, 0], np.float32)}
    arrays, _ = s.aggregate_train(1, [reply(10, up_a, 100), reply(11, up_b, 100)])
    got = to_numpy(arrays)
    assert sorted(got) == [f"proto.{c}" for c in range(4)] and got["proto.0"].shape == (3,)
    # centres: c0 (0,0,0), c1 (3,0,0), c2 (3,4,0): nearest distances 3, 3, 4 -> margin 4
    assert s.diagnostics["margin"] == pytest.approx(4.0)
    assert s.diagnostics["server-loss-after"] < s.diagnostics["server-loss-before"]
    bad = {"proto.3": np.array([1, 1, 1], np.float32)}  # a class node 11 does not have
    s.aggregate_train(2, [reply(10, up_a, 100), reply(11, bad, 100)])
    assert [n for _, n, _ in s.rejected] == [11]


# ------------------------------------------------------------------ FedKD / FML math


def test_energy_rank_against_closed_form() -> None:
    s = torch.tensor([3.0, 2.0, 1.0])  # energies 9, 4, 1 of 14
    assert [energy_rank(s, e) for e in (0.5, 9 / 14, 0.9, 13 / 14, 0.95, 1.0)] == [1, 1, 2, 2, 3, 3]
    assert energy_at(1, 30, 0.95, 0.98) == 0.95 and energy_at(30, 30, 0.95, 0.98) == 0.98


def test_compression_keeps_the_energy_share_and_falls_back_to_dense() -> None:
    g = torch.Generator().manual_seed(0)
    update = torch.randn(40, 6, generator=g) @ torch.randn(6, 12, generator=g)  # rank 6
    update = update.reshape(40, 3, 2, 2)
    us, vt = compress(update, 0.95)
    rebuilt = decompress(us, vt, tuple(update.shape)).float()
    err = float((update - rebuilt).square().sum() / update.square().sum())
    assert err <= 0.05 + 1e-6 and us.shape[1] <= 6
    assert compress(torch.randn(5, 5, generator=g), 0.999) is None  # factors not smaller
    assert compress(torch.randn(7, generator=g), 0.9) is None  # vectors go whole


def test_compression_survives_an_svd_that_fails_to_converge(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """LAPACK's SVD failed on one client's ill-conditioned FedKD update in a 30-round
    run (an error reply instead of an upload); the same factors come from the Gram
    eigendecomposition then."""
    g = torch.Generator().manual_seed(1)
    update = torch.randn(30, 4, generator=g) @ torch.randn(4, 20, generator=g)  # rank 4
    want_us, want_vt = compress(update, 0.9)

    def fail(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise torch.linalg.LinAlgError("linalg.svd: The algorithm failed to converge")

    monkeypatch.setattr(torch.linalg, "svd", fail)
    us, vt = compress(update, 0.9)
    assert us.shape == want_us.shape and vt.shape == want_vt.shape
    torch.testing.assert_close(us @ vt, want_us @ want_vt, rtol=1e-4, atol=1e-4)


def test_fml_loss_is_both_objectives_with_the_two_kl_directions() -> None:
    local = torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.0]], requires_grad=True)
    meme = torch.tensor([[0.5, 0.5, 0.0], [1.0, -1.0, 2.0]], requires_grad=True)
    y = torch.tensor([0, 2])
    pl, pm = F.softmax(local, 1).detach().numpy(), F.softmax(meme, 1).detach().numpy()

    def kl(p: np.ndarray, q: np.ndarray) -> float:
        return float((p * (np.log(p) - np.log(q))).sum(1).mean())

    ce = lambda p: float(-np.log(p[np.arange(2), y.numpy()]).mean())  # noqa: E731
    want = 0.3 * ce(pl) + 0.7 * kl(pm, pl) + 0.6 * ce(pm) + 0.4 * kl(pl, pm)
    got = fml_loss(local, meme, y, 0.3, 0.6)
    assert float(got) == pytest.approx(want, rel=1e-5)
    # each model learns from the other's prediction, not the other way round
    (g_local,) = torch.autograd.grad(0.7 * fml_loss(local, meme.detach(), y, 0.3, 0.6), [local])
    assert g_local.abs().sum() > 0


def test_fedkd_loss_weights_distillation_by_the_inverse_task_losses() -> None:
    s = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    m = torch.tensor([[0.0, 1.0], [1.0, 1.0]])
    reps, proj = torch.tensor([[1.0, 2.0]]), torch.tensor([[0.0, 0.0]])
    y = torch.tensor([0, 1])
    ce_s, ce_m = F.cross_entropy(s, y), F.cross_entropy(m, y)
    ps, pm = F.softmax(s, 1), F.softmax(m, 1)
    kl = lambda p, q: (p * (p.log() - q.log())).sum(1).mean()  # noqa: E731
    hidden = (1 + 4) / 2  # MSE over the two elements
    want = ce_s + ce_m + (kl(pm, ps) + kl(ps, pm) + 2 * hidden) / (ce_s + ce_m)
    assert float(fedkd_loss(s, m, reps, proj, y)) == pytest.approx(float(want), rel=1e-5)


# ------------------------------------------------------------------ strategies


def _kd(**cfg) -> FedKD:  # type: ignore[no-untyped-def]
    s = strategy(FedKD, [node(10 + i, i) for i in range(3)], **cfg)
    s.global_arrays = s.init_global()
    return s


def test_fedkd_reconstructs_and_averages_compressed_updates() -> None:
    s = _kd()
    rng = np.random.default_rng(1)
    key = "mentee.extractor.fc1.weight"
    assert key in s.global_arrays and s.global_arrays[key].ndim == 2
    updates, uploads = [], []
    for _ in range(2):
        up = {
            k: rng.normal(size=v.shape).astype(np.float32) * 0.01
            for k, v in s.global_arrays.items()
        }
        updates.append(up)
    rows, cols = updates[1][key].shape
    low_rank = rng.normal(size=(rows, 3)) @ rng.normal(size=(3, cols))
    updates[1][key] = low_rank.astype(np.float32)
    us, vt = compress(torch.from_numpy(updates[1][key]), 0.9)
    updates[1][key] = decompress(us, vt, updates[1][key].shape).numpy().astype(np.float32)
    uploads = [dict(updates[0]), {k: v for k, v in updates[1].items() if k != key}]
    uploads[1][key + ".us"], uploads[1][key + ".vt"] = us.numpy(), vt.numpy()
    old = {k: v.copy() for k, v in s.global_arrays.items()}
    sized(s, {10: 1, 11: 3})
    arrays, _ = s.aggregate_train(1, [reply(10, uploads[0], 1), reply(11, uploads[1], 3)])
    got = to_numpy(arrays)
    for k in old:
        want = old[k] + (updates[0][k].astype(np.float64) + 3 * updates[1][k]) / 4
        np.testing.assert_allclose(got[k], want, rtol=1e-5, atol=1e-6)
    assert 0 < s.diagnostics["upload-compression"] < 1


@pytest.mark.parametrize("poison", ["rank", "missing", "nan", "both"])
def test_fedkd_rejects_malformed_updates(poison: str) -> None:
    s = _kd()
    key = "mentee.extractor.fc1.weight"
    up = {k: np.zeros(v.shape, np.float32) for k, v in s.global_arrays.items()}
    rows, cols = up[key].shape
    if poison == "rank":
        del up[key]
        up[key + ".us"], up[key + ".vt"] = (
            np.zeros((rows, 0), np.float32),
            np.zeros((0, cols), np.float32),
        )
    elif poison == "missing":
        del up[key]
    elif poison == "nan":
        up[key][0, 0] = np.nan
    else:
        up[key + ".us"], up[key + ".vt"] = (
            np.zeros((rows, 1), np.float32),
            np.zeros((1, cols), np.float32),
        )
    arrays, _ = s.aggregate_train(1, [reply(12, up, 100)])
    assert arrays is None and [n for _, n, _ in s.rejected] == [12]


def test_fml_averages_memes_sample_weighted() -> None:
    s = strategy(FML, [node(10 + i, i) for i in range(2)])
    s.global_arrays = s.init_global()
    assert all(k.startswith("meme.") for k in s.global_arrays)
    rng = np.random.default_rng(0)
    ups = [
        {k: rng.normal(size=v.shape).astype(np.float32) for k, v in s.global_arrays.items()}
        for _ in range(2)
    ]
    sized(s, {10: 1, 11: 3})
    arrays, _ = s.aggregate_train(1, [reply(10, ups[0], 1), reply(11, ups[1], 3)])
    got = to_numpy(arrays)
    for k in got:
        np.testing.assert_allclose(got[k], (ups[0][k] + 3 * ups[1][k]) / 4, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ clients, contract


def test_default_shared_model_is_the_smallest_of_the_family(tmp_path: Path) -> None:
    run = open_run(client_context(tmp_path, "fml", pid=0), 1, methods.get("fml").client_hook())
    assert run.node.arch == "cnn-1" and run.model.meme.arch == "cnn-5"
    s = strategy(FML, [node(10, 0)])
    s.cfg = run.cfg
    assert {k.removeprefix("meme.") for k in s.init_global()} == {
        k for k, v in run.model.meme.state_dict().items() if v.is_floating_point()
    }


def test_fedkd_client_uploads_the_energy_share_of_its_update(tmp_path: Path) -> None:
    """Round 2 of 2 keeps 98 % of each matrix update's energy: every compressed key has
    exactly the rank :func:`energy_rank` gives for the update the client made."""
    res, _ = run_inprocess(tmp_path, algorithm="fedkd")
    assert all(r["valid-replies"] == 3 for r in res["rounds"])
    ctx = client_context(tmp_path, "fedkd", pid=1)
    hook = methods.get("fedkd").client_hook()
    run = open_run(ctx, 2, hook)
    received = {k: v.clone() for k, v in hook.shared_state(run).items()}
    run.received = received
    hook.train(run)
    sent = hook.upload(run)
    assert run.metrics["upload-energy"] == pytest.approx(0.98)
    compressed = 0
    for key, before in received.items():
        update = hook.shared_state(run)[key] - before
        if key + ".us" in sent:
            compressed += 1
            s = torch.linalg.svdvals(update.reshape(update.shape[0], -1).double())
            assert sent[key + ".us"].shape[1] == energy_rank(s, 0.98)
        else:
            torch.testing.assert_close(sent[key], update)
            assert compress(update, 0.98) is None
    assert compressed >= 1


@pytest.mark.slow  # a whole in-process run: in the full tier (the fast tier stays under 3 min)
def test_fml_and_fedtgp_upload_bytes_equal_the_analytic_counts(tmp_path: Path) -> None:
    res, _ = run_inprocess(tmp_path, algorithm="fml")
    run = open_run(client_context(tmp_path, "fml", pid=0), 1, methods.get("fml").client_hook())
    meme = sum(v.numel() for v in run.model.meme.state_dict().values() if v.is_floating_point())
    assert all(r["bytes-up-per-client"] == meme * 4 for r in res["rounds"])
    res, grid = run_inprocess(tmp_path / "t", algorithm="fedtgp")
    for row in res["rounds"]:
        for pid, b in row["client-bytes-up"].items():
            ctx = next(
                c for c in grid.contexts.values() if str(c.node_config["partition-id"]) == pid
            )
            counts = open_run(ctx, 0, methods.get("fedtgp").client_hook()).data.train_class_counts
            assert b == int((counts > 0).sum()) * 500 * 4
    assert res["rounds"][1]["bytes-down-per-client"] == 10 * 500 * 4  # every class, round 2
