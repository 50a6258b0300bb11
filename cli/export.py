"""``fedhet export``: every client's personal model, as it predicts, as an ONNX file.

SOURCE is a simulation's out-dir (``clients/node-<partition>/``) or one node's
``state-dir``. For each client the newest evaluated model (kept at every evaluation,
:mod:`client_app.export`) is rebuilt and written as ``client-<partition>.onnx`` with
``client-<partition>.json`` beside it (the model card: classes, input shape,
normalisation, algorithm, round, run, and its accuracy on the client's own test split:
from the out-dir's results.json for that round, else the node's own evaluation).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from client_app import state as personal_state
from client_app.export import model_card, predictor, replay, write_model
from common.errors import ConfigError

CLIENTS = "clients"
"""A simulation's folder of per-node state directories (``node-<partition>``)."""


def evaluated_files(source: Path, client: int | None = None) -> dict[int, Path]:
    """Partition id -> the newest evaluated model of that client under ``source``."""
    source = source.expanduser()
    if (source / CLIENTS).is_dir():
        dirs = {
            int(d.name.removeprefix("node-")): d
            for d in (source / CLIENTS).iterdir()
            if d.is_dir() and d.name.removeprefix("node-").isdigit()
        }
    elif (source / personal_state.EVALUATED).is_dir():
        dirs = {-1: source}  # one node; its partition is in the file
    elif not source.is_dir():
        raise ConfigError(f"{source} is not a folder")
    else:
        raise ConfigError(
            f"{source} is neither a run's out-dir (with {CLIENTS}/) nor a node's state-dir "
            f"(with {personal_state.EVALUATED}/): nothing was evaluated there"
        )
    found: dict[int, Path] = {}
    for pid, folder in sorted(dirs.items()):
        path = personal_state.newest_evaluated(folder)
        if path is None:
            continue
        if pid < 0:
            pid = int(_peek(path)["partition-id"])
        found[pid] = path
    if client is not None:
        if client not in found:
            raise ConfigError(
                f"no evaluated model of client {client} in {source} "
                f"(clients there: {', '.join(map(str, sorted(found))) or 'none'})"
            )
        return {client: found[client]}
    if not found:
        raise ConfigError(f"no evaluated model in {source}: did the run evaluate?")
    return found


def _peek(path: Path) -> dict[str, Any]:
    import torch

    try:
        return dict(torch.load(path, map_location="cpu", weights_only=True))
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets one line
        raise ConfigError(f"cannot read the evaluated model {path}: {exc}") from None


def recorded_accuracy(results: dict[str, Any] | None, server_round: int, pid: int) -> float | None:
    """The client's accuracy in round ``server_round`` as results.json recorded it."""
    for row in (results or {}).get("rounds", []):
        if row.get("round") == server_round:
            value = (row.get("client-accuracy") or {}).get(str(pid))
            return None if value is None else float(value)
    return None


def _results(source: Path) -> dict[str, Any] | None:
    path = source.expanduser() / "results.json"
    if not path.is_file():
        return None
    try:
        doc: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    return doc


def export_run(
    source: Path,
    out: Path,
    client: int | None = None,
    echo: Callable[[str], None] = print,
) -> list[Path]:
    """Write ``<out>/client-<partition>.onnx`` (+ ``.json``) for each client of
    ``source`` (or only ``client``); the ONNX paths."""
    results = _results(source)
    written = []
    for pid, path in evaluated_files(source, client).items():
        hook, run, doc = replay(path)
        recorded = recorded_accuracy(results, int(doc["round"]), pid)
        own = float(doc["accuracy"])
        if recorded is not None and not math.isclose(recorded, own, abs_tol=1e-12):
            echo(
                f"warning: client {pid}, round {doc['round']}: results.json records accuracy "
                f"{recorded:.6f}, the node measured {own:.6f}"
            )
        module = predictor(hook, run)
        accuracy, where = (recorded, "results.json") if recorded is not None else (own, "node")
        card = model_card(run, doc, module, accuracy=accuracy, source=where)
        target = write_model(module, card, out.expanduser() / f"client-{pid}.onnx")
        echo(
            f"client {pid}: {target} ({doc['algorithm']}, {doc['arch']}, round {doc['round']}, "
            f"accuracy {accuracy:.4f} from {where})"
        )
        written.append(target)
    return written
