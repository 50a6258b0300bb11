"""Which code made a run: a hash of the app's sources, and the git commit when known.

A run's ServerApp does not run from the checkout: ``flwr run`` bundles the app (the
packages of :data:`APP_PACKAGES`, ``fab-include`` in ``pyproject.toml``) and the
SuperLink unpacks it under ``FLWR_HOME``, where there is no ``.git``. So the ServerApp
records

- ``source``: sha256 over the app's ``.py`` files (sorted relative paths, each path
  and its bytes), computed where it runs: the same in the checkout and in the
  unpacked bundle when the code is the same, whatever the machine;
- ``git-commit`` and ``git-dirty``: from the launcher (``fedhet simulate``, ``fedhet
  federation`` and the benchmarks start the SuperLink with :data:`GIT_ENV` set by
  :func:`launch_env`), taken only when the launcher's ``source`` is the ServerApp's
  own; or from the checkout itself when the ServerApp runs from one (in process);
  ``null`` otherwise. ``git-dirty``: the app's files differ from the commit
  (uncommitted or untracked files under the app packages).

``python -m common.provenance [RESULTS.json ...]`` prints this tree's identity, and for
each results file (``.json`` or an archived ``.json.gz``) what it recorded and whether
it is this tree's code.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "APP_PACKAGES",
    "GIT_ENV",
    "KERNEL_ENV",
    "code_identity",
    "git_identity",
    "launch_env",
    "machine_identity",
    "source_hash",
]

APP_PACKAGES = ("common", "data", "models", "strategies", "server_app", "client_app")
"""The packages a run's bundle carries (``fab-include``; a test keeps them equal)."""
GIT_ENV = "FEDHET_GIT"
"""Environment variable the launcher sets for the SuperLink it starts: JSON
``{"commit", "dirty", "source"}`` of the checkout it launched from."""
APP_ROOT = Path(__file__).resolve().parent.parent
"""The folder holding the app packages: the checkout, or the unpacked bundle."""


def app_files(root: Path) -> list[Path]:
    """The app's source files under ``root``, sorted by relative path."""
    files = [
        path
        for package in APP_PACKAGES
        for path in (root / package).rglob("*.py")
        if "__pycache__" not in path.parts
    ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def source_hash(root: Path = APP_ROOT) -> str:
    """sha256 (hex) over the app's ``.py`` files under ``root``: for each, in order of
    relative path, the path, its length and its bytes."""
    digest = hashlib.sha256()
    for path in app_files(root):
        data = path.read_bytes()
        digest.update(f"{path.relative_to(root).as_posix()}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(
            # no optional locks: a status never takes the index lock of the user's checkout
            ["git", "--no-optional-locks", "-C", str(root), *args],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_identity(root: Path = APP_ROOT) -> dict[str, Any] | None:
    """``{"commit", "dirty"}`` of the git checkout whose top folder is ``root`` (None:
    not one, or no git): ``dirty`` when a file under the app packages differs from
    the commit or is untracked (ignored files aside)."""
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != root.resolve():
        return None
    commit = _git(root, "rev-parse", "--verify", "HEAD")
    status = _git(root, "status", "--porcelain", "--", *APP_PACKAGES)
    if commit is None or status is None:
        return None
    return {"commit": commit, "dirty": bool(status)}


def launch_env(root: Path = APP_ROOT) -> dict[str, str]:
    """What the launcher adds to the environment of the SuperLink it starts: the git
    identity of the checkout (with its source hash, so that a ServerApp running other
    code does not take the commit for its own); nothing outside a checkout."""
    git = git_identity(root)
    if git is None:
        return {}
    return {GIT_ENV: json.dumps({**git, "source": source_hash(root)})}


def _launcher_claim(source: str) -> dict[str, Any] | None:
    try:
        claim = json.loads(os.environ.get(GIT_ENV, ""))
    except ValueError:
        return None
    if not isinstance(claim, dict) or claim.get("source") != source:
        return None
    return claim


@functools.cache
def code_identity() -> dict[str, Any]:
    """``{"source", "git-commit", "git-dirty"}`` of the code running here (computed
    once per process; the two git entries None when unknown)."""
    source = source_hash()
    git = _launcher_claim(source) or git_identity()
    return {
        "source": source,
        "git-commit": git["commit"] if git else None,
        "git-dirty": bool(git["dirty"]) if git else None,
    }


KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR")
"""Environment variables that change which CPU kernels torch runs (and so the last
digits of a run's numbers); recorded when set."""


def cpu_model() -> str:
    """The processor's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "Hardware"):
                return value.strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


@functools.cache
def machine_identity() -> dict[str, Any]:
    """What decides a CPU run's last digits besides the code: torch's version, the
    vector instructions torch dispatches its kernels for (``AVX512``, ``AVX2``,
    ``DEFAULT`` on ARM ...), the processor and the architecture, and any of
    :data:`KERNEL_ENV` that is set. The same code gives the same numbers on machines
    with equal identities; on others they can differ from the first rounds on (e.g. the
    same run with AVX2 instead of AVX512 kernels: a few clients one test sample apart)."""
    import torch

    identity: dict[str, Any] = {
        "torch": torch.__version__,
        "cpu-capability": torch.backends.cpu.get_cpu_capability(),
        "cpu": cpu_model(),
        "arch": platform.machine(),
    }
    overrides = {k: os.environ[k] for k in KERNEL_ENV if os.environ.get(k)}
    if overrides:
        identity["kernel-env"] = overrides
    return identity


def recorded(path: Path) -> dict[str, Any]:
    """The ``versions`` a results file recorded (``.json`` or gzipped; {} if none)."""
    raw = path.read_bytes()
    doc = json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)
    versions = doc.get("versions") if isinstance(doc, dict) else None
    return versions if isinstance(versions, dict) else {}


def describe(
    versions: dict[str, Any],
    here: str | None = None,
    machine: dict[str, Any] | None = None,
) -> str:
    """One line: the commit (and ``+dirty``), the source hash, and whether it is the
    code ``here`` (a source hash); the machine it ran on, and whether its kernels are
    ``machine``'s; rows from before the identity was recorded say so."""
    source = versions.get("source")
    if not source:
        return "code not recorded (results written before fedhet recorded its source)"
    parts = []
    if commit := versions.get("git-commit"):
        parts.append(f"commit {commit[:12]}" + ("+dirty" if versions.get("git-dirty") else ""))
    parts.append(f"source {source[:16]}")
    if here is not None:
        parts.append("this tree's code" if source == here else "other code than this tree's")
    ran = versions.get("machine")
    if not isinstance(ran, dict):
        parts.append("machine not recorded")
    else:
        where = f"on {ran.get('cpu-capability')} {ran.get('cpu')} ({ran.get('arch')})"
        if machine is not None:
            same = ran == machine
            where += ": this machine's kernels" if same else ": other kernels than this machine's"
        parts.append(where)
    return ", ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    paths = [Path(a) for a in (sys.argv[1:] if argv is None else argv)]
    here = source_hash()
    git = git_identity() or {}
    machine = machine_identity()
    tree = {
        "source": here,
        "git-commit": git.get("commit"),
        "git-dirty": git.get("dirty"),
        "machine": machine,
    }
    print(f"this tree: {describe(tree)}")
    for path in paths:
        try:
            versions = recorded(path)
        except (OSError, ValueError) as exc:
            print(f"{path}: not a results file ({exc})", file=sys.stderr)
            return 2
        print(f"{path}: {describe(versions, here, machine)}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
