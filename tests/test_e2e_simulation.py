"""Real ``flwr run`` simulations (SuperLink + Ray) on loopback, cleaned up after."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from cli.launch import FLOWER_ENV, run_simulation, toml_value

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.e2e


def _common(tmp_path: Path) -> dict:
    return {
        "data.fraction": 0.05,
        "data.cache-dir": str(tmp_path / "cache"),
        "out-dir": str(tmp_path / "out"),
        "train.batch-size": 32,
    }


def test_flwr_run_three_nodes_two_rounds(tmp_path: Path) -> None:
    """The README's run command path: ``fedhet simulate`` -> ``flwr run``."""
    from common.provenance import code_identity

    code_identity.cache_clear()
    code_before = code_identity()
    overrides = {**_common(tmp_path), "num-server-rounds": 2, "data.alpha": 0.5}
    pairs = " ".join(f"{k}={toml_value(v)}" for k, v in overrides.items())
    env = {**os.environ, **FLOWER_ENV, "FLWR_HOME": str(tmp_path / "flwr")}
    out = subprocess.run(
        ["fedhet", "simulate", "--num-supernodes", "3", "-c", pairs],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    lines = [ln for ln in out.stdout.splitlines() if "[fedhet] round" in ln]
    assert len(lines) == 2 and "accuracy 0." in lines[0] and "up 19.6 KB" in lines[0]
    assert "finished:completed" in out.stdout
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["round"] for r in res["rounds"]] == [1, 2]
    assert res["config"]["algorithm"] == "lgfedavg"
    assert res["config"]["data.alpha"] == 0.5
    head_bytes = (500 * 10 + 10) * 4
    assert all(r["bytes-up-per-client"] == head_bytes for r in res["rounds"])
    assert all(r["train-clients"] == 3 for r in res["rounds"])
    assert 0.3 < res["summary"]["accuracy-last"] <= 1.0
    assert (tmp_path / "out" / "accuracy.png").stat().st_size > 0
    # the ServerApp ran from the bundle under FLWR_HOME (no .git there): the source hash
    # of this checkout and the commit the launcher passed (common/provenance.py)
    code_identity.cache_clear()
    code = {k: res["versions"][k] for k in ("source", "git-commit", "git-dirty")}
    assert code in (code_before, code_identity()), (code, code_before)  # edits meanwhile
    if (ROOT / ".git").exists():
        assert code["git-commit"] is not None


def test_bad_config_fails_the_run_with_one_clear_line(tmp_path: Path) -> None:
    overrides = {**_common(tmp_path), "algorithm": "fedxyz"}
    outcome = run_simulation(
        ROOT, overrides, num_supernodes=2, flwr_home=tmp_path / "flwr", timeout=300
    )
    assert outcome.status == "finished:failed"
    lines = [
        ln for ln in outcome.log_path.read_text().splitlines() if "ERROR" in ln and "fedhet:" in ln
    ]
    assert len(lines) == 1
    assert "'algorithm'" in lines[0] and "'lgfedavg'" in lines[0]
    assert not (tmp_path / "out" / "results.json").exists()


def test_cli_rejects_a_bad_key_before_starting_anything(tmp_path: Path) -> None:
    env = {**os.environ, **FLOWER_ENV, "FLWR_HOME": str(tmp_path / "flwr")}
    out = subprocess.run(
        ["fedhet", "simulate", "-c", "data.alpha=-1.0"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "fedhet: run-config key 'data.alpha' = -1.0 is invalid: Input should be greater than 0"
    ]


def test_same_seed_same_metrics_through_ray(tmp_path: Path) -> None:
    """Two real simulations with one seed: Ray's scheduling order must not leak into
    the metrics (on CPU they are identical, round by round)."""
    curves = []
    for name in ("a", "b"):
        overrides = {
            **_common(tmp_path),
            "out-dir": str(tmp_path / name),
            "num-server-rounds": 2,
            "algorithm": "fedre",
            "seed": 3,
        }
        outcome = run_simulation(
            ROOT, overrides, num_supernodes=3, flwr_home=tmp_path / "flwr", timeout=600
        )
        assert outcome.ok, outcome.status
        rounds = json.loads((tmp_path / name / "results.json").read_text())["rounds"]
        curves.append([(r["accuracy"], r["loss"], r["accuracy-std"]) for r in rounds])
    assert len(curves[0]) == 2
    assert curves[0] == curves[1]


@pytest.mark.parametrize("algorithm", ["fedtgp"])
def test_strongest_baselines_run_through_flwr(tmp_path: Path, algorithm: str) -> None:
    """A heterogeneous baseline with a server-side training step, 2 rounds on the main
    job's settings; the ServerApp runs with the ``server-threads`` asked for (3:
    nobody's default on this machine) and records it. Every other method runs through
    the same ClientApp and ServerApp code in process (tests/test_eval_mode.py,
    tests/test_inprocess.py, tests/test_tabular.py); Ray only carries the messages."""
    overrides = {
        **_common(tmp_path),
        "num-server-rounds": 2,
        "algorithm": algorithm,
        "server-threads": 3,
    }
    outcome = run_simulation(
        ROOT, overrides, num_supernodes=3, flwr_home=tmp_path / "flwr", timeout=600
    )
    assert outcome.ok, outcome.status
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["valid-replies"] for r in res["rounds"]] == [3, 3]
    assert res["summary"]["accuracy-last"] > res["summary"]["accuracy-prior"] - 0.2
    assert res["summary"]["server-threads"] == 3


