"""A launcher stopped mid-run (SIGTERM) leaves no process behind, soon.

Flower's SuperLink starts SuperExec, the simulation and Ray in process groups of
their own; the launcher must find and stop all of them. `fedhet federation` signals
every process at once (one grace period, then SIGKILL), so a busy machine does not
stretch its stop to one graceful exit after another.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli.launch import descendants

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.e2e, pytest.mark.serial]  # timings: run alone (test.sh --all)

SCRIPT = """
import sys
from pathlib import Path
from cli.launch import run_simulation
run_simulation(Path(sys.argv[1]), {"num-server-rounds": 100, "data.fraction": 0.05,
               "data.cache-dir": sys.argv[2] + "/cache", "out-dir": sys.argv[2] + "/out"},
               num_supernodes=2, flwr_home=Path(sys.argv[2]) / "flwr", timeout=600,
               echo=lambda line: print(line, flush=True))
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_mid_run_stops_every_process(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(ROOT), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,  # the script imports the app from the repository root
    )
    assert proc.stdout is not None
    tree: set[int] = set()
    deadline = time.monotonic() + 300
    for line in proc.stdout:
        tree |= set(descendants(proc.pid))
        if "[fedhet] round 2/" in line or time.monotonic() > deadline:
            break
    tree |= set(descendants(proc.pid))
    assert any("ray" in Path(f"/proc/{p}/cmdline").read_text() for p in tree if alive(p)), (
        "the simulation (with Ray) should be running"
    )
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    time.sleep(2)
    left = [p for p in tree if alive(p)]
    for pid in left:  # do not leak them into the rest of the suite
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left running: {left}"


BUSY_LOOPS = 8
"""CPU-bound processes beside the federation: a load average above 8 on 2 cores."""
STOPPED_WITHIN_S = 15.0


def _tree(roots: set[int]) -> set[int]:
    """``roots`` and every live process below them."""
    found = set(roots)
    for pid in list(roots):
        found |= set(descendants(pid))
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_sigterm_stops_a_federation_within_15_s_on_a_busy_machine(tmp_path: Path) -> None:
    """`fedhet federation` (TLS + node auth, 4 nodes with warm executors) mid-run, the CPU
    loaded by busy loops: every process it started is gone within 15 s of SIGTERM."""
    fedhet = Path(sys.executable).with_name("fedhet")
    run_config = (
        "algorithm='local' num-server-rounds=100 data.fraction=0.05 "
        f"data.cache-dir='{tmp_path / 'cache'}' out-dir='{tmp_path / 'out'}'"
    )
    proc = subprocess.Popen(
        [str(fedhet), "federation", "--nodes", "4", "--workdir", str(tmp_path / "fed")]
        + ["-c", run_config],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    assert proc.stdout is not None
    busy: subprocess.Popen[bytes] | None = None
    tree: set[int] = {proc.pid}
    try:
        deadline = time.monotonic() + 300
        seen = []
        for line in proc.stdout:
            seen.append(line)
            tree = _tree(tree)
            if "[fedhet] round 1/" in line or time.monotonic() > deadline:
                break
        assert any("[fedhet] round 1/" in line for line in seen), "".join(seen[-40:])
        # the load: busy loops in a process group of their own, killed below
        busy = subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"import os\nfor _ in range({BUSY_LOOPS - 1}):\n"
                "    if os.fork() == 0: break\nwhile True: pass",
            ],
            start_new_session=True,
        )
        time.sleep(5)  # the loops take the cores; the round goes on, slowly
        tree = _tree(tree)
        started = b" ".join(_cmdline(p) for p in tree)
        for name in (b"fedhet\0superlink", b"supernode", b"superexec", b"forkserver"):
            assert name in started, name
        proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        while time.monotonic() - start < 60:
            tree = _tree({p for p in tree if alive(p)}) | tree
            if not any(alive(p) for p in tree):
                break
            time.sleep(0.1)
        gone_after = time.monotonic() - start
        left = [p for p in tree if alive(p)]
        print(f"{len(tree)} processes, all gone {gone_after:.1f} s after SIGTERM")
        assert not left, f"processes left 60 s after SIGTERM: {left}"
        assert gone_after < STOPPED_WITHIN_S, (
            f"the last process ended {gone_after:.1f} s after SIGTERM"
        )
    finally:
        if busy is not None:
            os.killpg(busy.pid, signal.SIGKILL)
            busy.wait(timeout=10)
        for pid in tree:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)


SLOW_EXIT = """
import signal, sys, time
def slow(signum, frame):  # a graceful exit that takes a while, as a loaded SuperNode's
    time.sleep(float(sys.argv[1]))
    sys.exit(0)
signal.signal(signal.SIGTERM, slow if float(sys.argv[1]) >= 0 else signal.SIG_IGN)
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def test_stop_all_signals_every_process_at_once_and_kills_what_outlives_the_grace(
    tmp_path: Path,
) -> None:
    """Five processes that each need 3 s to exit after SIGTERM, and one that ignores it:
    stop_all takes one grace period for all of them (stopped one by one: 15 s and more),
    and SIGKILLs the one that ignores SIGTERM."""
    from cli.launch import Processes

    procs = Processes(dict(os.environ), tmp_path / "logs")
    started = [procs.start(f"slow-{i}", [sys.executable, "-c", SLOW_EXIT, "3"]) for i in range(5)]
    started.append(procs.start("deaf", [sys.executable, "-c", SLOW_EXIT, "-1"]))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # every handler installed
        logs = [(tmp_path / "logs" / f"{n}.log").read_text() for n in procs.procs]
        if all("ready" in log for log in logs):
            break
        time.sleep(0.1)
    start = time.monotonic()
    procs.stop_all(grace=5.0)
    took = time.monotonic() - start
    assert [p.returncode for p in started] == [0] * 5 + [-signal.SIGKILL]
    assert not procs.procs
    assert 3.0 <= took < 7.0, took
