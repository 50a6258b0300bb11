"""``eval-mode = with-train``: a round's evaluation inside the next training message.

The same seed gives the same per-round evaluation in both modes, for every method, with
every node training every round, with partial participation (nodes evaluated but not
sampled for the next round get an evaluation message of their own), with ``eval-every``
and with FedARA's deadline policy (whose next-round tier may differ from the evaluated
one: the message then carries the evaluation's arrays as well). Messages are counted at
the grid: one per node-round, plus one closing evaluation.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Error, Message

from client_app.app import app
from common import methods
from common.config import parse_run_config
from common.messages import EVAL_ARRAYS, EVAL_CONFIG
from server_app.app import serve
from server_app.inprocess import FakeGrid, run_inprocess, small_config
from server_app.results import Recorded
from strategies import make_strategy
from strategies.fedara import FedARA
from tests.test_resume import Crash, CrashingGrid

EVAL_FIELDS = (
    "accuracy",
    "accuracy-mean",
    "accuracy-std",
    "loss",
    "accuracy-global",
    "accuracy-without-shared",
    "eval-diagnostics",
    "eval-clients",
    "client-accuracy",
)
TRAIN_FIELDS = ("train-loss", "valid-replies", "bytes-up", "bytes-down", "client-bytes-up")


def family(algorithm: str) -> str:
    return "fedavgcnn" if methods.get(algorithm).name == "fedavg" else "cnn"


def both(
    tmp_path: Path, num_nodes: int = 3, **overrides: Any
) -> tuple[dict, FakeGrid, dict, FakeGrid]:
    """The same run in both modes: (separate results, grid, with-train results, grid)."""
    sep, g_sep = run_inprocess(
        tmp_path / "separate", num_nodes, **{"eval-mode": "separate", **overrides}
    )
    fold, g_fold = run_inprocess(
        tmp_path / "with-train", num_nodes, **{"eval-mode": "with-train", **overrides}
    )
    return sep, g_sep, fold, g_fold


def evaluations(res: dict) -> list[dict]:
    return [{k: r[k] for k in EVAL_FIELDS} for r in res["rounds"]]


def trainings(res: dict) -> list[dict]:
    return [{k: r[k] for k in TRAIN_FIELDS} for r in res["rounds"]]


def kinds(grid: FakeGrid) -> Counter[tuple[str, int]]:
    """(message kind, round) -> messages sent (the profile query left out)."""
    out: Counter[tuple[str, int]] = Counter()
    for m in grid.sent:
        kind = m.metadata.message_type.split(".")[0]
        if kind in ("train", "evaluate"):
            out[kind, int(m.content.config_records["config"]["server-round"])] += 1  # type: ignore[arg-type]
    return out


FAST = ("lgfedavg",)
"""Methods checked in the fast tier; every other registered one is ``slow``."""


@pytest.mark.parametrize(
    "algorithm",
    [a if a in FAST else pytest.param(a, marks=pytest.mark.slow) for a in sorted(methods.METHODS)],
)
def test_every_method_evaluates_the_same_inside_the_training_message(
    tmp_path: Path, algorithm: str
) -> None:
    sep, g_sep, fold, g_fold = both(
        tmp_path, algorithm=algorithm, **{"num-server-rounds": 3, "model.family": family(algorithm)}
    )
    assert evaluations(fold) == evaluations(sep)
    assert trainings(fold) == trainings(sep)
    assert all(r["accuracy"] is not None for r in fold["rounds"])
    assert fold["summary"]["accuracy-last"] == sep["summary"]["accuracy-last"]
    # separate: a train and an evaluate message per node-round; with-train: one per
    # node-round, plus the closing evaluation of the last round
    assert kinds(g_sep) == Counter({(k, r): 3 for k in ("train", "evaluate") for r in (1, 2, 3)})
    assert kinds(g_fold) == Counter(
        {("train", 1): 3, ("train", 2): 3, ("train", 3): 3, ("evaluate", 3): 3}
    )
    folded = [m for m in g_fold.sent if EVAL_CONFIG in m.content.config_records]
    assert len(folded) == 6
    # the training arrays serve the evaluation: nothing sent twice
    assert not any(EVAL_ARRAYS in m.content.array_records for m in folded)
    assert all(r["bytes-down-eval"] == 0 for r in fold["rounds"][:-1])
    assert fold["rounds"][-1]["bytes-down-eval"] == sep["rounds"][-1]["bytes-down-eval"]


@pytest.mark.slow  # a whole run (4-5 s): the full tier
def test_partial_participation_and_eval_every_evaluate_the_same(tmp_path: Path) -> None:
    """Half of 6 nodes train each round, evaluation every 2 rounds (and after the
    last): nodes evaluated but not sampled for the next round get their own message."""
    overrides = {
        "algorithm": "lgfedavg",
        "num-server-rounds": 5,
        "fraction-train": 0.5,
        "min-train-nodes": 1,
        "eval-every": 2,
    }
    sep, _, fold, g_fold = both(tmp_path, 6, **overrides)
    assert evaluations(fold) == evaluations(sep)
    assert trainings(fold) == trainings(sep)
    assert [r["accuracy"] is not None for r in fold["rounds"]] == [False, True, False, True, True]
    sent = kinds(g_fold)
    # rounds 2 and 4 are evaluated: the 3 nodes that train in rounds 3 and 5 inside
    # their training message, the other 3 by a message of their own; round 5 closes
    assert sent["evaluate", 2] == sent["evaluate", 4] == 3
    assert sent["evaluate", 5] == 6
    assert sent["evaluate", 1] == sent["evaluate", 3] == 0
    by_round = Counter(
        int(m.content.config_records[EVAL_CONFIG]["server-round"])  # type: ignore[arg-type]
        for m in g_fold.sent
        if EVAL_CONFIG in m.content.config_records
    )
    assert by_round == Counter({2: 3, 4: 3})


@pytest.mark.slow  # a whole in-process run: in the full tier (the fast tier stays under 3 min)
def test_a_new_tier_for_the_next_round_carries_the_evaluated_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node served another FedARA tier next round (as the deadline policy may do;
    here the tiers cycle by round, so that the test does not hang on measured times):
    its training message carries the evaluation's own arrays as well, and the
    accuracies are still those of separate evaluation messages."""
    cycle = (1.0, 0.5, 0.25)

    def plan_round(self: FedARA, server_round: int, nodes: list) -> None:  # type: ignore[type-arg]
        for n in nodes:
            self._policy[n.node_id] = cycle[(server_round + n.partition_id) % len(cycle)]

    monkeypatch.setattr(FedARA, "plan_round", plan_round)
    sep, _, fold, g_fold = both(tmp_path, algorithm="fedara", **{"num-server-rounds": 3})
    tiers = [r["client-rank-ratio"] for r in fold["rounds"]]
    assert tiers == [r["client-rank-ratio"] for r in sep["rounds"]]
    assert tiers[0] == {"0": 0.5, "1": 0.25, "2": 1.0}
    assert evaluations(fold) == evaluations(sep)
    extra = [m for m in g_fold.sent if EVAL_ARRAYS in m.content.array_records]
    assert len(extra) == 6  # every node, rounds 2 and 3: each had another tier
    # what went down for the evaluation alone is counted as evaluation traffic
    assert all(r["bytes-down-eval"] > 0 for r in fold["rounds"])
    assert [r["bytes-down"] for r in fold["rounds"]] == [r["bytes-down"] for r in sep["rounds"]]


