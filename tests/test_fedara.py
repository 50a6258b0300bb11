"""FedARA: server decomposition per tier, reconstruction + aggregation, client loss."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import strategies.fedara as fedara_module
from client_app.base import open_run
from client_app.fedara import anchor_loss, anchor_weight, decay_step, frobenius_sq
from common import methods
from common.config import parse_run_config
from common.records import to_numpy
from models import build_model
from models.lowrank import factorisable_layers, layer_rank, param_count
from server_app.inprocess import client_context, run_inprocess
from strategies.fedara import FedARA, update_coherence
from strategies.testing import node, reply, sized, strategy

LAYERS = "fc1,fc2"


def tier_node(nid: int, pid: int, ratio: float, layers: str = LAYERS):  # type: ignore[no-untyped-def]
    return node(nid, pid, **{"rank-ratio": ratio, "layers": layers})


class StubGrid:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_node_ids(self) -> list[int]:
        return self.ids


def fedara(ratios: list[float], layers: str = LAYERS, **cfg) -> FedARA:  # type: ignore[no-untyped-def]
    """The rule tests check each aggregation rule as the paper states it (server step
    η = 1) unless they set ``fedara.server-lr`` themselves."""
    nodes = [tier_node(100 + i, i, r, layers) for i, r in enumerate(ratios)]
    s = strategy(FedARA, nodes, **{"fedara.server-lr": 1.0, **cfg})
    s.global_arrays = s.init_global()
    return s


def test_one_decomposition_per_distinct_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    ratios = [1, 0.5, 0.25, 0.125, 0.0625] * 4
    s = fedara(ratios)
    calls = []
    real = fedara_module.decompose_state
    monkeypatch.setattr(
        fedara_module,
        "decompose_state",
        lambda *a, **k: calls.append(a[2]) or real(*a, **k),
    )
    from flwr.app import ConfigRecord

    msgs = list(s.configure_train(1, None, ConfigRecord(), StubGrid(list(s.nodes))))
    assert len(msgs) == 20
    assert sorted(calls) == [0.0625, 0.125, 0.25, 0.5]
    assert s.decompositions == {0: 4}
    assert s.svd_calls == {0: 2}  # one SVD per decomposed layer, truncated per tier
    # nodes of one tier receive the very same arrays
    by_tier: dict[float, list] = {}
    for m in msgs:
        ratio = s.nodes[m.metadata.dst_node_id].extras["rank-ratio"]
        by_tier.setdefault(ratio, []).append(m.content["arrays"])
    for recs in by_tier.values():
        for rec in recs[1:]:
            for k in rec:
                np.testing.assert_array_equal(rec[k].numpy(), recs[0][k].numpy())


def test_payload_shapes_follow_the_rank_rule() -> None:
    s = fedara([0.25])
    payload = s.payload(1, s.nodes[100])
    r1, r2 = layer_rank((2000, 512), 0.25), layer_rank((500, 2000), 0.25)
    assert payload["extractor.fc1.u"].shape == (2000, r1)
    assert payload["extractor.fc1.v"].shape == (512, r1)
    assert payload["extractor.fc2.u"].shape == (500, r2)
    assert payload["extractor.conv1.weight"].shape == (16, 1, 5, 5)
    assert "extractor.fc1.weight" not in payload


def _random_uploads(s: FedARA, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for nid in sorted(s.nodes):
        shape = {k: v.shape for k, v in s.payload(1, s.nodes[nid]).items()}
        out.append({k: rng.normal(size=sh).astype(np.float32) for k, sh in shape.items()})
    return out


def _rebuilt(s: FedARA, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Full-rank version of a (possibly factorised) state, in float64 numpy."""
    out = {}
    for k, v in state.items():
        if k.endswith(".u"):
            layer = k.removesuffix(".u")
            out[layer + ".weight"] = v.astype(np.float64) @ state[layer + ".v"].astype(np.float64).T
        elif not k.endswith(".v"):
            out[k] = v.astype(np.float64)
    return out


