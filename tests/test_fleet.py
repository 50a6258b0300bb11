"""The virtual clock: device classes, fleets, per-client and per-round virtual time,
deadlines (closed forms, crafted replies, and an in-process fleet run)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from client_app.base import NodeSpec
from client_app.clock import choose_arch, predicted_compute_s
from common.config import ConfigError, parse_run_config
from common.devices import (
    DEVICES,
    PROTOCOL_BYTES_DOWN,
    PROTOCOL_BYTES_UP,
    PROTOCOL_S,
    ROUND_TRIPS_PER_MESSAGE,
    Device,
    device_for,
    fleet_class,
    parse_fleet,
)
from models.workload import forward_flops, measure_speed, training_flops
from server_app.inprocess import run_inprocess
from strategies.clock import client_seconds, round_seconds
from strategies.lgfedavg import LGFedAvg
from strategies.testing import node, reply, strategy

DEV = Device("test", speed=10.0, uplink_mbps=8.0, downlink_mbps=16.0, latency_ms=100.0)


# --------------------------------------------------------------------------- devices
def test_round_seconds_of_a_device_is_compute_task_round_trips_and_transfers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import common.devices as devices

    monkeypatch.setattr(devices, "ROUND_TRIPS_PER_MESSAGE", 4.5)
    monkeypatch.setattr(devices, "PROTOCOL_S", 0.3)
    monkeypatch.setattr(devices, "PROTOCOL_BYTES_DOWN", 1e5)
    monkeypatch.setattr(devices, "PROTOCOL_BYTES_UP", 5e4)
    # 2 s of CPU on a host of speed 30 = 6 s on a device of speed 10; the task's
    # 5 GFLOP at 10 GFLOP/s = 0.5 s; 4.5 round trips of 0.1 s and 0.3 s at no
    # round-trip time; 1 MB + 0.1 MB down at 16 Mbit/s = 0.55 s; 2 MB + 0.05 MB up at
    # 8 Mbit/s = 2.05 s
    dev = replace(DEV, task_gflop=5.0)
    compute = dev.compute_seconds(2.0, host_speed=30.0)
    assert compute == pytest.approx(6.0)
    assert dev.task_seconds() == pytest.approx(0.5)
    assert dev.link_seconds(1e6, 2e6) == pytest.approx(0.45 + 0.3 + 0.55 + 2.05)
    assert dev.round_seconds(compute, 1e6, 2e6) == pytest.approx(6.0 + 0.5 + 3.35)
    # a task's work beyond training: at a Pi's speed; a Jetson trains on its GPU and
    # does the rest on its CPU (a Pi 5's); a server class's on one of its four cores
    rpi4 = DEVICES["rpi4"]
    assert rpi4.task_seconds() == pytest.approx(rpi4.task_gflop / rpi4.speed)
    jetson = DEVICES["jetson-orin-nano"]
    assert jetson.task_seconds() == pytest.approx(jetson.task_gflop / DEVICES["rpi5"].speed)
    server = DEVICES["server"]
    assert server.task_seconds() == pytest.approx(server.task_gflop / (server.speed / 4))
    # latency-ms is the round-trip time: a link's one-way delay is half of it
    assert DEVICES["rpi4"].latency_ms == 50
    # a class keeps its measured task cost when node-config overrides its speed
    custom = device_for("rpi4", {"speed": 1.0})
    assert custom.task_gflop == DEVICES["rpi4"].task_gflop
    assert custom.task_seconds() == pytest.approx(DEVICES["rpi4"].task_gflop)  # at speed 1


def test_a_training_message_that_carried_an_evaluation_is_charged_for_it() -> None:
    n = timed(10, 0, DEV)
    without = client_seconds(n, {"virtual-compute-s": 1.0}, 1000, 1000)
    with_eval = client_seconds(
        n, {"virtual-compute-s": 1.0, "eval-cpu-s": 0.5, "host-speed": 30.0}, 1000, 1000
    )
    assert without is not None and with_eval is not None
    assert with_eval - without == pytest.approx(0.5 * 30.0 / DEV.speed)
    assert without == pytest.approx(1.0 + DEV.transfer_seconds(1000, 1000))


def test_fleet_classes_cycle_over_partition_ids_in_order() -> None:
    assert parse_fleet("rpi4:2, server:1") == [("rpi4", 2), ("server", 1)]
    assert [fleet_class("rpi4:2,server:1", p) for p in range(7)] == [
        "rpi4",
        "rpi4",
        "server",
        "rpi4",
        "rpi4",
        "server",
        "rpi4",
    ]
    counts = [fleet_class("rpi4:8,rpi5:6,jetson-orin-nano:4,server:2", p) for p in range(100)]
    assert [counts.count(n) for n in DEVICES] == [40, 30, 20, 10]


@pytest.mark.parametrize("bad", ["toaster:3", "rpi4:0", "rpi4:-1", "rpi4:x", " , "])
def test_a_bad_fleet_is_refused_naming_the_key(bad: str) -> None:
    with pytest.raises(ConfigError, match="'fleet'"):
        parse_run_config({"fleet": bad})


def test_node_config_overrides_a_device_and_custom_needs_a_speed() -> None:
    d = device_for("rpi4", {"speed": 7.5, "uplink-mbps": 3, "latency-ms": 0})
    assert (d.speed, d.uplink_mbps, d.downlink_mbps, d.latency_ms) == (7.5, 3.0, 50, 0.0)
    assert device_for("custom", {"speed": 2}).speed == 2.0
    with pytest.raises(ValueError, match="speed"):
        device_for("custom", {})
    with pytest.raises(ValueError, match="must be > 0"):
        device_for("rpi5", {"speed": 0})


def test_fleet_nodes_take_their_class_model_but_train_as_the_run_says() -> None:
    cfg = parse_run_config(
        {"fleet": "rpi4:1,jetson-orin-nano:1", "model.family": "cnn", "train.batch-size": 32}
    )
    rpi4 = NodeSpec.from_context(cfg, {"partition-id": 0, "num-partitions": 2})
    jetson = NodeSpec.from_context(cfg, {"partition-id": 1, "num-partitions": 2})
    assert (rpi4.arch, rpi4.device, rpi4.virtual) == ("cnn-5", DEVICES["rpi4"], True)
    # a simulated Jetson needs no CUDA here, and keeps the run's torch device
    assert jetson.device == DEVICES["jetson-orin-nano"] and jetson.arch == "cnn-2"
    without = NodeSpec.from_context(parse_run_config({}), {"partition-id": 0, "num-partitions": 2})
    assert without.device is None and not without.virtual


# --------------------------------------------------------------------------- workload
def test_flops_are_counted_from_layer_shapes() -> None:
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 5 * 5, 4))
    x = torch.zeros(2, 3, 5, 5)
    conv = 2 * (2 * 8 * 5 * 5) * (3 * 3 * 3)  # 2 per MAC, per output element
    linear = 2 * (2 * 4) * 200
    assert forward_flops(net, x) == conv + linear
    assert training_flops(net, x) == 3 * (conv + linear)


def test_measured_speed_is_positive_and_finite() -> None:
    speed = measure_speed(seconds=0.05)
    assert np.isfinite(speed) and speed > 0


def test_the_deadline_policy_takes_the_largest_model_that_fits() -> None:
    flops = {"small": 1e6, "mid": 1e7, "big": 1e8}
    # 100 samples, 1 epoch on speed 10 GFLOP/s: 0.01 s, 0.1 s, 1 s; the message adds
    # its task, its protocol and 2 × 0 bytes
    args = (100, 1, DEV)
    extra = DEV.transfer_seconds(0, 0)
    assert predicted_compute_s(1e8, *args) == pytest.approx(1.0)
    assert choose_arch(list(flops), flops, *args, deadline_s=extra + 0.5, fixed_bytes=0) == "mid"
    assert choose_arch(list(flops), flops, *args, deadline_s=extra + 2.0, fixed_bytes=0) == "big"
    assert choose_arch(list(flops), flops, *args, deadline_s=extra, fixed_bytes=0) == "small"


# --------------------------------------------------------------------------- server
def timed(nid: int, pid: int, device: Device, **kw: object):  # type: ignore[no-untyped-def]
    extras = {
        "device": device.name,
        "speed": device.speed,
        "uplink-mbps": device.uplink_mbps,
        "downlink-mbps": device.downlink_mbps,
        "latency-ms": device.latency_ms,
    }
    return node(nid, pid, **extras, **kw)  # type: ignore[arg-type]


def head(value: float) -> dict[str, np.ndarray]:
    return {
        "head.weight": np.full((10, 500), value, np.float32),
        "head.bias": np.full((10,), value, np.float32),
    }


def test_a_client_past_the_deadline_is_not_aggregated() -> None:
    fast = replace(DEV, name="fast", speed=100.0, latency_ms=0.0)
    nodes = [timed(10, 0, fast), timed(11, 1, DEV), timed(12, 2, fast)]
    s = strategy(LGFedAvg, nodes, **{"round-deadline-s": 3.0})
    s.global_arrays = s.init_global()
    head_bytes = (10 * 500 + 10) * 4
    s._sent_bytes = {10: head_bytes, 11: head_bytes, 12: head_bytes}
    replies = [
        reply(10, head(1.0), 100, **{"virtual-compute-s": 1.0}),
        reply(11, head(5.0), 100, **{"virtual-compute-s": 2.9}),  # + transfers: > 3 s
        reply(12, head(3.0), 100, **{"virtual-compute-s": 0.5}),
    ]
    arrays, _ = s.aggregate_train(1, replies)
    assert arrays is not None
    assert s.deadline_dropped == [1]
    np.testing.assert_allclose(s.global_arrays["head.bias"], 2.0)  # mean of 1 and 3
    want_slow = (
        2.9
        + DEV.task_gflop / DEV.speed
        + ROUND_TRIPS_PER_MESSAGE * 0.1
        + PROTOCOL_S
        + (head_bytes + PROTOCOL_BYTES_DOWN) * 8 / 16e6
        + (head_bytes + PROTOCOL_BYTES_UP) * 8 / 8e6
    )
    assert s.client_virtual_s[1] == pytest.approx(want_slow)
    assert s.client_virtual_s[0] == pytest.approx(
        1.0 + fast.transfer_seconds(head_bytes, head_bytes)
    )
    assert "straggler" in s.rejected[-1][2]
    # the round lasts until the deadline (someone missed it), plus the server step
    assert round_seconds(list(s.client_virtual_s.values()), 3.0, 0.25) == 3.25
    assert round_seconds([1.0, 2.0], 3.0, 0.25) == 2.25
    assert round_seconds([1.0, 2.0], 0.0, 0.0) == 2.0


def test_without_a_device_or_a_deadline_nothing_is_timed_or_dropped() -> None:
    plain = node(10, 0)
    assert client_seconds(plain, {"virtual-compute-s": 5.0}, 100, 100) is None
    s = strategy(LGFedAvg, [timed(10, 0, DEV), timed(11, 1, DEV)])
    s.global_arrays = s.init_global()
    replies = [reply(n, head(1.0), 100, **{"virtual-compute-s": 99.0}) for n in (10, 11)]
    s.aggregate_train(1, replies)
    assert s.deadline_dropped == [] and len(s.client_virtual_s) == 2
    # in deployment the deadline is the real timeout, not a virtual drop
    s = strategy(LGFedAvg, [timed(10, 0, DEV), timed(11, 1, DEV)], **{"round-deadline-s": 1.0})
    s.global_arrays, s.virtual_deadline = s.init_global(), False
    s.aggregate_train(1, replies)
    assert s.deadline_dropped == []


# --------------------------------------------------------------------------- in process
def test_a_fleet_run_records_virtual_time_and_drops_stragglers(tmp_path: Path) -> None:
    """rpi4 nodes train cnn-5 about 10× slower (virtually) than server nodes train
    cnn-1: a deadline between the two drops exactly the rpi4 nodes."""
    base = {"fleet": "rpi4:1,server:1", "algorithm": "lgfedavg"}
    res, _ = run_inprocess(tmp_path / "a", num_nodes=4, **base)
    rows = res["rounds"]
    for row in rows:
        times = row["client-virtual-time-s"]
        assert sorted(times) == ["0", "1", "2", "3"]
        assert row["virtual-time-s"] == pytest.approx(max(times.values()) + row["server-time-s"])
        assert row["deadline-dropped"] == 0
        slow, fast = max(times["0"], times["2"]), max(times["1"], times["3"])
        assert min(times["0"], times["2"]) > 3 * fast, times
    assert res["summary"]["virtual-time-total-s"] == pytest.approx(
        sum(r["virtual-time-s"] for r in rows)
    )
    fast = max(max(r["client-virtual-time-s"][p] for p in ("1", "3")) for r in rows)
    slow = min(min(r["client-virtual-time-s"][p] for p in ("0", "2")) for r in rows)
    deadline = (fast * slow) ** 0.5  # between the two classes, with margin both ways
    res, _ = run_inprocess(tmp_path / "b", num_nodes=4, **base, **{"round-deadline-s": deadline})
    for row in res["rounds"]:
        assert row["deadline-dropped"] == 2 and row["valid-replies"] == 2
        assert row["virtual-time-s"] == pytest.approx(deadline + row["server-time-s"])
    reasons = [r["reason"] for r in res["summary"]["rejected-replies"]]
    assert len(reasons) == 4 and all("straggler" in r for r in reasons)


def test_without_a_fleet_rows_carry_no_virtual_time(tmp_path: Path) -> None:
    res, _ = run_inprocess(tmp_path, num_nodes=2, algorithm="local", **{"num-server-rounds": 1})
    row = res["rounds"][0]
    assert row["virtual-time-s"] is None and row["client-virtual-time-s"] == {}
    assert res["summary"]["virtual-time-total-s"] is None


# --------------------------------------------------------------------------- FedARA tiers
LINK = replace(DEV, uplink_mbps=80.0, downlink_mbps=160.0)
OVERHEAD = LINK.transfer_seconds(0, 0)
"""What a message costs LINK beyond its compute and bytes (task, protocol)."""


def fedara_deadline(deadline: float, **extras: float):  # type: ignore[no-untyped-def]
    from strategies.fedara import FedARA

    flops = {"flops@1": 4e7, "flops@0.5": 2e7, "flops@0.25": 1e7, "flops@0.125": 5e6}
    nodes = [
        timed(100, 0, LINK, num_train=100, **{"rank-ratio": 1.0, "layers": "fc1,fc2"}, **flops),
        timed(
            101,
            1,
            replace(LINK, speed=1000.0, uplink_mbps=1e4, downlink_mbps=1e4, latency_ms=0),
            num_train=100,
            **{"rank-ratio": 0.125, "layers": "fc1,fc2"},
            **flops,
        ),
    ]
    s = strategy(
        FedARA,
        nodes,
        **{
            "round-deadline-s": deadline,
            "fedara.rank-policy": "deadline",
            "fedara.rank-tiers": "1,0.5,0.25,0.125",
        },
    )
    s.global_arrays = s.init_global()
    return s, nodes


def test_fedara_deadline_policy_serves_the_largest_tier_that_fits() -> None:
    s, (slow, fast) = fedara_deadline(1.0 + OVERHEAD)
    # slow: compute = flops × 100 samples / 10 GFLOP/s; transfers of each tier's
    # extractor at 160 down / 80 up Mbit/s, + the message's task and protocol
    want = {}
    for r in (1.0, 0.5, 0.25, 0.125):
        nbytes = s.tier_bytes(r, ("fc1", "fc2"))
        flops = float(slow.extras[f"flops@{r:g}"])
        want[r] = flops * 100 / 1e10 + LINK.transfer_seconds(nbytes, nbytes)
    fitting = [r for r in (1.0, 0.5, 0.25, 0.125) if want[r] <= 1.0 + OVERHEAD]
    assert fitting, want  # the test's numbers must leave a choice to make
    assert s.deadline_ratio(slow) == max(fitting)
    assert max(fitting) < 1.0 and s.deadline_ratio(fast) == 1.0  # the fast one gets it all
    s.plan_round(1, [slow, fast])
    assert s.tier(slow)[0] == max(fitting) and s.message_config(slow) == {
        "rank-ratio": max(fitting)
    }
    assert s.round_facts() == {"client-rank-ratio": {}}  # nobody trained yet
    # a tier's bytes: the factorised layers r (rows + cols), the rest whole
    full = sum(v.size for v in s.global_arrays.values()) * 4
    assert s.tier_bytes(1.0, ("fc1", "fc2")) == full
    assert s.tier_bytes(0.5, ("fc1", "fc2")) == pytest.approx(
        sum(v.nbytes for v in s.served((0.5, ("fc1", "fc2"))).values())
    )


def test_fedara_deadline_policy_follows_what_a_node_measured() -> None:
    s, (slow, fast) = fedara_deadline(1.0 + OVERHEAD)
    s.plan_round(1, [slow, fast])
    first = s.tier(slow)[0]
    # the node reports it needed 10× the predicted compute: next round, a smaller tier
    predicted = float(slow.extras[f"flops@{first:g}"]) * 100 / 1e10
    s.client_compute_s = {slow.node_id: 10 * predicted}
    s.plan_round(2, [slow, fast])
    assert s.tier(slow)[0] < first


def test_a_node_follows_the_served_rank_and_keeps_its_head(tmp_path: Path) -> None:
    from client_app.base import open_run
    from common import methods
    from server_app.inprocess import client_context

    hook = methods.get("fedara").client_hook()
    ctx = client_context(tmp_path, "fedara", pid=0, num=5)
    run = open_run(ctx, 1, hook, served={"rank-ratio": 0.5})
    assert run.notes["tier"][0] == 0.5
    for v in run.model.head.parameters():
        v.data.add_(1.0)
    head = {k: v.clone() for k, v in run.model.state_dict().items() if k.startswith("head.")}
    run.save()
    again = open_run(ctx, 2, hook, served={"rank-ratio": 0.25})  # another rank next round
    assert again.notes["tier"][0] == 0.25
    for k, v in head.items():
        assert torch.equal(again.model.state_dict()[k], v), k  # the personal head stays


# --------------------------------------------------------------------------- report, cli
def test_report_and_plots_show_virtual_time(tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from cli.main import app
    from common.report import Run

    res, _ = run_inprocess(tmp_path, num_nodes=2, algorithm="lgfedavg", fleet="rpi4:1,server:1")
    path = tmp_path / "results.json"
    path.write_text(json.dumps(res))
    run = Run.load(path)
    xs, ys = run.virtual_curve()
    clock = [r["virtual-time-s"] for r in res["rounds"]]
    assert xs == pytest.approx([clock[0], clock[0] + clock[1]])
    assert ys == [r["accuracy"] for r in res["rounds"]]
    out = CliRunner().invoke(app, ["report", str(path), "--plot", str(tmp_path / "a.png")])
    assert out.exit_code == 0, out.output
    assert "virtual time (s)" in out.output
    assert f"{res['summary']['virtual-time-total-s']:.1f}" in out.output
    assert (tmp_path / "a-virtual.png").stat().st_size > 0


def test_profile_measure_prints_a_node_config_speed() -> None:
    from typer.testing import CliRunner

    from cli.main import app

    out = CliRunner().invoke(app, ["profile", "--measure", "--seconds", "0.05", "--repeats", "1"])
    assert out.exit_code == 0, out.output
    assert "| rpi4 | 3.12 | 10 | 50 | 50 |" in out.output
    speed = float(out.output.rsplit("speed=", 1)[1])
    assert speed > 0


def test_host_speed_is_measured_once_per_machine_and_can_be_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from models import workload

    monkeypatch.setenv("FEDHET_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FEDHET_HOST_SPEED", raising=False)
    calls: list[int] = []

    def fake(seconds: float = 1.0, threads: int = 1) -> float:
        calls.append(threads)
        return 12.5

    monkeypatch.setattr(workload, "measure_speed", fake)
    workload.host_speed.cache_clear()
    assert workload.host_speed(1) == 12.5
    workload.host_speed.cache_clear()  # a new process: reads the machine's cache
    assert workload.host_speed(1) == 12.5 and calls == [1]
    assert (tmp_path / "host-speed.json").exists()
    monkeypatch.setenv("FEDHET_HOST_SPEED", "3.5")
    workload.host_speed.cache_clear()
    assert workload.host_speed(1) == 3.5
    workload.host_speed.cache_clear()


def test_in_deployment_the_deadline_is_the_phase_timeout() -> None:
    from server_app.app import phase_timeout

    cfg = parse_run_config({"round-deadline-s": 30.0, "round-timeout": 600.0})
    assert phase_timeout(cfg, simulation=False) == 30.0
    assert phase_timeout(cfg, simulation=True) == 600.0  # virtual there
    assert phase_timeout(parse_run_config({}), simulation=False) == 3600.0
