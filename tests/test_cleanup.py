"""A launcher stopped mid-run (SIGTERM) leaves no process behind.

Flower's SuperLink starts SuperExec, the simulation and Ray in process groups of
their own; the launcher must find and stop all of them.
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
pytestmark = pytest.mark.e2e

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
