"""Freed memory given back to the system: glibc's ``malloc_trim`` on a timer.

A SuperLink or ServerApp that moves messages of megabytes for hundreds of nodes frees
most of what it allocates within a round, but glibc keeps freed memory in its arenas
(one per busy thread, up to eight per core) instead of returning it. Trimmed, the
SuperLink of a FedARA federation of 100 emulated nodes falls back to 1.4-1.6 GB
between rounds; its peak within a round (about 3 GB, the round's live data) is the
same either way (docs/deployment.md, "FedARA's memory, by role").
:func:`start_trimmer` calls ``malloc_trim(0)`` every ``FEDHET_HEAP_TRIM_S`` seconds
(default :data:`TRIM_S`; ``0``: never), which releases every whole free page of every
arena. Only where the C library is glibc (elsewhere a no-op)."""

from __future__ import annotations

import ctypes
import functools
import platform
import threading
import time

from common import envvars

TRIM_S = 5.0
"""Seconds between two trims (``FEDHET_HEAP_TRIM_S``)."""

_started: list[threading.Thread] = []


def trim_s() -> float:
    """``FEDHET_HEAP_TRIM_S`` (seconds; 0: never trim)."""
    return envvars.nonnegative("FEDHET_HEAP_TRIM_S", TRIM_S, "seconds between trims (0: never)")


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, or None where the C library is another (nothing to trim)."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def trim() -> bool:
    """One ``malloc_trim(0)``; False where the C library has none."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(ctypes.c_size_t(0))
    return True


def start_trimmer(every_s: float | None = None) -> threading.Thread | None:
    """A daemon thread that trims the heap every ``every_s`` seconds (default
    :func:`trim_s`), once per process; None when off or not glibc."""
    every = trim_s() if every_s is None else every_s
    if every <= 0 or _started or _libc() is None:
        return _started[0] if _started else None

    def run() -> None:
        while True:
            time.sleep(every)
            trim()

    thread = threading.Thread(target=run, daemon=True, name="fedhet-heap-trim")
    thread.start()
    _started.append(thread)
    return thread
