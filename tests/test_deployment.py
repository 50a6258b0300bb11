"""A real federation: SuperLink + 3 SuperNodes as processes on 127.0.0.1, TLS and
SuperNode authentication on, each node's tasks run by the warm executor (``fedhet
superexec``). Every process is started in its own group and killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from cli.federation import Federation
from cli.launch import free_port
from tests.federation_support import (
    app_copy,
    counted_app,
    marked_app,
    run_overrides,
    training_child,
)

ROOT = Path(__file__).resolve().parent.parent
# one worker runs them in order: later tests use the first run's results and node state
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("deployment")]
PROFILES = ("rpi4", "rpi5", "server")


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    work = tmp_path_factory.mktemp("federation")
    configs = [
        {
            "partition-id": i,
            "num-partitions": 3,
            "profile": PROFILES[i],
            "state-dir": str(work / "state" / f"node-{i}"),
        }
        for i in range(3)
    ]
    with Federation(work, configs, ROOT, secure=True) as federation:
        yield federation


def overrides(fed: Federation, name: str, **extra) -> dict:  # type: ignore[no-untyped-def]
    return run_overrides(fed, name, "fedre", **extra)


def results(fed: Federation, name: str) -> dict:
    return json.loads((fed.workdir / name / "results.json").read_text())


def test_tls_auth_run_completes(fed: Federation) -> None:
    outcome = fed.run(overrides(fed, "first"), timeout=600)
    assert outcome.ok, outcome.log_path.read_text()[-3000:]
    res = results(fed, "first")
    assert [r["valid-replies"] for r in res["rounds"]] == [3, 3]
    assert all(r["bytes-up-per-client"] == (500 + 10) * 4 for r in res["rounds"])
    # profiles chose the architectures: rpi4 -> cnn-5, rpi5 -> cnn-4, server -> cnn-1
    assert res["summary"]["nodes"] == {"0": "cnn-5", "1": "cnn-4", "2": "cnn-1"}
    assert all(
        len(list((fed.workdir / "state" / f"node-{i}").glob("fedre-*.r*.pt"))) == 2
        for i in range(3)
    )


def test_unregistered_supernode_is_refused(fed: Federation) -> None:
    cmd = fed.node_command(0, key_index=3)  # node-3's key was never registered
    cmd[cmd.index("--port") + 1] = str(free_port())
    proc = fed.procs.start("intruder", cmd)
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        fed.procs.stop("intruder", sig=signal.SIGKILL)
    assert code not in (None, 0)
    assert "Failed to activate SuperNode" in (fed.workdir / "logs" / "intruder.log").read_text()
    assert fed.online_nodes() == 3


def test_a_second_run_on_the_same_nodes_repeats_the_first_runs_metrics(fed: Federation) -> None:
    """Personal state on a node belongs to the run that made it: a new run with the
    same seed starts from fresh models, whatever earlier runs left in the state dirs."""
    if not (fed.workdir / "first" / "results.json").exists():
        assert fed.run(overrides(fed, "first"), timeout=600).ok
    outcome = fed.run(overrides(fed, "again"), timeout=600)
    assert outcome.ok, outcome.log_path.read_text()[-3000:]
    keys = ("accuracy", "loss", "accuracy-std", "valid-replies")
    first, again = results(fed, "first")["rounds"], results(fed, "again")["rounds"]
    assert [[r[k] for k in keys] for r in again] == [[r[k] for k in keys] for r in first]
    assert all(c["rounds-trained"] == 1 for c in again[0]["client-train"].values())


def test_restarted_supernode_resumes_its_personal_model(fed: Federation) -> None:
    """With ``carry-personal-state`` a node's personal model outlives the run and the
    node's process: a SIGKILLed SuperNode comes back with it from its state dir."""
    fed.restart_node(2, sig=signal.SIGKILL)
    run = overrides(fed, "after-restart", **{"num-server-rounds": 1, "carry-personal-state": True})
    outcome = fed.run(run, timeout=600)
    assert outcome.ok, outcome.log_path.read_text()[-3000:]
    row = results(fed, "after-restart")["rounds"][0]
    # 2 rounds in the previous run + this one: the model came back from the state dir
    assert row["client-train"]["2"]["rounds-trained"] == 3