@pytest.mark.parametrize("scale", ["none", "energy"])
@pytest.mark.parametrize("rule", ["reconstruct", "delta"])
def test_aggregation_rules_against_their_closed_forms(rule: str, scale: str) -> None:
    """Each reply's factor product is first divided by the gain g its tier was served
    with (1 under ``served-scale = none``), then the rule applies."""
    s = fedara([0.5, 0.125, 1.0], **{"fedara.aggregation": rule, "fedara.served-scale": scale})
    old = {k: v.astype(np.float64) for k, v in s.global_arrays.items()}
    gains = [s.gains(s.tier(s.nodes[nid])) for nid in (100, 101, 102)]
    assert (scale == "none") == all(g == 1.0 for gs in gains for g in gs.values())
    served = [
        _unscale(_rebuilt(s, s.payload(1, s.nodes[nid])), g)
        for nid, g in zip((100, 101, 102), gains, strict=True)
    ]
    uploads, weights = _random_uploads(s), [30, 50, 20]
    sized(s, {100: 30, 101: 50, 102: 20})
    full = [_unscale(_rebuilt(s, up), g) for up, g in zip(uploads, gains, strict=True)]
    arrays, _ = s.aggregate_train(
        1, [reply(n, u, w) for n, u, w in zip((100, 101, 102), uploads, weights, strict=True)]
    )
    got = to_numpy(arrays)
    assert set(got) == set(old)
    for k in got:
        recon = sum(f[k] * w for f, w in zip(full, weights, strict=True)) / 100
        if rule == "reconstruct":  # Σ_k w_k U'_k V'_kᵀ
            want = recon
        else:  # W + Σ_k w_k (U'_k V'_kᵀ − U_k V_kᵀ)
            delta = sum((f[k] - sv[k]) * w for f, sv, w in zip(full, served, weights, strict=True))
            want = old[k] + delta / 100
        np.testing.assert_allclose(got[k], want, rtol=1e-4, atol=1e-4)  # float32 GEMMs
    # U V^T of a balanced split, checked once by hand for fc2 of node 101
    u, v = uploads[1]["extractor.fc2.u"], uploads[1]["extractor.fc2.v"]
    g = gains[1]["fc2"]
    np.testing.assert_allclose(full[1]["extractor.fc2.weight"], u @ v.T / g, rtol=1e-4, atol=1e-5)


def _unscale(state: dict[str, np.ndarray], gains: dict[str, float]) -> dict[str, np.ndarray]:
    return {
        k: v / gains.get(k.removeprefix("extractor.").removesuffix(".weight"), 1.0)
        if k.endswith(".weight")
        else v
        for k, v in state.items()
    }


