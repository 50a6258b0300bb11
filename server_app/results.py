"""Per-round measurement and ``results.json``, as a wrapper around any strategy.

:class:`Recorded` forwards the four hooks to the wrapped strategy and measures on the
way: array payload bytes of every message sent and received, server time spent in
``configure_train`` + ``aggregate_train``, evaluation metrics. Its :meth:`end_round`
is passed to ``Strategy.start`` as ``evaluate_fn``, which Flower calls once before
round 1 and once at the end of every round.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from importlib import metadata
from logging import INFO
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from common.config import RunConfig, flatten
from common.records import content_bytes
from server_app import checkpoint
from server_app.tracking import Tracker
from strategies.base import HeteroStrategy, NodeInfo
from strategies.clock import round_seconds


def versions() -> dict[str, Any]:
    """Installed versions of fedhet, flwr and torch, the code that ran: ``source`` (a
    hash of the app's sources), ``git-commit`` and ``git-dirty`` (None when unknown),
    and the ``machine`` the ServerApp ran on (torch, CPU kernels, processor; in a
    simulation the clients' too, in a deployment each node's own is not recorded); see
    :mod:`common.provenance`."""
    from common.provenance import code_identity, machine_identity

    out: dict[str, Any] = {}
    for pkg in ("fedhet", "flwr", "torch"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "unknown"
    return {**out, **code_identity(), "machine": machine_identity()}


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


EVAL_SUMMARY = (
    "accuracy",
    "accuracy-mean",
    "accuracy-std",
    "loss",
    "accuracy-global",
    "accuracy-without-shared",
    "eval-clients",
)
"""Evaluation metrics that have a column of their own in a round's row."""
SCORES = EVAL_SUMMARY[:-1]
"""The evaluation columns that open a round's row, in order."""


def accuracy_prior(nodes: Iterable[NodeInfo]) -> float | None:
    """The trivial personalized predictor's accuracy: every client predicts its
    majority training class; Σ_k (test samples of that class) / Σ_k test samples."""
    hits = total = 0
    for n in nodes:
        if not n.test_class_counts or not n.class_counts:
            return None
        majority = max(range(len(n.class_counts)), key=lambda c: (n.class_counts[c], -c))
        hits += n.test_class_counts[majority]
        total += sum(n.test_class_counts)
    return hits / total if total else None


def virtual_total(rounds: list[dict[str, Any]]) -> float | None:
    """Σ virtual-time-s over the rounds (None when no round was timed)."""
    times = [r["virtual-time-s"] for r in rounds if r.get("virtual-time-s") is not None]
    return sum(times) if times else None


def release(replies: list[Message]) -> None:
    """Empty the contents of a round's aggregated replies.

    Flower's round loop keeps its ``train_replies`` until the next round's replies
    are in, so without this a ServerApp holds two rounds of uploads at once (FedARA at
    N = 1,000: about 3.4 GB each). Nothing reads a reply once it is aggregated."""
    for reply in replies:
        if reply.has_content():
            reply.content = RecordDict()


class Recorded(Strategy):
    """Measure a :class:`HeteroStrategy` round by round and write ``results.json``."""

    def __init__(self, inner: HeteroStrategy, cfg: RunConfig, out_dir: Path) -> None:
        self.inner, self.cfg, self.out_dir = inner, cfg, out_dir
        self.rounds: list[dict[str, Any]] = []
        self.offset = 0
        """Rounds completed before this process (a resumed run): Flower's round r is
        round r + offset of the run."""
        self._elapsed = 0.0
        """Wall time of the run before this process."""
        self._start = self._mark = time.perf_counter()
        self.tracker = Tracker.from_config(cfg, out_dir)  # log.tensorboard
        self._pending: int | None = None
        """The round whose row waits for its evaluation (``eval-mode = with-train``:
        it arrives with the next round's training replies)."""
        self._reset()

    def resume_from(self, checkpoint: dict[str, Any]) -> None:
        """Continue a run: its rounds so far, its strategy state, its clock."""
        self.inner.load_state_dict(checkpoint["strategy"])
        self.rounds = list(checkpoint["rounds"])
        self.offset = int(checkpoint["round"])
        self._elapsed = float(checkpoint["wall-time-s"])
        self._pending = checkpoint.get("eval-pending")

    def finish_pending(self, grid: Grid, timeout: float) -> None:
        """A resumed run whose last round's evaluation was to travel with the next
        training messages: evaluate that round now, by messages of its own."""
        if self._pending is None:
            return
        metrics = self.inner.evaluate_now(grid, int(self._pending), timeout)
        self._complete(int(self._pending), metrics)
        self.write()

    def _reset(self) -> None:
        self._cur: dict[str, Any] = {
            "bytes-up": 0,
            "bytes-down": 0,
            "bytes-down-eval": 0,
            "train-messages": 0,
            "train-replies": 0,
            "server-time-s": 0.0,
            "eval": None,
            "train": None,
            "client-bytes-up": {},
        }

    # ------------------------------------------------------------------ hooks
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        t0 = time.perf_counter()
        msgs = list(self.inner.configure_train(server_round + self.offset, arrays, config, grid))
        self._cur["server-time-s"] += time.perf_counter() - t0
        # arrays a message carries for the previous round's evaluation only count as
        # that round's evaluation traffic
        folded = self.inner.folded_bytes
        self._cur["bytes-down"] += sum(content_bytes(m.content) for m in msgs) - folded
        self._cur["train-messages"] += len(msgs)
        if folded and self._pending is not None:
            self._row_of(self._pending)["bytes-down-eval"] += folded
        return msgs

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        with_content = [r for r in replies if not r.has_error()]
        per_client = {self.inner.sender(r): content_bytes(r.content) for r in with_content}
        self._cur["bytes-up"] += sum(per_client.values())
        nodes = self.inner.nodes
        self._cur["client-bytes-up"] = {
            str(nodes[n].partition_id if n in nodes else f"node-{n}"): b
            for n, b in sorted(
                per_client.items(),
                key=lambda kv: nodes[kv[0]].partition_id if kv[0] in nodes else -1,
            )
        }
        self._cur["train-replies"] += len(with_content)
        t0 = time.perf_counter()
        try:
            arrays, metrics = self.inner.aggregate_train(server_round + self.offset, replies)
        finally:
            release(replies)
        self._cur["server-time-s"] += time.perf_counter() - t0
        self._cur["train"] = dict(metrics) if metrics is not None else None
        done = self.inner.take_completed_eval()
        if done is not None:
            self._complete(*done)
        return arrays, metrics

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        msgs = list(self.inner.configure_evaluate(server_round + self.offset, arrays, config, grid))
        self._cur["bytes-down-eval"] += sum(content_bytes(m.content) for m in msgs)
        return msgs

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        metrics = self.inner.aggregate_evaluate(server_round + self.offset, replies)
        self._cur["eval"] = dict(metrics) if metrics is not None else None
        self._cur["eval-pending"] = self.inner.pending_eval == server_round + self.offset
        return metrics

    def summary(self) -> None:
        self.inner.summary()

    # ------------------------------------------------------------------ rounds
    def end_round(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        """``evaluate_fn`` of ``Strategy.start``: close the round, write, print."""
        now = time.perf_counter()
        if server_round == 0:
            self._start = self._mark = now
            return None
        row = self._row(server_round + self.offset, now - self._mark)
        pending = self._cur.get("eval-pending", False)
        self.inner.diagnostics = {}
        self.inner.size_ratios = {}
        self._mark = now
        self.rounds.append(row)
        self.tracker.log_round(row, self.inner.rejected)
        self._reset()
        if pending:
            self._pending = row["round"]
        else:
            self._print(row)
        self.write()
        checkpoint.write(
            self.out_dir,
            {
                "round": server_round + self.offset,
                "config": flatten(self.cfg),
                "strategy": self.inner.state_dict(),
                "rounds": self.rounds,
                "wall-time-s": self.wall_time(),
                "eval-pending": self._pending,
            },
        )
        return None

    def _row_of(self, server_round: int) -> dict[str, Any]:
        return next(r for r in reversed(self.rounds) if r["round"] == server_round)

    def _complete(self, server_round: int, metrics: MetricRecord | None) -> None:
        """Round ``server_round``'s evaluation arrived (with the next round's training
        replies): fill in its row, print it."""
        row = self._row_of(server_round)
        row.update(self._eval_fields(dict(metrics) if metrics is not None else None))
        if self._pending == server_round:
            self._pending = None
        self._print(row)
        self.tracker.log_round(row, self.inner.rejected)

    def wall_time(self) -> float:
        return self._elapsed + time.perf_counter() - self._start

    def _virtual(self) -> dict[str, Any]:
        """The round on the virtual clock (None without device classes)."""
        timed = self.inner.client_virtual_s
        return {
            "virtual-time-s": round_seconds(
                list(timed.values()), self.inner.round_deadline_s, self._cur["server-time-s"]
            )
            if timed
            else None,
            "client-virtual-time-s": {str(k): v for k, v in sorted(timed.items())},
            "deadline-dropped": len(self.inner.deadline_dropped),
            **self.inner.round_facts(),
        }

    def _eval_fields(self, metrics: dict[str, Any] | None) -> dict[str, Any]:
        """A round's evaluation entries (None: no evaluation)."""
        ev = metrics or {}
        return {
            "accuracy": ev.get("accuracy"),
            "accuracy-mean": ev.get("accuracy-mean"),
            "accuracy-std": ev.get("accuracy-std"),
            "loss": ev.get("loss"),
            "accuracy-global": ev.get("accuracy-global"),
            "accuracy-without-shared": ev.get("accuracy-without-shared"),
            "eval-diagnostics": {k: v for k, v in ev.items() if k not in EVAL_SUMMARY},
            "eval-clients": int(ev.get("eval-clients", 0)),
            "client-accuracy": {
                str(k): v["accuracy"] for k, v in sorted(self.inner.last_eval.items())
            }
            if metrics
            else {},
        }

    def _row(self, server_round: int, seconds: float) -> dict[str, Any]:
        cur, tr = self._cur, self._cur["train"] or {}
        evaluation = self._eval_fields(cur["eval"])
        scores = {k: evaluation.pop(k) for k in SCORES}  # the row's first columns
        return {
            "round": server_round,
            **scores,
            "bytes-up": cur["bytes-up"],
            "bytes-down": cur["bytes-down"],
            "bytes-up-per-client": cur["bytes-up"] / max(cur["train-replies"], 1),
            "bytes-down-per-client": cur["bytes-down"] / max(cur["train-messages"], 1),
            "train-clients": cur["train-messages"],
            "round-time-s": seconds,
            "server-time-s": cur["server-time-s"],
            "valid-replies": int(tr.get("valid-replies", 0)),
            "missing-replies": len(self.inner.missing),
            "train-loss": tr.get("train-loss"),
            "client-train-time-s": tr.get("train-time-s"),
            "bytes-down-eval": cur["bytes-down-eval"],
            "client-bytes-up": cur["client-bytes-up"],
            "client-train": {str(k): v for k, v in sorted(self.inner.last_train.items())},
            "server-diagnostics": dict(self.inner.diagnostics),
            "upload-size-ratio": dict(self.inner.size_ratios),
            **evaluation,
            **self._virtual(),
        }

    def _print(self, row: dict[str, Any]) -> None:
        acc = "-" if row["accuracy"] is None else f"{row['accuracy']:.4f}"
        extra = ""
        if row["accuracy-without-shared"] is not None:
            extra += f" | without shared {row['accuracy-without-shared']:.4f}"
        if "head-change" in row["server-diagnostics"]:
            extra += f" | head change {row['server-diagnostics']['head-change']:.3f}"
        if row["virtual-time-s"] is not None:
            extra += f" | virtual {row['virtual-time-s']:.1f} s"
            if row["deadline-dropped"]:
                extra += f", {row['deadline-dropped']} past the deadline"
        log(
            INFO,
            "[fedhet] round %d/%d | accuracy %s | up %s down %s per client | %.1f s%s",
            row["round"],
            self.cfg.num_server_rounds,
            acc,
            human_bytes(row["bytes-up-per-client"]),
            human_bytes(row["bytes-down-per-client"]),
            row["round-time-s"],
            extra,
        )

    # ------------------------------------------------------------------ output
    def results(self) -> dict[str, Any]:
        evaluated = [r for r in self.rounds if r["accuracy"] is not None]
        best = max(evaluated, key=lambda r: r["accuracy"], default=None)
        return {
            "config": flatten(self.cfg),
            "versions": versions(),
            "rounds": self.rounds,
            "summary": {
                "accuracy-last": evaluated[-1]["accuracy"] if evaluated else None,
                "accuracy-best": best["accuracy"] if best else None,
                "best-round": best["round"] if best else None,
                "accuracy-prior": accuracy_prior(self.inner.nodes.values()),
                "bytes-up-total": sum(r["bytes-up"] for r in self.rounds),
                "bytes-down-total": sum(r["bytes-down"] for r in self.rounds),
                "wall-time-s": self.wall_time(),
                "virtual-time-total-s": virtual_total(self.rounds),
                "server-threads": torch.get_num_threads(),
                "rejected-replies": [
                    {"round": r, "node-id": n, "reason": why} for r, n, why in self.inner.rejected
                ],
                "nodes": {
                    str(n.partition_id): n.arch
                    for n in sorted(self.inner.nodes.values(), key=lambda n: n.partition_id)
                },
                "partition": partition_record(self.cfg, len(self.inner.nodes)),
            },
        }

    def write(self) -> Path:
        """Write ``results.json`` atomically; return its path."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / "results.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.results(), indent=1))
        os.replace(tmp, path)
        return path


def partition_record(cfg: RunConfig, num_partitions: int) -> dict[str, Any]:
    """Where the run's partition lies (on the machine that made it: a simulation's, or
    each node's own cache in a deployment) and how to write it again anywhere: the
    folder holds ``train/<partition>.npz`` and ``test/<partition>.npz``."""
    from data.store import cache_dir, partition_key

    data = cfg.data
    if data.name == "clients-npz":
        folder = Path(data.root).expanduser()
    else:
        folder = cache_dir(data) / partition_key(data, num_partitions, cfg.seed)
    keys = " ".join(f"{k}={toml_literal(v)}" for k, v in flatten(data, "data.").items())
    return {
        "folder": str(folder),
        "num-partitions": num_partitions,
        "export": f'fedhet partition -c "{keys} seed={cfg.seed}" -n {num_partitions} '
        "--export <folder>",
    }


def toml_literal(value: Any) -> str:
    """A run-config value as ``-c`` takes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return "'" + value + "'"
    return repr(value)
