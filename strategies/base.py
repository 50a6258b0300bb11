"""Shared base for model-heterogeneous strategies.

What every fedhet strategy needs and Flower's ``FedAvg`` does not give: one message per
node (payloads may differ by node), knowledge of each node (``query.profile``, asked
once), seeded sampling, and reply checks that drop a bad reply with a log line naming
the node instead of failing the round.
"""

from __future__ import annotations

import math
import random
import secrets
import statistics
from collections.abc import Iterable
from dataclasses import replace
from logging import ERROR, INFO, WARNING
from typing import TYPE_CHECKING, Any, ClassVar, Self, TypedDict

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.serverapp.strategy.strategy_utils import sample_nodes

from common.config import RunConfig
from common.records import (
    Arrays,
    capped_shares,
    content_bytes,
    invalid_reason,
    shapes,
    to_numpy,
    to_record,
)
from strategies.clock import client_seconds
from strategies.evalfold import fold, folded_metrics
from strategies.replies import (
    EvalRow,
    NodeInfo,
    Upload,
    eval_metrics,
    eval_row,
    metrics_row,
    train_upload,
)
from strategies.robust import (
    direction_outliers,
    flat_update,
    norm_outliers,
    robust_mean,
    update_norm,
)

if TYPE_CHECKING:  # pragma: no cover - typing only (models import torch)
    from models import HetNet

__all__ = ["EVAL_MODES", "HeteroStrategy", "NodeInfo", "RunSettings", "Upload", "run_settings"]

EVAL_MODES = ("with-train", "separate")
"""How a round's evaluation reaches the nodes (run-config ``eval-mode``)."""


class RunSettings(TypedDict, total=False):
    """The keyword arguments every strategy takes (see :class:`HeteroStrategy`)."""

    fraction_train: float
    fraction_evaluate: float
    min_train_nodes: int
    min_evaluate_nodes: int
    min_available_nodes: int
    min_valid_replies: float
    max_weight_share: float
    round_timeout: float
    round_deadline_s: float
    robust_aggregate: str
    robust_trim: float
    max_norm_ratio: float
    min_cosine: float
    eval_every: int
    eval_mode: str
    num_rounds: int
    seed: int


def run_settings(cfg: RunConfig) -> RunSettings:
    """The keyword arguments every strategy takes, from the run config's top-level keys."""
    return {
        "fraction_train": cfg.fraction_train,
        "fraction_evaluate": cfg.fraction_evaluate,
        "min_train_nodes": cfg.min_train_nodes,
        "min_evaluate_nodes": cfg.min_evaluate_nodes,
        "min_available_nodes": cfg.min_available_nodes,
        "min_valid_replies": cfg.min_valid_replies,
        "max_weight_share": cfg.max_weight_share,
        "round_timeout": cfg.round_timeout,
        "round_deadline_s": cfg.round_deadline_s,
        "robust_aggregate": cfg.robust.aggregate,
        "robust_trim": cfg.robust.trim,
        "max_norm_ratio": cfg.robust.max_norm_ratio,
        "min_cosine": cfg.robust.min_cosine,
        "eval_every": cfg.eval_every,
        "eval_mode": cfg.eval_mode,
        "num_rounds": cfg.num_server_rounds,
        "seed": cfg.seed,
    }


