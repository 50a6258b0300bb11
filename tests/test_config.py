"""Run-config validation and the pyproject <-> model drift check."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from common.config import ConfigError, RunConfig, flatten, known_keys, parse_run_config

ROOT = Path(__file__).resolve().parent.parent


def _pyproject_config() -> dict:
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    flat: dict = {}

    def walk(table: dict, prefix: str) -> None:
        for key, value in table.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                flat[prefix + key] = value

    walk(doc["tool"]["flwr"]["app"]["config"], "")
    return flat


def test_pyproject_keys_and_defaults_match_the_model() -> None:
    assert _pyproject_config() == flatten(RunConfig())


def test_pyproject_parses_to_the_defaults() -> None:
    assert parse_run_config(_pyproject_config()) == RunConfig()


def test_required_keys_exist() -> None:
    required = {
        "algorithm",
        "num-server-rounds",
        "fraction-train",
        "fraction-evaluate",
        "eval-every",
        "seed",
        "out-dir",
        "data.name",
        "data.root",
        "data.partition",
        "data.alpha",
        "data.classes-per-client",
        "data.protocol",
        "data.fraction",
        "data.download",
        "model.family",
        "model.feature-dim",
        "train.local-epochs",
        "train.batch-size",
        "train.lr",
    }
    assert required <= set(known_keys())


def test_unknown_algorithm_names_key_and_allowed_values() -> None:
    with pytest.raises(ConfigError) as err:
        parse_run_config({"algorithm": "fedxyz"})
    msg = str(err.value)
    assert "\n" not in msg
    assert "'algorithm'" in msg and "fedxyz" in msg
    assert "'lgfedavg'" in msg and "'local'" in msg


def test_negative_alpha_names_key_and_bound() -> None:
    with pytest.raises(ConfigError, match=r"'data\.alpha' = -1\.0 .*greater than 0"):
        parse_run_config({"data.alpha": -1.0})


@pytest.mark.parametrize("key", ["nope", "data.nope", "train.lr-schedule"])
def test_unknown_key_is_rejected_by_name(key: str) -> None:
    with pytest.raises(ConfigError, match=f"unknown run-config key '{key}'"):
        parse_run_config({key: 1})


def test_config_is_frozen() -> None:
    cfg = parse_run_config({"seed": 3})
    with pytest.raises(ValueError):
        cfg.seed = 4  # type: ignore[misc]


def test_out_dir_template(tmp_path: Path) -> None:
    cfg = parse_run_config({"out-dir": str(tmp_path / "{algorithm}-{seed}"), "seed": 7})
    assert cfg.resolved_out_dir("t") == tmp_path / "lgfedavg-7"
