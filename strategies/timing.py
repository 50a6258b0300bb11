"""A stopwatch for the phases of a server step (written to ``server-diagnostics``)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


class Phases:
    """Seconds per named phase, in the order phases first ran.

    >>> phases = Phases(decompose=0.5)
    >>> with phases("reconstruct"):
    ...     pass
    >>> list(phases.seconds)
    ['decompose', 'reconstruct']
    """

    def __init__(self, **already: float) -> None:
        self.seconds: dict[str, float] = dict(already)
        """Phase -> seconds (a phase run twice adds up)."""

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
