"""fd (federated distillation): the server's per-class mean against numpy (crafted
replies), the client's distillation term against closed forms, the logits it uploads
are the ones its training saw, and two rounds in process."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from client_app.base import open_run
from client_app.distill import distillation, mean_logits, received_logits
from common import methods
from common.messages import LOGIT
from common.records import to_numpy
from server_app.inprocess import client_context, run_inprocess
from strategies.fd import FD
from strategies.testing import node, reply, sized, strategy


def _logits(classes: list[int], rng: np.random.Generator, c: int = 10) -> dict[str, np.ndarray]:
    return {f"{LOGIT}{k}": rng.normal(size=c).astype(np.float32) for k in classes}


def test_the_global_logits_are_the_unweighted_mean_of_the_clients_that_have_the_class() -> None:
    a, b = (30, 30, 0, 0, 0, 0, 0, 0, 0, 0), (10, 0, 10, 0, 0, 0, 0, 0, 0, 0)
    s = sized(strategy(FD, [node(10, 0, counts=a), node(11, 1, counts=b)]), {10: 60, 11: 20})
    s.global_arrays = {f"{LOGIT}9": np.ones(10, np.float32)}  # known from an earlier round
    rng = np.random.default_rng(0)
    up0, up1 = _logits([0, 1], rng), _logits([0, 2], rng)
    arrays, metrics = s.aggregate_train(1, [reply(10, up0, 60), reply(11, up1, 20)])
    assert arrays is not None and metrics is not None and metrics["valid-replies"] == 2
    got = to_numpy(arrays)
    assert list(got) == [f"{LOGIT}{c}" for c in (0, 1, 2, 9)]  # class order; 9 kept
    np.testing.assert_allclose(got[f"{LOGIT}0"], (up0[f"{LOGIT}0"] + up1[f"{LOGIT}0"]) / 2, 1e-6)
    np.testing.assert_array_equal(got[f"{LOGIT}1"], up0[f"{LOGIT}1"])
    np.testing.assert_array_equal(got[f"{LOGIT}9"], np.ones(10, np.float32))


def test_a_reply_without_its_classes_or_with_other_shapes_is_refused() -> None:
    counts = (10, 10, 0, 0, 0, 0, 0, 0, 0, 0)
    s = sized(
        strategy(FD, [node(10, 0, counts=counts), node(11, 1, counts=counts)]), {10: 20, 11: 20}
    )
    s.global_arrays = {}
    rng = np.random.default_rng(1)
    short = _logits([0], rng)  # lacks class 1
    wide = {k: np.zeros(11, np.float32) for k in _logits([0, 1], rng)}  # C + 1 logits
    arrays, _ = s.aggregate_train(1, [reply(10, short, 20), reply(11, wide, 20)])
    assert arrays is None and sorted(nid for _, nid, _ in s.rejected) == [10, 11]


def test_the_distillation_term_against_closed_forms() -> None:
    z = torch.tensor([[1.0, 2.0, 0.5], [0.0, 0.0, 3.0]])
    t = torch.tensor([[0.5, 2.0, 1.0], [1.0, -1.0, 0.0]])
    p, q = torch.softmax(t, 1), torch.softmax(z, 1)
    kl = (p * (p.log() - q.log())).sum(1).mean()
    assert float(distillation(z, t, "kl")) == pytest.approx(float(kl), rel=1e-6)
    assert float(distillation(z, z, "kl")) == pytest.approx(0.0, abs=1e-7)
    assert float(distillation(z, t, "mse")) == pytest.approx(float(((z - t) ** 2).mean()))


def test_the_uploaded_logits_are_the_means_training_saw(tmp_path: Path) -> None:
    """The hook's loss records each batch's logits by class; the upload is their
    mean per class; the pull uses the global logits of each sample's class only."""
    run = open_run(client_context(tmp_path, "fd", pid=0), 1, methods.get("fd").client_hook())
    hook = methods.get("fd").client_hook()
    c = run.data.num_classes
    run.received = {f"{LOGIT}1": torch.full((c,), 2.0)}
    loss = hook.extra_loss(run)
    assert loss is not None
    seen = []
    rng = torch.Generator().manual_seed(0)
    for _ in range(3):
        y = torch.randint(0, c, (8,), generator=rng)
        z = torch.randn(8, c, generator=rng)
        seen.append((z, y))
        got = loss(torch.zeros(8, 4), z, y, torch.zeros(8))
        mask = y == 1
        want = run.cfg.fd.lam * distillation(z[mask], torch.full((int(mask.sum()), c), 2.0), "kl")
        assert float(got) == pytest.approx(float(want) if bool(mask.any()) else 0.0, rel=1e-6)
    z_all = torch.cat([z for z, _ in seen])
    y_all = torch.cat([y for _, y in seen])
    means, present = mean_logits(run)
    for k in range(c):
        if bool((y_all == k).any()) and bool(present[k]):
            torch.testing.assert_close(means[k], z_all[y_all == k].mean(0))
    train_classes = torch.bincount(run.data.y_train, minlength=c) > 0
    assert torch.equal(present, train_classes)
    run.received = {f"{LOGIT}99": torch.zeros(c)}
    with pytest.raises(ValueError, match="bad global logits 'logit.99'"):
        received_logits(run)


@pytest.mark.slow  # the full tier also runs fd end to end (test_eval_mode, test_reference)
def test_two_rounds_in_process_learn(tmp_path: Path) -> None:
    res, _ = run_inprocess(tmp_path, algorithm="fd")  # 3 nodes, synthetic data
    assert [r["round"] for r in res["rounds"]] == [1, 2]
    for row in res["rounds"]:
        assert sorted(row["client-train"]) == ["0", "1", "2"]
    assert res["rounds"][-1]["accuracy"] > 0.2