class HeteroStrategy(Strategy):
    """Base of every fedhet strategy (see each subclass docstring for its contract).

    Messages to a node: ``train.<name>`` / ``evaluate.<name>`` carrying
    ``{"arrays": ArrayRecord, "config": ConfigRecord{"server-round"}}``; the arrays are
    :meth:`payload` for that node. Training replies carry ``{"arrays": ArrayRecord,
    "metrics": MetricRecord{"num-examples", "train-loss", "train-time-s"}}``; the
    arrays must match :meth:`expected_upload` (keys, shapes), be float and finite.
    Evaluation replies carry ``{"metrics": {"num-examples", "correct", "loss-sum"}}``.
    """

    name: ClassVar[str] = ""
    shares_model: ClassVar[bool] = False
    """Replaces a whole shared model by a mean of replies (its default
    ``min-valid-replies`` is half of the sampled nodes; otherwise one reply)."""

    def __init__(
        self,
        *,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        min_train_nodes: int = 2,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        min_valid_replies: float = 0,
        max_weight_share: float = 1.0,
        round_timeout: float = 3600.0,
        round_deadline_s: float = 0.0,
        robust_aggregate: str = "mean",
        robust_trim: float = 0.1,
        max_norm_ratio: float = 50.0,
        min_cosine: float = -1.0,
        eval_every: int = 1,
        eval_mode: str = "with-train",
        num_rounds: int = 10,
        seed: int = 0,
    ) -> None:
        self.fraction_train = fraction_train
        """Share of the available nodes sampled for training each round."""
        self.fraction_evaluate = fraction_evaluate
        """Share sampled for evaluation (0: no evaluation)."""
        self.min_train_nodes = min_train_nodes
        self.min_evaluate_nodes = min_evaluate_nodes
        self.min_available_nodes = min_available_nodes
        """Nodes to wait for before the first round."""
        self.min_valid_replies = min_valid_replies
        """Valid training replies a round needs (see :meth:`min_valid`)."""
        self.max_weight_share = max_weight_share
        """Largest share one reply may have in a weighted mean (1: off)."""
        self.round_timeout = round_timeout
        """Seconds to wait for a round's replies (and the profile query's)."""
        self.round_deadline_s = round_deadline_s
        """Virtual seconds a training round may last (0: no deadline): a reply whose
        predicted round time exceeds it is a straggler, not aggregated."""
        self.robust_aggregate = robust_aggregate
        """``mean``, ``trimmed-mean`` or ``median``: how :meth:`mean_of` combines."""
        self.robust_trim = robust_trim
        """Weight share cut from each end by ``trimmed-mean``."""
        self.max_norm_ratio = max_norm_ratio
        """Reject uploads beyond this × the round's median :meth:`upload_size` (0: off)."""
        self.min_cosine = min_cosine
        """Reject uploads whose :meth:`upload_update` has a cosine below this with the
        round's coordinate-wise median update (-1: off)."""
        self.virtual_deadline = True
        """Apply ``round_deadline_s`` to the virtual clock (simulation, in process);
        False in deployment, where it is the real message timeout instead."""
        self.client_virtual_s: dict[int, float] = {}
        """This round's virtual time per partition id (nodes with a device class)."""
        self.deadline_dropped: list[int] = []
        """Partition ids of this round's stragglers."""
        self.client_compute_s: dict[int, float] = {}
        """Node id -> the compute seconds on its device it last reported."""
        self._sent_bytes: dict[int, int] = {}
        self.eval_every = eval_every
        """Evaluate every this many rounds (and after the last)."""
        if eval_mode not in EVAL_MODES:
            raise ValueError(f"eval-mode {eval_mode!r}: choose one of {list(EVAL_MODES)}")
        self.eval_mode = eval_mode
        """``with-train``: a round's evaluation goes to the nodes that train next inside
        their training message (:mod:`strategies.evalfold`); ``separate``: its own
        ``evaluate`` messages."""
        self.num_rounds = num_rounds
        """The run's last round number (evaluation always runs after it)."""
        self._planned: dict[int, list[NodeInfo]] = {}
        """Round -> the nodes sampled for its training ahead of time (``with-train``:
        chosen when the round before is evaluated)."""
        self._deferred: dict[int, Message] = {}
        """Node id -> the evaluation message that goes inside its next training message."""
        self.pending_eval: int | None = None
        """The round whose evaluation waits for replies to the next training messages."""
        self._pending_rows: list[EvalRow] = []
        """That evaluation's rows from nodes evaluated by a message of their own."""
        self.completed_eval: tuple[int, MetricRecord | None] | None = None
        """``(round, metrics)`` of a pending evaluation that the last training replies
        completed (taken by the recorder with :meth:`take_completed_eval`)."""
        self.folded_bytes = 0
        """Array bytes the last training messages carried for evaluation only
        (:data:`~common.messages.EVAL_ARRAYS`)."""
        self.seed = seed
        """Seeds sampling and everything the server initialises or shuffles."""
        self.nodes: dict[int, NodeInfo] = {}
        self.refused: dict[int, str] = {}
        """Node id -> the one-line cause a node gave for not running (its profile)."""
        self.global_arrays: Arrays = {}
        self.last_train: dict[int, dict[str, float]] = {}
        self.last_eval: dict[int, dict[str, float]] = {}
        self._outbox: dict[int, Message] = {}
        """Messages sent, to attribute SuperLink-made error replies to their node."""
        self.awaiting: set[int] = set()
        """Nodes sent a training message this round."""
        self.missing: list[int] = []
        """Nodes that did not reply to this round's training message in time."""
        self.rejected: list[tuple[int, int, str]] = []
        """``(round, node_id, reason)`` for every reply dropped from aggregation."""
        self.clients_dir = ""
        """A simulation's folder for the clients' personal models (sent with every
        message as ``clients-dir``); empty in deployment (nodes use their state-dir)."""
        self.lineage = secrets.token_hex(4)
        """This run's tag, sent with every message: nodes name their personal-model
        files with it, so a new run continues from what an earlier one left and a
        resumed run (the tag is checkpointed) from its own earlier rounds."""
        self.size_ratios: dict[str, float] = {}
        """Last training round: partition id -> upload size / the round's median
        (see :meth:`_screen`)."""
        self.diagnostics: dict[str, Any] = {}
        """What this round's server step measured about itself (written to the round's
        ``server-diagnostics`` in results.json, then cleared)."""

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Self:
        """This strategy as the run config sets it up (what the ServerApp calls); a
        subclass with settings of its own adds them to :func:`run_settings`."""
        return cls(**run_settings(cfg))

    # ------------------------------------------------------------------ subclass API
    def init_global(self) -> Arrays:
        """Initial global state from the discovered nodes (default: nothing)."""
        return {}

    def payload(self, server_round: int, node: NodeInfo) -> Arrays:
        """Arrays sent to ``node`` (default: the whole global state)."""
        return self.global_arrays

    def expected_upload(self, node: NodeInfo) -> dict[str, tuple[int, ...]] | None:
        """Keys and shapes a reply of ``node`` must have (default: the global's)."""
        return shapes(self.global_arrays)

    def aggregate(self, server_round: int, uploads: list[Upload]) -> Arrays | None:
        """New global state from valid uploads (sorted by partition id)."""
        return None

    def check_upload(self, node: NodeInfo, arrays: Arrays) -> str | None:
        """Why an upload is unusable, or ``None`` (default: keys/shapes/finite)."""
        return invalid_reason(arrays, self.expected_upload(node))

    def sender(self, reply: Message) -> int:
        """The node a reply is about. Errors the SuperLink makes for an unreachable
        node come from the SuperLink itself; they name our message instead."""
        src = reply.metadata.src_node_id
        if src != SUPERLINK_NODE_ID:
            return src
        wanted = reply.metadata.reply_to_message_id
        for msg in self._outbox.values():
            if wanted and msg.metadata.message_id == wanted:
                return msg.metadata.dst_node_id
        return src

    def _remember(self, msgs: list[Message]) -> list[Message]:
        self._outbox = {id(m): m for m in msgs}
        return msgs

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything this strategy carries from round to round (for a checkpoint):
        the global state, the rejected replies and :meth:`extra_state`."""
        return {
            "global": self.global_arrays,
            "rejected": self.rejected,
            "lineage": self.lineage,
            **self.extra_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (after discovery and ``init_global``)."""
        self.global_arrays = dict(state["global"])
        self.rejected = list(state["rejected"])
        self.lineage = str(state.get("lineage", self.lineage))
        self.load_extra_state(state)

    def extra_state(self) -> dict[str, Any]:
        """A subclass's own cross-round state (default: none)."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`extra_state`."""

    # ------------------------------------------------------------------ discovery
    def discover(self, grid: Grid, node_ids: Iterable[int]) -> None:
        """Ask every node not yet known for its profile (once per node)."""
        unknown = sorted(set(node_ids) - set(self.nodes))
        if not unknown:
            return
        msgs = [
            Message(
                RecordDict({"config": ConfigRecord()}),
                dst_node_id=nid,
                message_type="query.profile",
            )
            for nid in unknown
        ]
        self._remember(msgs)
        for reply in grid.send_and_receive(msgs, timeout=self.round_timeout):
            nid = self.sender(reply)
            if reply.has_error():
                self.refused[nid] = str(reply.error.reason)
                log(ERROR, "fedhet: node %d (%s): it cannot run", nid, reply.error.reason)
                continue
            self.refused.pop(nid, None)
            self.nodes[nid] = NodeInfo.from_metrics(nid, reply.content.config_records["profile"])

    def wait_and_discover(self, grid: Grid) -> list[int]:
        """Wait for ``min-available-nodes`` nodes, then discover them."""
        _, all_nodes = sample_nodes(grid, self.min_available_nodes, 0)
        self.discover(grid, all_nodes)
        if not self.nodes:
            if self.refused:
                causes = sorted(
                    {reason.partition(": ")[2] or reason for reason in self.refused.values()}
                )
                raise RuntimeError(
                    f"no node can run ({len(self.refused)} answered with a cause): "
                    + "; ".join(causes[:3])
                )
            raise RuntimeError("no node answered the profile query")
        return sorted(self.nodes, key=lambda n: self.nodes[n].partition_id)

    def shared_model(self, purpose: str) -> HetNet:
        """The one architecture every node runs, built (seeded) from node metadata.

        For algorithms that exchange (parts of) the extractor; a federation with
        several architectures is refused with an error naming them.
        """
        archs = sorted({n.arch for n in self.nodes.values()})
        if len(archs) != 1:
            raise ValueError(f"{purpose} needs one architecture on every node; found {archs}")
        return self.build_for_nodes(archs[0])

    def build_for_nodes(self, arch: str, feature_dim: int = 0) -> HetNet:
        """``arch`` built (seeded by ``seed``) for the nodes' data: input channels,
        image size, classes and ``d`` as they reported them (``feature_dim``, when
        set, instead of ``d``)."""
        from models import build_model

        node = next(iter(self.nodes.values()))
        meta = node.extras
        return build_model(
            arch,
            in_channels=int(meta["in-channels"]),
            num_classes=node.num_classes,
            image_size=int(meta["image-size"]),
            feature_dim=feature_dim or node.feature_dim,
            small_stem=bool(meta.get("small-stem", 1)),
            seed=self.seed,
        )

    def initial_arrays(self, grid: Grid) -> ArrayRecord:
        """Discover the nodes and build the initial global state."""
        self.wait_and_discover(grid)
        self.global_arrays = self.init_global()
        return to_record(self.global_arrays)

    # ------------------------------------------------------------------ sampling
    def _sample(
        self, grid: Grid, server_round: int, fraction: float, minimum: int, salt: int
    ) -> list[NodeInfo]:
        _, online = sample_nodes(grid, self.min_available_nodes, 0)
        self.discover(grid, online)
        known = sorted(
            (self.nodes[n] for n in online if n in self.nodes),
            key=lambda n: (n.partition_id, n.node_id),
        )
        k = min(len(known), max(minimum, int(round(fraction * len(known)))))
        rng = random.Random(self.seed * 1_000_003 + server_round * 2 + salt)
        chosen = rng.sample(known, k) if k < len(known) else known
        return sorted(chosen, key=lambda n: n.partition_id)

    def _messages(
        self, server_round: int, nodes: list[NodeInfo], kind: str, config: ConfigRecord
    ) -> list[Message]:
        msgs = []
        # nodes served the same arrays share one record (the payload is kept referenced
        # so its id cannot be reused within the loop)
        records: dict[int, tuple[Arrays, ArrayRecord]] = {}
        for node in nodes:
            cfg = ConfigRecord(dict(config))
            cfg["server-round"] = server_round
            cfg["lineage"] = self.lineage
            if self.clients_dir:
                cfg["clients-dir"] = self.clients_dir
            cfg.update(self.message_config(node))
            payload = self.payload(server_round, node)
            if id(payload) not in records:
                records[id(payload)] = (payload, to_record(payload))
            content = RecordDict({"arrays": records[id(payload)][1], "config": cfg})
            msgs.append(
                Message(
                    content,
                    dst_node_id=node.node_id,
                    message_type=f"{kind}.{self.name}",
                )
            )
        return msgs

    # ------------------------------------------------------------------ Flower hooks
    def _adopt(self, arrays: ArrayRecord | None) -> None:
        """The strategy keeps its own global state (set by :meth:`initial_arrays` and
        :meth:`aggregate_train`); Flower's copy is adopted only if it has none."""
        if not self.global_arrays and arrays is not None and len(arrays):
            self.global_arrays = to_numpy(arrays)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One ``train.<name>`` message per sampled node."""
        self._adopt(arrays)
        nodes = self._planned.pop(server_round, None) or self._train_sample(grid, server_round)
        log(INFO, "configure_train: %d nodes", len(nodes))
        self.awaiting = {n.node_id for n in nodes}
        self.plan_round(server_round, nodes)
        msgs = self._messages(server_round, nodes, "train", config)
        self.folded_bytes = sum(
            fold(m, self._deferred.pop(m.metadata.dst_node_id))
            for m in msgs
            if m.metadata.dst_node_id in self._deferred
        )
        self._deferred = {}
        self._sent_bytes = {m.metadata.dst_node_id: content_bytes(m.content) for m in msgs}
        return self._remember(msgs)

    def _train_sample(self, grid: Grid, server_round: int) -> list[NodeInfo]:
        return self._sample(grid, server_round, self.fraction_train, self.min_train_nodes, salt=0)

    def valid_uploads(self, server_round: int, replies: Iterable[Message]) -> list[Upload]:
        """Replies usable for aggregation; every other one is logged and recorded."""
        uploads = []
        self.last_train, self.client_virtual_s, self.deadline_dropped = {}, {}, []
        for reply in replies:
            nid = self.sender(reply)
            upload, reason = train_upload(reply, self.nodes.get(nid))
            if upload is not None:
                reason = self.check_upload(upload.node, upload.arrays)
            if upload is not None and reason is None:
                reason = self._clock(server_round, upload, reply)
                if reason is not None:  # a straggler: expected, not a fault
                    self.rejected.append((server_round, nid, reason))
                    continue
            if reason is not None:
                log(
                    WARNING,
                    "round %d: dropped reply of %s: %s",
                    server_round,
                    self.describe(nid),
                    reason,
                )
                self.rejected.append((server_round, nid, reason))
                continue
            assert upload is not None
            uploads.append(upload)
            self.last_train[upload.node.partition_id] = upload.metrics
        uploads.sort(key=lambda u: u.node.partition_id)
        uploads = self._screen(server_round, uploads)
        if not uploads:
            return []
        shares = capped_shares([u.num_examples for u in uploads], self.max_weight_share)
        return [replace(u, weight=w) for u, w in zip(uploads, shares, strict=True)]

    def _clock(self, server_round: int, upload: Upload, reply: Message) -> str | None:
        """Time the reply on the virtual clock; why it missed the deadline, if it did."""
        pid = upload.node.partition_id
        seconds = client_seconds(
            upload.node,
            upload.metrics,
            self._sent_bytes.get(upload.node.node_id, 0),
            content_bytes(reply.content),
        )
        if seconds is None:
            return None
        self.client_virtual_s[pid] = seconds
        self.client_compute_s[upload.node.node_id] = upload.metrics["virtual-compute-s"]
        if not self.virtual_deadline or self.round_deadline_s <= 0:
            return None
        if seconds <= self.round_deadline_s:
            return None
        self.deadline_dropped.append(pid)
        log(
            INFO,
            "round %d: partition %d is a straggler (%.1f s > round-deadline-s %g)",
            server_round,
            pid,
            seconds,
            self.round_deadline_s,
        )
        return f"straggler: {seconds:.2f} virtual s > round-deadline-s {self.round_deadline_s:g}"

    def plan_round(self, server_round: int, nodes: list[NodeInfo]) -> None:
        """Called with the nodes sampled for training, before their messages are
        built (default: nothing; FedARA's deadline policy picks their tiers)."""

    def round_facts(self) -> dict[str, Any]:
        """Per-round entries of a round's row in results.json (default: none)."""
        return {}

    def message_config(self, node: NodeInfo) -> dict[str, float | int | str]:
        """Per-node entries of a message's config (default: none; FedARA's
        deadline policy sends each node its rank ratio)."""
        return {}

    def upload_size(self, upload: Upload) -> float | None:
        """An upload's size in the form this server aggregates, for
        ``robust.max-norm-ratio`` (default: for a method that replaces a shared model by
        a mean, the norm of the update to what it was sent; otherwise not screened)."""
        if not self.shares_model:
            return None
        return update_norm(self.shared_part(upload.arrays), self.global_arrays)

    def shared_part(self, arrays: Arrays) -> Arrays:
        """The part of an upload (or of the global state) that is the shared model:
        what :meth:`mean_of` averages and the two screens measure (default: all of it;
        FedGen: its head, not the label counts beside it)."""
        return arrays

    def _screen(self, server_round: int, uploads: list[Upload]) -> list[Upload]:
        """Drop uploads far larger than the round's median (``robust.max-norm-ratio``).

        Each upload's size over the round's median is kept in :attr:`size_ratios`
        (``upload-size-ratio`` in results.json) whether screening is on or not: the
        honest distribution the threshold is chosen from."""
        sizes = {u.node.node_id: self.upload_size(u) for u in uploads}
        known = {n: s for n, s in sizes.items() if s is not None}
        median = statistics.median(known.values()) if known else 0.0
        pid = {u.node.node_id: u.node.partition_id for u in uploads}
        self.size_ratios = (
            {str(pid[n]): v / median for n, v in sorted(known.items())} if median > 0 else {}
        )
        outliers = norm_outliers(known, self.max_norm_ratio) if self.max_norm_ratio > 0 else {}
        kept = [u for u in uploads if u.node.node_id not in outliers]
        if self.min_cosine > -1:
            updates = {u.node.node_id: self.upload_update(u) for u in kept}
            outliers.update(
                direction_outliers(
                    {n: v for n, v in updates.items() if v is not None}, self.min_cosine
                )
            )
        for nid, reason in outliers.items():
            log(
                WARNING,
                "round %d: dropped reply of %s: %s",
                server_round,
                self.describe(nid),
                reason,
            )
            self.rejected.append((server_round, nid, reason))
        return [u for u in uploads if u.node.node_id not in outliers]

    def upload_update(self, upload: Upload) -> np.ndarray | None:
        """An upload's update as one flat vector, for ``robust.min-cosine`` (default:
        for a method that replaces a shared model by a mean, the upload minus what the
        node was sent, over the float keys, in key order; otherwise not screened)."""
        if not self.shares_model:
            return None
        vector = flat_update(self.shared_part(upload.arrays), self.global_arrays)
        return vector if vector.size else None

    def mean_of(self, uploads: list[Upload], weights: list[float] | None = None) -> Arrays:
        """The :meth:`shared_part` of the uploads, their weighted mean (``weights``,
        default ``Upload.weight``) in the global's dtypes, or the robust rule
        ``robust.aggregate`` chooses."""
        return robust_mean(
            [self.shared_part(u.arrays) for u in uploads],
            [u.weight for u in uploads] if weights is None else weights,
            self.shared_part(self.global_arrays),
            self.robust_aggregate,
            self.robust_trim,
        )

    def min_valid(self) -> int:
        """Valid replies a round needs (``min-valid-replies``: a count ≥ 1, a fraction
        of the nodes sampled this round below 1, 0: the algorithm's default)."""
        want = self.min_valid_replies
        if want == 0:
            want = 0.5 if self.shares_model else 1
        if want >= 1:
            return int(want)
        return max(1, math.ceil(want * len(self.awaiting)))

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate, then :meth:`aggregate`; too few valid replies keep the state."""
        replies = list(replies)
        self._complete_evaluation(replies)
        self.missing = sorted(self.awaiting - {self.sender(r) for r in replies})
        if self.missing:
            log(
                WARNING,
                "round %d: no reply within round-timeout=%gs from %s",
                server_round,
                self.round_timeout,
                ", ".join(self.describe(n) for n in self.missing),
            )
        uploads = self.valid_uploads(server_round, replies)
        if len(uploads) < self.min_valid():
            log(
                WARNING,
                "round %d: %d valid replies (< %d, min-valid-replies=%g); global state unchanged",
                server_round,
                len(uploads),
                self.min_valid(),
                self.min_valid_replies,
            )
            return None, None
        new = self.aggregate(server_round, uploads)
        if new is not None:
            self.global_arrays = new
        total = sum(u.num_examples for u in uploads)
        metrics = MetricRecord(
            {
                "train-loss": sum(
                    u.metrics.get("train-loss", 0.0) * u.num_examples for u in uploads
                )
                / total,
                "train-time-s": statistics.fmean(
                    u.metrics.get("train-time-s", 0.0) for u in uploads
                ),
                "valid-replies": len(uploads),
            }
        )
        return (to_record(new) if new is not None else None), metrics

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Every ``eval-every`` rounds (and the last): ``evaluate.<name>``; with
        ``eval-mode = with-train`` (before the last round) only to the evaluated nodes
        that do not train next round, the others' evaluation going inside their next
        training message (:mod:`strategies.evalfold`)."""
        last = server_round >= self.num_rounds
        if self.fraction_evaluate == 0 or (server_round % self.eval_every != 0 and not last):
            return []
        self._adopt(arrays)
        nodes = self._sample(
            grid,
            server_round,
            self.fraction_evaluate,
            self.min_evaluate_nodes,
            salt=1,
        )
        msgs = self._messages(server_round, nodes, "evaluate", config)
        if self.eval_mode == "with-train" and not last:
            upcoming = self._train_sample(grid, server_round + 1)
            self._planned[server_round + 1] = upcoming
            ahead = {n.node_id for n in upcoming}
            self._deferred = {
                m.metadata.dst_node_id: m for m in msgs if m.metadata.dst_node_id in ahead
            }
            msgs = [m for m in msgs if m.metadata.dst_node_id not in ahead]
            if self._deferred:
                self.pending_eval, self._pending_rows = server_round, []
        return self._remember(msgs)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Personalized accuracy: Σcorrect/Σsamples, plus mean and std over clients.

        Under ``data.protocol = official`` also ``accuracy-global``: the clients'
        personalized models on the official test set (Σcorrect/Σsamples). While part
        of the round's evaluation travels with the next training messages
        (:attr:`pending_eval`), the rows are kept and None is returned; the next
        :meth:`aggregate_train` completes it (:attr:`completed_eval`)."""
        rows: list[EvalRow] = []
        for reply in replies:
            nid = self.sender(reply)
            row, reason = eval_row(reply)
            if row is None:
                log(
                    WARNING,
                    "round %d: evaluation of %s dropped: %s",
                    server_round,
                    self.describe(nid),
                    reason,
                )
                continue
            rows.append(row._replace(node_id=nid))
        if self.pending_eval == server_round:
            self._pending_rows = rows
            return None
        return self._evaluation(rows)

    def _evaluation(self, rows: list[EvalRow]) -> MetricRecord | None:
        """A round's evaluation metrics from its rows (in partition order, so that the
        sums do not depend on the order replies arrived in)."""
        if not rows:
            return None
        rows = sorted(rows, key=lambda r: (self._partition(r.node_id), r.node_id))
        self.last_eval = {
            self.nodes[r.node_id].partition_id: {"accuracy": r.correct / r.n, "num-examples": r.n}
            for r in rows
            if r.node_id in self.nodes
        }
        return eval_metrics(rows)

    def _partition(self, node_id: int) -> int:
        node = self.nodes.get(node_id)
        return node.partition_id if node is not None else -1

    def _complete_evaluation(self, replies: list[Message]) -> None:
        """Complete :attr:`pending_eval` from the evaluations inside ``replies`` (a
        node whose reply is an error, or lacks them, is missing from it, as a node
        whose evaluation reply failed)."""
        if self.pending_eval is None:
            return
        rows = list(self._pending_rows)
        for reply in replies:
            nid = self.sender(reply)
            metrics = folded_metrics(reply)
            if metrics is None:
                reason = f"error reply: {reply.error.reason}" if reply.has_error() else "none sent"
                log(
                    WARNING,
                    "round %d: evaluation of %s missing: %s",
                    self.pending_eval,
                    self.describe(nid),
                    reason,
                )
                continue
            row, reason = metrics_row(metrics)
            if row is None:
                log(
                    WARNING,
                    "round %d: evaluation of %s dropped: %s",
                    self.pending_eval,
                    self.describe(nid),
                    reason,
                )
                continue
            rows.append(row._replace(node_id=nid))
        self.completed_eval = (self.pending_eval, self._evaluation(rows))
        self.pending_eval, self._pending_rows = None, []

    def take_completed_eval(self) -> tuple[int, MetricRecord | None] | None:
        """The ``(round, metrics)`` the last training replies completed, once."""
        done, self.completed_eval = self.completed_eval, None
        return done

    def evaluate_now(self, grid: Grid, server_round: int, timeout: float) -> MetricRecord | None:
        """Round ``server_round``'s evaluation by messages of its own, now (a run
        resumed after a round whose evaluation was to travel with the next round's
        training messages: the checkpoint holds the same global state)."""
        mode, self.eval_mode = self.eval_mode, "separate"
        try:
            msgs = list(self.configure_evaluate(server_round, ArrayRecord(), ConfigRecord(), grid))
        finally:
            self.eval_mode = mode
        replies = grid.send_and_receive(msgs, timeout=timeout) if msgs else []
        return self.aggregate_evaluate(server_round, replies)

    def describe(self, node_id: int) -> str:
        """``node 123 (partition 4, rpi4)``: a node as logs name it, with what it
        reported about itself when it is known."""
        node = self.nodes.get(node_id)
        if node is None:
            return f"node {node_id}"
        profile = node.extras.get("profile") or node.extras.get("device") or node.arch
        return f"node {node_id} (partition {node.partition_id}, {profile})"

    def summary(self) -> None:
        """Log the strategy's settings."""
        log(
            INFO,
            "\t├──> %s: fraction-train %.2f, fraction-evaluate %.2f, "
            "eval-every %d, min-valid-replies %g",
            self.name,
            self.fraction_train,
            self.fraction_evaluate,
            self.eval_every,
            self.min_valid_replies,
        )
