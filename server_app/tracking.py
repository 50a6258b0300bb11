"""Watching a run while it goes: every completed round's metrics as TensorBoard scalars.

Run-config ``log.tensorboard`` (a folder; empty = off) makes :class:`Tracker` write
TensorBoard event files to ``<folder>/<out-dir's name>``, one step per round, as soon
as a round's row of results.json is complete; ``tensorboard --logdir <folder>`` shows
every run under it side by side. It needs the optional ``tensorboard`` package
(``pip install 'fedhet[tensorboard]'``); torch's ``SummaryWriter`` writes the files.

A round's row may be completed later (``eval-mode = with-train``: its evaluation
arrives with the next round's training replies, filled into the same row): the
tracker keeps the rows it was given and, at every call, writes what each has that was
not written before, so a completed accuracy appears at the next round's call (or when
the completed row is logged again).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from common.config import ConfigError, RunConfig

SCALARS: dict[str, str] = {
    "accuracy": "accuracy/all",
    "accuracy-mean": "accuracy/mean",
    "accuracy-std": "accuracy/std",
    "accuracy-global": "accuracy/global",
    "accuracy-without-shared": "accuracy/without-shared",
    "loss": "loss/eval",
    "train-loss": "loss/train",
    "bytes-up": "bytes/up",
    "bytes-down": "bytes/down",
    "bytes-up-per-client": "bytes/up-per-client",
    "bytes-down-per-client": "bytes/down-per-client",
    "bytes-down-eval": "bytes/down-eval",
    "round-time-s": "time/round-s",
    "server-time-s": "time/server-s",
    "client-train-time-s": "time/client-train-s",
    "virtual-time-s": "time/virtual-s",
    "train-clients": "replies/sent",
    "valid-replies": "replies/valid",
    "missing-replies": "replies/missing",
    "deadline-dropped": "replies/deadline-dropped",
}
"""results.json row key -> TensorBoard tag (one scalar per round)."""
PER_CLIENT: dict[str, str] = {
    "client-accuracy": "client-accuracy",
    "client-bytes-up": "client-bytes-up",
    "client-virtual-time-s": "client-virtual-time-s",
}
"""Row keys holding ``{partition: value}`` -> tag prefix (``<prefix>/<partition>``)."""
REJECTED = "replies/rejected"
VIRTUAL_TOTAL = "time/virtual-total-s"
BY_VIRTUAL_TIME = "accuracy/by-virtual-second"
"""Accuracy with the step = the run's virtual seconds so far (runs with a virtual clock)."""


class Writer(Protocol):
    """What :class:`Tracker` needs of a TensorBoard writer."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


def tensorboard_writer(folder: Path) -> Writer:
    """torch's ``SummaryWriter`` on ``folder``; a clear error without tensorboard."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(
            "run-config key 'log.tensorboard' is set, but the tensorboard package is "
            "missing: pip install 'fedhet[tensorboard]'"
        ) from None
    return SummaryWriter(log_dir=str(folder))  # type: ignore[no-any-return]


class Tracker:
    """Logs results.json rows as they complete (a no-op without a writer)."""

    def __init__(self, writer: Writer | None = None) -> None:
        self.writer = writer
        self.logged: dict[tuple[str, int], float] = {}
        """(tag, step) -> the value written."""
        self.rows: dict[int, Mapping[str, Any]] = {}
        """Round -> its row (kept: a row may be completed after it was logged)."""
        self.virtual_total: dict[int, float] = {}
        """Round -> Σ virtual-time-s over the rounds logged up to it."""

    @classmethod
    def from_config(cls, cfg: RunConfig, out_dir: Path) -> Tracker:
        """The run's tracker: ``<log.tensorboard>/<out_dir's name>``, or a no-op."""
        if not cfg.log.tensorboard:
            return cls(None)
        folder = Path(cfg.log.tensorboard).expanduser() / out_dir.name
        return cls(tensorboard_writer(folder))

    def log_round(
        self, row: Mapping[str, Any], rejected: Iterable[tuple[int, int, str]] = ()
    ) -> None:
        """Write ``row``'s metrics at step ``row["round"]``, and what earlier rows gained
        since they were logged (values are written once per round and tag), then flush.
        ``rejected``: the strategy's ``(round, node, reason)`` list; a round's entries
        are counted as ``replies/rejected``."""
        if self.writer is None:
            return
        self.rows[int(row["round"])] = row
        rejected = list(rejected)
        for step in sorted(self.rows):
            self._log(self.rows[step], step, rejected)
        self.writer.flush()

    def _log(self, row: Mapping[str, Any], step: int, rejected: list[tuple[int, int, str]]) -> None:
        for key, tag in SCALARS.items():
            self._add(tag, row.get(key), step)
        for key, prefix in PER_CLIENT.items():
            for pid, value in sorted((row.get(key) or {}).items()):
                self._add(f"{prefix}/{pid}", value, step)
        self._add(REJECTED, sum(1 for r in rejected if r[0] == step), step)
        virtual = row.get("virtual-time-s")
        if virtual is not None:
            earlier = max((r for r in self.virtual_total if r < step), default=None)
            total = (self.virtual_total[earlier] if earlier is not None else 0.0) + virtual
            self.virtual_total[step] = total
            self._add(VIRTUAL_TOTAL, total, step)
            self._add(BY_VIRTUAL_TIME, row.get("accuracy"), round(total))

    def _add(self, tag: str, value: Any, step: int) -> None:
        if value is None or isinstance(value, bool) or not isinstance(value, int | float):
            return
        if self.logged.get((tag, step)) == float(value):
            return
        assert self.writer is not None
        self.writer.add_scalar(tag, float(value), step)
        self.logged[(tag, step)] = float(value)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


__all__ = ["Tracker", "tensorboard_writer"]
