"""Idle pacing, shared by the warm executor (``cli/warm.py``) and the SuperNode
(``cli/supernode.py``): fast right after a task, ever slower while idle.

Standard library only: the warm executor's task children import it.
"""

from __future__ import annotations

IDLE_GROWTH = 0.05
"""An idle poll comes ``IDLE_GROWTH`` x the time since the last task after the
previous one (plus the base poll), up to Flower's own interval: 0.05 s right after a
reply, 0.1 s after 1 s idle, 3 s after about a minute. Within a round a node waits
for a few seconds at most and answers at once; an idle federation costs what stock
Flower's does (3 SuperNodes polling every 0.05 s for ever took 76 % of a core here,
a third of it in the SuperLink answering them; Flower's intervals 4 %)."""


def idle_interval(base: float, idle_s: float, cap: float) -> float:
    """The poll interval after ``idle_s`` seconds without a task."""
    return min(cap, base + IDLE_GROWTH * max(0.0, idle_s))
