"""The personal model as the client predicts with it: kept at evaluation, exported to ONNX.

How a client predicts is what its hook's ``evaluate`` measures: the personal model
with what the server sent for the evaluation installed (lgfedavg, fedgh, fedre: the
global head; fedara: the served extractor at the client's rank with its own head;
fedlora: the global adapter beside its own model; fedavg: the global model; fml,
fedkd: the own model, whose forward never runs the meme or mentee; fedmrl: the own
extractor and the served shared model fused by the client's projector, read by its own
head) and, for
``fedproto`` with ``fedproto.infer = proto``, the nearest global prototype
(:func:`predictor`). ``fedtgp`` and ``fedproto`` with ``infer = head`` predict with the
client's own head.

Kept: at every evaluation a node with a state directory writes that model with
:func:`keep_evaluated` to ``<state-dir>/evaluated/`` (:func:`client_app.state.save_evaluated`):
its state dict after installation, the arrays the server sent, and what rebuilds its
structure (the run config, the node's options with its architecture and rank pinned).
``fedhet export`` rebuilds the client from that file (:func:`replay`) and exports it;
with node-config ``onnx-export = true`` the node itself writes
``<state-dir>/model.onnx`` and ``model.json`` after every evaluation
(:func:`write_model`).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from importlib import metadata
from logging import ERROR, WARNING
from pathlib import Path
from typing import Any

import torch
from flwr.app import Context, RecordDict
from flwr.common.logger import log
from torch import nn

from client_app import state as personal_state
from client_app.base import ClientHook, ClientRun, NodeSpec, open_run
from client_app.prototypes import FedProtoHook, received_prototypes
from common import methods
from common.config import ConfigError, DataConfig, RunConfig, Scalar, flatten
from data.client import ClientData
from models.export import INPUT, OUTPUT, NearestPrototype, to_onnx
from models.matryoshka import MatryoshkaNet, MatryoshkaPredictor

ONNX_EXPORT = "onnx-export"
"""Node-config key: write ``<state-dir>/model.onnx`` (+ ``model.json``) after every
evaluation (default false)."""
MODEL_FILE = "model.onnx"
"""The node's current model in its state directory (with ``onnx-export``)."""
FORMAT = "fedhet-model/1"
"""``format`` of a model card (the JSON beside an exported model)."""
METADATA_KEY = "fedhet"
"""Key of the model card in the ONNX file's ``metadata_props``."""
MACHINE_KEYS = ("state-dir", "profile", ONNX_EXPORT)
"""Node options that describe the machine rather than the model: dropped from what
rebuilds it (``profile`` pinned instead as ``model`` and ``rank-ratio``)."""

CLASS_NAMES: dict[str, tuple[str, ...]] = {
    "fashion-mnist": (
        "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
        "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
    ),
    "cifar10": (
        "airplane", "automobile", "bird", "cat", "deer",
        "dog", "frog", "horse", "ship", "truck",
    ),
}  # fmt: skip
"""Class names of the datasets that have them (others: the class indices)."""


def predictor(hook: ClientHook, run: ClientRun) -> nn.Module:
    """The module whose argmax is the client's prediction, as ``hook.evaluate`` decides
    it (after ``hook.install`` of what the server sent): ``run.model``, or for FedProto's
    ``infer = proto`` with global prototypes, :class:`~models.export.NearestPrototype`
    with them."""
    if isinstance(hook, FedProtoHook) and hook.infer(run) != "head":
        table, known = received_prototypes(run)
        if bool(known.any()):
            return NearestPrototype(run.model, table, known)
    head = run.cfg.fedmrl.predict_head
    if isinstance(run.model, MatryoshkaNet) and head != "own":
        return MatryoshkaPredictor(run.model, head)
    return run.model


def wants_onnx(options: Mapping[str, Scalar]) -> bool:
    """Node-config ``onnx-export``: true / false (a bool, or the strings)."""
    value = options.get(ONNX_EXPORT, False)
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1"):
        return True
    if text in ("false", "0", ""):
        return False
    raise ConfigError(f"node-config {ONNX_EXPORT}={value!r} must be true or false")


