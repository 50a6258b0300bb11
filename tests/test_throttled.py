"""The virtual clock against a real slow node (``benchmarks/throttled.py``, reduced):
a loopback federation whose node 1 (SuperNode, executor, ClientApp tasks) runs in a
cgroup v1 ``cpu`` group limited to a share of one core. Its predicted training time
(``virtual-compute-s``, device speed = host speed × q) against the wall time its reply
reports (``train-time-s``); and the round the clock predicts (the slowest node's
message: training, the evaluation it carried, the task, the protocol, the bytes; plus
the server step) against the round the server measured, for a node at 0.3 of a core
and a node at half a core behind a 100 ms / 10 Mbit/s link."""

from __future__ import annotations

import pytest

from benchmarks.cgroups import own_groups
from benchmarks.throttled import CHECK_ROWS, Row, cgroup_unavailable, measure, table

pytestmark = [pytest.mark.e2e, pytest.mark.serial]  # timings: run alone (test.sh --all)

QUOTA = 0.25
"""A quarter of a core: the node's group also gets raised ``cpu.shares``, so it keeps
its quarter while other work shares the machine (2 cores here, shared)."""
BOUND = 0.5
"""±50 %: one round is compared (round 2; round 1 builds the partition cache) on a
shared machine; the full benchmark (medians of 4 rounds) lands within -5 % at q = 0.25,
0.5 and 1 (docs/results/throttled.json), and -8 % at q = 0.25 without raised shares
under a load average of 6 on 2 cores."""


def test_throttled_node_matches_virtual_clock() -> None:
    reason = cgroup_unavailable()
    if reason is not None:
        pytest.skip(reason)
    result = measure([QUOTA], rounds=2, fraction=0.05)
    print()
    print(table(result))
    (run,) = result["quotas"]
    m = run["median"]
    print(
        f"q={QUOTA}: predicted {m['virtual-compute-s']:.2f} s, measured {m['train-time-s']:.2f} s "
        f"(ratio {run['ratio-predicted-over-train-time']:.2f}; train-cpu-s / q "
        f"{m['cpu-over-quota-s']:.2f} s, host speed task / here {m['host-speed-ratio']:.2f})"
    )
    # the limit applied: the node was throttled and its training tasks ran in the group
    assert run["cpu-stat"]["nr_throttled"] > 0
    assert run["training-tasks-found"] == 2
    assert m["task-wall-s"] > m["train-time-s"]
    # the node really was slow: its training took about 1/q of its CPU time
    assert m["train-time-s"] > 2 * m["train-cpu-s"]
    ratio = run["ratio-predicted-over-train-time"]
    assert 1 - BOUND <= ratio <= 1 + BOUND, ratio
    # nothing left behind
    assert not own_groups()


ROUND_BOUND = 0.3
"""±30 % for the round checks below: 2 rounds of one federation here, on a shared
machine (a timing, so the benchmark holds the goal: ±15 %, medians over more rounds,
``python -m benchmarks.throttled --check``: docs/results/throttled-check.json). The
clock that charged one latency per round (training and arrays only) predicted 0.56 of
the round at q = 0.3."""


@pytest.mark.parametrize("row", CHECK_ROWS, ids=["quota-0.3", "link-100ms-10mbit"])
def test_the_clock_predicts_a_slow_nodes_round(row: Row) -> None:
    """A node at 0.3 of a core, and a node at half a core behind a 100 ms / 10 Mbit/s
    link, both evaluating inside their training messages: the round the clock
    predicts (the slowest node's message + the server step) against the round the
    server measured."""
    reason = cgroup_unavailable()
    if reason is not None:
        pytest.skip(reason)
    result = measure([row], rounds=3, fraction=0.05)
    print()
    print(table(result))
    (run,) = result["quotas"]
    assert run["training-tasks-found"] == 3
    assert run["median"]["eval-cpu-s"] > 0  # its messages carried an evaluation
    ratio = run["ratio-predicted-round-over-round-time"]
    assert 1 - ROUND_BOUND <= ratio <= 1 + ROUND_BOUND, ratio
    assert not own_groups()
