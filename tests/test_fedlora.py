"""FedLoRA: a homogeneous adapter in heterogeneous models, two training phases."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from client_app.base import open_run
from client_app.fedlora import train_adapter, train_local_model
from common import methods
from common.records import to_numpy
from models import build_model, family_archs
from models.adapter import ADAPTERS, adapter_shapes, attach_adapters
from server_app.inprocess import client_context, run_inprocess
from strategies.fedlora import FedLoRA
from strategies.testing import node, reply, sized, strategy


def _adapter_state(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {
        k: tuple(v.shape) for k, v in model.state_dict().items() if k.startswith(ADAPTERS + ".")
    }


@pytest.mark.parametrize("family", ["cnn", "htfe"])
def test_adapter_keys_and_shapes_are_identical_across_architectures(
    family: str,
) -> None:
    seen = set()
    for arch in family_archs(family):
        model = build_model(arch, in_channels=1, num_classes=10, image_size=28, feature_dim=512)
        attach_adapters(model, ["head"], rank=4, alpha=4.0)
        seen.add(tuple(sorted(_adapter_state(model).items())))
    assert len(seen) == 1
    assert dict(next(iter(seen))) == adapter_shapes(["head"], 512, 10, 4)


def test_fresh_adapter_does_not_change_the_output() -> None:
    model = build_model(
        "cnn-3", in_channels=1, num_classes=10, image_size=28, feature_dim=500, seed=0
    )
    x = torch.randn(5, 1, 28, 28)
    before = model(x)
    attach_adapters(model, ["head"], rank=8, alpha=16.0)
    assert torch.equal(model(x), before)
    model.adapters["head"].B.data.normal_()
    assert not torch.allclose(model(x), before)


def test_adapter_branch_is_alpha_over_r_b_a_z() -> None:
    model = build_model("cnn-5", in_channels=1, num_classes=10, image_size=28, feature_dim=500)
    lora = attach_adapters(model, ["head"], rank=2, alpha=6.0)["head"]
    lora.B.data.normal_()
    z = torch.randn(3, 500)
    plain = torch.nn.functional.linear(z, model.head.weight, model.head.bias)
    want = plain + 3.0 * (z @ lora.A.T) @ lora.B.T
    torch.testing.assert_close(model.classify(z), want)


def test_non_square_target_is_refused_by_name() -> None:
    model = build_model("cnn-1", in_channels=1, num_classes=10, image_size=28, feature_dim=500)
    with pytest.raises(ValueError, match="extractor.fc1.*not d→d"):
        attach_adapters(model, ["head", "extractor.fc1"], rank=2, alpha=2.0)


def _run(tmp_path: Path):  # type: ignore[no-untyped-def]
    run = open_run(
        client_context(tmp_path, "fedlora", pid=2), 2, methods.get("fedlora").client_hook()
    )
    run.model.adapters["head"].B.data.normal_(std=0.1)  # a non-trivial adapter
    return run


def _split(model: torch.nn.Module) -> tuple[dict, dict]:
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ad = {k: v for k, v in state.items() if k.startswith(ADAPTERS + ".")}
    return ad, {k: v for k, v in state.items() if k not in ad}


def test_phase_one_leaves_the_adapter_bit_identical(tmp_path: Path) -> None:
    run = _run(tmp_path)
    ad0, loc0 = _split(run.model)
    train_local_model(run)
    ad1, loc1 = _split(run.model)
    assert all(torch.equal(ad0[k], ad1[k]) for k in ad0)
    assert any(not torch.equal(loc0[k], loc1[k]) for k in loc0)


def test_phase_two_leaves_the_local_model_bit_identical(tmp_path: Path) -> None:
    run = _run(tmp_path)
    ad0, loc0 = _split(run.model)
    train_adapter(run)
    ad1, loc1 = _split(run.model)
    assert all(torch.equal(loc0[k], loc1[k]) for k in loc0)
    assert all(not torch.equal(ad0[k], ad1[k]) for k in ad0)


@pytest.mark.parametrize(
    "pid", [pytest.param(1, marks=pytest.mark.slow), 2]
)  # htfe: resnet18, mobilenet_v2 (BatchNorm)
def test_phase_two_leaves_batchnorm_statistics_of_the_frozen_model_unchanged(
    tmp_path: Path, pid: int
) -> None:
    """Every parameter *and buffer* (running_mean, running_var, num_batches_tracked)
    of the frozen local model is bit-identical after the adapter phase."""
    ctx = client_context(tmp_path, "fedlora", pid=pid, num=4, **{"model.family": "htfe"})
    run = open_run(ctx, 2, methods.get("fedlora").client_hook())
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in run.model.modules())
    ad0, loc0 = _split(run.model)
    train_adapter(run)
    ad1, loc1 = _split(run.model)
    changed = [k for k in loc0 if not torch.equal(loc0[k], loc1[k])]
    assert changed == []
    assert any(not torch.equal(ad0[k], ad1[k]) for k in ad0)
    assert run.model.training  # the model is left in training mode as the loop found it


def test_aggregation_is_the_weighted_mean_and_poison_is_ignored() -> None:
    nodes = [node(10 + i, i) for i in range(3)]
    s = strategy(FedLoRA, nodes)
    s.global_arrays = s.init_global()
    assert {k: v.shape for k, v in s.global_arrays.items()} == adapter_shapes(["head"], 500, 10, 8)
    rng = np.random.default_rng(0)
    ups = [
        {k: rng.normal(size=v.shape).astype(np.float32) for k, v in s.global_arrays.items()}
        for _ in range(3)
    ]
    bad = {k: v.copy() for k, v in ups[2].items()}
    bad["adapters.head.B"][0, 0] = np.inf
    sized(s, {10: 1, 11: 3, 12: 100})
    arrays, _ = s.aggregate_train(
        1, [reply(10, ups[0], 1), reply(11, ups[1], 3), reply(12, bad, 100)]
    )
    got = to_numpy(arrays)
    for k in got:
        np.testing.assert_allclose(got[k], (ups[0][k] + 3 * ups[1][k]) / 4, rtol=1e-5, atol=1e-6)
    assert [n for _, n, _ in s.rejected] == [12]


def test_rep_adapter_upload_bytes_and_contract(tmp_path: Path) -> None:
    """targets=rep: a d→d residual adapter (A r×d, B d×r), the same for every
    architecture; upload = download = its parameters × 4 bytes."""
    res, grid = run_inprocess(
        tmp_path, algorithm="fedlora", **{"fedlora.targets": "rep", "fedlora.rank": 4}
    )
    params = 4 * 500 + 500 * 4
    assert all(r["bytes-up-per-client"] == params * 4 for r in res["rounds"])
    assert all(r["bytes-down-per-client"] == params * 4 for r in res["rounds"])
    assert all(r["valid-replies"] == 3 for r in res["rounds"])
    assert res["rounds"][-1]["accuracy-without-shared"] is not None
    assert {"logit-share", "adapter-weight-ratio"} <= set(res["rounds"][-1]["eval-diagnostics"])


def test_rep_adapter_is_a_residual_on_the_representation() -> None:
    model = build_model("cnn-2", in_channels=1, num_classes=10, image_size=28, feature_dim=500)
    attach_adapters(model, ["rep"], rank=2, alpha=4.0)
    lora = model.adapters["rep"]
    lora.B.data.normal_()
    z = torch.randn(3, 500)
    shifted = z + 2.0 * (z @ lora.A.T) @ lora.B.T  # (α/r) = 4 / 2
    want = torch.nn.functional.linear(shifted, model.head.weight, model.head.bias)
    torch.testing.assert_close(model.classify(z), want)


def test_upload_bytes_equal_adapter_parameters(tmp_path: Path) -> None:
    res, grid = run_inprocess(tmp_path, algorithm="fedlora", **{"fedlora.rank": 4})
    params = 4 * 500 + 10 * 4
    assert all(r["bytes-up-per-client"] == params * 4 for r in res["rounds"])
    assert all(r["bytes-down-per-client"] == params * 4 for r in res["rounds"])
    # the heterogeneous local models persist per node, with their adapters
    archs = {
        ctx.state["fedhet.model"]["extractor.fc1.weight"].shape for ctx in grid.contexts.values()
    }
    assert len(archs) == 3
