"""Helpers for benchmark child processes (one fresh process per measurement)."""

from __future__ import annotations


def peak_mb() -> float:
    """This process's peak RSS in MB (``VmHWM``; ``ru_maxrss`` would carry the
    parent's peak over ``exec``)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("/proc/self/status has no VmHWM")


def task_identity() -> None:
    """Messages built outside a running Flower app need a task identity."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