def rebuild_options(node: NodeSpec) -> dict[str, Scalar]:
    """The node options that rebuild this client's model on any machine: the machine's
    own (state dir, profile) dropped, its architecture and rank ratio pinned."""
    options = {k: v for k, v in node.options.items() if k not in MACHINE_KEYS}
    options["model"] = node.arch
    if node.profile is not None and "rank-ratio" not in options:
        options["rank-ratio"] = node.profile.rank_ratio
    return options


def evaluated_doc(run: ClientRun, run_id: int, accuracy: float) -> dict[str, Any]:
    """What :func:`replay` needs: the evaluated model, what the server sent beyond it
    (FedProto's global prototypes; arrays installed into the model are in its state
    already), and how to rebuild it."""
    state = run.model.state_dict()
    return {
        "model": {k: v.detach().cpu().clone() for k, v in state.items()},
        "received": {
            k: v.detach().cpu().clone() for k, v in run.received.items() if k not in state
        },
        "round": run.server_round,
        "lineage": run.lineage,
        "run-id": int(run_id),
        "algorithm": run.cfg.algorithm,
        "arch": run.node.arch,
        "partition-id": run.node.partition_id,
        "run-config": flatten(run.cfg),
        "node-config": rebuild_options(run.node),
        "accuracy": float(accuracy),
        "num-test": len(run.data.y_test),
    }


def keep_evaluated(hook: ClientHook, run: ClientRun, run_id: int, accuracy: float) -> None:
    """After an evaluation (the server's arrays installed): keep the evaluated model
    beside the personal state and, with node-config ``onnx-export``, write it as
    ``<state-dir>/model.onnx``. Without a state directory nothing is kept. A failed
    ONNX export is logged and the round goes on."""
    export = wants_onnx(run.node.options)
    if run.state_path is None:
        if export:
            log(WARNING, "node-config %s needs a state-dir: no model written", ONNX_EXPORT)
        return
    doc = evaluated_doc(run, run_id, accuracy)
    personal_state.save_evaluated(run.state_path, doc, run.server_round, run.lineage)
    if not export:
        return
    path = run.state_path.parent / MODEL_FILE
    try:
        module = predictor(hook, run)
        write_model(module, model_card(run, doc, module, accuracy=accuracy, source="node"), path)
    except (ImportError, OSError, RuntimeError, ConfigError) as exc:
        log(ERROR, "node-config %s: could not write %s: %s", ONNX_EXPORT, path, exc)


def replay(path: Path) -> tuple[ClientHook, ClientRun, dict[str, Any]]:
    """The client as it evaluated, from a file :func:`keep_evaluated` wrote: its hook,
    its run (on the CPU, the evaluated state loaded, ``received``: what the server sent
    that the state does not hold) and the file's contents. Loads the client's data
    (its shape and test split)."""
    try:
        doc = torch.load(path, map_location="cpu", weights_only=True)
        flat = {**doc["run-config"], "train.device": "cpu"}
        node_config = dict(doc["node-config"])
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets one line
        raise ConfigError(f"cannot read the evaluated model {path}: {exc}") from None
    context = Context(
        run_id=int(doc["run-id"]),
        node_id=0,
        node_config=node_config,
        state=RecordDict(),
        run_config=flat,
    )
    hook = methods.get(str(doc["algorithm"])).client_hook()
    run = open_run(context, int(doc["round"]), hook, training=False, lineage=str(doc["lineage"]))
    run.model.load_state_dict(doc["model"])
    run.received = dict(doc["received"])
    return hook, run, doc


