"""Freed memory given back to the system: glibc's ``malloc_trim`` on a timer.

A SuperLink or ServerApp that moves messages of megabytes for hundreds of nodes frees
most of what it allocates within a round, but glibc keeps freed memory in its arenas
(one per busy thread, up to eight per core) instead of returning it, so the resident
memory grew to the round's peak times the arenas that had held it (FedARA, 100 nodes:
a SuperLink of 3.2 GB whose live Python objects were about 0.5 GB at its peak).
:func:`start_trimmer` calls ``malloc_trim(0)`` every ``FEDHET_HEAP_TRIM_S`` seconds
(default :data:`TRIM_S`; ``0``: never), which releases every whole free page of every
arena. Only where the C library is glibc (elsewhere a no-op)."""

from __future__ import annotations

import ctypes
import os
import platform
import threading
import time

TRIM_S = 5.0
"""Seconds between two trims (``FEDHET_HEAP_TRIM_S``)."""

_started: list[threading.Thread] = []


def trim_s() -> float:
    """``FEDHET_HEAP_TRIM_S`` (seconds; 0: never trim)."""
    text = os.environ.get("FEDHET_HEAP_TRIM_S", "").strip()
    try:
        value = float(text) if text else TRIM_S
    except ValueError:
        raise SystemExit(f"FEDHET_HEAP_TRIM_S={text!r}: seconds between trims (0: never)") from None
    if not 0 <= value < float("inf"):
        raise SystemExit(f"FEDHET_HEAP_TRIM_S={text!r}: seconds between trims (0: never)")
    return value


def trim() -> bool:
    """One ``malloc_trim(0)``; False where the C library has none."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    libc.malloc_trim(ctypes.c_size_t(0))
    return True


def start_trimmer(every_s: float | None = None) -> threading.Thread | None:
    """A daemon thread that trims the heap every ``every_s`` seconds (default
    :func:`trim_s`), once per process; None when off or not glibc."""
    every = trim_s() if every_s is None else every_s
    if every <= 0 or _started or platform.libc_ver()[0] != "glibc":
        return _started[0] if _started else None
    libc = ctypes.CDLL("libc.so.6")

    def run() -> None:
        while True:
            time.sleep(every)
            libc.malloc_trim(ctypes.c_size_t(0))

    thread = threading.Thread(target=run, daemon=True, name="fedhet-heap-trim")
    thread.start()
    _started.append(thread)
    return thread
