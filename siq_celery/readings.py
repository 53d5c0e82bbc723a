"""What a queue's status says beyond its fields, for ``siq exporter`` and ``siq top``
alike: until when a hold lasts, and how long the backlog takes to start."""

from __future__ import annotations

from .types import US, QueueStatus


def held_until(st: QueueStatus) -> int:
    """The store time a back-off holds the queue until, or 0 (a weighted start's slots are
    not a hold): :attr:`QueueStatus.held_until_us`."""
    return st.held_until_us


def drain_seconds(st: QueueStatus) -> float:
    """Seconds until every claimed ticket could have started, at the current interval: the
    head at :attr:`QueueStatus.next_start_us`, then one ticket per interval, less what the
    burst credit lets catch up (GCRA: the last of n tickets comes no sooner than n - 1 - burst
    intervals after the theoretical arrival time, nor before its place on the line's grid),
    and no sooner than the window quota lets the last ticket in."""
    s = st.state
    if s.backlog <= 0:
        return 0.0
    head, n, i = st.next_start_us, s.backlog, s.interval_us
    spaced = max(s.anchor_us + n * i, max(s.last_start_us + i, head) + (n - 1 - s.burst) * i)
    return (max(head, spaced, st.window_last_us) - st.now_us) / US
