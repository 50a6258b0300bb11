"""The one run-config model.

Flower delivers ``[tool.flwr.app.config]`` as a flat mapping with dotted, kebab-case
keys (``"data.alpha"``). :func:`parse_run_config` folds it into the frozen
:class:`RunConfig` below, rejecting unknown keys and bad values with one line that
names the key and what is allowed.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from common import methods
from common.devices import parse_fleet
from common.errors import ConfigError
from common.sections import (
    DataConfig,
    FDConfig,
    FedARAConfig,
    FedGenConfig,
    FedGHConfig,
    FedKDConfig,
    FedL2GConfig,
    FedL2GLConfig,
    FedLoRAConfig,
    FedMRLConfig,
    FedProtoConfig,
    FedREConfig,
    FedTGPConfig,
    FMLConfig,
    LogConfig,
    ModelConfig,
    PrivacyConfig,
    RobustConfig,
    Section,
    TrainConfig,
    _kebab,
)

__all__ = [
    "ConfigError",
    "DataConfig",
    "FedARAConfig",
    "RunConfig",
    "Scalar",
    "flatten",
    "known_keys",
    "parse_run_config",
]

Scalar = bool | int | float | str


class RunConfig(Section):
    """Every run-config key of the app: the top-level keys below, then one section per
    dotted prefix (:mod:`common.sections`); docs/configuration.md lists them all."""

    algorithm: str = "lgfedavg"
    """The federated method to run (docs/algorithms.md); ``fedavg`` needs a homogeneous
    ``model.family``."""
    num_server_rounds: int = Field(10, ge=1)
    """Federated rounds to run."""
    fraction_train: float = Field(1.0, gt=0, le=1)
    """Share of the online nodes sampled for training each round (seeded)."""
    fraction_evaluate: float = Field(1.0, ge=0, le=1)
    """Share of the online nodes sampled for evaluation; 0 disables evaluation."""
    min_train_nodes: int = Field(2, ge=1)
    """At least this many nodes train in a round."""
    min_evaluate_nodes: int = Field(2, ge=0)
    """At least this many nodes evaluate in a round."""
    min_available_nodes: int = Field(2, ge=1)
    """A round waits until this many nodes are online (at least ``min-train-nodes``)."""
    min_valid_replies: float = Field(0, ge=0)
    """Valid training replies a round needs, else the global state is kept: a count
    (≥ 1), a fraction of the sampled nodes (below 1), or 0: half of the sampled nodes
    for algorithms that replace a whole shared model by a mean, one reply otherwise."""
    max_weight_share: float = Field(1.0, gt=0, le=1)
    """Largest share any one reply may have in a weighted mean (the excess goes to the
    others in proportion); 1 = off."""
    round_timeout: float = Field(3600.0, gt=0)
    """Seconds the server waits for replies in one phase of a round."""
    round_deadline_s: float = Field(0.0, ge=0)
    """A training round's deadline in seconds (0 = wait for everyone). In
    simulation, virtual seconds: a client whose predicted round time (``fleet``,
    docs/fleet.md) exceeds it is a straggler and its reply is not aggregated; in
    deployment, the training phase's message timeout."""
    reply_poll: Literal["informed", "fixed", "flower"] = "informed"
    """Deployment: how the ServerApp polls the SuperLink for replies. ``informed``:
    each phase polls ever closer to when its last reply came last round, then fast
    (docs/deployment.md, "How many devices per server"); ``fixed``: every 0.1 s;
    ``flower``: Flower's own grid (every 3 s)."""
    pack_messages: bool = True
    """Deployment: a message's records travel packed (``common/packing.py``: 3 objects
    up to 5 MB, above it 5 plus one per 5 MB, instead of one per record, array and
    chunk: fewer SuperLink requests per node-round; the server's messages with the same
    arrays share one packed array; the numbers are the same). A simulation never packs
    (nothing crosses a network)."""
    fleet: str = ""
    """Simulation only: device classes of the simulated nodes, ``class:count`` by
    partition id, cycled (``"rpi4:8,rpi5:6,jetson-orin-nano:4,server:2"``); each
    node takes its class's architecture and rank ratio and is timed as that device
    by the virtual clock. Empty = off."""
    eval_every: int = Field(1, ge=1)
    """Evaluate every this many rounds (and always after the last)."""
    eval_mode: Literal["with-train", "separate"] = "with-train"
    """How a round's evaluation reaches the clients. ``with-train``: a node that trains
    in the next round evaluates first within that training message (what round r's
    ``evaluate`` message would have carried, on its test split) and replies with both,
    so every node gets one message per round; nodes evaluated but not sampled for the
    next round, and the last round, get an ``evaluate`` message. ``separate``: an
    ``evaluate`` message to every evaluated node after each round (two messages per
    node-round). Both give the same accuracies; round r's accuracy is always the
    evaluation after round r's aggregation."""
    server_threads: int = Field(0, ge=0)
    """Torch intra-op threads of the ServerApp process (the server's decompositions,
    reconstructions and head training); 0 = torch's default, every core. Set 1 when
    other busy processes share the server's cores."""
    seed: int = Field(0, ge=0)
    """Seed of the partition, model initialisation, sampling, shuffling and FedRE's
    weights."""
    carry_personal_state: bool = False
    """A node with a state dir starts a new run from the personal model an earlier
    run left on it (off: every run starts fresh; a resumed run always continues its
    own)."""
    out_dir: str = "~/fedhet-runs/{algorithm}-{timestamp}"
    """Results folder; ``{algorithm}``, ``{seed}`` and ``{timestamp}`` are filled in
    (keep it outside the app folder)."""
    resume: str = ""
    """The out-dir of an earlier run to continue from its last complete round (its
    config must match but for num-server-rounds, round-timeout, out-dir); results are
    written there. Empty = a new run."""
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    fedre: FedREConfig = FedREConfig()
    fedproto: FedProtoConfig = FedProtoConfig()
    fedgh: FedGHConfig = FedGHConfig()
    fedara: FedARAConfig = FedARAConfig()
    fedlora: FedLoRAConfig = FedLoRAConfig()
    fedtgp: FedTGPConfig = FedTGPConfig()
    fedkd: FedKDConfig = FedKDConfig()
    fml: FMLConfig = FMLConfig()
    fd: FDConfig = FDConfig()
    fedmrl: FedMRLConfig = FedMRLConfig()
    fedgen: FedGenConfig = FedGenConfig()
    fedl2g: FedL2GConfig = FedL2GConfig()
    fedl2gl: FedL2GLConfig = FedL2GLConfig()
    privacy: PrivacyConfig = PrivacyConfig()
    robust: RobustConfig = RobustConfig()
    log: LogConfig = LogConfig()

    @field_validator("fleet")
    @classmethod
    def _known_fleet(cls, text: str) -> str:
        if text.strip():
            parse_fleet(text)  # raises ValueError naming the bad part
        return text

    @field_validator("algorithm")
    @classmethod
    def _known_algorithm(cls, name: str) -> str:
        if name not in methods.METHODS:
            raise ValueError("must be one of " + ", ".join(repr(n) for n in methods.names()))
        return name

    def section(self, name: str) -> BaseModel:
        """The run-config section ``name`` (a method registered from outside reads
        its own this way; built-in sections are typed attributes)."""
        value = getattr(self, name, None)
        if not isinstance(value, BaseModel):
            raise KeyError(f"no run-config section {name!r}")
        return value

    @model_validator(mode="after")
    def _check_nodes(self) -> RunConfig:
        if self.algorithm == "fedavg":
            from models.families import family_archs

            archs = family_archs(self.model.family)
            if len(archs) > 1:
                raise ValueError(
                    "algorithm 'fedavg' needs a homogeneous model.family (one "
                    "architecture, e.g. 'fedavgcnn', or 'mlp-1' for feature vectors); "
                    f"'{self.model.family}' has "
                    f"{', '.join(archs)}"
                )
        if self.min_available_nodes < self.min_train_nodes:
            raise ValueError(
                "min-available-nodes must be >= min-train-nodes "
                f"({self.min_available_nodes} < {self.min_train_nodes})"
            )
        return self

    def resolved_out_dir(self, timestamp: str) -> Path:
        """``out-dir`` with ``{algorithm}``, ``{seed}``, ``{timestamp}`` filled in."""
        text = self.out_dir.format(algorithm=self.algorithm, seed=self.seed, timestamp=timestamp)
        return Path(os.path.expanduser(text)).resolve()


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


