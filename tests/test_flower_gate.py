"""The gate of fedhet's changes to Flower's runtime (``common/flower_gate.py``): every
part fits the pinned Flower; a faked mismatch (a renamed symbol, a changed signature, a
changed body under the same name) turns the part off with one line naming it, or stops
a part without a fallback; the processes that apply the parts honour the verdict."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterator

import pytest

from common import flower_gate as gate


@pytest.fixture(autouse=True)
def _fresh_verdicts(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Flower's own objects back for the test (other tests of this process may have
    applied fedhet's changes), fresh verdicts."""
    import sys

    for module in list(sys.modules.values()):
        kept = getattr(module, gate.ORIGINALS, None)
        if isinstance(kept, dict) and kept:
            for name, obj in kept.items():
                monkeypatch.setattr(module, name, obj)
            monkeypatch.setattr(module, gate.ORIGINALS, {})
    gate.verdict.cache_clear()
    gate._said.clear()
    yield
    gate.verdict.cache_clear()
    gate._said.clear()


@pytest.mark.parametrize("part", [p.name for p in gate.PARTS])
def test_every_part_fits_the_pinned_flower(part: str) -> None:
    found = gate.verdict(part)
    assert found.fits, found.line()
    assert found.version == gate.flower_version() == "1.42.0"


def test_every_flower_internal_fedhet_uses_is_listed_in_the_gate() -> None:
    """The names the code looks up (flower_internal and the other lists) are in a part."""
    from cli.executor_auth import AUTH_INTERNALS
    from cli.supernode import HTTPCORE_INTERNALS
    from common.flower_runtime import FLOWER_INTERNALS

    listed = {u.split(".")[0] for p in gate.PARTS for u in p.uses}  # modules named
    modules = {m for m, *_ in (*FLOWER_INTERNALS, *AUTH_INTERNALS, *HTTPCORE_INTERNALS)}
    missing = {m for m in modules if not any(u.startswith(m) for p in gate.PARTS for u in p.uses)}
    assert listed and not missing, f"not in any part of common/flower_gate.py: {missing}"


