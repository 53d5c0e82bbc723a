"""What a queue's status says beyond its fields, for ``siq exporter``, ``siq top`` and
``siq status`` alike: until when a hold lasts, how long the backlog takes to start, and
what binds beyond the interval."""

from __future__ import annotations

from ..intervals import format_interval
from ..limits import NO_SPACING_US
from ..types import US, QueueStatus


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


def binding_use(st: QueueStatus, rate: float | None) -> float | None:
    """How much of the limit that binds is used, 1.0 for all of it: the largest of the
    spacing's (``rate`` starts a second against 1/interval), the quota's (units started in
    the window ending now) and the cap's (bodies in flight); None when none is known (no
    rate measured yet, and neither a quota nor a cap)."""
    s, uses = st.state, []
    if rate is not None and s.interval_us > NO_SPACING_US:
        uses.append(rate * s.interval_us / US)
    if s.quota:
        uses.append(st.window_used / s.quota)
    if s.concurrency:
        uses.append(st.in_flight / s.concurrency)
    return max(uses, default=None)


def has_limits(st: QueueStatus) -> bool:
    """Whether the queue has a limit beyond its interval (a quota, a burst, a cap or a margin), or an
    operator's override of one."""
    s = st.state
    return bool(s.quota or s.burst or s.concurrency or s.margin_us or st.sources.limits_override)


def limits_text(st: QueueStatus) -> str:
    """What binds beyond the interval, for people (``siq status``, ``siq top``): the quota's
    use of its window now, the burst, and the bodies running against the concurrency cap
    (``3/5 in 1s, burst 2, in flight 2/3``), each kind an operator overrides marked so;
    ``-`` for none."""
    s, o, parts = st.state, st.sources.limits_override, []
    if s.quota:
        parts.append(f"{st.window_used}/{s.quota} in {format_interval(s.limits.window_us)}" + _mark(o.quota))
    if s.burst:
        parts.append(f"burst {s.burst}" + _mark(o.burst))
    if s.concurrency:
        parts.append(f"in flight {st.in_flight}/{s.concurrency}" + _mark(o.concurrency))
    if s.margin_us:
        parts.append(f"margin {format_interval(s.margin_us)}" + _mark(o.margin_us))
    lifted = [kind for kind, v in (("quota", o.quota), ("concurrency", o.concurrency)) if v == 0]
    parts += [f"no {kind} (override)" for kind in lifted]
    return ", ".join(parts) or "-"


def _mark(overridden: int | None) -> str:
    return " (override)" if overridden is not None else ""
