"""The client side every algorithm shares: node, data, personal model, one loop.

An algorithm's client part is a :class:`ClientHook`: how it installs what the server
sent, an optional extra loss term, and what it uploads. Everything else (which node
this is, its data share, the personal model kept across rounds in
``context.state``, seeding, the training loop) lives here once.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from logging import WARNING
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
from flwr.common.logger import log
from torch import Tensor

from client_app import profiles
from client_app import state as personal_state
from client_app.profiles import Profile
from common.config import ConfigError, DataConfig, RunConfig, Scalar, parse_run_config
from common.devices import Device, device_for, fleet_class
from common.messages import HEAD
from common.records import to_record, to_torch
from data import ClientData, load_client_data, load_global_test, load_local_data
from models import HetNet, arch_for_partition, build_model, family_archs, natural_dim
from models.train import (
    AfterStep,
    EvalStats,
    ExtraLoss,
    SGDSettings,
    TrainStats,
    evaluate,
    train,
)

MODEL_KEY = "fedhet.model"
DATA_CACHE = "data-cache"
"""Node-config key: ``"own"`` keeps only this node's partition files on its disk."""
"""``context.state`` key of the personal model's state dict."""
META_KEY = "fedhet.meta"
"""``context.state`` key of bookkeeping (``rounds-trained``)."""


@functools.lru_cache(maxsize=8)
def _parse_cached(items: tuple[tuple[str, Scalar], ...]) -> RunConfig:
    return parse_run_config(dict(items))


def run_config(context: Context) -> RunConfig:
    """The validated run config (parsed once per process per distinct config)."""
    return _parse_cached(tuple(sorted(context.run_config.items())))


@dataclass(frozen=True)
class NodeSpec:
    """Who this node is: partition and architecture (node-config overrides)."""

    partition_id: int
    num_partitions: int
    arch: str
    profile: Profile | None = None

    options: Mapping[str, Scalar] = field(default_factory=dict)
    """The full node config (profile, rank-ratio, ...)."""
    device: Device | None = None
    """This node's device class for the virtual clock (a profile's, node-config
    ``speed``, or the run's ``fleet``); None: no virtual clock."""
    virtual: bool = False
    """A simulated device (``fleet``): it takes its class's architecture and rank
    ratio and is timed as that device, but trains with the run's batch size,
    threads and torch device."""

    @classmethod
    def from_context(
        cls,
        cfg: RunConfig,
        node_config: Mapping[str, Scalar],
        base_arch: str | None = None,
    ) -> NodeSpec:
        """Partition from node-config; architecture: node-config ``model`` > the
        algorithm's single base architecture > the profile's > round-robin."""
        try:
            pid = int(node_config["partition-id"])
            num = int(node_config["num-partitions"])
        except KeyError as exc:
            raise ValueError(
                f"node-config lacks {exc.args[0]!r}: start the SuperNode with "
                "--node-config 'partition-id=<i> num-partitions=<n>'"
            ) from None
        if not 0 <= pid < num:
            raise ValueError(f"node-config partition-id={pid} not in [0, {num})")
        name = node_config.get("profile")
        virtual = not name and bool(cfg.fleet)
        if virtual:
            name = fleet_class(cfg.fleet, pid)
        profile = profiles.resolve(str(name), check_device=not virtual) if name else None
        device = None
        if profile is not None:
            device = device_for(profile.name, node_config)
        elif "speed" in node_config:
            device = device_for("custom", node_config)
        arch = str(
            node_config.get("model")
            or base_arch
            or (profile.archs.get(cfg.model.family) if profile else None)
            or arch_for_partition(cfg.model.family, pid)
        )
        return cls(pid, num, arch, profile, dict(node_config), device, virtual)

    @property
    def cache_only(self) -> int | None:
        """Node-config ``data-cache``: ``"all"`` (default) keeps the whole partition in
        the data cache (one build that every client on one machine shares),
        ``"own"`` only this node's files (a device that holds no other node's data)."""
        value = str(self.options.get(DATA_CACHE, "all"))
        if value not in ("all", "own"):
            raise ConfigError(f'node-config {DATA_CACHE}={value!r} must be "all" or "own"')
        return self.partition_id if value == "own" else None

    def state_file(self, cfg: RunConfig, run_dir: str = "") -> Path | None:
        """Where this node keeps its personal model: node-config ``state-dir``, else
        ``<run_dir>/node-<partition>`` (a simulation's clients folder), else nowhere
        (kept in ``context.state``)."""
        state_dir = self.options.get("state-dir")
        if not state_dir and run_dir:
            state_dir = str(Path(run_dir) / f"node-{self.partition_id}")
        if not state_dir:
            return None
        return personal_state.state_path(str(state_dir), cfg, self.arch)

    def load_data(self, cfg: RunConfig) -> ClientData:
        """Device-local data (node-config ``data-name`` + ``data-root``) or the partition."""
        name = self.options.get("data-name")
        if not name:
            return load_client_data(
                cfg.data,
                self.partition_id,
                self.num_partitions,
                cfg.seed,
                own_only=self.cache_only is not None,
            )
        root = self.options.get("data-root")
        if not root:
            raise ConfigError("node-config data-name is set but data-root is not")
        return load_local_data(
            str(name),
            str(root),
            cfg.data.train_fraction,
            derive_seed(cfg.seed, self.partition_id),
            cfg.data.min_train_samples,
            cfg.data.min_test_samples,
            cfg.data.image_size,
        )