@pytest.mark.parametrize("conv", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_coverage_averages_each_direction_over_the_clients_that_cover_it(
    conv: bool, dtype: torch.dtype
) -> None:
    """Full-rank client A (weight 0.6) and a rank-5 client B (0.4) whose change lies
    where min(i, j) < 5 in the global's singular basis: there the update is the
    plain weighted mean; everywhere else it is A's own change (0.6·Δ_A / 0.6).
    With its products in float32 (the server's setting) the same to float32 rounding."""
    from models.lowrank import conv_to_matrix, matrix_to_conv, top_svd
    from models.lowrank_state import coverage_normalised

    rng = np.random.default_rng(3)
    shape = (8, 6, 3, 3) if conv else (40, 30)
    w = torch.from_numpy(rng.normal(size=shape))
    wm = conv_to_matrix(w) if conv else w
    svd = top_svd(w, 12)
    pf, _, qft = np.linalg.svd(wm.numpy())  # full bases, same leading subspaces
    p5, q5 = svd[0][:, :5].numpy(), svd[2][:5].T.numpy()
    d_a = rng.normal(size=wm.shape)
    d_b = p5 @ rng.normal(size=(5, wm.shape[1])) + rng.normal(size=(wm.shape[0], 5)) @ q5.T
    d = 0.6 * d_a + 0.4 * d_b
    cover = torch.tensor([1.0] * 5 + [0.6] * 7, dtype=torch.float64)
    as_weight = (
        (lambda m: matrix_to_conv(torch.from_numpy(m), *shape[:3])) if conv else torch.from_numpy
    )
    got = coverage_normalised(as_weight(d), svd, cover, 0.6, dtype)
    assert got.dtype == torch.float64
    got_m = (conv_to_matrix(got) if conv else got).numpy()
    i, j = np.indices(wm.shape)
    low = np.minimum(i, j) < 5
    want = pf @ np.where(low, pf.T @ d @ qft.T, pf.T @ d_a @ qft.T) @ qft
    atol = 1e-9 if dtype == torch.float64 else 1e-5
    np.testing.assert_allclose(got_m, want, atol=atol)
    ones = torch.ones(12, dtype=torch.float64)
    same = coverage_normalised(as_weight(d), svd, ones, 1.0, dtype)
    np.testing.assert_allclose((conv_to_matrix(same) if conv else same).numpy(), d, atol=atol)


def test_energy_scale_serves_g_times_the_truncation_with_the_full_norm() -> None:
    s = fedara([0.125], **{"fedara.served-scale": "energy"})
    payload = s.payload(1, s.nodes[100])
    for layer in ("fc1", "fc2"):
        w = s.global_arrays[f"extractor.{layer}.weight"].astype(np.float64)
        product = (
            payload[f"extractor.{layer}.u"].astype(np.float64)
            @ payload[f"extractor.{layer}.v"].astype(np.float64).T
        )
        assert np.linalg.norm(product) == pytest.approx(np.linalg.norm(w), rel=1e-4)
        r = layer_rank(w.shape, 0.125)
        p, sv, qt = np.linalg.svd(w, full_matrices=False)
        truncated = (p[:, :r] * sv[:r]) @ qt[:r]
        g = s.gains(s.tier(s.nodes[100]))[layer]
        assert g > 1.5  # a fresh layer's top 1/8 keeps about a quarter of the energy
        np.testing.assert_allclose(product, g * truncated, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("layers", [LAYERS, "conv2,fc1"])
def test_replying_what_was_served_is_a_fixed_point_of_delta_only(layers: str) -> None:
    """Every node returns exactly its tier's factors: ``delta`` keeps the global (to
    float tolerance); ``reconstruct`` replaces it by the mean of the truncations,
    shrinking every direction a low tier cannot hold (documented, not a bug). With a
    conv layer factorised too (its factors are conv weights; the residual goes back
    through the conv layout)."""
    moved = {}
    rules = (
        ("delta", "none"),
        ("delta", "energy"),
        ("coverage", "energy"),
        ("reconstruct", "none"),
    )
    for rule, scale in rules:
        cfg = {"fedara.aggregation": rule, "fedara.served-scale": scale}
        s = fedara([1.0, 0.5, 0.25, 0.125, 0.0625], layers, **cfg)
        old = {k: v.copy() for k, v in s.global_arrays.items()}
        sized(s, {nid: 40 + nid for nid in s.nodes})
        replies = [reply(nid, s.payload(1, s.nodes[nid]), 40 + nid) for nid in sorted(s.nodes)]
        arrays, _ = s.aggregate_train(1, replies)
        got = to_numpy(arrays)
        w = "extractor.fc1.weight"
        moved[rule + scale] = float(np.linalg.norm(got[w] - old[w]) / np.linalg.norm(old[w]))
        factorised = {f"extractor.{name}.weight" for name in layers.split(",")}
        for k in old:
            if rule != "reconstruct" or k not in factorised:
                np.testing.assert_allclose(got[k], old[k], rtol=0, atol=2e-6, err_msg=k)
    assert max(moved["deltanone"], moved["deltaenergy"], moved["coverageenergy"]) < 1e-6
    assert moved["reconstructnone"] > 0.3  # a fresh fc1 loses most of its energy


@pytest.mark.parametrize("rule", ["delta", "coverage", "reconstruct"])
def test_server_lr_scales_the_aggregated_step(rule: str) -> None:
    """``fedara.server-lr`` η: the new global is ``W + η (mean − W)``, with the mean of
    two full-rank replies computed here in numpy (sample weights 30 and 10)."""
    eta = 2.5
    s = fedara(
        [1.0, 1.0],
        **{"fedara.aggregation": rule, "fedara.server-lr": eta, "fedara.server-step": "fixed"},
    )
    old = {k: v.copy() for k, v in s.global_arrays.items()}
    sized(s, {100: 30, 101: 10})
    rng = np.random.default_rng(0)
    ups = {}
    for nid in (100, 101):
        ups[nid] = {
            k: (v + rng.normal(0, 0.01, v.shape)).astype(np.float32)
            for k, v in s.payload(1, s.nodes[nid]).items()
        }
    got, _ = s.aggregate_train(1, [reply(n, ups[n], w) for n, w in ((100, 30), (101, 10))])
    got = to_numpy(got)
    for k in old:
        mean = 0.75 * ups[100][k].astype(np.float64) + 0.25 * ups[101][k].astype(np.float64)
        want = old[k] + eta * (mean - old[k])
        np.testing.assert_allclose(got[k], want, rtol=1e-5, atol=1e-6)
        assert not np.allclose(got[k], mean, atol=1e-4)  # the step really is scaled


def test_update_coherence_against_its_closed_form() -> None:
    """``server-diagnostics.update-coherence``: ‖Σ w Δ‖ / Σ w ‖Δ‖ over the tensors
    every reply sends in full, computed here in numpy (weights 30 and 10); a
    factorised reply's factors are left out, the full tensors it sends are not."""
    s = fedara([1.0, 0.25])
    sized(s, {100: 30, 101: 10})
    rng = np.random.default_rng(1)
    ups, deltas = {}, {}
    for nid in (100, 101):
        served = s.payload(1, s.nodes[nid])
        ups[nid] = {
            k: (v + rng.normal(0, 0.01, v.shape)).astype(np.float32) for k, v in served.items()
        }
    full_keys = [
        k
        for k in s.global_arrays
        if k in ups[101] and ups[101][k].shape == s.global_arrays[k].shape
    ]
    assert full_keys and len(full_keys) < len(s.global_arrays)  # the factorised layers drop out
    for nid in (100, 101):
        deltas[nid] = np.concatenate(
            [(ups[nid][k].astype(np.float64) - s.global_arrays[k]).ravel() for k in full_keys]
        )
    want = np.linalg.norm(0.75 * deltas[100] + 0.25 * deltas[101]) / (
        0.75 * np.linalg.norm(deltas[100]) + 0.25 * np.linalg.norm(deltas[101])
    )
    s.aggregate_train(1, [reply(n, ups[n], w) for n, w in ((100, 30), (101, 10))])
    assert s.diagnostics["update-coherence"] == pytest.approx(want, rel=1e-6)
    assert 0.5 < want < 0.9  # two unrelated moves of these sizes: well below 1


def test_update_coherence_bounds() -> None:
    """Identical moves give 1, equal and opposite ones 0."""
    old = {"w": torch.zeros(3), "b": torch.zeros(2)}
    step = {"w": torch.tensor([1.0, -2.0, 0.5]), "b": torch.tensor([0.3, 0.0])}
    back = {k: -v for k, v in step.items()}
    assert update_coherence(old, [step, step], [2.0, 5.0]) == pytest.approx(1.0)
    assert update_coherence(old, [step, back], [1.0, 1.0]) == pytest.approx(0.0, abs=1e-12)
    assert update_coherence(old, [{"x": torch.zeros(1)}], [1.0]) is None  # nothing in full


@pytest.mark.parametrize("poison", ["nan", "inf", "inf-bias", "wrong-tier-shape"])
def test_poisoned_reply_is_ignored(poison: str) -> None:
    """A reply with a value that is not finite (in a factor, or in a tensor sent
    whole) or in another tier's shapes is rejected; the others make the round."""
    s = fedara([0.5, 0.25])
    good = {k: v.copy() for k, v in s.payload(1, s.nodes[100]).items()}
    bad = {k: v.copy() for k, v in s.payload(1, s.nodes[101]).items()}
    if poison == "nan":
        bad["extractor.fc1.u"][0, 0] = np.nan
    elif poison == "inf":
        bad["extractor.fc2.v"][3, 1] = -np.inf
    elif poison == "inf-bias":
        bad["extractor.conv1.bias"][0] = np.inf
    else:  # node 101 answers with the factors of another tier
        bad = good
    ref = fedara([0.5, 0.25])
    want, _ = ref.aggregate_train(1, [reply(100, good, 100)])
    got, _ = s.aggregate_train(1, [reply(100, good, 100), reply(101, bad, 100)])
    for k in want:
        np.testing.assert_array_equal(got[k].numpy(), want[k].numpy())
    assert [n for _, n, _ in s.rejected] == [101]


def test_lambda_schedule() -> None:
    cfg = parse_run_config({"fedara.lambda": 10.0, "fedara.warmup-rounds": 10})
    assert [anchor_weight(cfg, t) for t in (1, 2, 6, 11, 30)] == [
        0.0,
        1.0,
        5.0,
        10.0,
        10.0,
    ]
    cfg0 = parse_run_config({"fedara.lambda": 3.0, "fedara.warmup-rounds": 0})
    assert [anchor_weight(cfg0, t) for t in (1, 2, 5)] == [0.0, 3.0, 3.0]


def _client_run(tmp_path: Path, server_round: int, pid: int = 1, **cfg):  # type: ignore[no-untyped-def]
    ctx = client_context(tmp_path, "fedara", pid=pid, num=5, **cfg)
    return open_run(ctx, server_round, methods.get("fedara").client_hook())


def _install_served(run) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """Install a known, random 'served' extractor at the run's tier; return it."""
    gen = torch.Generator().manual_seed(7)
    served = {
        k: torch.randn(v.shape, generator=gen) * 0.05
        for k, v in run.model.state_dict().items()
        if k.startswith("extractor.")
    }
    methods.get("fedara").client_hook().install(run, served)
    return served


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_anchors_are_class_means_under_the_received_extractor(
    tmp_path: Path, reduction: str
) -> None:
    """Anchors are fixed from what the server sent: changing the extractor during
    training does not move them."""
    run = _client_run(tmp_path, 3, pid=2, **{"fedara.anchor-reduction": reduction})  # tier 0.25
    served = _install_served(run)
    reference = copy.deepcopy(run.model).eval()
    loss = methods.get("fedara").client_hook().extra_loss(run)  # anchors computed here
    with torch.no_grad():  # "training" moves the extractor afterwards
        for p in run.model.extractor.parameters():
            p.add_(torch.randn_like(p))
    with torch.no_grad():
        reps = reference.features(run.data.x_train).double()
    y = run.data.y_train
    present = [c for c in range(run.data.num_classes) if bool((y == c).any())]
    anchors = torch.zeros(run.data.num_classes, reps.shape[1], dtype=torch.float64)
    for c in present:
        anchors[c] = reps[y == c].mean(0)
    batch = torch.randn(6, reps.shape[1])
    yb = torch.tensor(present[:1] * 3 + present[-1:] * 3)
    lam = anchor_weight(run.cfg, 3)
    sq = (batch.double() - anchors[yb]) ** 2
    want = lam * (sq.sum(1).mean() if reduction == "sum" else sq.mean())
    assert float(loss(batch, torch.zeros(6, 10), yb, torch.zeros(6, 1, 28, 28))) == pytest.approx(
        float(want), rel=1e-4
    )
    assert set(served) == {k for k in run.received or served}


@pytest.mark.parametrize(("reduction", "want"), [("mean", 18 / 4), ("sum", (5 + 13) / 2)])
def test_anchor_loss_of_a_hand_built_batch(reduction: str, want: float) -> None:
    reps = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    targets = torch.tensor([[0.0, 0.0], [1.0, 1.0]])  # squared errors [[1, 4], [4, 9]]
    assert float(anchor_loss(reps, targets, reduction)) == pytest.approx(want)


def test_gradient_ratio_under_sum_is_d_times_the_mean_one(tmp_path: Path) -> None:
    ratios = {}
    for reduction in ("mean", "sum"):
        run = _client_run(tmp_path, 5, pid=1, **{"fedara.anchor-reduction": reduction})
        _install_served(run)
        methods.get("fedara").client_hook().extra_loss(run)
        ratios[reduction] = run.metrics["anchor-grad-ratio"]
        assert run.metrics["anchor-weight"] == anchor_weight(run.cfg, 5) > 0
    assert ratios["mean"] > 0
    assert ratios["sum"] / ratios["mean"] == pytest.approx(500, rel=1e-3)  # d = 500


def test_round_one_has_no_anchor_term(tmp_path: Path) -> None:
    hook = methods.get("fedara").client_hook()
    run1 = _client_run(tmp_path, 1)
    assert hook.extra_loss(run1) is None
    assert run1.metrics["anchor-weight"] == 0.0
    assert "anchor-grad-ratio" not in run1.metrics
    run2 = _client_run(tmp_path, 2)
    reps, y = torch.randn(4, 500), torch.tensor([0, 1, 2, 3])
    assert (
        float(hook.extra_loss(run2)(reps, torch.zeros(4, 10), y, torch.zeros(4, 1, 28, 28))) > 0.0
    )


def test_decay_step_is_one_gradient_step_on_the_frobenius_term() -> None:
    from models.lowrank import LowRankLinear

    layer = LowRankLinear(6, 5, 3)
    u, v = layer.u.detach().double().clone(), layer.v.detach().double().clone()
    decay_step(torch.nn.Sequential(layer), 0.01)
    np.testing.assert_allclose(layer.u.detach(), u - 0.02 * u @ (v.T @ v), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(layer.v.detach(), v - 0.02 * v @ (u.T @ u), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("every", [0, 1, 5])
def test_frobenius_decay_shrinks_the_trained_product(tmp_path: Path, every: int) -> None:
    """Same data, same batches: with μ > 0 ‖U Vᵀ‖_F ends smaller than with μ = 0."""
    norms = {}
    for mu in (0.0, 0.5):
        cfg = {"fedara.frobenius-decay": mu, "fedara.decay-every": every}
        run = _client_run(tmp_path, 1, pid=1, **cfg)
        _install_served(run)
        methods.get("fedara").client_hook().train(run)
        norms[mu] = float(frobenius_sq(run.model.extractor))
    assert norms[0.5] < 0.99 * norms[0.0]


def test_frobenius_term_matches_explicit_product(tmp_path: Path) -> None:
    from models.lowrank import LowRankConv2d, LowRankLinear

    run = _client_run(tmp_path, 1, pid=1)  # tier 0.5
    want = 0.0
    for m in run.model.extractor.modules():
        if isinstance(m, LowRankLinear):
            want += float(((m.u @ m.v.T) ** 2).sum())
        elif isinstance(m, LowRankConv2d):
            want += float(((m.factor_u() @ m.factor_v().T) ** 2).sum())
    assert want > 0
    assert float(frobenius_sq(run.model.extractor)) == pytest.approx(want, rel=1e-4)


def test_upload_bytes_per_tier_match_the_analytic_counts(tmp_path: Path) -> None:
    res, _ = run_inprocess(tmp_path, num_nodes=5, algorithm="fedara")
    model = build_model("cnn-1", in_channels=1, num_classes=10, image_size=28, feature_dim=500)
    shapes = factorisable_layers(model.extractor)
    total = sum(p.numel() for p in model.extractor.parameters())
    tiers = [1, 0.5, 0.25, 0.125, 0.0625]
    for row in res["rounds"]:
        for pid, ratio in enumerate(tiers):
            want = total
            if ratio < 1:
                for layer in ("fc1", "fc2"):
                    sh = shapes[layer]
                    want += param_count(sh, layer_rank(sh, ratio)) - int(np.prod(sh))
            assert row["client-bytes-up"][str(pid)] == want * 4
    assert len({row["client-bytes-up"]["0"], row["client-bytes-up"]["4"]}) == 2


def test_fedara_star_homogeneous_half_rank(tmp_path: Path) -> None:
    res, _ = run_inprocess(
        tmp_path,
        num_nodes=3,
        algorithm="fedara",
        **{
            "model.family": "fedavgcnn",
            "fedara.rank-tiers": "0.5",
            "fedara.lambda": 10.0,
            "fedara.anchor-reduction": "mean",
        },
    )
    ups = {v for row in res["rounds"] for v in row["client-bytes-up"].values()}
    assert len(ups) == 1  # one tier
    assert all(r["valid-replies"] == 3 for r in res["rounds"])


def test_shared_svd_gives_the_same_approximation_as_a_fresh_decomposition() -> None:
    from models.lowrank import decompose

    s = fedara([0.5, 0.125], **{"fedara.served-scale": "none"})
    for nid, ratio in ((100, 0.5), (101, 0.125)):
        payload = s.payload(1, s.nodes[nid])
        weight = torch.from_numpy(s.global_arrays["extractor.fc1.weight"])
        u, v = decompose(weight, layer_rank(tuple(weight.shape), ratio))
        pu, pv = payload["extractor.fc1.u"], payload["extractor.fc1.v"]
        assert pu.shape == u.shape and pv.shape == v.shape
        # the same rank-r approximation (factor columns may differ in sign, U Vᵀ does not)
        np.testing.assert_allclose(pu @ pv.T, (u @ v.T).numpy(), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(
            np.linalg.norm(pu, axis=0), np.linalg.norm(u.numpy(), axis=0), rtol=1e-5
        )


# ------------------------------------------------------------ tracked truncation


def _flat_fc1(seed: int, rows: int = 2000, cols: int = 512) -> np.ndarray:
    """A float32 [rows, cols] matrix whose singular values all lie in [1, 1.001)
    (a flat spectrum, as the practical regime's fc1 ends up), fixed bases."""
    gen = torch.Generator().manual_seed(11)
    p, _ = torch.linalg.qr(torch.randn(rows, cols, generator=gen, dtype=torch.float64))
    q, _ = torch.linalg.qr(torch.randn(cols, cols, generator=gen, dtype=torch.float64))
    values = 1 + 1e-3 * torch.rand(cols, generator=torch.Generator().manual_seed(seed))
    return (p * values.double() @ q.T).numpy().astype(np.float32)


def _column_overlap(a: np.ndarray, b: np.ndarray) -> float:
    """‖P_aᵀ P_b‖²_F / r for orthonormal bases of the column spaces of a and b."""
    pa, pb = np.linalg.qr(a.astype(np.float64))[0], np.linalg.qr(b.astype(np.float64))[0]
    return float(np.square(pa.T @ pb).sum()) / pa.shape[1]


@pytest.mark.parametrize("truncation", ["svd", "tracked"])
def test_tracked_truncation_keeps_a_tier_subspace_where_the_svd_jumps(truncation: str) -> None:
    """fc1 with a flat spectrum; a full-rank reply reorders its singular values (a 0.1 %
    change). Both truncations serve the rank-1/8 tier the SVD truncation at version
    0; at version 1 the SVD's leading subspace is another one, the tracked one is
    the same (and is still the exact projection of the new global onto it)."""
    s = fedara([1.0, 0.125], **{"fedara.aggregation": "delta", "fedara.truncation": truncation})
    key = "extractor.fc1.weight"
    s.global_arrays = {**s.global_arrays, key: _flat_fc1(seed=0)}
    low = s.payload(1, s.nodes[101])
    u0, v0 = low["extractor.fc1.u"], low["extractor.fc1.v"]
    w0 = s.global_arrays[key].astype(np.float64)
    r = u0.shape[1]
    p, sv, qt = np.linalg.svd(w0, full_matrices=False)
    g = s.gains(s.tier(s.nodes[101]))["fc1"]
    np.testing.assert_allclose(u0 @ v0.T, g * (p[:, :r] * sv[:r]) @ qt[:r], rtol=1e-3, atol=1e-5)
    full = {**s.payload(1, s.nodes[100]), key: _flat_fc1(seed=1)}
    sized(s, {100: 50, 101: 50})
    s.aggregate_train(1, [reply(100, full, 50), reply(101, low, 50)])
    w1 = s.global_arrays[key].astype(np.float64)
    assert np.linalg.norm(w1 - w0) < 1e-3 * np.linalg.norm(w0)
    nxt = s.payload(2, s.nodes[101])
    u1, v1 = nxt["extractor.fc1.u"], nxt["extractor.fc1.v"]
    overlap = _column_overlap(v0, v1)  # fc1 is tall: the right (input) side is tracked
    if truncation == "svd":
        assert overlap < 0.6
    else:
        assert overlap > 0.999
        q1 = np.linalg.qr(v1.astype(np.float64))[0]
        g1 = s.gains(s.tier(s.nodes[101]))["fc1"]
        np.testing.assert_allclose(u1 @ v1.T / g1, w1 @ q1 @ q1.T, rtol=1e-3, atol=1e-6)
        assert g1 == pytest.approx(np.linalg.norm(w1) / np.linalg.norm(w1 @ q1 @ q1.T), rel=1e-6)


def test_tracked_truncation_keeps_delta_a_fixed_point_and_resumes() -> None:
    """Two rounds of every tier replying what it was served (the second served from
    the tracked basis) leave the global as it was; a strategy restored from the
    checkpoint state after round 1 serves round 2 exactly as the running one did,
    and one without that state starts again from the SVD (a different subspace)."""
    ratios = [1.0, 0.5, 0.25, 0.125, 0.0625]
    cfg = {"fedara.aggregation": "coverage", "fedara.truncation": "tracked"}
    since = time.perf_counter()  # a state is decomposed when first served, from here on
    s = fedara(ratios, **cfg)
    old = {k: v.copy() for k, v in s.global_arrays.items()}
    sized(s, {nid: 40 + nid for nid in s.nodes})
    served: dict[int, dict[int, dict[str, np.ndarray]]] = {}
    evaluated: dict[int, dict[str, np.ndarray]] = {}
    state, arrays = None, None
    for rnd in (1, 2):
        served[rnd] = {nid: s.payload(rnd, s.nodes[nid]) for nid in sorted(s.nodes)}
        if rnd == 2:  # training is served what evaluation was (one decomposition per state)
            for nid, payload in served[rnd].items():
                for k in payload:
                    np.testing.assert_array_equal(payload[k], evaluated[nid][k])
        assert bool(s._cores) == (rnd == 2)  # round 2 is served from the tracked basis
        start = time.perf_counter()
        s.aggregate_train(rnd, [reply(nid, a, 40 + nid) for nid, a in served[rnd].items()])
        end = time.perf_counter()
        # where the server's time went: every phase timed, each within its wall time
        phases = dict(s.diagnostics["server-phases-s"])
        want = {"decompose", "updates", "diagnostics", "normalise", "step"}
        assert set(phases) == want
        assert min(phases.values()) >= 0
        assert 0 < phases.pop("decompose") <= start - since
        assert sum(phases.values()) <= end - start
        since = end
        if rnd == 1:
            # the evaluation message serves the new global before the checkpoint is taken
            evaluated = {nid: s.payload(rnd, s.nodes[nid]) for nid in sorted(s.nodes)}
            state = copy.deepcopy(s.extra_state())
            arrays = {k: v.copy() for k, v in s.global_arrays.items()}
    for k in old:
        np.testing.assert_allclose(s.global_arrays[k], old[k], rtol=0, atol=4e-6)
    restored = fedara(ratios, **cfg)
    restored.load_extra_state(state)
    restored.global_arrays = arrays
    fresh = fedara(ratios, **cfg)
    fresh.global_arrays = arrays
    for nid in sorted(s.nodes):
        got = restored.payload(2, restored.nodes[nid])
        for k in got:
            np.testing.assert_array_equal(got[k], served[2][nid][k])
    assert not fresh._tracked and fresh.payload(2, fresh.nodes[104])  # SVD again
    assert not fresh._cores and restored._cores


def test_upload_size_is_the_reconstructed_update_to_what_was_served() -> None:
    """Replying what was served has size 0; doubling one factor adds that layer's
    served product once (over the gain, as the rule reconstructs it)."""
    s = fedara([0.5, 0.25, 1.0], **{"fedara.served-scale": "energy"})
    nid = 101
    served = {k: v.copy() for k, v in s.payload(1, s.nodes[nid]).items()}
    upload = next(u for u in _uploads(s, {nid: served}) if u.node.node_id == nid)
    assert s.upload_size(upload) == pytest.approx(0.0, abs=1e-6)
    doubled = {**served, "extractor.fc1.u": served["extractor.fc1.u"] * 2}
    upload = next(u for u in _uploads(s, {nid: doubled}) if u.node.node_id == nid)
    g = s.gains(s.tier(s.nodes[nid]))["fc1"]
    product = served["extractor.fc1.u"].astype(np.float64) @ served["extractor.fc1.v"].T
    assert s.upload_size(upload) == pytest.approx(np.linalg.norm(product) / g, rel=1e-4)


def _uploads(s: FedARA, replies: dict[int, dict[str, np.ndarray]]) -> list:  # type: ignore[type-arg]
    """The validated uploads of ``replies`` (node id -> arrays), 100 samples each."""
    from strategies.replies import train_upload

    return [
        train_upload(reply(nid, arrays, 100), s.nodes[nid])[0] for nid, arrays in replies.items()
    ]


def test_fedara_median_is_taken_per_reconstructed_update() -> None:
    """``robust.aggregate = median`` under the ``reconstruct`` rule: the coordinate-wise
    median of each reply's own full-rank reconstruction (over its gain), so one huge
    reply moves nothing."""
    s = fedara(
        [0.5, 0.25, 1.0],
        **{
            "fedara.aggregation": "reconstruct",
            "fedara.served-scale": "energy",
            "robust.aggregate": "median",
            "robust.max-norm-ratio": 0,
        },
    )
    uploads = _random_uploads(s, seed=3)
    uploads[2] = {k: v * 1e4 for k, v in uploads[2].items()}
    gains = [s.gains(s.tier(s.nodes[nid])) for nid in (100, 101, 102)]
    full = [_unscale(_rebuilt(s, up), g) for up, g in zip(uploads, gains, strict=True)]
    sized(s, {100: 100, 101: 100, 102: 100})
    arrays, _ = s.aggregate_train(
        1, [reply(n, u, 100) for n, u in zip((100, 101, 102), uploads, strict=True)]
    )
    got = to_numpy(arrays)
    for k in got:
        want = np.median(np.stack([f[k] for f in full]), axis=0)
        np.testing.assert_allclose(got[k], want, rtol=1e-4, atol=1e-4)
    assert max(float(np.abs(v).max()) for v in got.values()) < 100


def test_fedara_screens_a_huge_reconstructed_update() -> None:
    s = fedara([0.5, 0.25, 1.0, 0.5], **{"robust.max-norm-ratio": 5.0})
    uploads = [
        {k: v.copy() for k, v in s.payload(1, s.nodes[nid]).items()} for nid in sorted(s.nodes)
    ]
    rng = np.random.default_rng(0)
    uploads = [{k: v + 0.01 * rng.normal(size=v.shape) for k, v in u.items()} for u in uploads]
    uploads = [{k: v.astype(np.float32) for k, v in u.items()} for u in uploads]
    uploads[1] = {k: v * 1e6 for k, v in uploads[1].items()}
    sized(s, {nid: 100 for nid in s.nodes})
    s.aggregate_train(1, [reply(n, u, 100) for n, u in zip(sorted(s.nodes), uploads, strict=True)])
    assert [n for _, n, _ in s.rejected] == [101]
    assert "robust.max-norm-ratio" in s.rejected[0][2]
    assert set(s.size_ratios) == {"0", "1", "2", "3"} and s.size_ratios["1"] > 1e4


def test_a_screened_out_reply_is_not_in_the_mean() -> None:
    """Screening forms every reply's update and their mean at once; when it drops a
    reply, the rule averages the others afresh: the new global is exactly the one of
    a round where the dropped node never replied."""
    ratios = [0.5, 0.25, 1.0, 0.5]
    rng = np.random.default_rng(1)
    uploads = []
    s = fedara(ratios, **{"robust.max-norm-ratio": 5.0})
    for nid in sorted(s.nodes):
        sent = s.payload(1, s.nodes[nid])
        uploads.append(
            {k: (v + 0.01 * rng.normal(size=v.shape)).astype(np.float32) for k, v in sent.items()}
        )
    uploads[1] = {k: v * 1e6 for k, v in uploads[1].items()}
    sized(s, {nid: 50 + nid for nid in s.nodes})
    got, _ = s.aggregate_train(
        1, [reply(nid, u, 50 + nid) for nid, u in zip(sorted(s.nodes), uploads, strict=True)]
    )
    assert [n for _, n, _ in s.rejected] == [101]
    honest = fedara(ratios, **{"robust.max-norm-ratio": 5.0})
    sized(honest, {nid: 50 + nid for nid in honest.nodes})
    want, _ = honest.aggregate_train(
        1, [reply(nid, uploads[nid - 100], 50 + nid) for nid in (100, 102, 103)]
    )
    assert got is not None and want is not None
    for key in want:
        np.testing.assert_array_equal(got[key].numpy(), want[key].numpy())


@pytest.mark.slow  # four in-process runs: about a minute
def test_four_nodes_do_not_collapse_in_round_2(tmp_path: Path) -> None:
    """A small fleet with long local training (4 nodes, 3 local epochs): the default
    bounded server step keeps round 2 at least as good as round 1; the fixed η = 3
    (the control) overshoots there, so the test sees the mechanism, not luck."""

    def run(step: str) -> tuple[list[float], list[float], list[float]]:
        res, _ = run_inprocess(
            tmp_path / step,
            4,
            algorithm="fedara",
            **{"train.local-epochs": 3, "train.batch-size": 10, "fedara.server-step": step},
        )
        rounds = res["rounds"]
        etas = [r["server-diagnostics"]["server-lr"] for r in rounds]
        return [r["accuracy"] for r in rounds], [r["train-loss"] for r in rounds], etas

    acc, loss, etas = run("bounded")
    assert acc[1] >= acc[0] - 0.02 and loss[1] < loss[0], (acc, loss)
    assert all(1.0 <= e < 3.0 for e in etas)  # 4 agreeing replies: bounded below 3
    fixed_acc, fixed_loss, fixed_etas = run("fixed")
    assert fixed_etas == [3.0, 3.0]
    assert fixed_acc[1] < fixed_acc[0] - 0.1 and fixed_loss[1] > fixed_loss[0], (
        fixed_acc,
        fixed_loss,
    )


def test_the_bounded_step_keeps_eta_with_many_replies_and_bounds_it_with_few() -> None:
    s = FedARA(server_lr=3.0, server_step="bounded")
    assert s.step_size(0.3, 50) == 3.0  # √50/2 = 3.5 and 1/0.3 = 3.3: η as set
    assert s.step_size(0.9, 4) == pytest.approx(1 / 0.9)  # few agreeing replies
    assert s.step_size(0.9, 20) == pytest.approx(20**0.5 / 2)
    assert s.step_size(None, 2) == 1.0 and s.step_size(2.0, 1) == 1.0  # never below 1
    assert FedARA(server_lr=3.0, server_step="fixed").step_size(0.9, 4) == 3.0
    assert FedARA(server_lr=0.5, server_step="bounded").step_size(0.9, 4) == 0.5