def _mismatch(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    module = importlib.import_module("flwr.supernode.start_client_internal")
    if how == "renamed":
        monkeypatch.delattr(module, "_push_messages")
    elif how == "signature":
        monkeypatch.setattr(module, "_push_messages", lambda state, store, send: None)
    else:  # same name and signature, another body

        def _push_messages(state, object_store, send, push_object):  # type: ignore[no-untyped-def]
            return None

        monkeypatch.setattr(module, "_push_messages", _push_messages)


@pytest.mark.parametrize("how", ["renamed", "signature", "body"])
def test_a_changed_flower_turns_the_parts_that_use_it_off_with_one_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    _mismatch(monkeypatch, how)
    with caplog.at_level(logging.WARNING):
        assert gate.use("run-watch") is False
        assert gate.use("run-watch") is False  # said once
    lines = [r.getMessage() for r in caplog.records if "run-watch" in r.getMessage()]
    assert len(lines) == 1
    [line] = lines
    assert "flwr 1.42.0" in line and "run-watch off, using Flower's own loop" in line
    if how == "renamed":
        assert "_push_messages is gone" in line
    else:
        assert "not the code it was checked against (checked: 1.42.0" in line
    assert gate.use("node-objects") is True  # parts that do not use it stay on


def test_a_part_without_a_fallback_stops_the_process_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    module = importlib.import_module("flwr.supernode.cli.flower_supernode")
    monkeypatch.delattr(module, "flower_supernode")
    monkeypatch.setattr(gate, "_say", lambda found: print(found.line()))
    with pytest.raises(SystemExit) as stop:
        gate.use("entry-points")
    assert stop.value.code == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "flower_supernode is gone" in out[0] and "flwr==1.42.0" in out[0]


def test_the_supernode_leaves_flowers_loop_alone_when_run_watch_does_not_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``fedhet supernode`` on a Flower whose loop changed: Flower's own
    ``_pull_and_store_message`` / ``_push_messages`` and ``push_task_output`` stay,
    the other parts are applied, and Flower's SuperNode starts."""
    from cli import supernode as cli_supernode

    loop = importlib.import_module("flwr.supernode.start_client_internal")
    handlers = importlib.import_module(cli_supernode.RUNTIME_HANDLERS)
    entry = importlib.import_module("flwr.supernode.cli.flower_supernode")
    for module, name in (
        (loop, "_pull_and_store_message"),
        (loop, "time"),
        (loop, "pull_objects"),
        (loop, "push_object_contents_from_iterable"),
        (handlers, "acquire_task"),
        (handlers, "push_task_output"),
        (entry, "flower_supernode"),
        (importlib.import_module("flwr.supernode.fleet_http_connection"), "FleetHttpClient"),
        (importlib.import_module(gate.OBJECTS), "get_num_workers"),
    ):
        monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    monkeypatch.setattr(cli_supernode.AliveInterval, "declared", None)
    gate.verdict("entry-points")  # checked before the entry point is replaced below
    _mismatch(monkeypatch, "body")
    stock_push, stock_pull = loop._push_messages, loop._pull_and_store_message
    stock_output, stock_pulls = handlers.push_task_output, loop.pull_objects
    started: list[bool] = []
    monkeypatch.setattr(entry, "flower_supernode", lambda: started.append(True))
    cli_supernode.run_supernode(["--insecure"])
    assert started == [True]
    assert loop._push_messages is stock_push and loop._pull_and_store_message is stock_pull
    assert handlers.push_task_output is stock_output  # failed-tasks needs the watch
    assert not isinstance(loop.time, cli_supernode.PacedSleep)  # it reads _push_messages too
    assert loop.pull_objects is not stock_pulls  # node-objects still fits


def test_a_task_child_that_raises_names_its_error_in_the_failure_it_reports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A warm child that raises before its ClientApp runs (e.g. a Flower name gone at
    import) writes one line that the executor's report to the node carries."""
    import multiprocessing
    import types

    from cli import warm

    def fails(argv: list[str], quiet: bool, finishing: object) -> None:
        raise ImportError("cannot import name 'pull_objects' from 'flwr.x'")

    monkeypatch.setattr(warm, "_run_clientapp_child", fails)
    cause = multiprocessing.get_context("spawn").Array("c", 512)
    with pytest.raises(ImportError):
        warm._clientapp_child([], False, None, cause)
    assert cause.value.decode() == "ImportError: cannot import name 'pull_objects' from 'flwr.x'"
    told: list[str] = []
    child = warm.TaskChild(4, types.SimpleNamespace(), types.SimpleNamespace(fail=told.append))
    child.cause = cause
    executor = object.__new__(warm.WarmExecutor)
    executor._log = lambda *a: None
    executor._report_died(child, 1)
    assert told == [
        "the ClientApp task process died (exit code 1): ImportError: cannot import name "
        "'pull_objects' from 'flwr.x'"
    ]


def test_parts_can_be_switched_off_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEDHET_FLOWER_PARTS_OFF", "warm-executor")
    assert not gate.verdict("warm-executor").fits
    assert gate.verdict("run-watch").fits


def test_the_gate_command_prints_every_part(capsys: pytest.CaptureFixture[str]) -> None:
    assert gate.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("flwr 1.42.0") and all(p.name in out for p in gate.PARTS)


def test_heartbeats_wait_for_a_busy_superlinks_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """heartbeat-patience: the timeout Flower's heartbeat call passes is the node's
    patience (30 s: one heartbeat interval), not Flower's 5 s; other calls keep theirs."""
    from flwr.supernode import fleet_http_client as client_module

    from cli.supernode import HEARTBEAT_PATIENCE_S, patient_heartbeats

    asked: dict[str, object] = {}

    def unary(self, *, path, rpc_method, request, response_type, timeout=None):  # type: ignore[no-untyped-def]
        asked[path.rsplit("/", 1)[-1]] = timeout

    monkeypatch.setattr(client_module.FleetHttpClient, "_unary_unary", unary)
    client = client_module.FleetHttpClient.__new__(client_module.FleetHttpClient)
    client.SendNodeHeartbeat(None)  # type: ignore[arg-type]
    assert asked["send-node-heartbeat"] == 5
    patient_heartbeats()
    client.SendNodeHeartbeat(None)  # type: ignore[arg-type]
    client.PullMessages(None)  # type: ignore[arg-type]
    assert asked["send-node-heartbeat"] == HEARTBEAT_PATIENCE_S == 30.0
    assert asked["pull-messages"] is None
    assert gate.original(client_module, "HEARTBEAT_CALL_TIMEOUT") == 5


@pytest.mark.slow  # four interpreters importing Flower: 13 s
def test_a_fingerprint_does_not_depend_on_the_hash_seed() -> None:
    """A part that reads a set of strings (the SuperLink's Control route keys) has one
    fingerprint whatever order the process's hash seed gives the set."""
    import os
    import subprocess
    import sys

    code = (
        "from common import flower_gate as g; "
        "print(g.fingerprint(g.BY_NAME['superlink-fleet-path']))"
    )
    seen = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
            capture_output=True, text=True, check=True, cwd=gate.CHECKED_FILE.parent.parent,
        ).stdout.strip()
        for seed in (1, 2, 3, 4)
    }  # fmt: skip
    assert len(seen) == 1, seen