def _describe(err: Mapping[str, Any], flat: Mapping[str, Scalar]) -> str:
    """One line for one pydantic error: the dotted key, the value, what is allowed."""
    loc = [str(p) for p in err["loc"] if isinstance(p, str)]
    key = ".".join(loc)
    if err["type"] == "extra_forbidden":
        # a whole unknown section: name the first key the user wrote in it
        key = next((k for k in flat if k.startswith(key + ".")), key)
        return f"unknown run-config key '{key}'; known keys: {', '.join(known_keys())}"
    msg = str(err["msg"]).removeprefix("Value error, ")
    if key in flat:
        return f"run-config key '{key}' = {flat[key]!r} is invalid: {msg}"
    if key:
        return f"run-config key '{key}' is invalid: {msg}"
    return f"invalid run-config: {msg}"


def config_model() -> type[RunConfig]:
    """:class:`RunConfig`, plus the section of every method registered from outside
    (those added with :func:`common.methods.register`)."""
    extra = tuple(
        (m.name, m.section)
        for m in methods.METHODS.values()
        if m.section is not None and m.name not in RunConfig.model_fields
    )
    return _with_sections(extra)


@functools.cache
def _with_sections(extra: tuple[tuple[str, type[BaseModel]], ...]) -> type[RunConfig]:
    if not extra:
        return RunConfig
    fields: dict[str, Any] = {name: (section, section()) for name, section in extra}
    return create_model("RunConfig", __base__=RunConfig, **fields)


def parse_run_config(flat: Mapping[str, Scalar]) -> RunConfig:
    """Validate Flower's flat run config; raise :class:`ConfigError` (one line)."""
    try:
        return config_model().model_validate(_nest(flat))
    except ValidationError as exc:
        raise ConfigError(_describe(exc.errors()[0], flat)) from None


def flatten(cfg: BaseModel, prefix: str = "") -> dict[str, Scalar]:
    """The inverse of parsing: ``{"data.alpha": 0.1, ...}`` with kebab-case keys."""
    flat: dict[str, Scalar] = {}
    fields = type(cfg).model_fields
    for name, value in cfg:
        key = prefix + (fields[name].alias or _kebab(name))
        if isinstance(value, BaseModel):
            flat.update(flatten(value, key + "."))
        else:
            flat[key] = value
    return flat


def known_keys() -> list[str]:
    """Every accepted dotted key, in declaration order."""
    return list(flatten(config_model()()))