class _Killed(Exception):
    pass


def test_a_simulation_killed_after_round_3_of_6_resumes_to_the_same_metrics(
    tmp_path: Path,
) -> None:
    """SIGKILL of the simulation's whole process tree (SuperLink, SuperExec, the
    simulation, Ray and its workers) once round 3 is reported; ``resume`` on a new
    SuperLink finishes the run with exactly the per-round metrics of an uninterrupted
    one (CPU, same seed; the clients' personal models come back from the out-dir)."""
    from cli.launch import (
        simulation_command,
        simulation_superlink,
        stream_run,
        write_run_config,
    )

    common = {**_common(tmp_path), "num-server-rounds": 6, "algorithm": "fedre", "seed": 1}
    home = tmp_path / "flwr"
    full = run_simulation(
        ROOT,
        {**common, "out-dir": str(tmp_path / "full")},
        num_supernodes=3,
        flwr_home=home,
        timeout=900,
    )
    assert full.ok, full.status

    crashed = tmp_path / "crashed"
    killed: list[str] = []
    with simulation_superlink(home) as (conn, env, procs):

        def echo(line: str) -> None:
            if not killed and "[fedhet] round 3/6" in line:
                killed.append(line)
                procs.stop("superlink", sig=signal.SIGKILL, grace=0.0)
                raise _Killed

        config = write_run_config({**common, "out-dir": str(crashed)}, tmp_path)
        cmd = simulation_command(ROOT, conn, 3, 1, config)
        with pytest.raises(_Killed):
            stream_run(cmd, env, ROOT, home / "logs" / "killed.log", echo, 900)
    assert killed
    before = json.loads((crashed / "results.json").read_text())["rounds"]
    # the checkpoint of round 3, or of round 2 if it was not written; under eval-mode
    # with-train the round after the last evaluated one may be there too, trained and
    # its evaluation pending (it travels in the next round's messages)
    evaluated = [r for r in before if r["accuracy"] is not None]
    assert 2 <= len(evaluated) <= 3
    assert [r["round"] for r in before] == list(range(1, len(before) + 1))
    assert len(before) - len(evaluated) <= 1

    resumed = run_simulation(
        ROOT,
        {**common, "out-dir": str(crashed), "resume": str(crashed)},
        num_supernodes=3,
        flwr_home=home,
        timeout=900,
    )
    assert resumed.ok, resumed.status
    keys = ("round", "accuracy", "loss", "accuracy-std", "bytes-up", "valid-replies")
    want = json.loads((tmp_path / "full" / "results.json").read_text())["rounds"]
    got = json.loads((crashed / "results.json").read_text())["rounds"]
    assert len(want) == 6
    assert [[r[k] for k in keys] for r in got] == [[r[k] for k in keys] for r in want]


def test_eval_modes_give_the_same_accuracies_under_flwr_run(tmp_path: Path) -> None:
    """The same seed under Flower's simulation engine (Ray actors, replies in any
    order): ``eval-mode = with-train`` and ``separate`` record the same per-round
    evaluations (in-process, every method: tests/test_eval_mode.py)."""
    rows = {}
    for mode in ("with-train", "separate"):
        overrides = {
            **_common(tmp_path / mode),
            "algorithm": "fedre",
            "num-server-rounds": 3,
            "eval-mode": mode,
        }
        outcome = run_simulation(
            ROOT, overrides, num_supernodes=3, flwr_home=tmp_path / "flwr", timeout=600
        )
        assert outcome.status == "finished:completed", outcome.log_path.read_text()[-3000:]
        res = json.loads((tmp_path / mode / "out" / "results.json").read_text())
        rows[mode] = [
            (r["accuracy"], r["loss"], r["accuracy-std"], r["client-accuracy"])
            for r in res["rounds"]
        ]
    assert rows["with-train"] == rows["separate"]
    assert all(acc is not None for acc, *_ in rows["with-train"])
