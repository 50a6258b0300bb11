"""Each algorithm for 2 rounds through ``Strategy.start`` with an in-process grid."""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np
import pytest

from client_app.app import app as client_app
from common import methods
from common.config import parse_run_config
from server_app.inprocess import FakeGrid, run_inprocess, small_config
from server_app.results import Recorded
from strategies import make_strategy

ROUND_KEYS = {
    "round",
    "accuracy",
    "accuracy-mean",
    "accuracy-std",
    "loss",
    "bytes-up",
    "bytes-down",
    "bytes-up-per-client",
    "bytes-down-per-client",
    "train-clients",
    "round-time-s",
    "server-time-s",
}
SUMMARY_KEYS = {
    "accuracy-last",
    "accuracy-best",
    "best-round",
    "bytes-up-total",
    "bytes-down-total",
    "wall-time-s",
}


def test_every_method_routes_train_and_evaluate_to_its_hook() -> None:
    """The ClientApp answers ``train.<name>`` / ``evaluate.<name>`` for every
    registered method (an unregistered action is refused by Flower)."""
    routes = set(client_app._registered_funcs)
    for name in methods.METHODS:
        assert {f"train.{name}", f"evaluate.{name}"} <= routes
    assert "query.profile" in routes


@pytest.mark.parametrize("algorithm", ["local", "lgfedavg", "fedavg"])
def test_two_rounds_produce_complete_results(tmp_path: Path, algorithm: str) -> None:
    family = "fedavgcnn" if algorithm == "fedavg" else "cnn"
    res, _ = run_inprocess(tmp_path, algorithm=algorithm, **{"model.family": family})
    assert [r["round"] for r in res["rounds"]] == [1, 2]
    for row in res["rounds"]:
        assert set(row) >= ROUND_KEYS
        # accuracy is Σcorrect/Σsamples over the clients: between the clients' own
        # accuracies; accuracy-mean and accuracy-std are their plain mean and std
        per_client = list(row["client-accuracy"].values())
        assert sorted(row["client-accuracy"]) == ["0", "1", "2"]
        assert min(per_client) - 1e-12 <= row["accuracy"] <= max(per_client) + 1e-12
        assert row["accuracy-mean"] == pytest.approx(statistics.fmean(per_client))
        assert row["accuracy-std"] == pytest.approx(statistics.pstdev(per_client), abs=1e-12)
        assert row["accuracy"] > 0.0
        assert row["train-clients"] == 3
    assert set(res["summary"]) >= SUMMARY_KEYS
    assert res["config"]["algorithm"] == algorithm
    assert set(res["versions"]) == {
        *("fedhet", "flwr", "torch", "source", "git-commit", "git-dirty", "machine")
    }


def test_lgfedavg_uploads_exactly_the_head(tmp_path: Path) -> None:
    res, _ = run_inprocess(tmp_path, algorithm="lgfedavg")
    head_bytes = (500 * 10 + 10) * 4
    for row in res["rounds"]:
        assert row["bytes-up-per-client"] == head_bytes
        assert row["bytes-down-per-client"] == head_bytes
        assert row["bytes-up"] == 3 * head_bytes


def test_local_sends_nothing(tmp_path: Path) -> None:
    res, _ = run_inprocess(tmp_path, algorithm="local")
    assert res["summary"]["bytes-up-total"] == 0 == res["summary"]["bytes-down-total"]


def test_same_seed_same_metrics(tmp_path: Path) -> None:
    a, _ = run_inprocess(tmp_path / "a", algorithm="lgfedavg")
    b, _ = run_inprocess(tmp_path / "b", algorithm="lgfedavg")
    acc = [[r["accuracy"], r["loss"]] for r in a["rounds"]]
    assert acc == [[r["accuracy"], r["loss"]] for r in b["rounds"]]


def test_personal_extractor_persists_across_rounds(tmp_path: Path) -> None:
    _, grid = run_inprocess(tmp_path, algorithm="lgfedavg")
    for ctx in grid.contexts.values():
        state = ctx.state["fedhet.model"]
        assert "extractor.conv1.weight" in state and "head.weight" in state
    w = [
        ctx.state["fedhet.model"]["extractor.conv1.weight"].numpy()
        for ctx in grid.contexts.values()
    ]
    assert not np.allclose(w[0], w[1])  # personal, not shared


