"""`flwr stop` on a run while its nodes train: every task child of that run ends within
seconds, and the next run's first round is not held up by the stopped run's work.

A real federation (SuperLink + 2 SuperNodes with the warm executor, insecure, on
127.0.0.1); a test build of the app marks each task child while it trains."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from pathlib import Path

import pytest

from cli.federation import CONNECTION, Federation
from tests.federation_support import marked_app, run_overrides, task_children, training_child

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.e2e, pytest.mark.serial]  # timings: run alone (test.sh --all)
NODES = 2
STOP_WITHIN_S = 10.0
"""How long a stopped run's task children may live on after ``flwr stop``."""


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    work = tmp_path_factory.mktemp("stop")
    configs = [{"partition-id": i, "num-partitions": NODES} for i in range(NODES)]
    with Federation(work, configs, ROOT, secure=False, durable=False) as federation:
        yield federation


def overrides(fed: Federation, name: str, **extra) -> dict:  # type: ignore[no-untyped-def]
    return run_overrides(fed, name, "local", **extra)


def _alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_stopped_run_ends_its_tasks_and_does_not_delay_the_next_run(
    fed: Federation, tmp_path: Path
) -> None:
    app, training = marked_app(tmp_path)
    run_ids: list[int] = []
    stopped: dict[str, object] = {}
    hunters: list[threading.Thread] = []

    def stop_while_training() -> None:
        # both nodes inside their round-1 training handler, then `flwr stop`
        try:
            if any(training_child(fed, n, training, timeout=180) is None for n in range(NODES)):
                return
            children = [pid for n in range(NODES) for pid in task_children(fed, n)]
            start = time.monotonic()
            stopped["output"] = fed.flwr("stop", str(run_ids[0]), CONNECTION)
            returned = time.monotonic()  # the run is stopped on the SuperLink by now
            while any(_alive(pid) for pid in children) and time.monotonic() - returned < 60:
                time.sleep(0.05)
            stopped["children"] = children
            stopped["command-s"] = returned - start
            stopped["gone-after-s"] = time.monotonic() - returned
            stopped["left"] = [pid for pid in children if _alive(pid)]
        except Exception as exc:  # noqa: BLE001 - reported by the test below
            stopped["error"] = repr(exc)
        finally:
            if "output" not in stopped:  # never leave the long run training
                with contextlib.suppress(Exception):
                    fed.flwr("stop", str(run_ids[0]), CONNECTION)

    def echo(line: str) -> None:
        if not run_ids and (m := re.search(r"run (\d+)", line)):
            run_ids.append(int(m.group(1)))
            hunters.append(threading.Thread(target=stop_while_training, daemon=True))
            hunters[0].start()

    # round 1 trains for minutes unless stopped (all the data, many epochs)
    long = overrides(fed, "long", **{"data.fraction": 1.0, "train.local-epochs": 50})
    fed.app_dir = app
    try:
        first = fed.run(long, timeout=300, echo=echo)
    finally:
        fed.app_dir = ROOT
    for hunter in hunters:  # `flwr run --stream` ends as soon as the run is stopped
        hunter.join(timeout=120)
    assert "error" not in stopped, stopped["error"]
    assert "gone-after-s" in stopped, f"no training task child seen: {first.log_path.read_text()}"
    assert stopped["children"], "no task child was running when the run was stopped"
    assert not stopped["left"], f"task children still alive after 60 s: {stopped['left']}"
    assert stopped["gone-after-s"] < STOP_WITHIN_S, stopped  # type: ignore[operator]
    assert first.status == "finished:stopped", first.status
    print(
        f"flwr stop: {stopped['command-s']:.1f} s; its children gone "
        f"{stopped['gone-after-s']:.1f} s after it returned"
    )

    start = time.monotonic()
    second = fed.run(overrides(fed, "next"), timeout=600)
    wall = time.monotonic() - start
    assert second.ok, second.log_path.read_text()[-3000:]
    rounds = json.loads((fed.workdir / "next" / "results.json").read_text())["rounds"]
    assert [r["valid-replies"] for r in rounds] == [NODES, NODES]
    print(f"next run: {wall:.1f} s, round 1 {rounds[0]['round-time-s']:.1f} s")
    # neither node was still busy with the stopped run
    assert rounds[0]["round-time-s"] < 20, rounds[0]
    assert wall < 90, wall
