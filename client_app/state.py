"""Personal state on disk: a restarted SuperNode, or a resumed run, continues with
each node's own model, and a simulation of thousands of nodes holds none of their
models in memory.

With a state directory (node-config ``state-dir`` in deployment; in a simulation
``<out-dir>/clients/node-<partition>``, sent by the server), every training round
writes the personal model to ``<dir>/<algorithm>-<arch>-<fingerprint>.r<round>.pt``
(atomically; the two newest rounds are kept) and nothing but a round counter stays
in ``context.state``. A message of round ``t`` loads the newest file of an earlier
round (training) or of round ``t`` at most (evaluation), so a round that is run
again after a crash starts from exactly what the round before it left. The
fingerprint covers every setting that changes the model's structure or meaning
(algorithm, model.*, data.*, seed, the algorithm's own section, the architecture):
change one and the node starts fresh instead of loading an incompatible model.
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


KEEP = 2
"""Rounds of personal state kept per node (the newest, and the one before it)."""


def state_path(state_dir: str, cfg: RunConfig, arch: str) -> Path:
    """The stem ``<dir>/<algorithm>-<arch>-<fingerprint>``; files add ``.r<round>.pt``."""
    return Path(state_dir).expanduser() / f"{cfg.algorithm}-{arch}-{fingerprint(cfg, arch)}"


def versions(stem: Path) -> dict[int, Path]:
    """Server round -> file of every saved version of ``stem``."""
    out = {}
    for path in stem.parent.glob(f"{stem.name}.r*.pt"):
        tail = path.name[len(stem.name) + 2 : -3]
        if tail.isdigit():
            out[int(tail)] = path
    return out


def save(
    stem: Path, model_state: dict[str, Tensor], rounds_trained: int, server_round: int
) -> None:
    """Write round ``server_round``'s version atomically (write, fsync, rename: a kill
    mid-write leaves the earlier versions intact); drop all but the newest ``KEEP``."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    path = stem.parent / f"{stem.name}.r{server_round:06d}.pt"
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "wb") as fh:
        torch.save(
            {
                "model": {k: v.detach().cpu() for k, v in model_state.items()},
                "rounds-trained": rounds_trained,
            },
            fh,
        )
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    for old in sorted(versions(stem))[:-KEEP]:
        versions(stem)[old].unlink(missing_ok=True)


def load(stem: Path, before: int | None = None) -> tuple[dict[str, Tensor], int] | None:
    """The newest saved version from a round before ``before`` (None: any), as (model
    state, rounds trained), or None (absent or unreadable)."""
    found = {r: p for r, p in versions(stem).items() if before is None or r < before}
    if not found:
        return None
    path = found[max(found)]
    try:
        doc = torch.load(path, map_location="cpu", weights_only=True)
        return doc["model"], int(doc["rounds-trained"])
    except Exception as exc:  # noqa: BLE001 - a corrupt file must not kill the node
        log(WARNING, "ignoring unreadable personal state %s: %s", path, exc)
        return None
