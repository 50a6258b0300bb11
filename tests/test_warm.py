"""The warm executor's contract with Flower 1.42 and the server's polling grid."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Message, RecordDict

from cli.warm import flower_command
from common.flower_runtime import FLOWER_INTERNALS, flower_internal
from server_app.grid import PollingGrid

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("module", "name"), FLOWER_INTERNALS)
def test_the_flower_internals_the_warm_executor_uses_exist(module: str, name: str) -> None:
    """Fails, naming the symbol, when a Flower other than 1.42.0 moved it."""
    assert flower_internal(module, name) is not None


def test_a_moved_symbol_is_named_in_the_error() -> None:
    with pytest.raises(RuntimeError, match=r"flwr\.supernode\.cli\.no_such_entry"):
        flower_internal("flwr.supernode.cli", "no_such_entry")


def _spec(**kwargs):  # type: ignore[no-untyped-def]
    types = flower_internal("flwr.supercore.superexec.executor.types", "ExecutionSpec")
    task = flower_internal("flwr.supercore.constant", "TaskType").CLIENT_APP
    base = {
        "task_type": task,
        "runtime_api_address": "127.0.0.1:9094",
        "token": "tok",
        "insecure": True,
        "root_certificates_path": None,
        "runtime_dependency_install": False,
        "parent_pid": 77,
        "suppress_output": False,
        "task_id": 5,
    }
    return types(**{**base, **kwargs})


def test_tls_and_insecure_settings_pass_through_as_flower_passes_them() -> None:
    argv, quiet = flower_command(_spec())
    assert argv[:5] == [
        "flwr-clientapp",
        "--runtime-api-address",
        "127.0.0.1:9094",
        "--token",
        "tok",
    ]
    assert "--insecure" in argv and "--root-certificates" not in argv
    assert argv[argv.index("--parent-pid") + 1] == "77" and not quiet
    argv, quiet = flower_command(
        _spec(insecure=False, root_certificates_path="/c/ca.crt", suppress_output=True)
    )
    assert argv[argv.index("--root-certificates") + 1] == "/c/ca.crt"
    assert "--insecure" not in argv and quiet
    # the capture left Flower's module as it was
    module = __import__(
        "flwr.supercore.superexec.executor.subprocess_executor", fromlist=["subprocess"]
    )
    assert module.subprocess.Popen.__module__ == "subprocess"


class _Clock:
    """Virtual time: ``sleep`` advances ``monotonic`` exactly, so a test measures the
    code's own waits, never the host's load."""

    def __init__(self) -> None:
        self.now, self.slept = 100.0, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    import server_app.grid

    virtual = _Clock()
    monkeypatch.setattr(server_app.grid, "time", virtual)
    return virtual


class SlowGrid:
    """Replies arrive over several pulls; records when (virtual time) each pull happened."""

    def __init__(self, batches: list[int], clock: _Clock) -> None:
        self.batches, self.pulls, self.sent, self.clock = batches, [], [], clock

    def push_messages(self, messages):  # type: ignore[no-untyped-def]
        self.sent = list(messages)
        return [m.metadata.message_id or f"m{i}" for i, m in enumerate(self.sent)]

    def pull_messages(self, ids):  # type: ignore[no-untyped-def]
        self.pulls.append(self.clock.now)
        take = self.batches.pop(0) if self.batches else 0
        out = []
        for mid in sorted(ids)[:take]:
            reply = Message(
                RecordDict({"config": ConfigRecord()}), dst_node_id=1, message_type="train.x"
            )
            reply.metadata.__dict__["_reply_to_message_id"] = mid
            out.append(reply)
        return out


def test_polling_grid_collects_every_reply_at_short_intervals(clock: _Clock) -> None:
    inner = SlowGrid([0, 1, 0, 2], clock)
    grid = PollingGrid(inner, interval=0.05)  # type: ignore[arg-type]
    msgs = [Message(RecordDict(), dst_node_id=i, message_type="train.x") for i in range(3)]
    replies = list(grid.send_and_receive(msgs, timeout=10))
    assert len(replies) == 3 and len(inner.pulls) == 4
    assert len(clock.slept) == 3 and clock.slept[0] == pytest.approx(0.05)
    assert sum(clock.slept) < 0.5  # Flower's HTTP grid would wait 3 s per pull


def test_polling_grid_stops_at_the_timeout(clock: _Clock) -> None:
    inner = SlowGrid([], clock)
    grid = PollingGrid(inner, interval=0.05)  # type: ignore[arg-type]
    msgs = [Message(RecordDict(), dst_node_id=1, message_type="train.x")]
    start = clock.now
    replies = list(grid.send_and_receive(msgs, timeout=0.3))
    assert replies == [] and clock.now - start == pytest.approx(0.3)  # last wait cut short
    assert inner.pulls[-1] - start == pytest.approx(0.3)


def test_reply_wait_closes_in_on_the_expected_last_reply() -> None:
    from server_app.grid import CAP_S, GROWTH, LEAD, reply_wait

    assert reply_wait(0.1, 0.0, None) == pytest.approx(0.1)  # unknown: from the push
    assert reply_wait(0.1, 10.0, None) == pytest.approx(0.1 + GROWTH * 10.0)
    assert reply_wait(0.1, 0.0, 5.0) == pytest.approx(LEAD * 5.0 / 2)  # half the way
    assert reply_wait(0.1, 0.0, 10.0) == CAP_S  # never longer than Flower's interval
    assert reply_wait(0.1, 6.0, 10.0) == pytest.approx((LEAD * 10.0 - 6.0) / 2)
    assert reply_wait(0.1, 7.95, 10.0) == pytest.approx(0.1)  # close: the interval
    assert reply_wait(0.1, 8.0, 10.0) == pytest.approx(0.1)  # due
    assert reply_wait(0.1, 18.0, 10.0) == pytest.approx(0.1 + GROWTH * 10.0)  # overdue
    assert reply_wait(0.1, 0.0, 1000.0) == CAP_S
    assert reply_wait(0.1, 1e5, 10.0) == CAP_S


class TimedGrid(SlowGrid):
    """Each message's reply is there ``delay`` (virtual) seconds after its push."""

    def __init__(self, delay: float, clock: _Clock) -> None:
        super().__init__([], clock)
        self.delay, self.pushed = delay, 0.0

    def push_messages(self, messages):  # type: ignore[no-untyped-def]
        self.pushed = self.clock.now
        return super().push_messages(messages)

    def pull_messages(self, ids):  # type: ignore[no-untyped-def]
        ready = self.clock.now - self.pushed >= self.delay
        self.batches = [len(list(ids))] if ready else [0]
        return super().pull_messages(ids)


@pytest.mark.parametrize("mode", ["informed", "fixed"])
def test_informed_reply_polls_wait_for_the_phase_they_learnt(mode: str, clock: _Clock) -> None:
    """The second phase of a kind polls a few times before its replies are due (fixed:
    every interval) and still collects them within about one interval."""
    inner = TimedGrid(1.2, clock)
    grid = PollingGrid(inner, interval=0.05, mode=mode)  # type: ignore[arg-type]
    msgs = [Message(RecordDict(), dst_node_id=i, message_type="train.x") for i in range(2)]
    assert len(list(grid.send_and_receive(msgs, timeout=10))) == 2
    if mode == "informed":
        assert grid.expected["train"] == pytest.approx(1.2, abs=0.3)
    inner.pulls = []
    start = clock.now
    assert len(list(grid.send_and_receive(msgs, timeout=10))) == 2
    late = clock.now - start - 1.2
    early = sum(1 for t in inner.pulls if t - start < 1.2)
    if mode == "informed":
        assert early <= 12 and late < 0.25
    else:
        assert early >= 18


