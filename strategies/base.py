"""Shared base for model-heterogeneous strategies.

What every fedhet strategy needs and Flower's ``FedAvg`` does not give: one message per
node (payloads may differ by node), knowledge of each node (``query.profile``, asked
once), seeded sampling, and reply checks that drop a bad reply with a log line naming
the node instead of failing the round.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import ClassVar, NamedTuple

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.serverapp.strategy.strategy_utils import sample_nodes

from common.config import RunConfig
from common.records import Arrays, invalid_reason, shapes, to_numpy, to_record


@dataclass(frozen=True)
class NodeInfo:
    """What a node reported about itself in reply to ``query.profile``."""

    node_id: int
    partition_id: int
    arch: str
    num_train: int
    num_test: int
    num_classes: int
    feature_dim: int
    class_counts: tuple[int, ...]
    extras: dict[str, float | int | str] = field(default_factory=dict)

    @classmethod
    def from_metrics(cls, node_id: int, cfg: ConfigRecord) -> NodeInfo:
        known = {f.replace("_", "-") for f in cls.__dataclass_fields__}
        return cls(
            node_id=node_id,
            partition_id=int(cfg["partition-id"]),  # type: ignore[arg-type]
            arch=str(cfg["arch"]),
            num_train=int(cfg["num-train"]),  # type: ignore[arg-type]
            num_test=int(cfg["num-test"]),  # type: ignore[arg-type]
            num_classes=int(cfg["num-classes"]),  # type: ignore[arg-type]
            feature_dim=int(cfg["feature-dim"]),  # type: ignore[arg-type]
            class_counts=tuple(int(c) for c in cfg["class-counts"]),  # type: ignore[union-attr]
            extras={k: v for k, v in cfg.items() if k not in known},  # type: ignore[misc]
        )


class EvalRow(NamedTuple):
    """One usable evaluation reply."""

    node_id: int
    n: int
    correct: int
    loss: float
    global_n: int = 0
    global_correct: int = 0


def _eval_row(reply: Message) -> tuple[EvalRow | None, str]:
    """Parse and check an evaluation reply: (row, "") or (None, why not)."""
    if reply.has_error():
        return None, f"error reply: {reply.error.reason}"
    if "metrics" not in reply.content.metric_records:
        return None, "no metrics"
    m = reply.content.metric_records["metrics"]
    try:
        n, correct, loss = int(m["num-examples"]), int(m["correct"]), float(m["loss-sum"])  # type: ignore[arg-type]
        g_n = int(m.get("global-num-examples", 0))  # type: ignore[arg-type]
        g_c = int(m.get("global-correct", 0))  # type: ignore[arg-type]
    except (KeyError, TypeError, ValueError) as exc:
        return None, f"malformed metrics ({exc})"
    if n <= 0 or not 0 <= correct <= n or not math.isfinite(loss) or not 0 <= g_c <= max(g_n, 0):
        return None, f"inconsistent metrics (n={n}, correct={correct}, loss={loss})"
    return EvalRow(0, n, correct, loss, g_n, g_c), ""


@dataclass(frozen=True)
class Upload:
    """One valid training reply."""

    node: NodeInfo
    arrays: Arrays
    num_examples: int
    metrics: dict[str, float]


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

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.nodes: dict[int, NodeInfo] = {}
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
        for reply in grid.send_and_receive(msgs, timeout=self.cfg.round_timeout):
            nid = self.sender(reply)
            if reply.has_error():
                log(
                    WARNING,
                    "node %d: profile query failed: %s",
                    nid,
                    reply.error.reason,
                )
                continue
            self.nodes[nid] = NodeInfo.from_metrics(nid, reply.content.config_records["profile"])

    def wait_and_discover(self, grid: Grid) -> list[int]:
        """Wait for ``min-available-nodes`` nodes, then discover them."""
        _, all_nodes = sample_nodes(grid, self.cfg.min_available_nodes, 0)
        self.discover(grid, all_nodes)
        if not self.nodes:
            raise RuntimeError("no node answered the profile query")
        return sorted(self.nodes, key=lambda n: self.nodes[n].partition_id)

    def shared_model(self, purpose: str):  # type: ignore[no-untyped-def]
        """The one architecture every node runs, built (seeded) from node metadata.

        For algorithms that exchange (parts of) the extractor; a federation with
        several architectures is refused with an error naming them.
        """
        from models import build_model

        archs = sorted({n.arch for n in self.nodes.values()})
        if len(archs) != 1:
            raise ValueError(f"{purpose} needs one architecture on every node; found {archs}")
        node = next(iter(self.nodes.values()))
        meta = node.extras
        return build_model(
            archs[0],
            in_channels=int(meta["in-channels"]),
            num_classes=node.num_classes,
            image_size=int(meta["image-size"]),
            feature_dim=node.feature_dim,
            small_stem=bool(meta.get("small-stem", 1)),
            seed=self.cfg.seed,
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
        _, online = sample_nodes(grid, self.cfg.min_available_nodes, 0)
        self.discover(grid, online)
        known = sorted(
            (self.nodes[n] for n in online if n in self.nodes),
            key=lambda n: (n.partition_id, n.node_id),
        )
        k = min(len(known), max(minimum, int(round(fraction * len(known)))))
        rng = random.Random(self.cfg.seed * 1_000_003 + server_round * 2 + salt)
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
        nodes = self._sample(
            grid,
            server_round,
            self.cfg.fraction_train,
            self.cfg.min_train_nodes,
            salt=0,
        )
        log(INFO, "configure_train: %d nodes", len(nodes))
        self.awaiting = {n.node_id for n in nodes}
        return self._remember(self._messages(server_round, nodes, "train", config))

    def valid_uploads(self, server_round: int, replies: Iterable[Message]) -> list[Upload]:
        """Replies usable for aggregation; every other one is logged and recorded."""
        uploads = []
        self.last_train = {}
        for reply in replies:
            nid = self.sender(reply)
            reason = self._reply_problem(reply)
            upload = None
            if reason is None:
                upload = self._to_upload(reply)
                reason = self.check_upload(upload.node, upload.arrays)
            if reason is not None:
                log(
                    WARNING,
                    "round %d: dropped reply of node %d: %s",
                    server_round,
                    nid,
                    reason,
                )
                self.rejected.append((server_round, nid, reason))
                continue
            assert upload is not None
            uploads.append(upload)
            self.last_train[upload.node.partition_id] = upload.metrics
        return sorted(uploads, key=lambda u: u.node.partition_id)

    def _reply_problem(self, reply: Message) -> str | None:
        if reply.has_error():
            return f"error reply: {reply.error.reason}"
        content = reply.content
        if self.sender(reply) not in self.nodes:
            return "unknown node"
        if "arrays" not in content.array_records or "metrics" not in content.metric_records:
            return "reply lacks 'arrays' or 'metrics'"
        num = content["metrics"].get("num-examples")
        if not isinstance(num, int | float) or num <= 0:
            return f"bad num-examples {num!r}"
        return None

    def _to_upload(self, reply: Message) -> Upload:
        metrics = {
            k: float(v) for k, v in reply.content["metrics"].items() if isinstance(v, int | float)
        }
        return Upload(
            node=self.nodes[self.sender(reply)],
            arrays=to_numpy(reply.content.array_records["arrays"]),
            num_examples=int(metrics["num-examples"]),
            metrics=metrics,
        )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate, then :meth:`aggregate`; too few valid replies keep the state."""
        replies = list(replies)
        self.missing = sorted(self.awaiting - {self.sender(r) for r in replies})
        if self.missing:
            log(
                WARNING,
                "round %d: no reply within round-timeout=%gs from node(s) %s",
                server_round,
                self.cfg.round_timeout,
                self.missing,
            )
        uploads = self.valid_uploads(server_round, replies)
        if len(uploads) < self.cfg.min_valid_replies:
            log(
                WARNING,
                "round %d: %d valid replies (< min-valid-replies=%d); global state unchanged",
                server_round,
                len(uploads),
                self.cfg.min_valid_replies,
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
        """Every ``eval-every`` rounds (and the last): ``evaluate.<name>``."""
        last = server_round == self.cfg.num_server_rounds
        if self.cfg.fraction_evaluate == 0 or (
            server_round % self.cfg.eval_every != 0 and not last
        ):
            return []
        self._adopt(arrays)
        nodes = self._sample(
            grid,
            server_round,
            self.cfg.fraction_evaluate,
            self.cfg.min_evaluate_nodes,
            salt=1,
        )
        return self._remember(self._messages(server_round, nodes, "evaluate", config))

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Personalized accuracy: Σcorrect/Σsamples, plus mean and std over clients.

        Under ``data.protocol = official`` also ``accuracy-global``: the clients'
        personalized models on the official test set (Σcorrect/Σsamples)."""
        rows: list[EvalRow] = []
        for reply in replies:
            nid = self.sender(reply)
            row, reason = _eval_row(reply)
            if row is None:
                log(
                    WARNING,
                    "round %d: evaluation of node %d dropped: %s",
                    server_round,
                    nid,
                    reason,
                )
                continue
            rows.append(row._replace(node_id=nid))
        if not rows:
            return None
        self.last_eval = {
            self.nodes[r.node_id].partition_id: {"accuracy": r.correct / r.n, "num-examples": r.n}
            for r in rows
            if r.node_id in self.nodes
        }
        accs = [r.correct / r.n for r in rows]
        total = sum(r.n for r in rows)
        out = MetricRecord(
            {
                "accuracy": sum(r.correct for r in rows) / total,
                "accuracy-mean": statistics.fmean(accs),
                "accuracy-std": statistics.pstdev(accs),
                "loss": sum(r.loss for r in rows) / total,
                "eval-clients": len(rows),
            }
        )
        if all(r.global_n > 0 for r in rows):
            out["accuracy-global"] = sum(r.global_correct for r in rows) / sum(
                r.global_n for r in rows
            )
        return out

    def summary(self) -> None:
        """Log the strategy's settings."""
        log(
            INFO,
            "\t├──> %s: fraction-train %.2f, fraction-evaluate %.2f, "
            "eval-every %d, min-valid-replies %d",
            self.name,
            self.cfg.fraction_train,
            self.cfg.fraction_evaluate,
            self.cfg.eval_every,
            self.cfg.min_valid_replies,
        )