def initial_seed(cfg: RunConfig, node: NodeSpec) -> int:
    """Seed of a node's initial weights (``model.init``): per (seed, partition), or
    per (seed, architecture) so that clients of one architecture start identical."""
    if cfg.model.init == "shared":
        arch = int.from_bytes(hashlib.sha256(node.arch.encode()).digest()[:4], "big")
        return derive_seed(cfg.seed, 1_000_003, arch)
    return derive_seed(cfg.seed, node.partition_id)


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (seed, round, partition, purpose...)."""
    return int(np.random.SeedSequence(list(parts)).generate_state(2, np.uint64)[0] >> 1)


@dataclass
class ClientRun:
    """Everything one message's handling needs."""

    cfg: RunConfig
    node: NodeSpec
    data: ClientData
    model: HetNet
    state: RecordDict
    server_round: int
    received: dict[str, Tensor] = field(default_factory=dict)
    """What the server sent with this message, by name (set by the handler)."""
    notes: dict[str, Any] = field(default_factory=dict)
    """Per-message facts a hook derives once (e.g. FedARA's tier)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Diagnostics a hook measures; sent with the training reply's metrics."""
    state_path: Path | None = None
    """Stem of the personal model's files on disk (None: kept in memory)."""
    lineage: str = ""
    """The run's lineage tag the server sent (names this run's files on disk)."""

    def generator(self, purpose: int = 0) -> torch.Generator:
        """A generator seeded by (seed, round, partition, purpose)."""
        seed = derive_seed(self.cfg.seed, self.server_round, self.node.partition_id, purpose)
        return torch.Generator().manual_seed(seed)

    @property
    def sgd(self) -> SGDSettings:
        t = self.cfg.train
        return SGDSettings(
            epochs=t.local_epochs,
            batch_size=self.node.profile.batch_size
            if self.node.profile and not self.node.virtual
            else t.batch_size,
            lr=t.lr,
            momentum=t.momentum,
            weight_decay=t.weight_decay,
        )

    @property
    def rounds_trained(self) -> int:
        meta = self.state.config_records.get(META_KEY)
        return int(meta["rounds-trained"]) if meta else 0  # type: ignore[arg-type]

    def save(self) -> None:
        """Keep the personal model for the next round: on disk when the node has a
        state directory (only the round counter stays in memory), else in
        ``context.state``."""
        rounds = self.rounds_trained + 1
        self.state[META_KEY] = ConfigRecord({"rounds-trained": rounds})
        if self.state_path is not None:
            personal_state.save(
                self.state_path, self.model.state_dict(), rounds, self.server_round, self.lineage
            )
        else:
            self.state[MODEL_KEY] = to_record(self.model.state_dict())


def feature_dim(cfg: RunConfig) -> int:
    return cfg.model.feature_dim or natural_dim(cfg.model.family)


def device_of(cfg: RunConfig, node: NodeSpec) -> torch.device:
    want = node.profile.device if node.profile and not node.virtual else cfg.train.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(want)