def test_reply_poll_flower_is_flowers_own_grid() -> None:
    class Inner:
        def send_and_receive(self, messages, *, timeout=None):  # type: ignore[no-untyped-def]
            return ["flower", timeout]

    grid = PollingGrid(Inner(), mode="flower")  # type: ignore[arg-type]
    assert grid.send_and_receive([], timeout=7) == ["flower", 7]
    with pytest.raises(ValueError, match="reply-poll"):
        PollingGrid(Inner(), mode="slow")  # type: ignore[arg-type]


@pytest.mark.slow  # a real warm parent: imports torch in a fork server
def test_the_warm_parent_preloads_the_optimiser_imports_and_starts_no_thread() -> None:
    """After PRELOAD, a process's first torch optimiser imports nothing more (else every
    forked training task pays for it again), and PRELOAD starts no native thread beyond
    what importing numpy and torch alone starts (a fork must not lose live threads)."""
    import subprocess
    import sys

    code = """
import importlib, os, sys
def tasks(): return len(os.listdir('/proc/self/task'))
import numpy, torch
base = tasks()
from cli.warm import PRELOAD
for name in PRELOAD: importlib.import_module(name)
after = tasks()
before = set(sys.modules)
torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1, momentum=0.9)
new = sorted(n for n in set(sys.modules) - before if n.startswith(('torch', 'sympy')))
print(base, after, len(new), new[:5])
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-2000:]
    base, after, new, *names = out.stdout.split(maxsplit=3)
    assert after == base, f"PRELOAD started native threads: {base} -> {after}"
    assert new == "0", f"the first optimiser still imports {names}"


PULLERS = [
    ("flwr.supernode.start_client_internal", "pull_objects"),
    ("flwr.supernode.runtime.run_clientapp", "pull_and_inflate_object_from_tree"),
    ("flwr.superlink.grid.http_grid", "pull_objects"),
]


def _backoff_waits(monkeypatch: pytest.MonkeyPatch, pull_objects, missing: int) -> list[float]:  # type: ignore[no-untyped-def]
    """The waits ``pull_objects`` makes for one object that is missing ``missing``
    times (no jitter, no real sleeping)."""
    import threading
    import types as pytypes

    from flwr.supercore.inflatable import inflatable_utils as iu

    waits: list[float] = []

    class Event(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            if timeout is None:
                return super().wait()
            waits.append(round(timeout, 6))
            return False

    monkeypatch.setattr(iu, "threading", pytypes.SimpleNamespace(Event=Event, Lock=threading.Lock))
    monkeypatch.setattr(iu, "random", pytypes.SimpleNamespace(uniform=lambda a, b: 0.0))
    tries = {"n": 0}

    def pull(object_id: str) -> bytes:
        tries["n"] += 1
        if tries["n"] <= missing:
            raise iu.ObjectUnavailableError(object_id)
        return b"content"

    assert pull_objects(["obj"], pull) == {"obj": b"content"}
    return waits


@pytest.mark.parametrize(("module", "name"), PULLERS)
def test_object_pulls_retry_a_missing_object_after_a_short_wait(
    monkeypatch: pytest.MonkeyPatch, module: str, name: str
) -> None:
    """A SuperNode lists a task before it has the message's objects, so the ClientApp
    (and the SuperNode, and the ServerApp for replies) often pulls an object that is
    not there yet. Flower retries after 1 s, 2 s, 4 s ...; fedhet's processes after
    0.05 s doubling to 0.5 s."""
    import functools
    import importlib

    from flwr.supercore.inflatable.inflatable_utils import pull_objects

    from common.flower_runtime import PULL_BACKOFF, fast_object_pulls

    assert _backoff_waits(monkeypatch, pull_objects, 6) == [1, 2, 4, 8, 10, 10]
    mod = importlib.import_module(module)
    monkeypatch.setattr(mod, name, getattr(mod, name))  # restored after the test
    fast_object_pulls(module, name)
    fast_object_pulls(module, name)  # idempotent
    patched = getattr(mod, name)
    # with the backoff: the ServerApp's grid (a test that built one before may have
    # patched its module already) also moves several objects at once
    assert {k: patched.keywords.get(k) for k in PULL_BACKOFF} == PULL_BACKOFF
    assert set(patched.keywords) <= {*PULL_BACKOFF, "max_concurrent_pulls"}
    # the patched function itself where it is ``pull_objects``; the one that
    # ``pull_and_inflate_object_from_tree`` hands its keywords to otherwise
    keywords = patched.keywords
    pull = patched if name == "pull_objects" else functools.partial(pull_objects, **keywords)
    assert _backoff_waits(monkeypatch, pull, 6) == [
        0.05,
        0.1,
        0.2,
        0.4,
        0.5,
        0.5,
    ]


def test_a_puller_without_the_backoff_arguments_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types as pytypes

    from common.flower_runtime import fast_object_pulls

    fake = pytypes.ModuleType("fake_flower_module")
    fake.pull_objects = lambda object_ids, pull_object_fn: {}  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_flower_module", fake)
    with pytest.raises(RuntimeError, match=r"fake_flower_module\.pull_objects"):
        fast_object_pulls("fake_flower_module", "pull_objects")


@pytest.mark.slow  # builds the run bundle with flwr
def test_the_run_bundle_carries_the_app_packages_only() -> None:
    """Every ClientApp task receives and installs the run's FAB: it holds the app's
    packages (every module the components import), not the launcher (``cli``, which
    the apps never import), the docs, benchmarks or tests."""
    import io
    import zipfile

    import tomllib
    from flwr.cli.build import build_fab_from_disk

    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"
    ]
    names = zipfile.ZipFile(io.BytesIO(build_fab_from_disk(ROOT))).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {".info", "pyproject.toml", *packages} - {"cli"}
    packaged = {n for n in names if n.endswith(".py")}
    on_disk = {
        str(p.relative_to(ROOT))
        for top in tops - {".info", "pyproject.toml"}
        for p in (ROOT / top).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert packaged == on_disk


# ------------------------------------------------------------------ idle pacing


def test_flower_waits_that_the_pacing_tells_apart() -> None:
    """The pacing tells Flower's idle pull (3 s) from its waits inside a task (0.5 s)
    by the length Flower asks for, and caps the SuperExec's idle poll at Flower's
    default interval: if flwr changes any of them, this fails."""
    import inspect

    from flwr.supercore.superexec import run_superexec
    from flwr.supernode import start_client_internal

    from cli.supernode import FLOWER_IDLE_PULL_S
    from cli.warm import FLOWER_TASK_POLL_S

    source = inspect.getsource(start_client_internal)
    waits = sorted(set(re.findall(r"time\.sleep\(([0-9.]+)\)", source)), key=float)
    assert [float(w) for w in waits] == [0.5, FLOWER_IDLE_PULL_S]
    assert run_superexec._DEFAULT_TASK_POLL_INTERVAL_SECONDS == FLOWER_TASK_POLL_S


def _paced(clock: _Clock, fast: bool = False, cap: float | None = None):  # type: ignore[no-untyped-def]
    import types as pytypes

    from cli.supernode import PacedSleep

    real = pytypes.ModuleType("time")
    real.monotonic, real.sleep = clock.monotonic, clock.sleep  # type: ignore[attr-defined]
    return PacedSleep(real, poll=0.05, fast=fast, cap=cap)


def test_a_held_poll_is_taken_off_the_next_idle_wait() -> None:
    """The time the SuperLink held the node's last poll (``x-fedhet-held``) was spent
    waiting: the next idle wait is shorter by as much, down to none."""
    from cli import supernode as sn

    paced = _paced(_Clock(), cap=10.0)
    try:
        sn.HELD.seconds = 0.0
        unheld = paced.wait_for(sn.FLOWER_IDLE_PULL_S)
        sn.HELD.seconds = 1.0
        assert paced.wait_for(sn.FLOWER_IDLE_PULL_S) == pytest.approx(max(0.0, unheld - 1.0))
        sn.HELD.seconds = 20.0
        assert unheld > 0 and paced.wait_for(sn.FLOWER_IDLE_PULL_S) == 0.0
    finally:
        sn.HELD.seconds = 0.0


def test_supernode_fast_mode_polls_fast_after_a_task_and_backs_off_when_idle() -> None:
    from cli.pacing import FAST_GROWTH as IDLE_GROWTH

    clock = _Clock()
    paced = _paced(clock, fast=True)
    paced.sleep(0.5)  # inside a task: capped, and the node is active
    assert clock.slept == [0.05]
    paced.sleep(3)  # the first idle pull after it: about the base poll
    assert clock.slept[-1] == pytest.approx(0.05 + IDLE_GROWTH * 0.05)
    clock.now += 10.0  # ten idle seconds
    paced.sleep(3)
    assert clock.slept[-1] == pytest.approx(0.05 + IDLE_GROWTH * 10.1, abs=1e-3)
    clock.now += 3600.0  # idle for an hour: Flower's own 3 s, never more
    paced.sleep(3)
    assert clock.slept[-1] == 3
    paced.sleep(0.5)  # a new task: fast again
    paced.sleep(3)
    assert clock.slept[-2:] == [0.05, pytest.approx(0.05 + IDLE_GROWTH * 0.05)]


def test_supernode_polls_when_its_next_message_is_due() -> None:
    """With no history it backs off from its reply; once it has seen a gap after a
    reply to a ``train`` message, it waits PRE_DUE_SHARE of the time left to LEAD x
    that gap, then polls every DUE_SHARE x the gap, backing off; idle, at most the
    idle cap."""
    from cli.pacing import DUE_SHARE, IDLE_GROWTH, LEAD, PRE_DUE_SHARE

    clock = _Clock()
    paced = _paced(clock, cap=10.0)
    paced.arrived("train")
    paced.sleep(0.5)  # training; the reply goes out at the end of the waits
    assert clock.slept == [0.05]
    paced.sleep(3)  # no gap seen yet: back off from the reply
    assert clock.slept[-1] == pytest.approx(0.05 + IDLE_GROWTH * 0.05)
    clock.now = 100.0 + 20.0  # the next message came 20 s after the reply (at 100)
    paced.arrived("evaluate")
    assert paced.gaps.expected("train") == pytest.approx(20.0)
    paced.sleep(0.5)  # evaluating
    paced.arrived("train")  # (no gap after evaluate replies is known yet)
    paced.sleep(0.5)
    reply = clock.now
    paced.sleep(3)  # right after the train reply: a share of the time to the due time
    first = min(10.0, LEAD * 20.0 * PRE_DUE_SHARE)  # (at most the idle cap)
    assert clock.slept[-1] == pytest.approx(first, abs=0.1)
    paced.sleep(3)
    assert clock.slept[-1] == pytest.approx((LEAD * 20.0 - first) * PRE_DUE_SHARE, abs=0.1)
    clock.now = reply + LEAD * 20.0  # due: a share of the gap
    paced.sleep(3)
    assert clock.slept[-1] == pytest.approx(DUE_SHARE * 20.0, abs=0.01)
    clock.now = reply + LEAD * 20.0 + 10.0  # 10 s overdue: backing off
    paced.sleep(3)
    assert clock.slept[-1] == pytest.approx(DUE_SHARE * 20.0 + IDLE_GROWTH * 10.0, abs=0.01)
    clock.now += 3600.0  # idle for an hour: the cap
    paced.sleep(3)
    assert clock.slept[-1] == 10.0


def test_a_busy_superlink_slows_a_nodes_idle_polls() -> None:
    """ServerLoad: pulls answered within LOAD_SLACK_S of the node's quick ones leave
    its waits alone; later ones stretch every idle wait by delay / slack, at most
    MAX_SLOWDOWN; the quick answer is the quickest of the recent LOAD_BASELINE."""
    from cli.pacing import LOAD_BASELINE, LOAD_RECENT, LOAD_SLACK_S, MAX_SLOWDOWN, ServerLoad

    load = ServerLoad()
    assert load.slowdown() == 1.0  # nothing seen yet
    for _ in range(LOAD_RECENT):
        load.note(0.05)
    assert load.delay() == 0.0 and load.slowdown() == 1.0
    for _ in range(LOAD_RECENT):
        load.note(0.05 + LOAD_SLACK_S * 0.9)  # a slow link's handshakes: not load
    assert load.slowdown() == 1.0
    for _ in range(LOAD_RECENT):
        load.note(0.05 + 3 * LOAD_SLACK_S)
    assert load.slowdown() == pytest.approx(3.0)
    load.note(60.0)  # one outlier does not move the median
    assert load.slowdown() == pytest.approx(3.0)
    for _ in range(LOAD_RECENT):
        load.note(60.0)
    assert load.slowdown() == MAX_SLOWDOWN
    for _ in range(LOAD_BASELINE):  # a new, slower link: its answers become the quick ones
        load.note(0.6)
    assert load.slowdown() == 1.0

    clock, other, busy = _Clock(), _Clock(), ServerLoad()
    paced, plain = _paced(clock, cap=10.0), _paced(other, cap=10.0)
    paced.load = busy
    for _ in range(LOAD_RECENT):
        busy.note(0.05)
    assert paced.wait_for(3) == plain.wait_for(3)
    for _ in range(LOAD_RECENT):
        busy.note(0.05 + 2 * LOAD_SLACK_S)
    assert paced.wait_for(3) == pytest.approx(2 * plain.wait_for(3))
    assert paced.wait_for(0.5) == 0.05  # waits inside a task are never slowed
    paced.gaps.add("train", 20.0)
    paced.replied = "train"
    plain.gaps.add("train", 20.0)
    plain.replied = "train"
    clock.now += 1000  # long idle: twice the cap
    other.now += 1000
    assert paced.wait_for(3) == pytest.approx(20.0) and plain.wait_for(3) == 10.0


def test_a_busy_superlink_gets_fewer_heartbeats_with_a_longer_declared_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """load-aware-idle: each heartbeat declares Flower's 30 s times the slowdown (what
    the SuperLink holds the node online for, twice), the next one follows Flower's
    rule for that interval, and each heartbeat's time is noted."""
    from flwr.common import constant
    from flwr.supernode import fleet_http_connection as conn

    from cli.pacing import LOAD_RECENT, LOAD_SLACK_S, ServerLoad
    from cli.supernode import AliveInterval, load_aware_heartbeats
    from tests.test_links import first_wait

    monkeypatch.setattr(conn, "HeartbeatSender", conn.HeartbeatSender)
    monkeypatch.setattr(conn, "HEARTBEAT_DEFAULT_INTERVAL", conn.HEARTBEAT_DEFAULT_INTERVAL)
    monkeypatch.setattr(AliveInterval, "declared", AliveInterval.declared)
    load = ServerLoad()
    load_aware_heartbeats(load)
    declared: list[float] = []

    def beat() -> bool:
        declared.append(conn.HEARTBEAT_DEFAULT_INTERVAL)
        return True

    sender = conn.HeartbeatSender(beat)
    base = float(constant.HEARTBEAT_DEFAULT_INTERVAL)
    wait = first_wait(sender)
    assert declared == [base] and len(load._history) == 1
    assert 0.7 * (base - 5) <= wait <= 0.9 * (base - 5)
    for _ in range(LOAD_RECENT):
        load.note(load._history[0] + 4 * LOAD_SLACK_S)
    wait = first_wait(sender)
    assert declared[-1] == pytest.approx(4 * base, abs=0.1)
    assert 0.7 * (4 * base - 5) <= wait <= 0.9 * (4 * base - 5)

    # a heartbeat whose answer is late raises the slowdown: the wait after it still
    # follows the interval it declared, well inside the 2 x the SuperLink holds
    quick = ServerLoad()
    load_aware_heartbeats(quick)

    def slow_beat() -> bool:
        declared.append(conn.HEARTBEAT_DEFAULT_INTERVAL)
        for _ in range(LOAD_RECENT):
            quick.note(10 * LOAD_SLACK_S)
        return True

    quick.note(0.01)
    sender = conn.HeartbeatSender(slow_beat)
    wait = first_wait(sender)
    assert declared[-1] == pytest.approx(base, abs=0.1)
    assert wait <= 0.9 * (base - 5) < 2 * base


