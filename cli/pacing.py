"""Poll pacing, shared by the warm executor (``cli/warm.py``) and the SuperNode
(``cli/supernode.py``): fast when something is due, slow while nothing can happen.

Standard library only: the warm executor's task children import it.

A node learns when its next message is due from its own history: the gap between
its reply and its next message, by the kind of message it replied to (a training
reply waits for the round's slowest trainer and the server's step; an evaluation
reply for the slowest evaluator and the next round's set-up). Until
:data:`LEAD` x the expected gap it polls ever closer to that time (each wait
:data:`PRE_DUE_SHARE` of the time left), then every :data:`DUE_SHARE` x the gap,
backing off by :data:`IDLE_GROWTH` while the message does not come; with no history,
it backs off from its reply on. Idle, a pull comes at most every :data:`IDLE_POLL_S`
(``FEDHET_IDLE_POLL_S``).

A busy SuperLink slows every one of these waits (:class:`ServerLoad`): a node whose
pulls come back late (the SuperLink's one process saturated by a large fleet) polls,
and sends its heartbeats, up to :data:`MAX_SLOWDOWN` times less often, so that the
fleet's idle traffic stays below what the SuperLink answers.
"""

from __future__ import annotations

import os
import statistics
import threading
from collections import deque

IDLE_GROWTH = 0.1
"""While a message is due but has not come, each poll comes ``IDLE_GROWTH`` x the
time since it became due after the previous one (plus the base poll): 0.05 s at
first, 0.15 s after 1 s, 1 s after about 10 s, the idle cap (10 s) after 100 s."""
FAST_GROWTH = 0.05
"""The growth of ``FEDHET_NODE_POLL=fast`` (from every reply, up to Flower's 3 s)."""
PRE_DUE_SHARE = 0.75
"""Before its next message is due, a node waits this share of the time left, then
looks again (about log4 of LEAD / DUE_SHARE polls before the due time: 2.7)."""
LEAD = 0.9
"""Fast polls start at this share of the expected gap (of the shortest of the last
:data:`GAP_MEMORY` gaps)."""
DUE_SHARE = 0.02
"""Once due, a node polls every ``DUE_SHARE`` x the expected gap (at least the base
poll), growing while the message does not come: about 1 % of the gap in added
latency, 0.05 s for gaps below 2.5 s, 0.2 s for 10 s gaps."""
IDLE_POLL_S = 10.0
"""The longest wait between two pulls of an idle SuperNode (env
``FEDHET_IDLE_POLL_S``; Flower's own is 3 s). The first message of a run that
starts after a long idle time waits up to this long; within a run a node polls by
its expected gap. Each pull costs the SuperLink about one request's CPU (TLS, node
authentication, its state): 10 s keeps an idle node below 0.002 of a server core."""
GAP_MEMORY = 4
"""A node expects the shortest of its last this many gaps of the same kind (a
round it was not sampled in must not slow the next one)."""


def idle_poll_s(default: float = IDLE_POLL_S) -> float:
    """``FEDHET_IDLE_POLL_S`` (seconds, > 0) or ``default``."""
    text = os.environ.get("FEDHET_IDLE_POLL_S", "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise SystemExit(f"FEDHET_IDLE_POLL_S={text!r}: not a number of seconds") from None
    if not value > 0:
        raise SystemExit(f"FEDHET_IDLE_POLL_S={text!r}: must be > 0")
    return value


def fast_polls() -> bool:
    """``FEDHET_NODE_POLL=fast``: every poll at the base interval from each reply on,
    backing off only by :func:`idle_interval` (what fedhet did before its polls knew
    the round; for comparison). Default ``informed``."""
    mode = os.environ.get("FEDHET_NODE_POLL", "informed").strip() or "informed"
    if mode not in ("informed", "fast"):
        raise SystemExit(f"FEDHET_NODE_POLL={mode!r}: choose 'informed' or 'fast'")
    return mode == "fast"


def idle_interval(base: float, idle_s: float, cap: float, growth: float = IDLE_GROWTH) -> float:
    """The poll interval ``idle_s`` seconds after the last task (or after the
    message became due)."""
    return min(cap, base + growth * max(0.0, idle_s))


def informed_interval(base: float, since_s: float, expected_s: float | None, cap: float) -> float:
    """The poll interval ``since_s`` seconds after the node's reply, its next message
    expected ``expected_s`` seconds after a reply (None: unknown)."""
    if expected_s is None:
        return idle_interval(base, since_s, cap)
    due, fast = LEAD * expected_s, max(base, DUE_SHARE * expected_s)
    if since_s < due:
        return min(cap, max(fast, (due - since_s) * PRE_DUE_SHARE))
    return idle_interval(fast, since_s - due, cap)


class Gaps:
    """A node's gaps between a reply and its next message, by the kind of the message
    it replied to."""

    def __init__(self) -> None:
        self._gaps: dict[str, list[float]] = {}

    def add(self, kind: str, seconds: float) -> None:
        seen = self._gaps.setdefault(kind, [])
        seen.append(seconds)
        del seen[:-GAP_MEMORY]

    def expected(self, kind: str | None) -> float | None:
        seen = self._gaps.get(kind or "")
        return min(seen) if seen else None


LOAD_SLACK_S = 0.5
"""A pull answered this much later than the node's quick ones (:data:`LOAD_BASELINE`)
does not slow the node: a new connection's TCP and TLS handshakes on a slow link.
Beyond it, each further ``LOAD_SLACK_S`` of delay slows the node's idle traffic once
more (1 s late: 2x, 2.5 s: 5x)."""
MAX_SLOWDOWN = 6.0
"""The most a busy SuperLink slows a node's idle polls and heartbeats (a 10 s idle
poll becomes 60 s; a heartbeat every 20 s, one every 2.5 min)."""
LOAD_RECENT = 5
"""The slowdown follows the median delay of this many recent pulls."""
LOAD_BASELINE = 120
"""A node's quick answer is its quickest of this many recent pulls (20 min of idle
pulls at 10 s: a node whose link changes learns the new one)."""


class ServerLoad:
    """How busy the SuperLink looks from a node: the time its pulls take to come
    back. One per process (an emulator's nodes share their SuperLink's)."""

    def __init__(self) -> None:
        self._recent: deque[float] = deque(maxlen=LOAD_RECENT)
        self._history: deque[float] = deque(maxlen=LOAD_BASELINE)
        self._lock = threading.Lock()

    def note(self, seconds: float) -> None:
        """A request to the SuperLink took ``seconds`` to come back."""
        with self._lock:
            self._recent.append(seconds)
            self._history.append(seconds)

    def delay(self) -> float:
        """How much later than its quick answers the SuperLink answers now."""
        with self._lock:
            if not self._recent:
                return 0.0
            return max(0.0, statistics.median(self._recent) - min(self._history))

    def slowdown(self) -> float:
        """The factor a node's idle waits and heartbeat interval are stretched by:
        1 while the SuperLink answers within :data:`LOAD_SLACK_S` of its quick
        answers, up to :data:`MAX_SLOWDOWN`."""
        return min(MAX_SLOWDOWN, max(1.0, self.delay() / LOAD_SLACK_S))


LOAD = ServerLoad()
"""This process's view of its SuperLink."""