def open_run(
    context: Context,
    server_round: int,
    hook: ClientHook,
    run_dir: str = "",
    training: bool = True,
    lineage: str = "",
    served: Mapping[str, Scalar] | None = None,
) -> ClientRun:
    """Config, node, data and the personal model (restored, or fresh and seeded).

    ``run_dir``: the simulation's clients folder the server sent (a node-config
    ``state-dir`` wins); ``training``: a training message loads the personal model
    of an earlier round, an evaluation message that of this round at most;
    ``lineage``: the run's tag (see :mod:`client_app.state`); ``served``: node
    options the server set for this message (they win over node-config)."""
    cfg = run_config(context)
    node_config = {**context.node_config, **(served or {})}
    node = NodeSpec.from_context(cfg, node_config, hook.base_arch(cfg))
    threads = node.profile.threads if node.profile and not node.virtual else cfg.train.num_threads
    if threads > 0:
        torch.set_num_threads(threads)
    data = node.load_data(cfg)
    node = policy_arch(cfg, node, data, hook.base_arch(cfg))
    model = build_model(
        node.arch,
        in_channels=data.in_channels,
        num_classes=data.num_classes,
        image_size=data.image_size,
        feature_dim=feature_dim(cfg),
        small_stem=cfg.model.small_input_stem,
        seed=initial_seed(cfg, node),
    )
    run = ClientRun(cfg, node, data, model, context.state, server_round)
    run.state_path = node.state_file(cfg, run_dir)
    run.lineage = lineage
    hook.prepare(run)
    if run.state_path is not None:
        resume(run, server_round if training else server_round + 1, hook)
    elif MODEL_KEY in context.state.array_records:
        load_personal(run, to_torch(context.state.array_records[MODEL_KEY]), hook)
    run.model.to(device_of(cfg, node))
    return run


def policy_arch(cfg: RunConfig, node: NodeSpec, data: ClientData, base: str | None) -> NodeSpec:
    """``model.policy = deadline``: the node's architecture is the largest of the
    family whose predicted round time on its device meets ``round-deadline-s``
    (compute from the architectures' FLOPs, the head both ways over its links);
    otherwise, or with node-config ``model`` or one base architecture, unchanged."""
    if (
        cfg.model.policy != "deadline"
        or node.device is None
        or cfg.round_deadline_s <= 0
        or base
        or node.options.get("model")
    ):
        return node
    from client_app.clock import choose_arch, flops_per_sample

    d = feature_dim(cfg)
    archs = family_archs(cfg.model.family)
    flops = {
        a: flops_per_sample(
            a, data.in_channels, data.num_classes, data.image_size, d, cfg.model.small_input_stem
        )
        for a in archs
    }
    head_bytes = 4.0 * (d + 1) * data.num_classes
    arch = choose_arch(
        archs,
        flops,
        len(data.y_train),
        cfg.train.local_epochs,
        node.device,
        cfg.round_deadline_s,
        head_bytes,
    )
    return replace(node, arch=arch)


def load_personal(run: ClientRun, saved: Mapping[str, Tensor], hook: ClientHook) -> None:
    """Load a saved personal model. Entries the hook replaces on every install (a
    FedARA extractor, whose rank the server may change between rounds) may differ
    in shape; they are left as built. Anything else that does not fit raises."""
    own = run.model.state_dict()
    changed = {k for k, v in saved.items() if k in own and tuple(own[k].shape) != tuple(v.shape)}
    missing = set(own) - set(saved)
    if not changed and not missing:
        run.model.load_state_dict(saved)
        return
    unfit = sorted(
        k for k in changed | missing | (set(saved) - set(own)) if not hook.replaced_on_install(k)
    )
    if unfit:
        raise RuntimeError(f"saved personal state does not fit this model: {unfit[:3]}")
    run.model.load_state_dict(
        {k: v for k, v in saved.items() if k in own and k not in changed}, strict=False
    )


def resume(run: ClientRun, before: int, hook: ClientHook) -> None:
    """Load the personal model this run starts from (:func:`client_app.state.pick`)."""
    path = run.state_path
    saved = (
        personal_state.load(path, before, run.lineage, run.cfg.carry_personal_state)
        if path is not None
        else None
    )
    if saved is None:
        return
    model_state, rounds = saved
    try:
        load_personal(run, model_state, hook)
    except RuntimeError as exc:
        log(
            WARNING,
            "personal state %s does not fit this model, starting fresh: %s",
            path,
            str(exc).splitlines()[0],
        )
        return
    run.state[META_KEY] = ConfigRecord({"rounds-trained": rounds})