@pytest.mark.slow  # a whole in-process run: in the full tier (the fast tier stays under 3 min)
def test_stragglers_past_the_deadline_are_evaluated_alike(tmp_path: Path) -> None:
    """Simulated devices with a deadline: stragglers' uploads are dropped in both
    modes, their evaluations kept in both."""
    overrides = {
        "algorithm": "lgfedavg",
        "num-server-rounds": 3,
        "fleet": "rpi4:1,server:2",
        "round-deadline-s": 0.5,
    }
    sep, _, fold, _ = both(tmp_path, **overrides)
    assert sum(r["deadline-dropped"] for r in sep["rounds"]) > 0, "no straggler: checks nothing"
    assert [r["deadline-dropped"] for r in fold["rounds"]] == [
        r["deadline-dropped"] for r in sep["rounds"]
    ]
    assert evaluations(fold) == evaluations(sep)


def test_a_failed_training_reply_loses_the_evaluation_it_carried(tmp_path: Path) -> None:
    """A node whose round-2 training reply is an error: its round-1 evaluation
    travelled in that message and is missing; round 1's accuracy is the others'."""
    run_config = small_config(
        tmp_path, algorithm="lgfedavg", **{"num-server-rounds": 2, "eval-mode": "with-train"}
    )
    cfg = parse_run_config(run_config)
    grid = FakeGrid(app, run_config, 3)
    nid = grid.node_of_partition(1)

    def crash_in_round_2(reply: Message) -> Message:
        request = grid.sent[-1]
        if int(request.content.config_records["config"]["server-round"]) != 2:  # type: ignore[arg-type]
            return reply
        return Message(Error(code=0, reason="the task died"), reply_to=request)

    grid.faults[nid] = crash_in_round_2
    strategy = make_strategy(cfg)
    recorder = Recorded(strategy, cfg, cfg.resolved_out_dir("t"))
    initial = strategy.initial_arrays(grid)  # type: ignore[arg-type]
    recorder.start(grid, initial, num_rounds=2, evaluate_fn=recorder.end_round)  # type: ignore[arg-type]
    res = json.loads(recorder.write().read_text())
    first, second = res["rounds"]
    assert first["eval-clients"] == 2 and set(first["client-accuracy"]) == {"0", "2"}
    assert second["eval-clients"] == 3  # the closing evaluation message reached it
    assert second["valid-replies"] == 2


@pytest.mark.slow  # a whole run (4-5 s): the full tier
def test_a_resumed_run_evaluates_the_pending_round_by_itself(tmp_path: Path) -> None:
    """A server killed when round 3 starts: round 2's evaluation was to come with
    round 3's training replies. The resumed run evaluates round 2 by messages of its
    own first, and every round's evaluation equals an uninterrupted run's."""
    common = {"algorithm": "lgfedavg", "num-server-rounds": 3}
    whole = small_config(tmp_path, **{"out-dir": str(tmp_path / "whole"), **common})
    full = serve(FakeGrid(app, whole, 3), parse_run_config(whole), True)
    stopped = small_config(tmp_path, **{"out-dir": str(tmp_path / "stopped"), **common})
    with pytest.raises(Crash):
        serve(CrashingGrid(app, stopped, 3, at=3), parse_run_config(stopped), True)
    before = json.loads((tmp_path / "stopped" / "results.json").read_text())["rounds"]
    assert before[1]["accuracy"] is None  # pending when the server died
    resumed = small_config(tmp_path, **{**common, "resume": str(tmp_path / "stopped")})
    grid = FakeGrid(app, resumed, 3)
    path = serve(grid, parse_run_config(resumed), True)
    assert evaluations(json.loads(path.read_text())) == evaluations(json.loads(full.read_text()))
    assert kinds(grid) == Counter({("evaluate", 2): 3, ("train", 3): 3, ("evaluate", 3): 3})
