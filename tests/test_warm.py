"""The warm executor's contract with Flower 1.42 and the server's polling grid."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Message, RecordDict

from cli.warm import FLOWER_INTERNALS, flower_command, flower_internal
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


class SlowGrid:
    """Replies arrive over several pulls; records when each pull happened."""

    def __init__(self, batches: list[int]) -> None:
        self.batches, self.pulls, self.sent = batches, [], []

    def push_messages(self, messages):  # type: ignore[no-untyped-def]
        self.sent = list(messages)
        return [m.metadata.message_id or f"m{i}" for i, m in enumerate(self.sent)]

    def pull_messages(self, ids):  # type: ignore[no-untyped-def]
        self.pulls.append(time.monotonic())
        take = self.batches.pop(0) if self.batches else 0
        out = []
        for mid in sorted(ids)[:take]:
            reply = Message(
                RecordDict({"config": ConfigRecord()}), dst_node_id=1, message_type="train.x"
            )
            reply.metadata.__dict__["_reply_to_message_id"] = mid
            out.append(reply)
        return out


def test_polling_grid_collects_every_reply_at_short_intervals() -> None:
    inner = SlowGrid([0, 1, 0, 2])
    msgs = [Message(RecordDict(), dst_node_id=i, message_type="train.x") for i in range(3)]
    start = time.monotonic()
    replies = list(PollingGrid(inner, interval=0.05).send_and_receive(msgs, timeout=10))  # type: ignore[arg-type]
    assert len(replies) == 3 and len(inner.pulls) == 4
    assert time.monotonic() - start < 1.0  # Flower's HTTP grid would wait 3 s per pull


def test_polling_grid_stops_at_the_timeout() -> None:
    inner = SlowGrid([])
    msgs = [Message(RecordDict(), dst_node_id=1, message_type="train.x")]
    start = time.monotonic()
    replies = list(PollingGrid(inner, interval=0.05).send_and_receive(msgs, timeout=0.3))  # type: ignore[arg-type]
    assert replies == [] and 0.3 <= time.monotonic() - start < 1.0


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

    from cli.warm import PULL_BACKOFF, fast_object_pulls

    assert _backoff_waits(monkeypatch, pull_objects, 6) == [1, 2, 4, 8, 10, 10]
    mod = importlib.import_module(module)
    monkeypatch.setattr(mod, name, getattr(mod, name))  # restored after the test
    fast_object_pulls(module, name)
    fast_object_pulls(module, name)  # idempotent
    patched = getattr(mod, name)
    assert patched.keywords == PULL_BACKOFF
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

    from cli.warm import fast_object_pulls

    fake = pytypes.ModuleType("fake_flower_module")
    fake.pull_objects = lambda object_ids, pull_object_fn: {}  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_flower_module", fake)
    with pytest.raises(RuntimeError, match=r"fake_flower_module\.pull_objects"):
        fast_object_pulls("fake_flower_module", "pull_objects")


def test_the_run_bundle_carries_the_app_packages_only() -> None:
    """Every ClientApp task receives and installs the run's FAB: it holds the app's
    packages (every module the components import), not the docs, benchmarks or tests."""
    import io
    import zipfile

    import tomllib
    from flwr.cli.build import build_fab_from_disk

    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"
    ]
    names = zipfile.ZipFile(io.BytesIO(build_fab_from_disk(ROOT))).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {".info", "pyproject.toml", *packages}
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

    from cli.warm import FLOWER_IDLE_PULL_S, FLOWER_TASK_POLL_S

    source = inspect.getsource(start_client_internal)
    waits = sorted(set(re.findall(r"time\.sleep\(([0-9.]+)\)", source)), key=float)
    assert [float(w) for w in waits] == [0.5, FLOWER_IDLE_PULL_S]
    assert run_superexec._DEFAULT_TASK_POLL_INTERVAL_SECONDS == FLOWER_TASK_POLL_S


class _Clock:
    def __init__(self) -> None:
        self.now, self.slept = 100.0, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_supernode_polls_fast_after_a_task_and_backs_off_when_idle() -> None:
    import types as pytypes

    from cli.warm import IDLE_GROWTH, PacedSleep

    clock = _Clock()
    real = pytypes.ModuleType("time")
    real.monotonic, real.sleep = clock.monotonic, clock.sleep  # type: ignore[attr-defined]
    paced = PacedSleep(real, poll=0.05)
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


def _pace_only_executor():  # type: ignore[no-untyped-def]
    """A WarmExecutor without its fork server (``pace`` needs only its children)."""
    import time as pytime

    from cli.warm import WarmExecutor

    ex = object.__new__(WarmExecutor)
    ex._children, ex._last_active = [], pytime.monotonic()
    return ex


def test_superexec_waits_on_a_running_task_instead_of_polling() -> None:
    """While a task's child runs, ``pace`` returns when the child ends (not after
    Flower's 1 s poll), and at the latest after that poll interval."""
    import multiprocessing
    import time as pytime

    ctx = multiprocessing.get_context("fork")
    ex = _pace_only_executor()
    child = ctx.Process(target=pytime.sleep, args=(0.3,))
    child.start()
    ex._children = [(1, child)]
    t0 = pytime.monotonic()
    ex.pace()
    assert 0.25 < pytime.monotonic() - t0 < 0.9  # woke when the child ended
    child.join()
    stuck = ctx.Process(target=pytime.sleep, args=(30,))
    stuck.start()
    ex._children = [(2, stuck)]
    t0 = pytime.monotonic()
    ex.pace()
    assert 0.9 < pytime.monotonic() - t0 < 2.5  # a long task: Flower's interval
    stuck.kill()
    stuck.join()


def test_superexec_idle_poll_grows_to_flowers_interval(monkeypatch: pytest.MonkeyPatch) -> None:
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
    assert clock.slept == [pytest.approx(warm.IDLE_GROWTH * 10.0)]
    clock.now += 3600.0
    ex.pace()
    assert clock.slept[-1] == warm.FLOWER_TASK_POLL_S