class ClientHook:
    """One algorithm's client part. Defaults: install by name, CE training, no upload."""

    name: ClassVar[str] = ""

    def base_arch(self, cfg: RunConfig) -> str | None:
        """One architecture for every node (None: round-robin over the family)."""
        return None

    def prepare(self, run: ClientRun) -> None:
        """Change the freshly built model's structure before state is loaded."""

    def replaced_on_install(self, key: str) -> bool:
        """Whether :meth:`install` overwrites this state entry every round (so a
        saved personal model may hold it in another shape; default: no)."""
        return False

    def profile(self, run: ClientRun) -> dict[str, Scalar]:
        """Extra facts the server needs about this node (e.g. its rank ratio)."""
        return {}

    def install(self, run: ClientRun, arrays: dict[str, Tensor]) -> None:
        """Put the server's arrays into the personal model (by state-dict key)."""
        if not arrays:
            return
        own = run.model.state_dict()
        unknown = sorted(set(arrays) - set(own))
        if unknown:
            raise ValueError(f"server sent keys this model lacks: {unknown[:5]}")
        for key, value in arrays.items():
            if own[key].shape != value.shape:
                raise ValueError(
                    f"server sent '{key}' with shape {tuple(value.shape)}, "
                    f"model has {tuple(own[key].shape)}"
                )
        run.model.load_state_dict(arrays, strict=False)

    def extra_loss(self, run: ClientRun) -> ExtraLoss | None:
        """A loss term added to cross-entropy (default: none)."""
        return None

    def after_step(self, run: ClientRun) -> AfterStep | None:
        """Called after every optimiser step (default: none)."""
        return None

    def train(self, run: ClientRun) -> TrainStats:
        """Local training with the shared loop."""
        return train(
            run.model,
            run.data.x_train,
            run.data.y_train,
            run.sgd,
            run.generator(),
            extra_loss=self.extra_loss(run),
            after_step=self.after_step(run),
        )

    def upload(self, run: ClientRun) -> dict[str, Tensor]:
        """What goes back to the server after training (default: nothing)."""
        return {}

    def evaluate(self, run: ClientRun, x: Tensor, y: Tensor) -> EvalStats:
        """Personalized evaluation on ``(x, y)`` (the local test split, or the
        official test set under ``data.protocol = official``)."""
        return evaluate(run.model, x, y)

    def evaluate_without_shared(self, run: ClientRun, x: Tensor, y: Tensor) -> EvalStats | None:
        """The same evaluation without what the federation shares (``None``: not
        defined for this algorithm); the gap is what the shared part carries."""
        return None


class GlobalHeadHook(ClientHook):
    """A hook whose server sends a global head that replaces the client's own."""

    def install(self, run: ClientRun, arrays: dict[str, Tensor]) -> None:
        run.notes["own-head"] = {k: v.clone() for k, v in head_arrays(run).items()}
        super().install(run, arrays)

    def evaluate_without_shared(self, run: ClientRun, x: Tensor, y: Tensor) -> EvalStats | None:
        """With the client's own head as local training left it (before replacement)."""
        own = run.notes.get("own-head")
        if own is None:
            return None
        shared = {k: v.clone() for k, v in head_arrays(run).items()}
        run.model.load_state_dict(own, strict=False)
        try:
            return evaluate(run.model, x, y)
        finally:
            run.model.load_state_dict(shared, strict=False)


@functools.lru_cache(maxsize=2)
def _global_test(
    data: DataConfig, num_partitions: int, seed: int, only: int | None
) -> tuple[Tensor, Tensor] | None:
    return load_global_test(data, num_partitions, seed, only)


def global_test(run: ClientRun) -> tuple[Tensor, Tensor] | None:
    """The official test set (``data.protocol = official``, partitioned data only)."""
    if run.cfg.data.protocol != "official" or run.node.options.get("data-name"):
        return None
    return _global_test(run.cfg.data, run.node.num_partitions, run.cfg.seed, run.node.cache_only)


def profile_record(context: Context, hook: ClientHook) -> ConfigRecord:
    """This node's self-description for the server's ``query.profile``."""
    run = open_run(context, 0, hook)
    counts = [int(c) for c in run.data.train_class_counts]
    test_counts = torch.bincount(run.data.y_test, minlength=run.data.num_classes)
    return ConfigRecord(
        {
            **hook.profile(run),
            "partition-id": run.node.partition_id,
            "arch": run.node.arch,
            "num-train": len(run.data.y_train),
            "num-test": len(run.data.y_test),
            "num-classes": run.data.num_classes,
            "feature-dim": run.model.feature_dim,
            "class-counts": counts,
            "test-class-counts": [int(c) for c in test_counts],
            "in-channels": run.data.in_channels,
            "image-size": run.data.image_size,
            "small-stem": int(run.cfg.model.small_input_stem),
            **({"profile": run.node.profile.name} if run.node.profile else {}),
            **device_record(run.node.device),
        }
    )


def device_record(device: Device | None) -> dict[str, Scalar]:
    """The device class a node reports in its profile (nothing without one)."""
    if device is None:
        return {}
    return {
        "device": device.name,
        "speed": device.speed,
        "uplink-mbps": device.uplink_mbps,
        "downlink-mbps": device.downlink_mbps,
        "latency-ms": device.latency_ms,
    }


def head_arrays(run: ClientRun) -> dict[str, Tensor]:
    """The head's parameters by state-dict key."""
    return {k: v for k, v in run.model.state_dict().items() if k.startswith(HEAD)}


__all__ = ["ArrayRecord", "ClientHook", "ClientRun", "open_run", "profile_record"]
