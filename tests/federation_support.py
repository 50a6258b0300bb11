"""Helpers of the tests that run a real federation on loopback (test_deployment,
test_stop): run overrides, a changeable copy of the app, task children of a node."""

from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path

from cli.federation import Federation
from cli.launch import descendants

ROOT = Path(__file__).resolve().parent.parent


def run_overrides(fed: Federation, name: str, algorithm: str, **extra) -> dict:  # type: ignore[no-untyped-def]
    """A small run (2 rounds, 5 % of the data) writing to ``<workdir>/<name>``."""
    return {
        "algorithm": algorithm,
        "num-server-rounds": 2,
        "data.fraction": 0.05,
        "data.cache-dir": str(fed.workdir / "cache"),
        "round-timeout": 300.0,
        "out-dir": str(fed.workdir / name),
        **extra,
    }


def app_copy(tmp_path: Path) -> Path:
    """A copy of this app that a test may change (its own FAB)."""
    app = tmp_path / "app"
    shutil.copytree(
        ROOT,
        app,
        ignore=shutil.ignore_patterns(".venv*", ".git", ".flwr", "benchmarks", "docs", "tests"),
    )
    return app


def task_children(fed: Federation, node: int) -> list[int]:
    """Task processes of node ``node``: children of its warm executor's fork server
    (processes may end while they are listed)."""
    servers = []
    for pid in descendants(fed.procs.procs[f"superexec-{node}"].pid):
        with contextlib.suppress(OSError):
            if b"forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes():
                servers.append(pid)
    return [c for s in servers for c in descendants(s)]


TRAINING_MARKER_MOD = """

def _training_marker(msg, context, call_next):
    # test build: a file names each task child while it trains (before its reply exists)
    import os
    from pathlib import Path
    if not msg.metadata.message_type.startswith("train"):
        return call_next(msg, context)
    marker = Path({folder!r}) / str(os.getpid())
    marker.touch()
    try:
        return call_next(msg, context)
    finally:
        marker.unlink()


app = make_app(mods=[_training_marker])
"""


def marked_app(tmp_path: Path) -> tuple[Path, Path]:
    """A test build of the app whose task children mark themselves while they train:
    (app folder, marker folder)."""
    app = app_copy(tmp_path)
    training = tmp_path / "training"
    training.mkdir()
    source = app / "client_app" / "app.py"
    assert "\napp = make_app()\n" in source.read_text()
    source.write_text(
        source.read_text().replace(
            "\napp = make_app()\n",
            TRAINING_MARKER_MOD.format(folder=str(training)),
        )
    )
    return app, training


COUNTING_MOD = """

def _count_messages(msg, context, call_next):
    # test build: one line per message a node's ClientApp receives
    from pathlib import Path
    config = msg.content.config_records.get("config", {{}})
    line = "%s %s %s\\n" % (
        context.node_config["partition-id"],
        msg.metadata.message_type,
        config.get("server-round", 0),
    )
    with open(Path({folder!r}) / "messages.log", "a") as out:
        out.write(line)
    return call_next(msg, context)


app = make_app(mods=[_count_messages])
"""


def counted_app(tmp_path: Path) -> tuple[Path, Path]:
    """A test build of the app whose ClientApp writes one line per message it
    receives (partition, message type, round) to ``<folder>/messages.log``:
    (app folder, that log)."""
    app = app_copy(tmp_path)
    folder = tmp_path / "counted"
    folder.mkdir()
    source = app / "client_app" / "app.py"
    assert "\napp = make_app()\n" in source.read_text()
    source.write_text(
        source.read_text().replace("\napp = make_app()\n", COUNTING_MOD.format(folder=str(folder)))
    )
    return app, folder / "messages.log"


def training_child(fed: Federation, node: int, training: Path, timeout: float = 120) -> int | None:
    """Wait for a task child of ``node`` that is inside its training handler."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in task_children(fed, node):
            if (training / str(pid)).exists():
                return pid
        time.sleep(0.02)
    return None
