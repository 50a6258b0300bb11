"""The fleet emulator (benchmarks/fleet_node.py, benchmarks/fleet_load.py): replies of
the method's real shapes from captured templates; a real federation of 3 emulated nodes
completes with every reply aggregated."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from benchmarks.fleet_node import build_reply, describe, template_key

ROOT = Path(__file__).resolve().parent.parent


def _instruction() -> Message:
    head = {
        "head.weight": Array(np.ones((10, 500), np.float32)),
        "head.bias": Array(np.zeros(10, np.float32)),
    }
    msg = Message(
        RecordDict({"arrays": ArrayRecord(head), "config": ConfigRecord({"server-round": 2})}),
        dst_node_id=5,
        message_type="train.lgfedavg",
    )
    msg.metadata.__dict__["_message_id"] = msg.object_id
    return msg


def test_an_emulated_reply_has_the_real_replys_records_and_shapes() -> None:
    received = _instruction()
    real = Message(
        RecordDict(
            {
                "arrays": ArrayRecord(
                    {k: Array(v.numpy() + 1) for k, v in received.content["arrays"].items()}
                ),
                "extra": ArrayRecord({"proto": Array(np.ones((3, 7), np.float32))}),
                "metrics": MetricRecord({"num-examples": 40, "train-loss": 0.5}),
                "profile": ConfigRecord({"partition-id": 0, "arch": "cnn-1"}),
            }
        ),
        reply_to=received,
    )
    template = json.loads(json.dumps(describe(real, received)))  # as the file holds it
    assert template_key(received) == "train"
    assert template["arrays"]["arrays"]["same"] and not template["arrays"]["extra"]["same"]
    rng = np.random.default_rng(0)
    reply = build_reply(received, received.content, template, 7, rng)
    assert reply.metadata.reply_to_message_id == received.metadata.message_id
    got = reply.content
    sent = received.content["arrays"]["head.weight"].numpy()
    back = got["arrays"]["head.weight"].numpy()
    assert back.shape == (10, 500) and back.dtype == np.float32
    assert 0 < np.abs(back - sent).max() < 1e-2  # what it received, perturbed
    assert got["extra"]["proto"].numpy().shape == (3, 7)
    assert dict(got["metrics"]) == {"num-examples": 40, "train-loss": 0.5}
    assert dict(got["profile"]) == {"partition-id": 7, "arch": "cnn-1"}  # this node's partition
    again = build_reply(received, received.content, template, 7, rng)
    assert not np.array_equal(again.content["arrays"]["head.weight"].numpy(), back)  # new objects


@pytest.mark.e2e
def test_three_emulated_nodes_complete_a_run_with_every_reply(tmp_path: Path) -> None:
    """The benchmark at its smallest: TLS, node auth, real SuperLink and ServerApp."""
    out = tmp_path / "rows.json"
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.fleet_load", "--nodes", "3", "--rounds", "2",
         "--delay", "0.2", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [row] = json.loads(out.read_text())
    assert row["valid-replies"] == [3, 3] and row["lost-replies"] == 0
    assert row["emulator-error-count"] == 0
    assert row["requests"]["fleet/push-messages"] >= 3 * 2 + 3  # profile + 2 rounds (+ final eval)
    # every node message's objects carried in its poll's answer and its push
    # (carried-objects; the ServerApp's own object pulls are not asserted: a few remain
    # at N = 1,000)
    assert not {"fleet/pull-object", "fleet/push-object"} & set(row["requests"]), row["requests"]
    assert row["server-cpu-s"] > 0 and row["superlink-peak-sockets"] > 0
    # the SuperLink counts each HTTP request once: no more polls than the nodes made
    # (a held poll's answers to its wakes are not requests)
    polls = sum(row["node-polls-per-node-round"].values()) * 3 * 2
    assert 0 < row["requests"]["fleet/pull-messages"] <= round(polls), (row["requests"], polls)
    # every answer that carried objects gave its bytes back to the in-flight budget
    carry = row["carry"]
    assert carry["inflight-peak-bytes"] > 0 and carry["inflight-now-bytes"] == 0, carry
    # and every carried push its bytes to the incoming budget
    assert carry["incoming-peak-bytes"] > 0 and carry["incoming-now-bytes"] == 0, carry
    # each role's memory was sampled (the emulators count as SuperNodes)
    assert {"superlink", "serverapp", "supernode"} <= set(row["peak-rss-mb-by-role"])


def test_a_run_about_to_exhaust_memory_is_stopped_and_says_where() -> None:
    """Below the memory floor the probe interrupts the run (the main thread, whose
    ``with`` then shuts the federation down) and records each role's memory then."""
    import signal
    import time
    from types import SimpleNamespace

    from benchmarks.fleet_load import LowMemory, SuperLinkProbe, stopped_on_low_memory

    groups = SimpleNamespace(placed={os.getpid(): "serverapp"})
    probe = SuperLinkProbe(os.getpid(), groups, floor_mb=1e12)  # type: ignore[arg-type]
    ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell's background job
    try:
        with pytest.raises(LowMemory), stopped_on_low_memory():
            probe.start()
            time.sleep(10)  # interrupted after one sample (0.5 s)
    finally:
        signal.signal(signal.SIGINT, ignored)
    probe.stop.set()
    assert probe.low_memory is not None
    assert probe.low_memory["rss-mb-by-role"]["serverapp"] > 0
    assert probe.low_memory["available-mb"] < 1e12


@pytest.mark.e2e
def test_emulated_nodes_answer_as_their_captured_partition() -> None:
    """Templates are captured per partition (FedARA: each its own tier), and node i
    answers with partition i mod the captured nodes' template: a fleet has the tier
    mix of a real federation, not every node at the first node's rank."""
    import tempfile

    from benchmarks.fleet_load import DATA, capture_templates
    from benchmarks.fleet_node import template_of

    with tempfile.TemporaryDirectory() as tmp:
        templates = capture_templates("fedara", {**DATA, "eval-mode": "with-train"}, Path(tmp), 2)
    assert [t["query.profile"]["configs"]["profile"]["rank-ratio"] for t in templates] == [1, 0.5]

    def size(t: dict) -> int:
        return sum(int(np.prod(s[0])) for r in t["arrays"].values() for s in r["keys"].values())

    assert size(template_of(templates, 3, "train")) < size(template_of(templates, 4, "train"))
    assert template_of([{}, {"train": {"x": 1}}], 0, "train") == {"x": 1}  # any that has it


def test_a_stored_reply_waits_as_its_bytes_alone() -> None:
    """The emulated node keeps a reply as its objects' bytes in its store and the
    message without content: the push reads the store, and nothing else holds the
    reply's arrays while the node waits."""
    import gc
    import tracemalloc

    from flwr.supercore.inflatable.inflatable_object import iterate_object_tree
    from flwr.supercore.object_store import ObjectStoreFactory

    from benchmarks.fleet_node import stored
    from common.packing import pack

    store = ObjectStoreFactory().store()
    values = np.random.default_rng(0).normal(size=(1000, 1000)).astype(np.float32)  # 4 MB
    tracemalloc.start()
    try:
        reply = Message(
            pack(RecordDict({"arrays": ArrayRecord({"w": Array(values)})}), inline_max=0),
            reply_to=_instruction(),
        )
        reply = stored(reply, store, run_id=1)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert not reply.content.array_records and not reply.content.config_records
    tree = store.get_object_tree(reply.metadata.message_id)
    assert all(store.get(t.object_id) is not None for t in iterate_object_tree(tree))
    assert held < 1.25 * values.nbytes  # one copy: the store's