# ---------------------------------------------------------------- warm executor


def test_packed_and_unpacked_messages_give_the_same_metrics(fed: Federation) -> None:
    """``pack-messages`` (the default: each message's records as one array on the wire)
    against the records sent one object each: every per-round metric equal."""
    outcome = fed.run(overrides(fed, "unpacked", **{"pack-messages": False}), timeout=600)
    assert outcome.ok, outcome.log_path.read_text()[-3000:]
    packed, unpacked = results(fed, "first")["rounds"], results(fed, "unpacked")["rounds"]
    keys = ("accuracy", "loss", "accuracy-std", "bytes-up", "bytes-down", "valid-replies")
    assert [[r[k] for k in keys] for r in packed] == [[r[k] for k in keys] for r in unpacked]


def test_every_part_off_falls_back_to_flowers_own_runtime_and_completes(
    fed: Federation, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a Flower that fits none of fedhet's runtime changes gets
    (``FEDHET_FLOWER_PARTS_OFF=all``, as a failed gate would): each process says which
    part is off in one line, and the run completes with the warm path's metrics. With
    the warm executor off every message runs in a fresh process of Flower's subprocess
    executor, as with ``fedhet federation --cold``: this is also the check that the cold
    path gives the warm path's per-round metrics (the cold federation itself runs in
    tests/test_executor_auth.py)."""
    monkeypatch.setenv("FEDHET_FLOWER_PARTS_OFF", "all")
    configs = [
        {**c, "state-dir": str(tmp_path / "state" / f"node-{i}")}
        for i, c in enumerate(fed.node_configs)
    ]
    with Federation(tmp_path / "off", configs, ROOT, secure=True) as off:
        outcome = off.run(overrides(fed, "parts-off"), timeout=900)
        logs = {p.name: p.read_text() for p in (tmp_path / "off" / "logs").glob("*.log")}
    assert outcome.ok, outcome.log_path.read_text()[-3000:]
    warm, stock = results(fed, "first")["rounds"], results(fed, "parts-off")["rounds"]
    keys = ("accuracy", "loss", "accuracy-std", "bytes-up", "valid-replies")
    assert [[r[k] for k in keys] for r in warm] == [[r[k] for k in keys] for r in stock]
    node, executor = logs["supernode-0.log"], logs["superexec-0.log"]
    for part in ("node-polling", "node-objects", "run-watch", "carried-objects"):
        assert node.count(f"; {part} off, using") == 1, part
    assert executor.count("; warm-executor off, using Flower's subprocess executor") == 1


def test_a_second_run_with_changed_app_code_uses_the_new_code(
    fed: Federation, tmp_path: Path
) -> None:
    """The warm parent never imports the app: each run's FAB is what its tasks run."""
    app = app_copy(tmp_path)
    source, config = app / "client_app" / "app.py", app / "common" / "config.py"
    original, original_config = source.read_text(), config.read_text()
    assert '"rounds-trained": run.rounds_trained,' in original
    # the marker lives in common/, which the executor's own command line also imports
    source.write_text(
        original.replace(
            '"rounds-trained": run.rounds_trained,',
            '"rounds-trained": run.rounds_trained, "code-marker": CODE_MARKER,',
        ).replace(
            "from common.records import",
            "from common.config import CODE_MARKER\nfrom common.records import",
        )
    )
    markers = []
    try:
        for marker in (1, 2):
            config.write_text(original_config + f"\nCODE_MARKER = {marker}\n")
            fed.app_dir = app
            outcome = fed.run(overrides(fed, f"code-{marker}", **{"num-server-rounds": 1}))
            assert outcome.ok, outcome.log_path.read_text()[-3000:]
            train = results(fed, f"code-{marker}")["rounds"][0]["client-train"]
            markers.append({m["code-marker"] for m in train.values()})
    finally:
        fed.app_dir = ROOT
    assert markers == [{1}, {2}]


