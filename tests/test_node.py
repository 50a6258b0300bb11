"""Node-level deployment features: profiles, device-local data, state on disk."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict

import data.client
from client_app import profiles
from client_app.app import app as client_app
from client_app.base import open_run
from common import methods
from common.config import ConfigError
from common.records import to_record
from server_app.inprocess import client_context


def test_auto_picks_the_largest_profile_that_fits() -> None:
    assert profiles.pick_auto(cpus=4, memory_gb=0.8, cuda=False).name == "rpi4"
    assert profiles.pick_auto(cpus=4, memory_gb=3.0, cuda=False).name == "rpi5"
    assert profiles.pick_auto(cpus=8, memory_gb=6.0, cuda=True).name == "server"
    assert profiles.pick_auto(cpus=6, memory_gb=3.5, cuda=True).name == "jetson-orin-nano"
    assert profiles.pick_auto(cpus=1, memory_gb=0.1, cuda=False).name == "rpi4"
    assert profiles.resolve("auto").name in profiles.PROFILES


def test_unknown_profile_is_named() -> None:
    with pytest.raises(ValueError, match="profile='toaster'.*rpi4.*auto"):
        profiles.resolve("toaster")


def _context(tmp_path: Path, node_config: dict, algorithm: str = "lgfedavg") -> Context:
    return client_context(tmp_path, algorithm, node_config=node_config)


def test_profile_sets_architecture_batch_threads(tmp_path: Path) -> None:
    run = open_run(
        _context(tmp_path, {"profile": "rpi5"}), 1, methods.get("lgfedavg").client_hook()
    )
    assert run.node.arch == "cnn-4" and run.sgd.batch_size == 16
    fedara = open_run(
        _context(tmp_path, {"profile": "rpi4"}, "fedara"), 1, methods.get("fedara").client_hook()
    )
    assert fedara.node.arch == "cnn-1" and fedara.notes["tier"][0] == 0.125


def test_data_cache_own_keeps_only_the_nodes_files(tmp_path: Path) -> None:
    """node-config data-cache="own": the node's cache holds its own partition files
    alone (the same data as the shared whole partition); a bad value is named."""
    hook = methods.get("lgfedavg").client_hook()
    own = open_run(_context(tmp_path, {"partition-id": 1, "data-cache": "own"}), 1, hook)
    cache = Path(own.cfg.data.cache_dir)
    files = sorted(str(p.relative_to(cache)).split("/", 1)[1] for p in cache.rglob("*.npz"))
    assert files == ["test/1.npz", "train/1.npz"]
    data.client._CACHE.clear()  # the process's loaded clients: reload from the cache
    shared = open_run(_context(tmp_path, {"partition-id": 1, "data-cache": "all"}), 1, hook)
    assert len(list(cache.rglob("*.npz"))) == 2 + 2 * 3
    assert torch.equal(own.data.x_train, shared.data.x_train)
    with pytest.raises(ConfigError, match="node-config data-cache='mine' must be"):
        open_run(_context(tmp_path, {"data-cache": "mine"}), 1, hook)


def test_device_local_npz_is_split_locally(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    path = tmp_path / "mine.npz"
    np.savez(path, x=rng.integers(0, 255, (80, 28, 28), dtype=np.uint8), y=rng.integers(0, 10, 80))
    run = open_run(
        _context(tmp_path, {"data-name": "npz", "data-root": str(path)}),
        1,
        methods.get("lgfedavg").client_hook(),
    )
    assert len(run.data.y_train) + len(run.data.y_test) == 80
    assert len(run.data.y_test) == 20


def test_device_local_missing_path_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.npz"
    with pytest.raises(ConfigError, match=str(missing)):
        open_run(
            _context(tmp_path, {"data-name": "npz", "data-root": str(missing)}),
            1,
            methods.get("lgfedavg").client_hook(),
        )


def _train(ctx: Context, head: dict, server_round: int, lineage: str = "") -> Message:
    config = ConfigRecord({"server-round": server_round, "lineage": lineage})
    msg = Message(
        RecordDict({"arrays": to_record(head), "config": config}),
        dst_node_id=ctx.node_id,
        message_type="train.lgfedavg",
    )
    return client_app(msg, ctx)


def test_state_dir_lets_a_restarted_node_resume(tmp_path: Path) -> None:
    """With a state dir the personal model lives on disk, one file per round (the two
    newest kept), and only a round counter in memory; a restarted node continues."""
    from client_app import state as personal_state

    state_dir = tmp_path / "state"
    head = {"head.weight": np.zeros((10, 500), np.float32), "head.bias": np.zeros(10, np.float32)}
    ctx = _context(tmp_path, {"state-dir": str(state_dir)})
    for rnd in (1, 2, 3):
        reply = _train(ctx, head, rnd)
        assert reply.content["metrics"]["rounds-trained"] == rnd
    assert "fedhet.model" not in ctx.state.array_records  # nothing heavy in memory
    files = sorted(state_dir.glob("lgfedavg-cnn-1-*.r*.pt"))
    assert [f.name[-10:] for f in files] == ["r000002.pt", "r000003.pt"]
    after_two = torch.load(files[0], weights_only=True)["model"]["extractor.fc1.weight"]

    # a node restarted in round 3 (whose round-3 file a crash may have left) starts
    # round 3 again from what round 2 left, and evaluates round 3 with round 3's
    restarted = _context(tmp_path, {"state-dir": str(state_dir)})  # empty memory
    run = open_run(restarted, 3, methods.get("lgfedavg").client_hook())
    assert torch.equal(run.model.state_dict()["extractor.fc1.weight"], after_two)
    assert run.rounds_trained == 2
    evaluated = open_run(restarted, 3, methods.get("lgfedavg").client_hook(), training=False)
    after_three = personal_state.load(run.state_path)[0]["extractor.fc1.weight"]  # type: ignore[index]
    assert torch.equal(evaluated.model.state_dict()["extractor.fc1.weight"], after_three)
    assert _train(restarted, head, 4).content["metrics"]["rounds-trained"] == 4

    fresh = _context(tmp_path, {})  # no state dir: a new model, kept in memory
    run = open_run(fresh, 3, methods.get("lgfedavg").client_hook())
    assert not torch.equal(run.model.state_dict()["extractor.fc1.weight"], after_two)


def test_a_new_run_starts_fresh_a_resumed_one_from_its_own_round(tmp_path: Path) -> None:
    """A new run on a node with an earlier run's files starts from a fresh model (the
    same round-1 metrics as the first run with that seed); a round run again after a
    crash starts from what this run's round before it left."""
    state_dir = tmp_path / "state"
    head = {"head.weight": np.zeros((10, 500), np.float32), "head.bias": np.zeros(10, np.float32)}
    first = _train(_context(tmp_path, {"state-dir": str(state_dir)}), head, 1, "runa")
    assert first.content["metrics"]["rounds-trained"] == 1
    assert _train(_context(tmp_path, {"state-dir": str(state_dir)}), head, 2, "runa")
    again = _context(tmp_path, {"state-dir": str(state_dir)})  # a new process, a new run
    second = _train(again, head, 1, "runb")
    assert second.content["metrics"]["rounds-trained"] == 1
    timeless = (
        {k: v for k, v in dict(r.content["metrics"]).items() if k != "train-time-s"}
        for r in (first, second)
    )
    assert next(timeless) == next(timeless)
    # run b crashed in round 2 after the node saved: round 2 again starts from run b's round 1
    assert _train(again, head, 2, "runb").content["metrics"]["rounds-trained"] == 2
    rerun = _context(tmp_path, {"state-dir": str(state_dir)})
    assert (
        open_run(rerun, 2, methods.get("lgfedavg").client_hook(), lineage="runb").rounds_trained
        == 1
    )