def test_a_missing_object_is_asked_for_again_later_the_longer_it_is_missing() -> None:
    """PatientPulls: a message object the SuperLink does not have yet is retried at
    Flower's pace while it has been missing < 2 s on an idle SuperLink; after t s it
    waits MISSING_SHARE x t x slowdown (less Flower's 0.5 s) first; found, it is
    forgotten."""
    from flwr.supercore.inflatable.inflatable_utils import ObjectUnavailableError

    from cli.pacing import LOAD_RECENT, LOAD_SLACK_S, ServerLoad
    from cli.supernode import MISSING_SHARE, PatientPulls

    clock, load, there = _Clock(), ServerLoad(), {"a": False}

    def pull(run_id: int, object_id: str) -> bytes:
        if not there[object_id]:
            raise ObjectUnavailableError(object_id)
        return b"x"

    pulls = PatientPulls(pull, load, clock=clock.monotonic, sleep=clock.sleep)
    for _ in range(3):
        with pytest.raises(ObjectUnavailableError):
            pulls(1, "a")
    assert clock.slept == []  # missing for no time yet
    clock.now += 10.0
    with pytest.raises(ObjectUnavailableError):
        pulls(1, "a")
    assert clock.slept == [pytest.approx(MISSING_SHARE * 10.0 - 0.5)]
    for _ in range(LOAD_RECENT):
        load.note(0.05)
    for _ in range(LOAD_RECENT):
        load.note(0.05 + 3 * LOAD_SLACK_S)  # a busy SuperLink: 3x
    waited = clock.now - 100.0
    with pytest.raises(ObjectUnavailableError):
        pulls(1, "a")
    assert clock.slept[-1] == pytest.approx(MISSING_SHARE * waited * 3 - 0.5)
    there["a"] = True
    assert pulls(1, "a") == b"x" and pulls.missing_since == {}