def test_a_killed_superlink_is_restarted_and_the_run_resumed(fed: Federation) -> None:
    """SIGKILL of the SuperLink (and with it the ServerApp) once round 2 of 3 has
    started; the restarted SuperLink knows its nodes again, and `resume` finishes the
    run: round 1's evaluation, which was travelling with round 2's training messages
    (``eval-mode = with-train``), by messages of its own, then rounds 2 and 3."""
    killed = []

    def echo(line: str) -> None:
        if not killed and "[ROUND 2/3]" in line:
            killed.append(time.time())
            threading.Thread(target=fed.restart_superlink, daemon=True).start()

    first = fed.run(overrides(fed, "superlink-killed", **{"num-server-rounds": 3}), echo=echo)
    assert killed and not first.ok
    deadline = time.monotonic() + 240
    while fed.online_nodes() < 3 and time.monotonic() < deadline:
        time.sleep(2)
    before = results(fed, "superlink-killed")["rounds"]
    assert [r["round"] for r in before] == [1]
    assert before[0]["accuracy"] is None  # its evaluation was on its way
    resumed = fed.run(
        overrides(
            fed,
            "superlink-killed",
            **{"num-server-rounds": 3, "resume": str(fed.workdir / "superlink-killed")},
        ),
        timeout=900,
    )
    assert resumed.ok, resumed.log_path.read_text()[-3000:]
    rounds = results(fed, "superlink-killed")["rounds"]
    assert [r["round"] for r in rounds] == [1, 2, 3]
    evaluated = {"accuracy", "accuracy-mean", "accuracy-std", "loss", "accuracy-without-shared"}
    evaluated |= {"eval-clients", "client-accuracy", "eval-diagnostics"}
    assert {k: v for k, v in rounds[0].items() if k not in evaluated} == {
        k: v for k, v in before[0].items() if k not in evaluated
    }
    assert all(r["valid-replies"] == 3 and r["eval-clients"] == 3 for r in rounds)


@pytest.mark.parametrize("mode", ["with-train", "separate"])
def test_one_message_per_node_round(fed: Federation, tmp_path: Path, mode: str) -> None:
    """Counted where the messages arrive (a test build of the ClientApp logs each):
    with ``eval-mode = with-train`` every node gets one message per round (its
    training message, which carries the previous round's evaluation) and one
    closing evaluation; ``separate`` sends a training and an evaluation message per
    node-round. Both runs evaluate the same."""
    app, log = counted_app(tmp_path)
    fed.app_dir = app
    try:
        outcome = fed.run(
            overrides(fed, mode, **{"num-server-rounds": 3, "eval-mode": mode}), timeout=900
        )
    finally:
        fed.app_dir = ROOT
    assert outcome.ok, outcome.log_path.read_text()[-3000:]
    lines = [line.split() for line in log.read_text().splitlines()]
    got: dict[tuple[str, str, str], int] = {}
    for pid, kind, rnd in lines:
        if kind.startswith(("train.", "evaluate.")):
            got[pid, kind.split(".")[0], rnd] = got.get((pid, kind.split(".")[0], rnd), 0) + 1
    trains = {(str(p), "train", str(r)): 1 for p in range(3) for r in (1, 2, 3)}
    if mode == "with-train":
        assert got == {**trains, **{(str(p), "evaluate", "3"): 1 for p in range(3)}}
    else:
        evals = {(str(p), "evaluate", str(r)): 1 for p in range(3) for r in (1, 2, 3)}
        assert got == {**trains, **evals}
    res = results(fed, mode)
    assert [r["eval-clients"] for r in res["rounds"]] == [3, 3, 3]


