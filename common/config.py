"""The one run-config model.

Flower delivers ``[tool.flwr.app.config]`` as a flat mapping with dotted, kebab-case
keys (``"data.alpha"``). :func:`parse_run_config` folds it into the frozen
:class:`RunConfig` below, rejecting unknown keys and bad values with one line that
names the key and what is allowed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

ALGORITHMS = ("local", "fedavg", "lgfedavg")
"""Every value ``algorithm`` accepts; each has a strategy and a client hook."""

Scalar = bool | int | float | str


def _kebab(name: str) -> str:
    return name.replace("_", "-")


class ConfigError(ValueError):
    """A run-config key is unknown or has a value that is not allowed."""


class _Section(BaseModel):
    model_config = ConfigDict(
        frozen=True, extra="forbid", alias_generator=_kebab, populate_by_name=True
    )


class DataConfig(_Section):
    """``data.*``: which dataset, how it is split over clients, where it lives."""

    name: Literal[
        "fashion-mnist",
        "cifar10",
        "cifar100",
        "tiny-imagenet",
        "npz",
        "imagefolder",
        "clients-npz",
        "synthetic",
    ] = "fashion-mnist"
    root: str = ""
    """Dataset location; empty = the dataset's default places (see README)."""
    partition: Literal["dirichlet", "pathological", "iid"] = "dirichlet"
    alpha: float = Field(0.1, gt=0)
    classes_per_client: int = Field(2, ge=1)
    protocol: Literal["merge", "official"] = "merge"
    fraction: float = Field(1.0, gt=0, le=1)
    download: bool = False
    train_fraction: float = Field(0.75, gt=0, lt=1)
    """Share of each client's samples used for local training (rest: local test)."""
    min_train_samples: int = Field(10, ge=1)
    min_test_samples: int = Field(2, ge=1)
    cache_dir: str = ""
    """Where computed partitions are cached; empty = ``~/.cache/fedhet/partitions``."""


class ModelConfig(_Section):
    """``model.*``: the model family and the unified representation size ``d``."""

    family: str = "cnn"
    """A family name (``cnn``, ``fedavgcnn``, ``htfe``, ...) or a comma-separated
    list of architecture names, assigned round-robin by partition id."""
    feature_dim: int = Field(0, ge=0)
    """Unified representation size ``d``; 0 = the family's natural ``d``."""
    small_input_stem: bool = True


class TrainConfig(_Section):
    """``train.*``: the shared local training loop (SGD)."""

    local_epochs: int = Field(1, ge=1)
    batch_size: int = Field(10, ge=1)
    lr: float = Field(0.01, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    num_threads: int = Field(1, ge=0)
    """Torch intra-op threads per client process; 0 = leave torch's default."""
    device: Literal["cpu", "cuda", "auto"] = "cpu"


class RunConfig(_Section):
    """Every run-config key of the app (see README, "Run-config")."""

    algorithm: Literal["local", "fedavg", "lgfedavg"] = "lgfedavg"
    num_server_rounds: int = Field(10, ge=1)
    fraction_train: float = Field(1.0, gt=0, le=1)
    fraction_evaluate: float = Field(1.0, ge=0, le=1)
    min_train_nodes: int = Field(2, ge=1)
    min_evaluate_nodes: int = Field(2, ge=0)
    min_available_nodes: int = Field(2, ge=1)
    min_valid_replies: int = Field(1, ge=1)
    round_timeout: float = Field(3600.0, gt=0)
    eval_every: int = Field(1, ge=1)
    seed: int = Field(0, ge=0)
    out_dir: str = "~/fedhet-runs/{algorithm}-{timestamp}"
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()

    @model_validator(mode="after")
    def _check_nodes(self) -> RunConfig:
        if self.min_available_nodes < self.min_train_nodes:
            raise ValueError(
                "min-available-nodes must be >= min-train-nodes "
                f"({self.min_available_nodes} < {self.min_train_nodes})"
            )
        return self

    def resolved_out_dir(self, timestamp: str) -> Path:
        """``out-dir`` with ``{algorithm}``, ``{seed}``, ``{timestamp}`` filled in."""
        text = self.out_dir.format(
            algorithm=self.algorithm, seed=self.seed, timestamp=timestamp
        )
        return Path(os.path.expanduser(text)).resolve()


_SECTIONS = {"data": DataConfig, "model": ModelConfig, "train": TrainConfig}


def _nest(flat: Mapping[str, Scalar]) -> dict[str, Any]:
    """Fold ``{"data.alpha": 0.1}`` into ``{"data": {"alpha": 0.1}}``."""
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        section, dot, field = key.partition(".")
        if dot:
            nested.setdefault(section, {})[field] = value
        else:
            nested[key] = value
    return nested


def _describe(err: dict[str, Any], flat: Mapping[str, Scalar]) -> str:
    """One line for one pydantic error: the dotted key, the value, what is allowed."""
    loc = [str(p) for p in err["loc"] if isinstance(p, str)]
    key = ".".join(loc)
    if err["type"] == "extra_forbidden":
        return f"unknown run-config key '{key}'; known keys: {', '.join(known_keys())}"
    msg = str(err["msg"]).removeprefix("Value error, ")
    if key in flat:
        return f"run-config key '{key}' = {flat[key]!r} is invalid: {msg}"
    if key:
        return f"run-config key '{key}' is invalid: {msg}"
    return f"invalid run-config: {msg}"


def parse_run_config(flat: Mapping[str, Scalar]) -> RunConfig:
    """Validate Flower's flat run config; raise :class:`ConfigError` (one line)."""
    try:
        return RunConfig.model_validate(_nest(flat))
    except ValidationError as exc:
        raise ConfigError(_describe(exc.errors()[0], flat)) from None


def flatten(cfg: BaseModel, prefix: str = "") -> dict[str, Scalar]:
    """The inverse of parsing: ``{"data.alpha": 0.1, ...}`` with kebab-case keys."""
    flat: dict[str, Scalar] = {}
    for name, value in cfg:
        key = prefix + _kebab(name)
        if isinstance(value, BaseModel):
            flat.update(flatten(value, key + "."))
        else:
            flat[key] = value
    return flat


def known_keys() -> list[str]:
    """Every accepted dotted key, in declaration order."""
    return list(flatten(RunConfig()))
