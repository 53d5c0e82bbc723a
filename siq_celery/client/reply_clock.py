"""This process's clock read against the state store's, from the answers to its asks.

A body authorized ahead of its slot is held until the slot comes on the store's clock
(``body.hold_until``). One answer alone places that moment by its own way back (the
reply, the process's wake) as if it were the store's time; the last few answers together
place it within the quickest of them.
"""

from __future__ import annotations

from collections import deque

#: Answers older than this say nothing of where the store's clock is now: this host's
#: monotonic clock and the store's wall clock drift apart ...
REPLY_WINDOW_S = 0.1
REPLIES_KEPT = 16
#: ... by at most this much a second (a clock slewed by NTP: 500 ppm), which comes off each
#: older answer's bound; a faster slew, or a step, is capped by the newest answer's own
#: upper bound (the body then waits at most its ask's way there too little).
DRIFT = 0.0005


class ReplyClock:
    """Where the store's clock stands against this process's monotonic clock, as tightly as
    the answers to its asks bound it. An ask sent at ``t1`` and answered at ``t2`` (this
    process's clock) on which the store read ``T`` says ``T - t2 <= store - local <= T - t1``:
    the store's clock is at least ``T - t2`` ahead of this one. The largest such bound among
    the last answers (within :data:`REPLY_WINDOW_S`, each less the drift since, never above
    the newest answer's upper bound) is the one a body held for its slot waits by
    (``body.hold_until``): the slot on the store's clock comes no later than it says, and
    less late than by one answer alone, which counts its whole way back (the reply, the
    process's wake) as the store's time. One a queue: on a Cluster each queue's answers
    come from the master of its slot, with its own clock."""

    __slots__ = ("_lows",)

    def __init__(self) -> None:
        self._lows: deque[tuple[float, float]] = deque(maxlen=REPLIES_KEPT)

    def note(self, asked_at: float, answered_at: float, store_us: int) -> float:
        """Record an answer (sent at ``asked_at``, back at ``answered_at``, the store's time
        ``store_us`` when it answered); returns the lower bound of store - local, seconds."""
        low, high = store_us / 1e6 - answered_at, store_us / 1e6 - asked_at
        self._lows.append((answered_at, low))
        since = answered_at - REPLY_WINDOW_S
        return min(max(b - DRIFT * (answered_at - at) for at, b in tuple(self._lows) if at >= since), high)
