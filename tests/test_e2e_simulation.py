"""Real ``flwr run`` simulations (SuperLink + Ray) on loopback, cleaned up after."""

from __future__ import annotations

import json
import os
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


@pytest.mark.parametrize("algorithm", ["fedtgp", "fedkd", "fml"])
def test_strongest_baselines_run_through_flwr(tmp_path: Path, algorithm: str) -> None:
    """The three heterogeneous baselines, 2 rounds each, on the main job's settings."""
    overrides = {**_common(tmp_path), "num-server-rounds": 2, "algorithm": algorithm}
    outcome = run_simulation(
        ROOT, overrides, num_supernodes=3, flwr_home=tmp_path / "flwr", timeout=600
    )
    assert outcome.ok, outcome.status
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["valid-replies"] for r in res["rounds"]] == [3, 3]
    assert res["summary"]["accuracy-last"] > res["summary"]["accuracy-prior"] - 0.2
