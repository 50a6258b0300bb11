"""Emulated SuperNodes on the real protocol, many per process, without torch.

Each emulated node is a thread with its own key, Flower's own Fleet API client
(``http_request_response``: TLS, node authentication, registration and heartbeats as a
SuperNode has them) and Flower's own node loop functions (``_pull_and_store_message``,
``_push_messages``) driven by fedhet's node policy: :class:`cli.supernode.RunWatch`
(confirmation sent along), :class:`cli.supernode.PacedSleep` (idle pulls paced by
when the next message is due) and fedhet's object concurrency. Where a real node hands
the message to its executor, an emulated one answers it itself: after ``--delay``
seconds (train and evaluate messages) it stores a reply of the method's real shapes
and records, made from the templates captured from fedhet's real ClientApp on five
nodes (``benchmarks.fleet_load``; node i answers as partition i mod 5 did: its
architecture, its FedARA tier): arrays the node also received go back perturbed, others
are drawn at their template's shape; metric and config records are the template's,
with this node's partition id. Nothing here imports torch.

    python -m benchmarks.fleet_node --superlink 127.0.0.1:PORT --ca CA --keys DIR \\
        --first 0 --count 250 --num-partitions 1000 --templates T.json --stats S.json
"""

from __future__ import annotations

import argparse
import base64
import importlib
import json
import random
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

SUPERNODE = "flwr.supernode.start_client_internal"
NOISE = 1e-4
"""Relative noise on arrays sent back: every reply's objects are new (Flower
deduplicates identical objects, which would understate the bytes)."""
REPLY_SLOTS = threading.BoundedSemaphore(4)
"""Nodes of one process decoding a message and building its reply at a time: each
holds the message's objects, its arrays, the reply's arrays and its bytes at once, a
transient of four or five copies of a FedARA message, bounded so. (Measured alone it
did not lower the emulators' peak, which was the replies waiting, see :func:`stored`.)
The nodes share a process's GIL, so more at once would not answer sooner."""


# ------------------------------------------------------------------ templates
def encode_value(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"bytes": base64.b64encode(value).decode()}
    return value


def decode_value(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"bytes"}:
        return base64.b64decode(value["bytes"])
    return value


def describe(reply: Any, received: Any) -> dict[str, Any]:
    """A reply's structure and records as JSON: per array record its arrays' shapes
    and dtypes (``same``: the received message had the same record, keys and shapes),
    metric and config records with their values."""
    content = reply.content
    got = received.content.array_records
    arrays = {}
    for name, record in content.array_records.items():
        keys = {k: [list(a.shape), str(a.dtype)] for k, a in record.items()}
        same = (
            name in got and {k: [list(a.shape), str(a.dtype)] for k, a in got[name].items()} == keys
        )
        arrays[name] = {"same": same, "keys": keys}
    return {
        "arrays": arrays,
        "metrics": {n: dict(r) for n, r in content.metric_records.items()},
        "configs": {
            n: {k: encode_value(v) for k, v in r.items()} for n, r in content.config_records.items()
        },
    }


def template_key(message: Any, content: Any = None) -> str:
    """``query.profile``, ``train`` or ``train+eval`` (a training message that carries
    the previous round's evaluation), ``evaluate``."""
    kind = str(message.metadata.message_type).split(".")[0]
    if kind == "query":
        return str(message.metadata.message_type)
    from common.messages import EVAL_CONFIG

    records = (message.content if content is None else content).config_records
    return f"{kind}+eval" if EVAL_CONFIG in records else kind


def template_of(templates: list[dict[str, Any]], index: int, kind: str) -> dict[str, Any]:
    """Node ``index``'s template of ``kind``: what captured partition ``index`` mod
    the captured nodes sent (any captured node's if that one sent none of this kind)."""
    own = templates[index % len(templates)]
    if kind in own:
        return own[kind]
    return next(t[kind] for t in templates if kind in t)


