"""Personal state on disk, so a restarted SuperNode resumes with its own model.

With node-config ``state-dir``, every training round writes the personal model to
``<state-dir>/<algorithm>-<arch>-<fingerprint>.pt`` (atomically). When a node's
in-memory ``context.state`` is empty (a restart, or a new run with the same setup)
the file is loaded instead of building a fresh model. The fingerprint covers every
setting that changes the model's structure or meaning (algorithm, model.*, data.*,
seed, the algorithm's own section, the architecture): change one and the node
starts fresh instead of loading an incompatible model.
"""

from __future__ import annotations

import hashlib
import json
import os
from logging import WARNING
from pathlib import Path

import torch
from flwr.common.logger import log
from torch import Tensor

from common.config import RunConfig, flatten

_KEYS = ("algorithm", "seed", "model.", "data.")


def fingerprint(cfg: RunConfig, arch: str) -> str:
    flat = flatten(cfg)
    keep = {
        k: v for k, v in flat.items() if k.startswith(_KEYS) or k.startswith(cfg.algorithm + ".")
    }
    keep["arch"] = arch
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:12]


def state_path(state_dir: str, cfg: RunConfig, arch: str) -> Path:
    return Path(state_dir).expanduser() / f"{cfg.algorithm}-{arch}-{fingerprint(cfg, arch)}.pt"


def save(path: Path, model_state: dict[str, Tensor], rounds_trained: int) -> None:
    """Write atomically (a kill mid-write leaves the previous file intact)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(
        {
            "model": {k: v.detach().cpu() for k, v in model_state.items()},
            "rounds-trained": rounds_trained,
        },
        tmp,
    )
    os.replace(tmp, path)


def load(path: Path) -> tuple[dict[str, Tensor], int] | None:
    """The saved model state and its round count, or None (absent or unreadable)."""
    if not path.exists():
        return None
    try:
        doc = torch.load(path, map_location="cpu", weights_only=True)
        return doc["model"], int(doc["rounds-trained"])
    except Exception as exc:  # noqa: BLE001 - a corrupt file must not kill the node
        log(WARNING, "ignoring unreadable personal state %s: %s", path, exc)
        return None
