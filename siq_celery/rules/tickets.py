"""The line and its tickets: a queue's state, the tickets it issues, and when each is due.

* a ticket ``t > current`` is due at ``anchor + (t - current) * interval``; a ticket
  ``t <= current`` (it turned up after a higher one started) takes the next free slot
  (:func:`slot_of`); :data:`FREE` is a start with no place in a line;
* a claim on a queue whose whole line is overdue re-bases the anchor so the new ticket is
  due at the first free slot (a burst after an idle period keeps ticket order: :func:`claim`);
* a reset starts a new life of the line, keeping what happened (:func:`reset`); parked
  tasks go back to the broker by the ticket whose slot is in reach (:func:`release_cutoff`).

Twin: ``tickets.lua`` beside this module. All times are integer microseconds on the
store's clock."""

from __future__ import annotations

from dataclasses import replace

from ..limits import NO_SPACING_US
from ..types import NO_LIMITS, ClaimResult, Limits, QueueState
from .declarations import set_limits
from .spacing import cap
from .window import Window, WindowUnits, window_units

#: The ticket of a start with no place in a queue's line (the other queues of a combined
#: limit): it takes the next free slot, as a late ticket does.
FREE = 0


def new_state(now_us: int, interval_us: int, epoch: str, limits: Limits = NO_LIMITS) -> QueueState:
    # last_start = now: a state created from nothing (a new queue, or one whose store was
    # wiped) cannot know when the last start happened, so the first start waits one
    # interval. That is the whole cost of surviving a lost state without a burst. With a
    # burst, the credit starts spent (T = now + (burst + 1) intervals): still one interval.
    state = QueueState(epoch, interval_us, 0, 0, now_us, now_us, False, 0, 0)
    set_limits(state, limits)
    state.last_start_us = now_us + state.burst * state.interval_us
    return state


def claim(state: QueueState, count: int, now_us: int, window: Window | None = None) -> ClaimResult:
    """Issue ``count`` tickets (mutates ``state``)."""
    units = window_units(state, window, now_us)  # first: it may move the line (see WindowUnits)
    first = state.ticket + 1
    due_first = state.anchor_us + (first - state.current) * state.interval_us
    floor = max(now_us, cap(state))
    # The line may be due burst intervals before the theoretical arrival time (burst 0: the cap).
    rebase = max(now_us, state.last_start_us + state.interval_us) - state.burst * state.interval_us
    if due_first < rebase:
        # The line is overdue (an idle queue), or its head is held by the rate cap: the
        # new ticket is due at the first free slot, and the ones claimed after it follow
        # one interval apart from there (so their estimates match the slots they get).
        state.anchor_us += rebase - due_first
        due_first = rebase
    state.ticket += count
    slots = [] if units is None else [units.slot(t, 1) for t in range(first, first + count)]
    return ClaimResult(
        first=first,
        count=count,
        epoch=state.epoch,
        base_us=due_first,
        floor_us=floor,
        interval_us=state.interval_us,
        now_us=now_us,
        window_us=tuple(slots) if any(slots) else (),
    )


def slot_of(state: QueueState, ticket: int) -> int:
    """The earliest store time at which ``ticket`` may start, by its interval (and burst)."""
    if ticket <= state.current:
        return cap(state)  # passed over: the next free slot
    return max(state.anchor_us + (ticket - state.current) * state.interval_us, cap(state))


def paused_new_state(now_us: int, epoch: str) -> QueueState:
    """A queue paused before any worker declared it (an operator preparing a deploy): no
    interval is known yet, so it has no spacing and no limits (:func:`no_limit_known`); the
    first declaration sets them (:func:`declare` takes the first one as the declaration) and
    the pause holds until resume."""
    state = new_state(now_us, NO_SPACING_US, epoch)
    state.paused = True
    return state


def reset(state: QueueState, now_us: int, epoch: str, interval_us: int | None = None) -> QueueState:
    """A new life for the queue: tickets and pause are forgotten, the last start is kept
    (so a reset never allows a burst), finished-task records are kept (so a reset never
    lets a finished task run again). The limits, the window's starts and the leases stay
    (they happened; their bodies still run)."""
    fresh = new_state(now_us, interval_us or state.declared_interval_us, epoch, state.limits)
    # Ticket 1 of the new life is due at once, subject to the kept rate cap.
    return replace(
        fresh,
        last_start_us=state.last_start_us,
        anchor_us=now_us - fresh.interval_us,
        started_us=state.started_us,
        held_until_us=state.held_until_us,
        pending_us=state.pending_us,  # its body still begins, and reports
        pending_due_us=state.pending_due_us,
    )


def release_cutoff(state: QueueState, now_us: int, horizon_us: int, units: WindowUnits | None = None) -> int | None:
    """The highest ticket whose slot is within ``horizon_us`` of now: parked tasks up to it
    go back to the broker. None while paused (no slot is known), and while the next free
    slot is itself beyond the horizon (a long back-off): every ticket, passed-over ones
    too, starts no earlier than that.

    The caller first shifts a stalled line with ``overdue_us=horizon_us``: a release
    shifts it only once its head is overdue by more than the horizon. A shorter outage is
    left to the first task that comes back; a release made as the outage began (a
    stopping worker's upkeep, a producer parking) would otherwise spend the one shift
    before the workers return, and the returning tasks would start in arrival order.

    With a window quota a ticket is due by the later of its interval slot and its window
    slot (``units``: the window read by :func:`window_units`, as a start of cost 1): the
    same slot its start will meet."""
    reach = now_us + horizon_us
    if state.paused or cap(state) > reach or (units is not None and units.slot(FREE, 1) > reach):
        return None
    cutoff = state.current + max((reach - state.anchor_us) // state.interval_us, 0)
    if units is None or cutoff <= state.current:
        return cutoff
    low, high = state.current, cutoff  # the window slots grow with the ticket: the last one in reach
    while low < high:
        mid = (low + high + 1) // 2
        if units.slot(mid, 1) <= reach:
            low = mid
        else:
            high = mid - 1
    return low


def estimate_of(state: QueueState, ticket: int, now_us: int, units: WindowUnits | None = None) -> int:
    """When ``ticket`` is expected to start (for a released task's ETA; ``units``: the
    window read by :func:`window_units`)."""
    return max(slot_of(state, ticket), 0 if units is None else units.slot(ticket, 1), now_us)
