"""Spacing and burst: the rate cap and the waits that follow from it.

* no start is authorized before ``last_start + interval`` (the rate cap: :func:`cap`);
* burst (GCRA): ``last_start + interval`` is the theoretical arrival time T; a start may
  come ``burst`` intervals before it, then T = max(T, now) + cost x interval
  (``line.commit_start``); burst 0 is the spacing above, bit for bit;
* a head of the line overdue by more than :func:`outage_us` shifts the backlog once
  (:func:`shift_after_outage`); a back-off holds every start until its end (:func:`backoff`);
* a start whose body reports may be authorized up to :func:`start_lead_us` before its slot;
  later starts wait for that report (:data:`BEGIN_WAIT_US`, :func:`pending_wait`).

Twin: ``spacing.lua`` beside this module. Times in integer microseconds, store's clock."""

from __future__ import annotations

from ..types import QueueState

#: The head of a line may be this late (or 10 intervals, if longer) before the line shifts.
OUTAGE_MIN_US = 1_000_000


def cap(state: QueueState) -> int:
    """The rate cap: no start before it. GCRA: the theoretical arrival time
    ``last_start + interval`` less the burst tolerance (burst 0: ``last_start + interval``)."""
    return state.last_start_us + state.interval_us - state.burst * state.interval_us


def outage_us(interval_us: int) -> int:
    """How late the head of the line may be before the backlog shifts to now (see start)."""
    return max(10 * interval_us, OUTAGE_MIN_US)


def shift_after_outage(state: QueueState, now_us: int, overdue_us: int = 0, held_us: int = 0) -> bool:
    """After an outage (no start, and the head of the line overdue by more than
    :func:`outage_us`, or ``overdue_us`` if longer), the whole backlog shifts once so the
    head is due :func:`outage_us` from now: the returning workers and their tasks settle
    in, and the line restarts in ticket order instead of letting whichever task arrives
    first jump ahead. Once only (the anchor then lies more than an interval after the last
    start) until the next start, so a head that never comes back costs its slot and the
    line moves on.

    A task asking shifts at the threshold; a release passes its horizon as ``overdue_us``
    (see :func:`release_cutoff`). ``held_us``: when the window quota lets the head start
    (a head the window holds is not late). Mutates ``state``."""
    if state.anchor_us > state.last_start_us + state.interval_us:  # shifted already (or resumed)
        return False  # (a back-off that keeps the first slot sets the anchor one interval on: not a shift)
    settle = outage_us(state.interval_us)
    if max(state.anchor_us + state.interval_us, held_us) >= now_us - max(settle, overdue_us):
        return False
    state.anchor_us = now_us + settle - state.interval_us
    return True


def start_lead_us(interval_us: int) -> int:
    """How long before its slot a start whose body reports may be authorized: a quarter of
    the interval, 5 ms at most. It is recorded at its slot, and its process holds the body
    until then (the authorization's ``wait_us``), so the work between the authorization and
    the body (the reply, Celery's trace) is done before the slot instead of after it, where
    the body's report would move the line by it."""
    return min(interval_us // 4, 5_000)


#: How long after its authorization a start's body may report that it began
#: (:func:`began`): until then no later start of the queue is authorized, unless the report
#: came. A body that did not report by then (its process died, or was stopped longer) no
#: longer holds the queue; one that is about to begin later than half of it asks first
#: (tasks/gate.py: a late body).
BEGIN_WAIT_US = 500_000


def pending_wait(state: QueueState, now_us: int) -> int:
    """How long a start whose slot came waits before asking again while the last start's
    body has not reported: a quarter of the interval, between 0.5 and 5 ms, and never past
    the pending start's expiry."""
    return max(min(max(state.interval_us // 4, 500), 5_000, state.pending_us - now_us), 1)


def backoff(state: QueueState, now_us: int, hold_us: int, keep_first: bool = False) -> None:
    """No start before ``now + hold`` (the service said "retry after"): the last start
    and the anchor move so that the cap and ticket ``current + 1`` both fall then, and the
    line behind keeps its order. Never earlier than already due: a back-off only delays.
    ``keep_first``: the first slot after the hold is kept for the task that backed off
    (it comes back with its own, passed-over ticket), and the line follows one slot on.
    With a burst the hold spends the burst credit: the cap falls at the hold's end."""
    until = now_us + hold_us - state.interval_us
    state.held_until_us = max(state.held_until_us, now_us + hold_us)
    state.last_start_us = max(state.last_start_us, until + state.burst * state.interval_us)
    state.anchor_us = max(state.anchor_us, until + (state.interval_us if keep_first else 0))


def charge_overtaken(state: QueueState, now_us: int) -> int | None:
    """A report of a start that is not the queue's last pending one any more (a later
    start came while its process stood still): under a burst, without a quota and not
    paused, its body may begin now if the rate cap has room for one more start now; it is
    charged as one (GCRA: T = max(T, now) + I), and its place at its authorization stays
    charged too, so every window of the bodies' starts holds no more than the bound (the
    bodies' set is a subset of the starts charged). Returns now, or None: no room (or no
    burst, a quota, a pause): the body must not begin now. A burst of 0 has no room for a
    start beside a later one; a quota's window would count the start twice."""
    if not state.burst or state.quota or state.paused or cap(state) > now_us:
        return None
    i = state.interval_us
    state.last_start_us = max(state.last_start_us + i, now_us)
    state.anchor_us = max(state.anchor_us, state.last_start_us - state.burst * i)
    return now_us
