"""A checkpoint after every round, and resuming a run from it.

``<out-dir>/checkpoint.pt`` holds what the ServerApp needs to continue exactly: the
completed round, the run config, the strategy's state (global arrays, its own
cross-round state such as FedTGP's generator or FedARA's version, the rejected
replies) and the results so far. It is written atomically (temporary file, fsync,
rename), so the previous checkpoint stays until the new one is complete. Sampling and
every seed derive from (seed, round), so nothing else is needed; the clients'
personal models are on disk by round (see ``client_app.state``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from common.config import ConfigError, RunConfig, flatten

FILE = "checkpoint.pt"
MAY_CHANGE = ("num-server-rounds", "round-timeout", "out-dir", "resume")
"""Run-config keys a resumed run may set differently."""


def write(out_dir: Path, doc: dict[str, Any]) -> Path:
    """Write ``doc`` as the run's checkpoint, atomically."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / FILE
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "wb") as fh:
        torch.save(doc, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


def read(out_dir: Path) -> dict[str, Any]:
    """The checkpoint of the run in ``out_dir``; a clear error when there is none."""
    path = Path(out_dir).expanduser() / FILE
    if not path.exists():
        raise ConfigError(f"run-config key 'resume': no {FILE} in {path.parent}")
    return dict(torch.load(path, map_location="cpu", weights_only=False))


def check_config(saved: dict[str, Any], cfg: RunConfig) -> None:
    """Refuse a resumed run whose config differs in a key that may not change."""
    now = flatten(cfg)
    for key in sorted(set(saved) | set(now)):
        if key in MAY_CHANGE:
            continue
        if saved.get(key) != now.get(key):
            raise ConfigError(
                f"run-config key '{key}' = {now.get(key)!r} differs from the resumed run's "
                f"{saved.get(key)!r} (only {', '.join(MAY_CHANGE[:3])} may change)"
            )