def test_a_round_the_node_sat_out_does_not_slow_the_next() -> None:
    from cli.pacing import GAP_MEMORY, Gaps

    gaps = Gaps()
    gaps.add("train", 5.0)
    gaps.add("train", 300.0)  # not sampled for a while
    assert gaps.expected("train") == 5.0
    assert gaps.expected("evaluate") is None
    for _ in range(GAP_MEMORY):
        gaps.add("train", 7.0)
    assert gaps.expected("train") == 7.0  # only the last GAP_MEMORY count


def test_idle_poll_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from cli.pacing import fast_polls, idle_poll_s

    monkeypatch.setenv("FEDHET_IDLE_POLL_S", "4.5")
    assert idle_poll_s() == 4.5
    monkeypatch.setenv("FEDHET_IDLE_POLL_S", "0")
    with pytest.raises(SystemExit, match="FEDHET_IDLE_POLL_S"):
        idle_poll_s()
    monkeypatch.setenv("FEDHET_NODE_POLL", "slow")
    with pytest.raises(SystemExit, match="FEDHET_NODE_POLL"):
        fast_polls()


class _Answer:
    def __init__(self, task: bool) -> None:
        self.task = task

    def HasField(self, name: str) -> bool:  # noqa: N802 - protobuf's name
        return name == "task" and self.task


class _TaskState:
    def __init__(self, busy: bool = False) -> None:
        self.busy = busy

    def get_tasks(self, **kwargs: object) -> list[int]:
        return [1] if self.busy else []


@pytest.mark.slow  # wall-clock bounds: in the full tier, never in the fast one
@pytest.mark.serial  # ... and alone (test.sh --all)
def test_node_holds_a_task_request_until_a_message_arrives() -> None:
    import threading
    import time as pytime

    from cli.supernode import HeldTasks

    tasks: list[bool] = []
    calls = []

    def acquire(request: object, state: object) -> _Answer:
        calls.append(pytime.monotonic())
        return _Answer(bool(tasks))

    import types as pytypes

    ask = pytypes.SimpleNamespace(supported_task_types=["clientapp"], agentapp_fab_hashes=[])
    busy = pytypes.SimpleNamespace(supported_task_types=[], agentapp_fab_hashes=[])
    held = HeldTasks(acquire, hold_s=5.0, busy_hold_s=0.2)
    t0 = pytime.monotonic()
    assert not held(busy, _TaskState()).HasField("task")  # no capacity: at once
    assert pytime.monotonic() - t0 < 0.1
    t0 = pytime.monotonic()
    assert not held(ask, _TaskState(busy=True)).HasField("task")  # a task runs: short
    assert 0.15 < pytime.monotonic() - t0 < 1.0

    def arrive() -> None:
        pytime.sleep(0.3)
        tasks.append(True)
        held.ring()

    threading.Thread(target=arrive).start()
    t0 = pytime.monotonic()
    assert held(ask, _TaskState()).HasField("task")  # answered when the message came
    assert 0.25 < pytime.monotonic() - t0 < 1.5
    tasks.clear()
    calls.clear()
    held.hold_s = 0.3
    t0 = pytime.monotonic()
    assert not held(ask, _TaskState()).HasField("task")  # nothing came: Flower's answer
    assert 0.25 < pytime.monotonic() - t0 < 1.5
    assert len(calls) <= 2  # held, not polled


def test_a_stopping_node_answers_its_held_task_request_at_once() -> None:
    """SIGTERM: Flower's exit handler stops the Runtime API server, which waited for a
    held request (up to TASK_HOLD_S) and then cancelled it with tracebacks; ``close``
    (registered to run first) answers it now and holds none again."""
    import threading
    import time as pytime
    import types as pytypes

    from cli.supernode import HeldTasks

    held = HeldTasks(lambda request, state: _Answer(False), hold_s=30.0)
    ask = pytypes.SimpleNamespace(supported_task_types=["clientapp"], agentapp_fab_hashes=[])
    threading.Timer(0.2, held.close).start()
    t0 = pytime.monotonic()
    assert not held(ask, _TaskState()).HasField("task")
    assert pytime.monotonic() - t0 < 5.0  # not the 30 s hold
    t0 = pytime.monotonic()
    held(ask, _TaskState())
    assert pytime.monotonic() - t0 < 5.0  # closed: never held again


def _pace_only_executor():  # type: ignore[no-untyped-def]
    """A WarmExecutor without its fork server (``pace``, ``reconcile`` and ``watch``
    need only its children and a logger)."""
    import time as pytime

    from cli.warm import WarmExecutor

    ex = object.__new__(WarmExecutor)
    ex._children, ex._last_active = [], pytime.monotonic()
    ex._asked_at, ex._ignore_answer, ex.node_holds, ex._fast = None, False, False, False
    ex._log, ex.logged = lambda level, msg, *args: ex.logged.append(msg % args), []
    return ex