def stored(reply: Any, store: Any, run_id: int) -> Any:
    """``reply``'s objects put in the node's ``store`` as bytes, and the message
    without its content, to be stored when it is due: a node holds one serialised
    reply while it "trains" (its decoded arrays would double that; the push reads the
    store alone). A function of its own, so that no local of the node's loop keeps a
    reply's arrays alive while the node waits (one did: the last object of the loop
    that stored them, 389 MB at N = 100, traced)."""
    from flwr.app.message import remove_content_from_message
    from flwr.supercore.inflatable.inflatable_object import (
        get_all_nested_objects,
        get_object_tree,
        no_object_id_recompute,
    )

    with no_object_id_recompute():
        reply.metadata.__dict__["_message_id"] = reply.object_id
        store.preregister(run_id, get_object_tree(reply))
        for object_id, obj in get_all_nested_objects(reply).items():
            store.put(object_id, obj.deflate())
    return remove_content_from_message(reply)


def build_reply(
    received: Any,
    content: Any,
    template: dict[str, Any],
    partition_id: int,
    rng: np.random.Generator,
) -> Any:
    """A reply to ``received`` (its metadata as the node stored it; ``content``: what
    it carried) with ``template``'s records (see :func:`describe`)."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

    records: dict[str, Any] = {}
    got = content.array_records
    for name, spec in template["arrays"].items():
        arrays = {}
        for key, (shape, dtype) in spec["keys"].items():
            if spec["same"] and name in got and key in got[name]:
                base = got[name][key].numpy()
                scale = NOISE * (float(np.abs(base).mean()) or 1.0)
                if base.dtype in (np.float32, np.float64):  # noise in the array's precision
                    noise = rng.standard_normal(base.shape, dtype=base.dtype)
                    value = base + (noise * base.dtype.type(scale))
                else:
                    value = base + rng.normal(0.0, scale, base.shape).astype(base.dtype)
            else:
                value = rng.normal(0.0, 0.1, shape).astype(dtype)
            arrays[key] = Array(np.ascontiguousarray(value))
        records[name] = ArrayRecord(arrays)
    for name, values in template["metrics"].items():
        records[name] = MetricRecord(dict(values))
    for name, values in template["configs"].items():
        decoded = {k: decode_value(v) for k, v in values.items()}
        if "partition-id" in decoded:
            decoded["partition-id"] = partition_id
        records[name] = ConfigRecord(decoded)
    return Message(RecordDict(records), reply_to=received)


# ------------------------------------------------------------------ one node
class Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.data: dict[str, Any] = {
            "handled": {},
            "errors": [],
            "online": 0,
            "connect-s": [],
            "connections": 0,
            "polls": {},
        }

    def connection(self) -> None:
        """A node opened a connection to the SuperLink (TCP, then TLS)."""
        with self.lock:
            self.data["connections"] += 1

    def add(self, kind: str) -> None:
        with self.lock:
            self.data["handled"][kind] = self.data["handled"].get(kind, 0) + 1

    def poll(self, got_message: bool, held_s: float) -> None:
        """A poll's outcome: a message, or empty after a hold of a second or more
        (``empty-held``) or at once (``empty-at-once``)."""
        kind = "message" if got_message else "empty-held" if held_s >= 1.0 else "empty-at-once"
        with self.lock:
            polls = self.data["polls"]
            polls[kind] = polls.get(kind, 0) + 1
            polls["held-s"] = polls.get("held-s", 0.0) + held_s

    def error(self, text: str) -> None:
        with self.lock:
            self.data["errors"].append(text[:500])

    def online(self, seconds: float) -> None:
        with self.lock:
            self.data["online"] += 1
            self.data["connect-s"].append(round(seconds, 3))

    def write(self, path: Path) -> None:
        from cli.supernode import HEARTBEATS

        with self.lock:
            text = json.dumps({**self.data, "heartbeats": HEARTBEATS.view()})
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)


def run_node(args: argparse.Namespace, index: int, templates: list, stats: Stats) -> None:
    """Node ``index``: connect, then Flower's loop with fedhet's node policy, answering
    each message from its template; until the process ends."""
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key
    from flwr.common.constant import SubStatus
    from flwr.supercore.inflatable.inflatable_object import iterate_object_tree
    from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.supernode.fleet_http_connection import http_request_response
    from flwr.supernode.nodestate import NodeStateFactory

    from cli.pacing import LOAD
    from cli.supernode import FLOWER_IDLE_PULL_S, Inbox, PacedSleep, RunWatch, held_s
    from common.packing import is_packed, pack, unpack

    loop = importlib.import_module(SUPERNODE)
    key = load_ssh_private_key((Path(args.keys) / f"node-{index}").read_bytes(), None)
    node_config = {"partition-id": index, "num-partitions": args.num_partitions}
    factory = NodeStateFactory(ObjectStoreFactory())
    state, store = factory.state(), factory.objectstore_factory.store()
    load = LOAD if args.load_aware else None
    paced = PacedSleep(time, 0.05, load=load)
    watch = RunWatch(
        loop._pull_and_store_message,
        loop._push_messages,
        sleep=paced.sleep,
        on_message=paced.arrived,
        on_receive_s=LOAD.note if load is not None else None,
        load=load,
        confirm_along=True,
        inbox=Inbox("legacy"),
        carry=args.carry,
        confirm_on_push=args.confirm_on_push,
    )
    rng = np.random.default_rng([args.seed, index])
    t0 = time.monotonic()
    with http_request_response(
        args.superlink,
        insecure=args.ca is None,
        root_certificates=None if args.ca is None else Path(args.ca).read_bytes(),
        authentication_keys=(key, key.public_key()),  # type: ignore[arg-type]
    ) as conn:
        node_id, receive, send, get_run, get_fab, pull_object, push_object, confirm = conn
        state.set_node_id(node_id)
        stats.online(time.monotonic() - t0)
        poll = receive

        def receive() -> Any:
            got = poll()
            stats.poll(got is not None, held_s())
            return got

        while True:
            run_id = watch.pull(
                state=state,
                object_store=store,
                node_config=node_config,
                receive=receive,
                get_run=get_run,
                get_fab=get_fab,
                pull_object=pull_object,
                confirm_message_received=confirm,
                trusted_entities=None,
            )
            if run_id is None:
                paced.sleep(FLOWER_IDLE_PULL_S)
                continue
            try:
                with REPLY_SLOTS:
                    # what the Runtime API does for a task: hand the message out, time it
                    [message] = state.get_messages_legacy(run_ids=[run_id], is_reply=False, limit=1)
                    mid = message.metadata.message_id
                    state.record_message_processing_start(message_id=mid)
                    tree = store.get_object_tree(mid)
                    contents = {
                        t.object_id: store.get(t.object_id) for t in iterate_object_tree(tree)
                    }
                    inflated = inflate_object_from_contents(mid, contents)  # type: ignore[arg-type]
                    content = inflated.content  # type: ignore[attr-defined]
                    # what a ClientApp's confirmation does on a real node: the message's
                    # objects leave the node's store once the task holds the message
                    del contents, inflated
                    store.delete(mid)
                    packed = is_packed(content)  # as fedhet's ClientApp mod: unpack, answer packed
                    if packed:
                        content = unpack(content)
                    kind = template_key(message, content)
                    template = template_of(templates, index, kind)
                    reply = build_reply(message, content, template, index, rng)
                    del content
                    if packed:
                        reply.content = pack(reply.content)
                    reply = stored(reply, store, run_id)

                def deliver(
                    reply: Any = reply, mid: str = mid, kind: str = kind, run: int = run_id
                ) -> None:
                    """What the task's ClientApp does when it ends: store its reply."""
                    try:
                        # its objects are in the store already: the node pushes a reply
                        # as soon as it sees it (what the Runtime API's push handler
                        # guarantees)
                        state.store_message(reply)
                        state.record_message_processing_end(message_id=mid)
                        for task in state.get_tasks(run_ids=[run]):
                            state.finish_task(
                                task.task_id, sub_status=SubStatus.COMPLETED, details=""
                            )
                        stats.add(kind)
                    except Exception as exc:  # noqa: BLE001 - counted: a lost reply
                        stats.error(f"node {index}: {type(exc).__name__}: {exc}")

                delay = 0.0 if kind.startswith("query") else args.delay
                delay += random.uniform(0.0, args.jitter) if delay else 0.0
                if delay > 0:  # the node waits for it as for its executor (run checks)
                    threading.Timer(delay, deliver).start()
                else:
                    deliver()
            except Exception as exc:  # noqa: BLE001 - counted: a lost reply
                stats.error(f"node {index}: {type(exc).__name__}: {exc}")
            watch.push(state=state, object_store=store, send=send, push_object=push_object)
            paced.sleep(0.0)  # as a node's wait inside a task: active until its reply went


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--superlink", required=True)
    parser.add_argument("--ca")
    parser.add_argument("--keys", required=True)
    parser.add_argument("--first", type=int, required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--num-partitions", type=int, required=True)
    parser.add_argument("--templates", required=True)
    parser.add_argument("--stats", required=True)
    parser.add_argument("--delay", type=float, default=1.0)
    parser.add_argument("--jitter", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ramp-s", type=float, default=0.01, help="between two node starts")
    args = parser.parse_args()

    from cli.supernode import (
        carried_node_objects,
        keep_alive_clients,
        load_aware_heartbeats,
        patient_heartbeats,
        switch,
    )
    from common import flower_gate, heap
    from common.flower_runtime import concurrent_objects, object_concurrency

    if flower_gate.use("heartbeat-patience"):  # once for every node of this process
        patient_heartbeats()
    args.load_aware = switch("FEDHET_LOAD_AWARE") and flower_gate.use("load-aware-idle")
    if args.load_aware:
        load_aware_heartbeats()  # one view of the SuperLink's load for the process's nodes
    if flower_gate.use("warm-connections"):  # the keep-alive a SuperLink names
        keep_alive_clients()
    count = object_concurrency()
    if flower_gate.use("node-objects") and count is not None:
        concurrent_objects(
            SUPERNODE, "pull_objects", "push_object_contents_from_iterable", count=count
        )
    args.carry = switch("FEDHET_CARRIED_OBJECTS") and flower_gate.use("carried-objects")
    args.confirm_on_push = args.carry and flower_gate.use("carried-confirmations")
    if args.carry:  # after the object concurrency: it wraps the pulls that has
        carried_node_objects()
    heap.start_trimmer()  # as fedhet supernode
    templates = json.loads(Path(args.templates).read_text())
    stats, path = Stats(), Path(args.stats)
    count_connections(stats)
    for index in range(args.first, args.first + args.count):
        threading.Thread(
            target=_guarded, args=(args, index, templates, stats), daemon=True, name=f"node-{index}"
        ).start()
        time.sleep(args.ramp_s)
    while True:
        stats.write(path)
        time.sleep(1.0)


def count_connections(stats: Stats) -> None:
    """Count every connection this process's nodes open (httpcore's pool makes each)."""
    import httpcore

    pool = httpcore.ConnectionPool
    make = pool.create_connection

    def counted(self: Any, origin: Any) -> Any:
        stats.connection()
        return make(self, origin)

    pool.create_connection = counted  # type: ignore[method-assign]


def _guarded(args: argparse.Namespace, index: int, templates: list, stats: Stats) -> None:
    try:
        run_node(args, index, templates, stats)
        # Flower's connection swallows the error that ended its loop (and logs it)
        stats.error(f"node {index}: its connection ended (see the emulator's log)")
    except BaseException as exc:  # noqa: BLE001 - a node that died is counted
        stats.error(f"node {index} ended: {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