@functools.lru_cache(maxsize=8)
def _local_stats(name: str, root: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    from data import load_arrays

    ds = load_arrays(DataConfig.model_validate({"name": name, "root": root}))
    return ds.mean, ds.std


def normalisation(cfg: RunConfig, node: NodeSpec) -> tuple[list[float], list[float]]:
    """Per-channel ``(mean, std)`` the client's images were normalised with (on the
    [0, 1] scale): its partition folder's, or its own data's (node-config
    ``data-name`` + ``data-root``)."""
    name = node.options.get("data-name")
    if name:
        mean, std = _local_stats(str(name), str(node.options.get("data-root", "")))
    else:
        from data.client import _folder_info
        from data.store import prepare_partition

        folder = prepare_partition(cfg.data, node.num_partitions, cfg.seed, node.cache_only)
        _, (mean, std) = _folder_info(str(folder.resolve()))
    return [float(m) for m in mean], [float(s) for s in std]


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "unknown"


def _input_entry(data: ClientData) -> dict[str, Any]:
    """The card's ``input``: images ``NCHW`` (with ``resized-from`` when they were
    resized in training), or feature vectors ``NF``."""
    if data.tabular:
        return {
            "name": INPUT,
            "shape": ["batch", data.in_channels],
            "dtype": "float32",
            "layout": "NF",
        }
    return {
        "name": INPUT,
        "shape": ["batch", data.in_channels, data.image_size, data.image_size],
        "dtype": "float32",
        "layout": "NCHW",
        **(
            {"resized-from": [data.resized_from, data.resized_from], "resize": "bilinear"}
            if data.resized_from
            else {}
        ),
    }


def model_card(
    run: ClientRun,
    doc: Mapping[str, Any],
    module: nn.Module,
    *,
    accuracy: float | None,
    source: str,
) -> dict[str, Any]:
    """The JSON that travels with ``module`` (:func:`predictor`) exported: what it takes
    and returns, where it comes from, and its accuracy on the client's own test split
    (``source``: ``results.json``, or ``node``: the node's own evaluation)."""
    data = run.data
    dataset = str(run.node.options.get("data-name") or run.cfg.data.name)
    names = CLASS_NAMES.get(dataset)
    if names is None or len(names) != data.num_classes:
        names = tuple(str(c) for c in range(data.num_classes))
    if data.mean:
        mean, std = [float(m) for m in data.mean], [float(v) for v in data.std]
    else:
        mean, std = normalisation(run.cfg, run.node)
    decision = "nearest-prototype" if isinstance(module, NearestPrototype) else "head"
    return {
        "format": FORMAT,
        "algorithm": doc["algorithm"],
        "arch": doc["arch"],
        "partition-id": doc["partition-id"],
        "round": doc["round"],
        "run-id": doc["run-id"],
        "lineage": doc["lineage"],
        "dataset": dataset,
        "num-classes": data.num_classes,
        "classes": list(names),
        "input": _input_entry(data),
        "normalisation": {
            "rule": "x[f] = (value[f] - mean[f]) / std[f]"
            if data.tabular
            else "x[c] = (pixel[c] / 255 - mean[c]) / std[c]",
            "mean": mean,
            "std": std,
        },
        "output": {
            "name": OUTPUT,
            "shape": ["batch", data.num_classes],
            "decision": decision,
            "meaning": "argmax = the predicted class; "
            + (
                "scores are minus the distance to each class's global prototype "
                "(-inf: no prototype)"
                if decision == "nearest-prototype"
                else "scores are logits"
            ),
        },
        "accuracy": accuracy,
        "accuracy-source": source if accuracy is not None else None,
        "num-test": doc["num-test"],
        "versions": {p: _version(p) for p in ("fedhet", "torch")},
    }


def write_model(module: nn.Module, card: Mapping[str, Any], path: Path) -> Path:
    """``module`` as the ONNX file ``path`` (the card in its metadata) and the card as
    ``path`` with ``.json``, each written atomically (the model first)."""
    shape = card["input"]["shape"][1:]
    module = module.cpu()
    text = json.dumps(card, indent=1)
    to_onnx(module, tuple(int(v) for v in shape), path, {METADATA_KEY: text})
    side = path.with_suffix(".json")
    tmp = side.with_name(f"{side.name}.tmp{os.getpid()}")
    tmp.write_text(text + "\n")
    os.replace(tmp, side)
    return path


__all__ = [
    "MODEL_FILE",
    "ONNX_EXPORT",
    "keep_evaluated",
    "model_card",
    "predictor",
    "replay",
    "write_model",
]
