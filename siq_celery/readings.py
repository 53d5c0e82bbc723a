"""What a queue's status says beyond its fields, for ``siq exporter`` and ``siq top``
alike: until when a hold lasts, and how long the backlog takes to start."""

from __future__ import annotations

from .types import US, QueueStatus


def held_until(st: QueueStatus) -> int:
    """The store time a back-off holds the queue until, or 0 (a weighted start's slots are
    not a hold): :attr:`QueueStatus.held_until_us`."""
    return st.held_until_us


def drain_seconds(st: QueueStatus) -> float:
    """Seconds until every claimed ticket could have started, at the current interval."""
    s = st.state
    wait = max(0, st.next_start_us - st.now_us)
    return (wait + max(0, s.backlog - 1) * s.interval_us) / US if s.backlog > 0 else 0.0