def test_poisoned_client_does_not_change_the_global_head(tmp_path: Path) -> None:
    """A node that replies NaN is dropped; the other two still aggregate."""
    from flwr.app import Message, RecordDict

    from common.records import to_numpy, to_record

    run_config = small_config(tmp_path, algorithm="lgfedavg")
    cfg = parse_run_config(run_config)
    grid = FakeGrid(client_app, run_config, 3)
    bad = grid.node_of_partition(2)

    def poison(reply: Message) -> Message:
        arrays = to_numpy(reply.content["arrays"])
        arrays = {k: np.full_like(v, np.nan) for k, v in arrays.items()}
        content = RecordDict({"arrays": to_record(arrays), "metrics": reply.content["metrics"]})
        return Message(content, reply_to=grid.sent[-1])

    grid.faults[bad] = poison
    strategy = make_strategy(cfg)
    recorder = Recorded(strategy, cfg, cfg.resolved_out_dir("t"))
    recorder.start(
        grid,
        strategy.initial_arrays(grid),
        num_rounds=2,
        evaluate_fn=recorder.end_round,
    )
    assert {n for _, n, _ in strategy.rejected} == {bad}
    assert all(np.isfinite(v).all() for v in strategy.global_arrays.values())
    assert [r["valid-replies"] for r in recorder.rounds] == [2, 2]


def test_official_protocol_reports_accuracy_on_the_official_test_set(tmp_path: Path) -> None:
    res, _ = run_inprocess(tmp_path, algorithm="lgfedavg", **{"data.protocol": "official"})
    for row in res["rounds"]:
        assert 0.0 < row["accuracy-global"] <= 1.0
    merged, _ = run_inprocess(tmp_path / "m", algorithm="lgfedavg")
    assert all(r["accuracy-global"] is None for r in merged["rounds"])


def test_a_client_whose_training_diverges_keeps_its_last_good_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round 1 of partition 2 ends with NaN weights: its reply is rejected, its personal
    model is not overwritten (round 2 trains from the finite one and is saved)."""
    import torch

    hook = methods.get("lgfedavg").client_hook()
    train = hook.train

    def diverge(run):  # type: ignore[no-untyped-def]
        stats = train(run)
        if run.node.partition_id == 2 and run.server_round == 1:
            with torch.no_grad():
                for p in run.model.parameters():
                    p.fill_(float("nan"))
        return stats

    monkeypatch.setattr(hook, "train", diverge)
    res, grid = run_inprocess(tmp_path, algorithm="lgfedavg")
    assert [r["valid-replies"] for r in res["rounds"]] == [2, 3]
    bad = grid.contexts[grid.node_of_partition(2)]
    assert int(bad.state["fedhet.meta"]["rounds-trained"]) == 1
    for key, value in bad.state["fedhet.model"].items():
        assert np.isfinite(value.numpy()).all(), key
    assert res["rounds"][-1]["accuracy"] > 0.0


def test_aggregated_replies_are_released(tmp_path: Path) -> None:
    """Flower's round loop holds a round's replies until the next round's are in; the
    recorder empties them once aggregated, so a ServerApp holds one round of uploads,
    not two (their bytes are freed while the loop's list still holds the messages)."""
    import gc
    import tracemalloc

    from common.records import content_bytes
    from strategies.fedavg import FedAvg
    from strategies.testing import node, reply, sized, strategy

    nodes = [node(10 + i, i, arch="fedavgcnn", d=512) for i in range(8)]
    s = strategy(FedAvg, nodes, **{"model.family": "fedavgcnn"})
    s.global_arrays = g = s.init_global()
    sized(s, {n.node_id: 10 for n in nodes})
    recorder = Recorded(s, parse_run_config(small_config(tmp_path)), tmp_path / "out")
    tracemalloc.start()
    try:
        replies = [
            reply(n.node_id, {k: v + i for k, v in g.items()}, 10) for i, n in enumerate(nodes)
        ]
        sent = sum(content_bytes(r.content) for r in replies)
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        arrays, _ = recorder.aggregate_train(1, replies)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert arrays is not None and len(replies) == 8
    assert all(not r.content.array_records for r in replies)
    # eight replies freed; the new global is held twice (its arrays and its record)
    assert before - after > 0.5 * sent
