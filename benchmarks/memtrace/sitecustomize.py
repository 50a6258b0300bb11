"""A diagnostic for the fleet benchmark: with ``FEDHET_TRACEMALLOC=PREFIX`` and this
folder on ``PYTHONPATH`` (``python -m benchmarks.fleet_load --tracemalloc PREFIX`` puts
it there for every process of the federation), each Python process traces its
allocations and writes ``PREFIX-<program>-<pid>.txt``: the allocations by traceback
at the process's largest traced total so far, rewritten at each peak 10 % above the
last one (checked every 5 s). Tracing costs CPU (and stalls the traced process while a
snapshot is grouped): never with a measurement that is quoted.
``FEDHET_TRACEMALLOC_ONLY``: trace only the programs it names (e.g. ``server_cost``,
the counting SuperLink; ``flwr-serverapp``; ``fleet_node``), comma-separated;
``FEDHET_TRACEMALLOC_EACH_S``: also a snapshot file every so many seconds
(``PREFIX-<program>-<pid>-HHMMSS.txt``), what is held between the peaks."""

from __future__ import annotations

import os
import sys
import threading
import time
import tracemalloc
from pathlib import Path


def _program() -> str:
    argv = [a for a in sys.argv if a]
    if "-m" in sys.orig_argv:
        return sys.orig_argv[sys.orig_argv.index("-m") + 1].rsplit(".", 1)[-1]
    return Path(argv[0]).name if argv else "python"


def _trace(path: Path, every_s: float = 5.0, each_s: float = 0.0) -> None:
    peak, last = 0, time.monotonic()
    while True:
        time.sleep(every_s)
        total = tracemalloc.get_traced_memory()[0]
        now = time.monotonic()
        if each_s and now - last >= each_s:  # one file per snapshot: what stays between peaks
            last = now
            _write(path.with_name(f"{path.stem}-{time.strftime('%H%M%S')}.txt"), total)
        if total <= 1.1 * peak:  # a snapshot's grouping holds the GIL for seconds
            continue
        peak = total
        _write(path, total)


def _write(path: Path, total: int) -> None:
    snapshot = tracemalloc.take_snapshot()
    lines = [f"{total / 2**20:.0f} MB traced at {time.strftime('%H:%M:%S')}"]
    for stat in snapshot.statistics("traceback")[:15]:
        lines.append(f"{stat.size / 2**20:.1f} MB in {stat.count} blocks")
        lines += [f"    {frame}" for frame in stat.traceback.format()[-20:]]
    path.write_text("\n".join(lines) + "\n")


_only = os.environ.get("FEDHET_TRACEMALLOC_ONLY", "")
_wanted = [name.strip() for name in _only.split(",") if name.strip()]
if (prefix := os.environ.get("FEDHET_TRACEMALLOC")) and (not _wanted or _program() in _wanted):
    tracemalloc.start(10)
    target = Path(f"{prefix}-{_program()}-{os.getpid()}.txt")
    each = float(os.environ.get("FEDHET_TRACEMALLOC_EACH_S", "0") or 0)
    threading.Thread(target=_trace, args=(target, 5.0, each), daemon=True, name="memtrace").start()