# ------------------------------------------- near the end: these two disturb node 1


def _run_marked(fed: Federation, app: Path, name: str, hunt) -> object:  # type: ignore[no-untyped-def]
    """Run 2 fedre rounds with the marked app; ``hunt`` starts in a thread once round 1's
    tasks are next."""

    def echo(line: str) -> None:
        if "[fedhet] fedre:" in line:  # nodes known: the next tasks are round 1's
            threading.Thread(target=hunt, daemon=True).start()

    fed.app_dir = app
    try:
        return fed.run(overrides(fed, name, **{"round-timeout": 150.0}), timeout=900, echo=echo)
    finally:
        fed.app_dir = ROOT


def test_a_killed_task_child_fails_only_its_task(fed: Federation, tmp_path: Path) -> None:
    """SIGKILL of a task child while it trains in round 1 (a test build of the app
    marks those children): the warm executor reports the task failed and the node
    answers with an error at once, so round 1 ends within round 2's time + 10 s (not
    after Flower's 60 s token expiry); every other task completes, and the node serves
    round 2."""
    app, training = marked_app(tmp_path)
    killed: list[int] = []
    marked_after_kill: list[bool] = []

    def hunt() -> None:
        if killed or (pid := training_child(fed, 1, training)) is None:
            return
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
        time.sleep(0.5)
        # still there: the child died inside the handler, before any reply
        marked_after_kill.append((training / str(pid)).exists())

    outcome = _run_marked(fed, app, "child-killed", hunt)
    assert killed, "no training task child of node 1 was seen"
    assert marked_after_kill == [True], "the kill came after the child's handler returned"
    assert outcome.ok, outcome.log_path.read_text()[-3000:]  # type: ignore[attr-defined]
    res = results(fed, "child-killed")
    # exactly the killed training reply is lost: 2 rounds x 3 nodes x (train + evaluate) - 1
    rounds = res["rounds"]
    assert sum(r["valid-replies"] + r["eval-clients"] for r in rounds) == 11
    assert sum(r["valid-replies"] for r in rounds) == 5
    assert [r["valid-replies"] for r in rounds] == [2, 3]
    [rejected] = res["summary"]["rejected-replies"]
    assert "error reply" in rejected["reason"] and "died (exit code -9)" in rejected["reason"]
    assert sum(r["missing-replies"] for r in rounds) == 0
    assert rounds[0]["round-time-s"] <= rounds[1]["round-time-s"] + 10.0, rounds
    log = (fed.workdir / "logs" / "superexec-1.log").read_text()
    assert "ended with exit code -9 before its reply; reported it to the node as failed" in log


def test_node_killed_in_round_one_does_not_stop_the_run(fed: Federation, tmp_path: Path) -> None:
    """SIGKILL of node 1 (SuperNode and executor) while it trains in round 1, so it
    cannot have replied: the run goes on with the two others in both rounds."""
    app, training = marked_app(tmp_path)
    killed: list[int] = []

    def hunt() -> None:
        if killed or (pid := training_child(fed, 1, training)) is None:
            return
        fed.stop_node(1, sig=signal.SIGKILL)
        killed.append(pid)

    # the SuperLink answers for the dead node with an error once its heartbeat expires
    outcome = _run_marked(fed, app, "killed", hunt)
    assert killed, "no training task child of node 1 was seen in round 1"
    assert outcome.ok, outcome.log_path.read_text()[-3000:]  # type: ignore[attr-defined]
    res = results(fed, "killed")
    assert [r["round"] for r in res["rounds"]] == [1, 2]
    assert [r["valid-replies"] for r in res["rounds"]] == [2, 2]
    first = res["rounds"][0]
    assert first["train-clients"] == 3
    assert first["missing-replies"] + len(res["summary"]["rejected-replies"]) == 1
    assert sorted(first["client-train"]) == ["0", "2"]
