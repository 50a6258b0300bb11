"""A Grid that collects replies every 0.1 s.

Flower 1.42's HTTP grid (what a ServerApp gets in a deployment) polls for replies
every 3 s inside ``send_and_receive``; the simulation's in-memory grid every 0.1 s.
:class:`PollingGrid` wraps whichever grid the ServerApp receives and implements
``send_and_receive`` with the public ``push_messages`` / ``pull_messages`` at a short
interval, so a deployment round does not wait up to 3 s per phase for nothing. The
reply objects it pulls are retried with the node side's short backoff
(``common.flower_runtime.PULL_BACKOFF``: 0.05 s doubling to 0.5 s, not Flower's 1 s
doubling to 10 s).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from flwr.app import Message
from flwr.serverapp import Grid
from flwr.supercore.run import Run

from common.flower_runtime import fast_object_pulls


class PollingGrid(Grid):
    """``grid`` with ``send_and_receive`` polling every ``interval`` seconds; every
    other method is the wrapped grid's."""

    def __init__(self, grid: Grid, interval: float = 0.1) -> None:
        self._grid, self._interval = grid, interval
        fast_object_pulls("flwr.superlink.grid.http_grid", "pull_objects")

    def set_run(self, run: Run) -> None:
        self._grid.set_run(run)

    @property
    def run(self) -> Run:
        return self._grid.run

    def create_message(self, *args, **kwargs) -> Message:  # type: ignore[no-untyped-def]
        return self._grid.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        return self._grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._grid.pull_messages(message_ids)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Push, then pull every ``interval`` s until every reply is in or
        ``timeout`` (seconds, None: no limit) has passed."""
        pending = set(self.push_messages(messages))
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        while pending:
            got = list(self.pull_messages(pending))
            replies += got
            pending -= {m.metadata.reply_to_message_id for m in got}
            if not pending or (deadline is not None and time.monotonic() >= deadline):
                break
            time.sleep(self._interval)
        return replies