def test_superexec_waits_on_a_running_task_instead_of_polling() -> None:
    """While a task's child runs, ``pace`` returns when the child ends (not after
    Flower's 1 s poll), and at the latest after that poll interval."""
    import multiprocessing
    import time as pytime

    from cli.warm import TaskChild

    ctx = multiprocessing.get_context("fork")
    ex = _pace_only_executor()
    child = ctx.Process(target=pytime.sleep, args=(0.3,))
    child.start()
    ex._children = [TaskChild(1, child)]
    t0 = pytime.monotonic()
    ex.pace()
    assert 0.25 < pytime.monotonic() - t0 < 0.9  # woke when the child ended
    child.join()
    stuck = ctx.Process(target=pytime.sleep, args=(30,))
    stuck.start()
    ex._children = [TaskChild(2, stuck)]
    t0 = pytime.monotonic()
    ex.pace()
    assert 0.9 < pytime.monotonic() - t0 < 2.5  # a long task: Flower's interval
    stuck.kill()
    stuck.join()


def test_superexec_idle_poll_grows_to_flowers_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    import cli.pacing as pacing
    import cli.warm as warm

    clock = _Clock()
    monkeypatch.setattr(warm.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(warm.time, "sleep", clock.sleep)
    ex = _pace_only_executor()
    ex._last_active = clock.now
    ex.pace()  # right after a task: no extra wait beyond the loop's own 0.05 s
    assert clock.slept == []
    clock.now += 10.0
    ex.pace()
    assert clock.slept == [pytest.approx(pacing.IDLE_GROWTH * 10.0)]
    clock.now += 3600.0
    ex.pace()
    assert clock.slept[-1] == warm.FLOWER_TASK_POLL_S


def test_superexec_asks_again_at_once_when_the_node_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A task request the node held (it took >= HELD_S) means the node answers when a
    task is there: no idle wait; an instant empty answer (Flower's own SuperNode)
    brings the idle pacing back."""
    import cli.warm as warm

    clock = _Clock()
    monkeypatch.setattr(warm.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(warm.time, "sleep", clock.sleep)
    ex = _pace_only_executor()
    ex._last_active = clock.now - 10.0
    ex.pace()
    assert len(clock.slept) == 1  # idle pacing: no answer seen yet
    clock.now += warm.HELD_S + 1.0  # the request was held
    ex.reconcile()
    assert ex.node_holds
    clock.slept.clear()
    ex.pace()
    assert clock.slept == []  # ask again at once
    clock.now += 0.01  # answered at once: the node does not hold
    ex.reconcile()
    assert not ex.node_holds
    ex.pace()
    assert len(clock.slept) == 1


def test_a_busy_executor_asks_for_no_task() -> None:
    """While a child runs the executor declares no capacity (a node that holds task
    requests answers it at once, so the child stays watched)."""
    import multiprocessing

    from cli.warm import TaskChild

    ex = _pace_only_executor()
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,))
    child.start()
    ex._children = [TaskChild(1, child)]
    try:
        assert ex.get_eligible_capacity({"clientapp"}) == (set(), set())
    finally:
        _reap(child)
    ex._children = []
    assert ex.get_eligible_capacity({"clientapp"}) == ({"clientapp"}, set())


# ------------------------------------------------------------ flwr stop: executor


def _sleeper(seconds: float, ignore_sigterm: bool = False) -> None:
    import signal
    import time as pytime

    if ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pytime.sleep(seconds)


def _drive(ex, seconds: float) -> None:  # type: ignore[no-untyped-def]
    """Flower's SuperExec loop (reconcile, pace, a short sleep) for ``seconds``."""
    import time as pytime

    end = pytime.monotonic() + seconds
    while pytime.monotonic() < end and ex._children:
        ex.reconcile()
        ex.pace()
        pytime.sleep(0.01)


@pytest.fixture
def fast_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    import cli.warm as warm

    monkeypatch.setattr(warm, "TASK_BEAT_S", 0.1)
    monkeypatch.setattr(warm, "STOP_GRACE_S", 0.3)
    monkeypatch.setattr(warm, "KILL_AFTER_S", 0.5)


def _child(ex, task_id: int, answers: list, ignore_sigterm: bool = False):  # type: ignore[no-untyped-def]
    """A real forked child that sleeps 30 s, its heartbeat answering ``answers`` in
    turn (the last one for ever)."""
    import multiprocessing
    import time as pytime

    from cli.warm import TaskChild

    process = multiprocessing.get_context("fork").Process(
        target=_sleeper, args=(30, ignore_sigterm)
    )
    process.start()
    calls: list[float] = []

    def beat() -> bool | None:
        calls.append(pytime.monotonic())
        return answers[min(len(calls), len(answers)) - 1]

    ex._children.append(TaskChild(task_id, process, beat, pytime.monotonic() + 0.1))
    return process, calls


def _until_collected(ex, task_id: int, limit: float = 5.0) -> float:  # type: ignore[no-untyped-def]
    """Drive the executor until task ``task_id``'s child is collected; seconds taken."""
    import time as pytime

    t0 = pytime.monotonic()
    while any(t.task_id == task_id for t in ex._children) and pytime.monotonic() - t0 < limit:
        _drive(ex, 0.05)
    return pytime.monotonic() - t0


def _reap(*processes) -> None:  # type: ignore[no-untyped-def]
    import contextlib

    for process in processes:
        with contextlib.suppress(ValueError):  # collected (and closed) by the executor
            process.kill()
            process.join()


@pytest.mark.usefixtures("fast_stop")
def test_the_executor_ends_a_child_whose_task_the_node_finished() -> None:
    """The node answers a child's heartbeat with success=False (its run was stopped):
    after the grace period the child gets SIGTERM; children whose heartbeat succeeds or
    gets no answer live on."""
    import signal

    ex = _pace_only_executor()
    stopped, stopped_beats = _child(ex, 1, [True, True, False])
    healthy, healthy_beats = _child(ex, 2, [True])
    silent, _ = _child(ex, 3, [None])
    try:
        ended = _until_collected(ex, 1)
        assert any(f"task 1 ended (exit code {-signal.SIGTERM})" in m for m in ex.logged)
        # third beat (0.3 s) + grace (0.3 s); not before
        assert 0.55 < ended < 1.5, ended
        assert len(stopped_beats) == 3  # no beat after the node said finished
        _drive(ex, 1.0)
        assert healthy.is_alive() and silent.is_alive()
        gaps = [b - a for a, b in zip(healthy_beats, healthy_beats[1:], strict=False)]
        assert len(healthy_beats) <= 22 and min(gaps) >= 0.09  # about every 0.1 s
        assert [t.task_id for t in ex._children] == [2, 3]
        assert any("task 1 was finished by its SuperNode" in m for m in ex.logged)
        assert not any("ended with exit code" in m for m in ex.logged)
    finally:
        _reap(stopped, healthy, silent)


@pytest.mark.usefixtures("fast_stop")
def test_a_child_that_outlives_sigterm_is_killed() -> None:
    import signal

    ex = _pace_only_executor()
    stubborn, _ = _child(ex, 1, [False], ignore_sigterm=True)
    try:
        ended = _until_collected(ex, 1)
        # beat (0.1 s) + grace (0.3 s) + SIGTERM ignored (0.5 s)
        assert any(f"task 1 ended (exit code {-signal.SIGKILL})" in m for m in ex.logged)
        assert 0.8 < ended < 2.0, ended
        assert any("outlived SIGTERM" in m for m in ex.logged)
    finally:
        _reap(stubborn)


class _Beat:
    """A task heartbeat that records the failures reported through it."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def __call__(self) -> bool:
        return True

    def fail(self, details: str) -> bool:
        self.failed.append(details)
        return True


@pytest.mark.slow  # wall-clock bounds: in the full tier, never in the fast one
@pytest.mark.serial  # ... and alone (test.sh --all)
def test_a_child_that_died_before_its_reply_is_reported_failed_at_once() -> None:
    """A child killed while its task runs (it never set ``finishing``) is reported to
    the node as failed as soon as it is collected; one that reported its end, or that
    the executor ended after its run stopped, is not."""
    import multiprocessing
    import signal
    import time as pytime

    from cli.warm import TaskChild

    ctx = multiprocessing.get_context("fork")
    ex = _pace_only_executor()
    killed = ctx.Process(target=_sleeper, args=(30,))
    done = ctx.Process(target=pytime.sleep, args=(0.0,))
    for process in (killed, done):
        process.start()
    finishing = ctx.Event()
    finishing.set()
    beats = [_Beat(), _Beat()]
    ex._children = [
        TaskChild(1, killed, beats[0], pytime.monotonic() + 60, ctx.Event()),
        TaskChild(2, done, beats[1], pytime.monotonic() + 60, finishing),
    ]
    try:
        os.kill(killed.pid, signal.SIGKILL)
        t0 = pytime.monotonic()
        while ex._children and pytime.monotonic() - t0 < 5:
            _drive(ex, 0.05)
        assert pytime.monotonic() - t0 < 1.0
        assert beats[0].failed == [f"the ClientApp task process died (exit code {-signal.SIGKILL})"]
        assert beats[1].failed == []
        assert any("reported it to the node as failed" in m for m in ex.logged)
    finally:
        _reap(killed, done)


def test_the_node_answers_a_failed_client_task_with_an_error_reply() -> None:
    """``FailedTasks`` (the SuperNode's ``push_task_output``): a ClientApp task
    finished as failed stores an error reply for its run's message and rings the held
    task requests; any other output is only Flower's handler."""
    import types as pytypes

    from flwr.common.constant import SubStatus
    from flwr.supercore.constant import TaskType
    from flwr.supernode.nodestate.in_memory_nodestate import InMemoryNodeState

    from cli.supernode import FailedTasks

    pushed, rings, errors = [], [], []

    def fail(state: object, cause: str) -> bool:
        errors.append((state, cause))
        return True

    handler = FailedTasks(
        lambda *a: pushed.append(a) or "answer", fail, on_failed=lambda: rings.append(1)
    )
    state = InMemoryNodeState
    task = pytypes.SimpleNamespace(type=TaskType.CLIENT_APP, run_id=7, task_id=3)
    failed = pytypes.SimpleNamespace(sub_status=SubStatus.FAILED, details="died (exit code -9)")
    assert handler(failed, state, task) == "answer" and len(pushed) == 1
    [(got_state, cause)] = errors
    assert got_state is state and "died (exit code -9)" in cause
    assert rings == [1]
    completed = pytypes.SimpleNamespace(sub_status=SubStatus.COMPLETED, details="")
    handler(completed, state, task)
    agent = pytypes.SimpleNamespace(type=TaskType.AGENT_APP, run_id=7, task_id=4)
    handler(failed, state, agent)
    assert len(errors) == 1 and rings == [1] and len(pushed) == 3


def test_the_task_heartbeat_reads_a_revoked_token_as_finished(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Finishing a task revokes its token, so the node answers 401: finished. A
    connection failure or a 503 is no answer (the child is left alone)."""
    import httpx

    from cli.warm import TaskBeat

    answers: list = []

    class Client:
        def SendTaskHeartbeat(self, request):  # type: ignore[no-untyped-def]  # noqa: N802
            answer = answers.pop(0)
            if type(answer) is int:  # a status code (not a bool)
                req = httpx.Request("POST", "http://node/v1/runtime/send-task-heartbeat")
                raise httpx.HTTPStatusError(
                    "x", request=req, response=httpx.Response(answer, request=req)
                )
            if isinstance(answer, Exception):
                raise answer
            return type("Response", (), {"success": answer})()

    beat = TaskBeat(_spec())
    monkeypatch.setattr(beat, "_connect", Client)
    answers[:] = [True, False, 401, 503, httpx.ConnectError("refused")]
    assert [beat() for _ in range(5)] == [True, False, False, None, None]


def test_the_task_heartbeat_reaches_a_runtime_api(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client TaskBeat builds sends Flower's request, with the child's token."""
    import httpx

    from cli.warm import TaskBeat

    seen: list[httpx.Request] = []
    resp = flower_internal("flwr.proto.runtime_pb2", "SendTaskHeartbeatResponse")
    real_send = httpx.Client.send

    def send(self, request, **kwargs):  # type: ignore[no-untyped-def]
        if request.url.host != "127.0.0.1":
            return real_send(self, request, **kwargs)
        seen.append(request)
        body = resp(success=True).SerializeToString()
        return httpx.Response(
            200,
            content=body,
            headers={"content-type": "application/protobuf"},
            request=request,
        )

    monkeypatch.setattr(httpx.Client, "send", send)
    beat = TaskBeat(_spec(token="child-token"))
    try:
        assert beat() is True
    finally:
        beat.close()
    assert seen and seen[0].url.path == "/v1/runtime/send-task-heartbeat"
    assert "child-token" in seen[0].headers.values()


# ------------------------------------------------------------ flwr stop: SuperNode


def _node_state():  # type: ignore[no-untyped-def]
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.supernode.nodestate import NodeStateFactory

    factory = NodeStateFactory(ObjectStoreFactory())
    return factory.state(), factory.objectstore_factory.store()


def _instruction(run_id: int, dst: int = 1):  # type: ignore[no-untyped-def]
    from flwr.app import ArrayRecord

    msg = Message(
        RecordDict({"config": ConfigRecord({"x": run_id}), "a": ArrayRecord()}),
        dst_node_id=dst,
        message_type="train.x",
    )
    msg.metadata.__dict__["_run_id"] = run_id
    msg.metadata.__dict__["_message_id"] = msg.object_id
    return msg


@pytest.fixture
def flower_never_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flower's ``_push_messages``, handed the replies, must not wait for any."""
    import types as pytypes

    from flwr.supernode import start_client_internal

    def sleep(seconds: float) -> None:
        raise RuntimeError("Flower's push waited for a reply it had been handed")

    monkeypatch.setattr(start_client_internal, "time", pytypes.SimpleNamespace(sleep=sleep))


class _Node:
    """A SuperNode's state and the calls Flower's loop makes; ``get_run`` answers from
    ``self.runs`` (run id -> running?), recording when it was asked."""

    def __init__(self) -> None:
        self.state, self.store = _node_state()
        self.clock = _Clock()
        self.runs: dict[int, bool] = {}
        self.asked: list[float] = []
        self.sent: list[Message] = []
        self.inbox: list[Message] = []

    def get_run(self, run_id: int):  # type: ignore[no-untyped-def]
        from types import SimpleNamespace

        from flwr.supercore.run import RunNotRunningException

        self.asked.append(self.clock.now)
        if not self.runs[run_id]:
            raise RunNotRunningException  # what the Fleet API's 403 turns into
        return SimpleNamespace(status=SimpleNamespace(status="running"))

    def receive(self):  # type: ignore[no-untyped-def]
        return (self.inbox.pop(0), None) if self.inbox else None

    def pull(self, *, state, object_store, receive, get_run) -> int | None:  # type: ignore[no-untyped-def]
        """What Flower's ``_pull_and_store_message`` does with a message: a task for it,
        the message in the state and store; the executor claims and starts the task."""
        from flwr.supercore.constant import TaskType
        from flwr.supernode.start_client_internal import _insert_message

        got = receive()
        if got is None:
            return None
        msg = got[0]
        get_run(msg.metadata.run_id)
        task_id = state.create_task(TaskType.CLIENT_APP, msg.metadata.run_id, "fab")
        _insert_message(msg, state, object_store)
        state.claim_task(task_id)
        state.activate_task(task_id)
        return int(msg.metadata.run_id)

    def send(self, message, object_tree, runtime):  # type: ignore[no-untyped-def]
        self.sent.append(message)
        return set(), "session"

    def watch(self):  # type: ignore[no-untyped-def]
        from flwr.supernode.start_client_internal import _push_messages

        from cli.supernode import RunWatch

        return RunWatch(self.pull, _push_messages, sleep=self.sleep, clock=self.clock.monotonic)

    def sleep(self, seconds: float) -> None:
        """The node's wait: the fake clock's (as a test sets it), never unbounded."""
        if self.clock.now > 1000.0:
            raise RuntimeError("the node waited for ever")
        self.clock.sleep(seconds)

    def loop_once(self, watch) -> int | None:  # type: ignore[no-untyped-def]
        """One turn of Flower's loop (pull, then push) through ``watch``."""
        run_id = watch.pull(
            state=self.state, object_store=self.store, receive=self.receive, get_run=self.get_run
        )
        if run_id is not None:
            watch.push(state=self.state, object_store=self.store, send=self.send, push_object=None)
        return run_id

    def task(self, run_id: int):  # type: ignore[no-untyped-def]
        (task,) = self.state.get_tasks(run_ids=[run_id])
        return task


def _reply_later(node: _Node, msg: Message, at: float, to_node: _Node | None = None) -> None:
    """The task's child pushes its reply at fake time ``at``."""
    from flwr.supernode.start_client_internal import _insert_message

    real_sleep = node.clock.sleep

    def sleep(seconds: float) -> None:
        real_sleep(seconds)
        if node.clock.now >= at and not getattr(sleep, "done", False):
            sleep.done = True  # type: ignore[attr-defined]
            _insert_message(Message(RecordDict(), reply_to=msg), node.state, node.store)

    node.clock.sleep = sleep  # type: ignore[method-assign]


@pytest.mark.usefixtures("flower_never_waits")
def test_the_node_drops_a_stopped_runs_task_and_pulls_the_next_message() -> None:
    """While the task runs the node asks for the run every STOP_CHECK_S; once the run
    is stopped, the task is finished (stopped: its token no longer heartbeats), the
    message and its objects leave the node, and the loop goes on."""
    from flwr.common.constant import Status, SubStatus

    from cli.supernode import STOP_CHECK_S

    node = _Node()
    msg = _instruction(7)
    node.inbox.append(msg)
    node.runs[7] = True
    watch = node.watch()
    stop_at = 11.0

    real_sleep = node.clock.sleep

    def sleep(seconds: float) -> None:
        assert seconds == 0.5  # Flower's reply wait (paced by PacedSleep on a node)
        real_sleep(seconds)
        if node.clock.now - 100.0 >= stop_at:
            node.runs[7] = False  # `flwr stop`

    node.clock.sleep = sleep  # type: ignore[method-assign]
    assert node.loop_once(watch) == 7
    asked = [t - 100.0 for t in node.asked[1:]]  # [0]: the pull's own get_run
    gaps = [b - a for a, b in zip(asked, asked[1:], strict=False)]
    assert min(gaps) >= STOP_CHECK_S and asked[0] >= STOP_CHECK_S
    assert stop_at <= asked[-1] <= stop_at + STOP_CHECK_S + 0.5  # noticed within one check
    task = node.task(7)
    assert (task.status.status, task.status.sub_status) == (Status.FINISHED, SubStatus.STOPPED)
    assert not node.state.acknowledge_task_heartbeat(task.task_id)  # the executor's cue
    assert node.sent == []
    assert node.state.get_messages_legacy() == []
    assert node.store.get(msg.metadata.message_id) is None


@pytest.mark.usefixtures("flower_never_waits")
def test_the_node_sends_the_reply_of_a_running_run_with_flowers_push() -> None:
    node = _Node()
    msg = _instruction(8)
    node.inbox.append(msg)
    node.runs[8] = True
    _reply_later(node, msg, at=100.0 + 5.0)
    assert node.loop_once(node.watch()) == 8
    assert [m.metadata.reply_to_message_id for m in node.sent] == [msg.metadata.message_id]
    assert node.state.get_messages_legacy() == []  # Flower's push cleaned up
    assert len(node.asked) == 1 + 2  # the pull's, then at 2 s and 4 s


@pytest.mark.usefixtures("flower_never_waits")
def test_a_late_reply_of_a_stopped_run_is_not_taken_for_the_next_runs() -> None:
    """A stopped run's child may still push its reply: the node discards it and waits
    for the reply of the task in progress."""
    from flwr.supernode.start_client_internal import _insert_message

    node = _Node()
    first, second = _instruction(1), _instruction(2)
    node.inbox += [first, second]
    node.runs.update({1: True, 2: True})
    watch = node.watch()
    plain = node.clock.sleep

    def stop_run_1(seconds: float) -> None:
        plain(seconds)
        node.runs[1] = False

    node.clock.sleep = stop_run_1  # type: ignore[method-assign]
    assert node.loop_once(watch) == 1 and node.sent == []
    # run 1's child pushes its reply after all; run 2's task replies a second later
    _insert_message(Message(RecordDict(), reply_to=first), node.state, node.store)
    node.clock.sleep = plain  # type: ignore[method-assign]
    _reply_later(node, second, at=node.clock.now + 1.0)
    assert node.loop_once(watch) == 2
    assert [m.metadata.reply_to_message_id for m in node.sent] == [second.metadata.message_id]
    assert node.state.get_messages_legacy() == []


@pytest.mark.usefixtures("flower_never_waits")
def test_a_task_that_ended_without_a_reply_gets_an_error_reply_with_its_cause() -> None:
    """Never a silent wait: the task's child ended (here: finished by the node, as
    when this Flower keeps replies where the watch does not look) and no reply came;
    after REPLY_GRACE_S the message gets an error reply naming the cause."""
    from flwr.common.constant import SubStatus

    from cli.supernode import REPLY_GRACE_S

    node = _Node()
    msg = _instruction(9)
    node.inbox.append(msg)
    node.runs[9] = True
    plain = node.clock.sleep

    def sleep(seconds: float) -> None:
        plain(seconds)
        if node.clock.now >= 103.0 and not getattr(sleep, "done", False):
            sleep.done = True  # type: ignore[attr-defined]
            task = node.task(9)
            node.state.finish_task(task.task_id, sub_status=SubStatus.FAILED, details="boom")

    node.clock.sleep = sleep  # type: ignore[method-assign]
    assert node.loop_once(node.watch()) == 9
    [reply] = node.sent
    assert reply.metadata.reply_to_message_id == msg.metadata.message_id and reply.has_error()
    assert "boom" in reply.error.reason and "left no reply" in reply.error.reason
    assert 103.0 + REPLY_GRACE_S <= node.clock.now <= 103.0 + REPLY_GRACE_S + 2.5


@pytest.mark.usefixtures("flower_never_waits")
def test_a_task_no_executor_takes_is_failed_with_an_error_reply() -> None:
    from flwr.common.constant import Status, SubStatus
    from flwr.supercore.constant import TaskType
    from flwr.supernode.start_client_internal import _insert_message

    from cli.supernode import RunWatch

    node = _Node()
    msg = _instruction(5)
    node.inbox.append(msg)
    node.runs[5] = True

    def pull_unclaimed(*, state, object_store, receive, get_run):  # type: ignore[no-untyped-def]
        got = receive()
        state.create_task(TaskType.CLIENT_APP, 5, "fab")
        _insert_message(got[0], state, object_store)
        return 5

    from flwr.supernode.start_client_internal import _push_messages

    watch = RunWatch(
        pull_unclaimed,
        _push_messages,
        sleep=node.sleep,
        clock=node.clock.monotonic,
        start_bound_s=10.0,
    )
    watch.pull(state=node.state, object_store=node.store, receive=node.receive, get_run=None)
    watch.push(state=node.state, object_store=node.store, send=node.send, push_object=None)
    [reply] = node.sent
    assert reply.has_error() and "no executor took its task in 10 s" in reply.error.reason
    task = node.task(5)
    assert (task.status.status, task.status.sub_status) == (Status.FINISHED, SubStatus.FAILED)
    assert 110.0 <= node.clock.now <= 113.0


def test_the_store_inbox_finds_replies_and_stores_error_replies_where_flower_looks() -> None:
    """flwr 1.43's loop reads replies from the core message store
    (``get_messages(dst_node_id=SUPERLINK_NODE_ID)``): the ``store`` inbox finds a
    reply stored there and stores its error replies there, which the ``legacy`` one
    (``get_messages_legacy``) does not see."""
    from flwr.common.constant import SUPERLINK_NODE_ID

    from cli.supernode import Inbox

    state, store = _node_state()
    state.set_node_id(7)
    msg = _instruction(3, dst=7)
    msg.metadata.__dict__["_src_node_id"] = SUPERLINK_NODE_ID  # as the SuperLink sends it
    assert state.store_messages([msg]) == [True]
    inbox = Inbox("store")
    assert inbox.replies(state) == []
    inbox.error_reply(state, store, msg, "the cause")
    [reply] = inbox.replies(state)
    assert reply.has_error() and reply.error.reason == "the cause"
    assert reply.metadata.dst_node_id == SUPERLINK_NODE_ID
    assert Inbox("legacy").replies(state) == []  # where 1.42's loop looked
    inbox.drop(state, store, [reply.metadata.message_id])
    assert inbox.replies(state) == []


def test_a_held_polls_hold_is_not_counted_as_its_answers_delay() -> None:
    """The round trip a node notes (its load view, its connections' expiry) is the
    poll's time less what the SuperLink held it."""
    from cli import supernode as sn

    noted: list[float] = []

    def receive():  # type: ignore[no-untyped-def]
        time.sleep(0.05)  # the poll took 50 ms, all of it held
        sn.HELD.seconds = 10.0
        return None

    def pull(*, state, object_store, receive, get_run):  # type: ignore[no-untyped-def]
        return receive()

    watch = sn.RunWatch(pull, lambda *, state, object_store: None, on_receive_s=noted.append)
    try:
        watch.pull(state=None, object_store=None, receive=receive, get_run=None)
    finally:
        sn.HELD.seconds = 0.0
    assert noted == [0.0]


def test_run_watch_names_a_flower_loop_function_that_changed() -> None:
    from cli.supernode import RunWatch

    def pull(*, state, receive):  # type: ignore[no-untyped-def]
        return None

    with pytest.raises(RuntimeError, match=r"_pull_and_store_message.*get_run"):
        RunWatch(pull, lambda *, state, object_store: None)


@pytest.mark.usefixtures("fast_stop")
def test_a_child_that_reports_its_tasks_end_gets_no_more_heartbeats() -> None:
    """Reporting its task's end revokes the child's token while the child still exits:
    the executor stops its heartbeats then (no failed heartbeat, no signal)."""
    import multiprocessing

    ex = _pace_only_executor()
    child, beats = _child(ex, 1, [True, False])
    ex._children[0].finishing = multiprocessing.get_context("fork").Event()
    try:
        _drive(ex, 0.15)
        assert len(beats) == 1
        ex._children[0].finishing.set()  # the child pushes its task output
        _drive(ex, 0.8)
        assert len(beats) == 1 and child.is_alive() and ex.logged == []
    finally:
        _reap(child)


def test_the_child_tells_the_executor_as_it_reports_its_tasks_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys
    import threading

    from flwr.supernode import cli as flower_cli
    from flwr.supernode.runtime import run_clientapp

    from cli.warm import _clientapp_child

    finishing = threading.Event()
    pushed: list[bool] = []
    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    monkeypatch.setattr(sys, "argv", sys.argv)
    monkeypatch.setattr(
        run_clientapp,
        "pull_and_inflate_object_from_tree",
        run_clientapp.pull_and_inflate_object_from_tree,
    )
    monkeypatch.setattr(
        run_clientapp, "push_task_output", lambda **kwargs: pushed.append(finishing.is_set())
    )
    # the child's replacements keep what they replaced here: this test's fakes, forgotten after
    monkeypatch.setattr(run_clientapp, "__fedhet_originals__", {}, raising=False)
    # Flower's clientapp: reports its task's end through the module's function
    monkeypatch.setattr(
        flower_cli, "flwr_clientapp", lambda: run_clientapp.push_task_output(client=None)
    )
    _clientapp_child(["flwr-clientapp"], False, finishing)
    assert pushed == [True]  # set before the node hears of it


def test_a_message_whose_run_stops_while_it_arrives_leaves_no_task_behind() -> None:
    """A SuperLink restarted while a node pulled a message's objects: Flower's pull
    has stored the message and created its task, then meets the run's
    ``RunNotRunningException`` (a BaseException its clean-up does not catch) and
    returns None with the task unfinished, so that the task's ClientApp waited for
    the objects for ever and the executor took no other task. The node finishes the
    task (stopped: its child's heartbeat fails, the warm executor ends it) and drops
    the message."""
    from flwr.common.constant import Status, SubStatus
    from flwr.supercore.constant import TaskType
    from flwr.supercore.run import RunNotRunningException
    from flwr.supernode.start_client_internal import _insert_message

    node = _Node()
    msg = _instruction(9)
    node.inbox.append(msg)
    node.runs[9] = True

    def pull(*, state, object_store, receive, get_run) -> int | None:  # type: ignore[no-untyped-def]
        got = receive()
        task_id = state.create_task(TaskType.CLIENT_APP, got[0].metadata.run_id, "fab")
        _insert_message(got[0], state, object_store)
        state.claim_task(task_id)
        state.activate_task(task_id)
        try:  # pulling the message's objects: the restarted SuperLink's answer
            raise RunNotRunningException
        except RunNotRunningException:
            return None  # what Flower's _pull_and_store_message does

    from cli.supernode import RunWatch

    rung: list[int] = []

    def push(*, state, object_store) -> None:  # type: ignore[no-untyped-def]
        raise AssertionError("nothing to push")

    watch = RunWatch(pull, push, on_stop=lambda: rung.append(1))
    assert (
        watch.pull(
            state=node.state, object_store=node.store, receive=node.receive, get_run=node.get_run
        )
        is None
    )
    task = node.task(9)
    assert (task.status.status, task.status.sub_status) == (Status.FINISHED, SubStatus.STOPPED)
    assert not node.state.acknowledge_task_heartbeat(task.task_id)
    assert node.state.get_messages_legacy() == []
    assert node.store.get(msg.metadata.message_id) is None
    assert rung == [1]  # a held task request is answered


def test_a_node_pulls_again_after_a_server_error_instead_of_ending() -> None:
    """Flower's node loop ended (and its SuperNode with it) on the first 500 of a
    message pull; a transient error (5xx, no connection) is tried again, others are not."""
    import httpx

    from cli.supernode import receive_again

    def failing(code: int, times: int):  # type: ignore[no-untyped-def]
        calls = []

        def receive() -> str:
            calls.append(1)
            if len(calls) <= times:
                request = httpx.Request("POST", "https://link/v1/fleet/pull-messages")
                raise httpx.HTTPStatusError(
                    "500", request=request, response=httpx.Response(code, request=request)
                )
            return "message"

        return receive, calls

    receive, calls = failing(500, 2)
    assert receive_again(receive, waits=(0.0, 0.0, 0.0)) == "message" and len(calls) == 3
    receive, calls = failing(500, 5)
    with pytest.raises(httpx.HTTPStatusError):
        receive_again(receive, waits=(0.0, 0.0))
    assert len(calls) == 3  # tried, then twice again, then given up
    receive, calls = failing(401, 1)
    with pytest.raises(httpx.HTTPStatusError):
        receive_again(receive, waits=(0.0,))
    assert len(calls) == 1  # refused: not tried again
