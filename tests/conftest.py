"""Shared fixtures: Flower task identity for building Messages, quiet Flower env."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")  # no ~/.cache/Microsoft files
if "FEDHET_CACHE_DIR" not in os.environ:
    # the virtual clock's host speed: measured once per test session, not in $HOME
    import tempfile

    os.environ["FEDHET_CACHE_DIR"] = tempfile.mkdtemp(prefix="fedhet-cache-")


@pytest.fixture(autouse=True, scope="session")
def _task_identity() -> None:
    """Messages built outside a running app need a task identity (private API)."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.task_id = 1
    TaskIdentity.run_id = 1
    TaskIdentity.node_id = 0


RAY_MODULES = {"test_e2e_simulation", "test_ray_cluster", "test_preflight", "test_cleanup"}
"""Modules that start Ray (a `flwr run` simulation or a Ray cluster): under `pytest -n`
(`test.sh --all`) one worker runs them one after another, so that no simulation meets
another's Ray instance."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.module is not None and item.module.__name__.rsplit(".", 1)[-1] in RAY_MODULES:
            item.add_marker(pytest.mark.xdist_group("ray"))