def test_carry_personal_state_continues_the_model_an_earlier_run_left(tmp_path: Path) -> None:
    """``carry-personal-state = true``: a new run's first message continues from the
    newest model any earlier run left; its own rounds still win once it has them."""
    state_dir = tmp_path / "state"
    head = {"head.weight": np.zeros((10, 500), np.float32), "head.bias": np.zeros(10, np.float32)}

    def ctx() -> Context:
        return client_context(
            tmp_path,
            "lgfedavg",
            node_config={"state-dir": str(state_dir)},
            **{"carry-personal-state": True},
        )

    for rnd in (1, 2):
        assert _train(ctx(), head, rnd, "runa").content["metrics"]["rounds-trained"] == rnd
    restarted = ctx()  # a new process
    assert _train(restarted, head, 1, "runb").content["metrics"]["rounds-trained"] == 3
    # run b crashed in round 1 after the node saved: round 1 again starts from run a's
    again = ctx()
    assert (
        open_run(again, 1, methods.get("lgfedavg").client_hook(), lineage="runb").rounds_trained
        == 2
    )
    assert _train(again, head, 1, "runb").content["metrics"]["rounds-trained"] == 3
    assert _train(again, head, 2, "runb").content["metrics"]["rounds-trained"] == 4
    # round 2 of run b run again: from run b's round 1
    assert (
        open_run(ctx(), 2, methods.get("lgfedavg").client_hook(), lineage="runb").rounds_trained
        == 3
    )
    names = sorted(f.name.split(".", 1)[1] for f in state_dir.glob("*.pt"))
    assert names == ["r000001.runb.pt", "r000002.runb.pt"]


def test_state_from_another_setup_is_not_loaded(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    head = {"head.weight": np.zeros((10, 500), np.float32), "head.bias": np.zeros(10, np.float32)}
    _train(_context(tmp_path, {"state-dir": str(state_dir)}), head, 1)
    other = client_context(tmp_path, "lgfedavg", node_config={"state-dir": str(state_dir)}, seed=5)
    assert open_run(other, 1, methods.get("lgfedavg").client_hook()).rounds_trained == 0


@pytest.mark.parametrize("init", ["per-client", "shared"])
def test_model_init_shared_starts_one_architecture_identical(tmp_path: Path, init: str) -> None:
    """Partitions 0 and 5 both run cnn-1 (round-robin over 5): identical initial
    weights exactly when model.init = shared; cnn-2 (partition 1) differs anyway."""
    runs = [
        open_run(
            client_context(tmp_path, "local", pid=pid, num=6, **{"model.init": init}),
            1,
            methods.get("local").client_hook(),
        )
        for pid in (0, 5, 1)
    ]
    assert runs[0].node.arch == runs[1].node.arch == "cnn-1" != runs[2].node.arch
    a, b = runs[0].model.state_dict(), runs[1].model.state_dict()
    same = all(torch.equal(a[k], b[k]) for k in a)
    assert same == (init == "shared")
