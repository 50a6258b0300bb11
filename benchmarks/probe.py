"""Helpers for benchmark child processes (one fresh process per measurement)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"


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


def save_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """``{"rows": rows}`` as JSON at ``path`` (its folder made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rows": rows}, indent=1))


def archive_rows(name: str, rows: list[dict[str, Any]], table: str) -> Path:
    """``docs/results/<name>.json`` (the rows) and ``<name>.md`` (their table)."""
    save_rows(RESULTS / f"{name}.json", rows)
    (RESULTS / f"{name}.md").write_text(table)
    return RESULTS
