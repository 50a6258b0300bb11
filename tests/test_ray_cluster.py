"""The simulation on an existing Ray cluster (a local ``ray start --head`` stands in).

Recipe under test (docs/deployment.md "Simulation beyond one machine"): ``RAY_ADDRESS`` in the
environment of the SuperLink that runs the simulation.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from cli.launch import FLOWER_ENV, free_port, run_simulation

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.e2e

JOBS = """
import json, sys, ray
from ray._private.state import jobs
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
print(json.dumps(len(jobs())))
"""


def _jobs(address: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", JOBS, address], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return int(json.loads(out.stdout.strip().splitlines()[-1]))


def test_simulation_runs_on_an_existing_ray_cluster(tmp_path: Path) -> None:
    port, dash = free_port(), free_port()
    temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: socket paths
    env = {**os.environ, **FLOWER_ENV, "RAY_USAGE_STATS_ENABLED": "0"}
    head = subprocess.Popen(
        [
            "ray",
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--num-cpus=2",
            "--include-dashboard=false",
            f"--dashboard-agent-listen-port={dash}",
            f"--temp-dir={temp}",
            "--disable-usage-stats",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    address = f"127.0.0.1:{port}"
    try:
        wait_for_gcs(address, head)
        before = _jobs(address)
        overrides = {
            "num-server-rounds": 1,
            "data.fraction": 0.05,
            "data.cache-dir": str(tmp_path / "cache"),
            "out-dir": str(tmp_path / "out"),
        }
        outcome = run_simulation(
            ROOT,
            overrides,
            num_supernodes=3,
            flwr_home=tmp_path / "flwr",
            timeout=600,
            extra_env={"RAY_ADDRESS": address},
        )
        assert outcome.ok, outcome.log_path.read_text()[-3000:]
        assert (tmp_path / "out" / "results.json").exists()
        # the simulation connected to this cluster as a driver (one more job, and ours
        # from _jobs itself): it did not start a private Ray instance
        assert _jobs(address) >= before + 2
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        subprocess.run(["pkill", "-f", str(temp)], check=False)


def wait_for_gcs(address: str, proc: subprocess.Popen) -> None:  # type: ignore[type-arg]
    import socket
    import time

    host, port = address.split(":")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("ray start exited early")
        with socket.socket() as s:
            if s.connect_ex((host, int(port))) == 0:
                time.sleep(2)
                return
        time.sleep(0.5)
    raise TimeoutError("Ray head did not come up")
