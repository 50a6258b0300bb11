"""Personal state on disk: a restarted SuperNode, or a resumed run, continues with
each node's own model, and a simulation of thousands of nodes holds none of their
models in memory.

With a state directory (node-config ``state-dir`` in deployment; in a simulation
``<out-dir>/clients/node-<partition>``, sent by the server), every training round
writes the personal model to ``<dir>/<algorithm>-<arch>-<fingerprint>.r<round>.<lineage>.pt``
(atomically; the two newest rounds are kept) and nothing but a round counter stays
in ``context.state``. Files carry the run's lineage (a tag the server draws when a
run starts and keeps when it is resumed): a message of round ``t`` loads this run's
newest file of an earlier round (training) or of round ``t`` at most (evaluation),
so a round that is run again after a crash starts from exactly what the round
before it left. A new run starts fresh: files of other runs are never loaded, so two
runs with the same seed give the same metrics on a reused node. With run-config
``carry-personal-state = true`` a new run (no file of its own yet) continues instead
from the newest file any earlier run left (a long-lived fleet that keeps its personal
models across runs). The
fingerprint covers every setting that changes the model's structure or meaning
(algorithm, model.*, data.*, seed, the algorithm's own section, the architecture):
change one and the node starts fresh instead of loading an incompatible model.

Every evaluation also keeps the model as the client evaluated it (what the server sent
installed, see :mod:`client_app.export`) in ``<dir>/evaluated/`` under the same stem
(:func:`save_evaluated`; the two newest evaluated rounds are kept): the model the
client predicts with, which ``fedhet export`` turns into an ONNX file.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from logging import WARNING
from pathlib import Path
from typing import Any

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
    """The stem ``<dir>/<algorithm>-<arch>-<fingerprint>``; files add ``.r<round>.<lineage>.pt``."""
    return Path(state_dir).expanduser() / f"{cfg.algorithm}-{arch}-{fingerprint(cfg, arch)}"


def clean_lineage(lineage: str) -> str:
    """A lineage tag as it may appear in a file name (it comes from the server)."""
    return "".join(c for c in str(lineage) if c.isalnum() or c == "-")[:32]


@dataclass(frozen=True)
class Version:
    """One saved personal model: its run lineage, server round and file."""

    lineage: str
    round: int
    path: Path
    mtime_ns: int


def versions(stem: Path) -> list[Version]:
    """Every saved version of ``stem``, oldest first (by write time, then round)."""
    out = []
    for path in stem.parent.glob(f"{stem.name}.r*.pt"):
        tail = path.name[len(stem.name) + 2 : -3]
        rnd, _, lineage = tail.partition(".")
        if not rnd.isdigit():
            continue
        try:
            mtime = path.stat().st_mtime_ns
        except OSError:  # removed meanwhile
            continue
        out.append(Version(lineage, int(rnd), path, mtime))
    return sorted(out, key=lambda v: (v.mtime_ns, v.round))


def save(
    stem: Path,
    model_state: dict[str, Tensor],
    rounds_trained: int,
    server_round: int,
    lineage: str = "",
) -> None:
    """Write round ``server_round``'s version of run ``lineage`` atomically (write,
    fsync, rename: a kill mid-write leaves the earlier versions intact); drop all but
    the newest ``KEEP``."""
    doc = {
        "model": {k: v.detach().cpu() for k, v in model_state.items()},
        "rounds-trained": rounds_trained,
    }
    _write_version(stem, doc, server_round, lineage)


def _write_version(stem: Path, doc: dict[str, Any], server_round: int, lineage: str) -> Path:
    """``doc`` as ``<stem>.r<round>.<lineage>.pt`` (write, fsync, rename); all but the
    newest ``KEEP`` versions of ``stem`` removed."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    tag = clean_lineage(lineage)
    path = stem.parent / (f"{stem.name}.r{server_round:06d}" + (f".{tag}" if tag else "") + ".pt")
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "wb") as fh:
        torch.save(doc, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    for old in versions(stem)[:-KEEP]:
        old.path.unlink(missing_ok=True)
    return path


EVALUATED = "evaluated"
"""Subfolder of a state directory with the models as the client evaluated them."""


def evaluated_stem(stem: Path) -> Path:
    """``<dir>/evaluated/<stem's name>``: where :func:`save_evaluated` writes."""
    return stem.parent / EVALUATED / stem.name


def save_evaluated(stem: Path, doc: dict[str, Any], server_round: int, lineage: str = "") -> Path:
    """Keep round ``server_round``'s evaluated model of run ``lineage`` (``doc``: tensors,
    numbers and strings only) as a version of :func:`evaluated_stem` (atomically, the
    newest ``KEEP`` kept); its path."""
    return _write_version(evaluated_stem(stem), doc, server_round, lineage)


def newest_evaluated(state_dir: Path) -> Path | None:
    """The evaluated model written last under a state directory (any run, any
    algorithm: the node's current one), or None."""
    found = []
    for path in (Path(state_dir) / EVALUATED).glob("*.r*.pt"):
        try:
            found.append((path.stat().st_mtime_ns, path.name, path))
        except OSError:  # removed meanwhile
            continue
    return max(found)[2] if found else None


def pick(
    found: list[Version], before: int | None, lineage: str, carry: bool = False
) -> Version | None:
    """The version a message of run ``lineage`` starts from: the newest of this run
    from a round before ``before`` (a round run again after a crash starts from what
    the round before it left). If this run has none: nothing (a fresh model), or with
    ``carry`` the newest version any earlier run left (a new run continues the node's
    personal model)."""
    tag = clean_lineage(lineage)
    own = [v for v in found if v.lineage == tag and (before is None or v.round < before)]
    if own:
        return max(own, key=lambda v: v.round)
    others = [v for v in found if v.lineage != tag] if carry else []
    return others[-1] if others else None


def load(
    stem: Path, before: int | None = None, lineage: str = "", carry: bool = False
) -> tuple[dict[str, Tensor], int] | None:
    """The personal model :func:`pick` chooses, as (model state, rounds trained), or
    None (absent or unreadable)."""
    chosen = pick(versions(stem), before, lineage, carry)
    if chosen is None:
        return None
    try:
        doc = torch.load(chosen.path, map_location="cpu", weights_only=True)
        return doc["model"], int(doc["rounds-trained"])
    except Exception as exc:  # noqa: BLE001 - a corrupt file must not kill the node
        log(WARNING, "ignoring unreadable personal state %s: %s", chosen.path, exc)
        return None
