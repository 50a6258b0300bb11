"""An in-process Grid: delivers each message straight to a ClientApp, no Ray.

Each node keeps its own ``Context`` (node config, persistent ``state``) across
messages, as a SuperNode does. ``faults`` can turn a node's reply into a crafted one
(NaN arrays, wrong shapes, an error) to test what the server survives.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp

Fault = Callable[[Message], Message]


class FakeGrid:
    """Minimal Grid for ``Strategy.start``: ``get_node_ids`` + ``send_and_receive``."""

    def __init__(
        self,
        app: ClientApp,
        run_config: dict,
        num_nodes: int,
        node_configs: list[dict] | None = None,
    ) -> None:
        self.app = app
        self.contexts: dict[int, Context] = {}
        for pid in range(num_nodes):
            nid = 1000 + 17 * pid
            node_config: dict[str, bool | float | int | str] = {
                "partition-id": pid,
                "num-partitions": num_nodes,
            }
            if node_configs:
                node_config.update(node_configs[pid])
            self.contexts[nid] = Context(
                run_id=1,
                node_id=nid,
                node_config=node_config,
                state=RecordDict(),
                run_config=dict(run_config),
            )
        self.faults: dict[int, Fault] = {}
        self.sent: list[Message] = []
        self.offline: set[int] = set()

    def get_node_ids(self) -> Iterable[int]:
        return [n for n in self.contexts if n not in self.offline]

    def node_of_partition(self, pid: int) -> int:
        return next(n for n, c in self.contexts.items() if c.node_config["partition-id"] == pid)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        replies = []
        for msg in messages:
            self.sent.append(msg)
            nid = msg.metadata.dst_node_id
            if nid in self.offline:
                continue
            reply = self.app(msg, self.contexts[nid])
            if nid in self.faults and msg.metadata.message_type.startswith("train"):
                reply = self.faults[nid](reply)
            replies.append(reply)
        return replies
