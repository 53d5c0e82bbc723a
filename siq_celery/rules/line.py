"""A start, decided across every limit kind of its queue in one step.

:func:`start` asks each kind in turn (the run lease, a pause, spacing and burst, the
window, the concurrency cap, a pending body's report) and records an authorized start
(:func:`commit_start`): an authorized start moves ``current``, and the anchor up to the
start itself (to its last slot, with a cost), never back: a line whose head is due later
(an outage's settle, a resume's grace, a kept first slot) stays there. (A lagging anchor
would gain nothing for the next ticket, which the cap holds to last start + interval
anyway, and it would shrink the margin that keeps later tickets from overtaking a late
head: with the anchor at the start, ticket ``current + 2`` is due a full interval after
the head's slot.) :func:`start_all` is one start through several queues at once; a body's
report moves its start to when it began (:func:`began`, :func:`restamp`).

Twin: ``line.lua`` beside this module. Times in integer microseconds, store's clock."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ..types import Decision, QueueState, Verdict
from .concurrency import Leases, RunOwner, _live, lease_turn, lease_wait
from .spacing import cap, charge_overtaken, pending_wait, shift_after_outage, start_lead_us
from .tickets import FREE, slot_of
from .window import Window, window_slot, window_units


def start(
    state: QueueState, ticket: int, epoch: str, now_us: int, *, finished: bool = False, cost: int = 1,
    lost: bool = False, window: Window | None = None, leases: Leases | None = None,
    lease: tuple[str, int] | None = None, running_us: int = 0, token: str = "", own: RunOwner | None = None,
    begin_wait_us: int = 0,
) -> Decision:  # fmt: skip
    """Decide whether ``ticket`` may start at ``now_us`` (mutates ``state`` if authorized).

    A start of ``cost`` c holds tickets ``ticket .. ticket + c - 1`` (claimed together) and
    takes c slots: the next start may come c intervals after it. It is recorded as if its
    last slot had been used at ``now + (c - 1) * interval`` (anchor and last start), so
    every other rule stays as it is. ``lost``: :func:`too_many_lost` holds for its task id;
    ``running_us``: :func:`running_copy`'s answer for it. An authorized start takes
    ``lease`` = (member, expiry) if given (a start with a task id, or any start under a
    concurrency cap), one whatever its cost. ``token``: the asking call's, kept as the
    owner of the run's lease (given only with a task id); ``own``: :func:`own_start`'s
    answer for it, a start already given to that call, which is answered again as it was
    and records nothing. ``begin_wait_us``: its body reports when it began (:func:`commit_start`)."""
    if own is not None and not finished:  # this call's own start, its reply lost: the same, charged once
        member = lease[0] if lease else ""
        return Decision(
            Verdict.AUTHORIZED, ticket, own.now_us, max(own.now_us - now_us, 0), own.slot_us, state.interval_us, member
        )  # fmt: skip
    if ticket == FREE and not finished and not lost:  # only a combined start may have no place in a line
        return Decision(Verdict.RECLAIM, ticket, now_us)
    decision = decide(
        state, ticket, epoch, now_us, finished=finished, cost=cost, lost=lost, window=window, leases=leases,
        running_us=running_us,
    )  # fmt: skip
    at = now_us
    if begin_wait_us and _within_lead(state, decision):  # authorized for its slot, the body held until then
        ahead = decide(state, ticket, epoch, decision.slot_us, cost=cost, window=window, leases=leases)
        if ahead.authorized:
            at, decision = decision.slot_us, replace(ahead, wait_us=decision.slot_us - now_us)
    if decision.authorized:
        taken = commit_start(state, ticket, at, cost, window, leases, lease, begin_wait_us)
        if token and taken and leases is not None:
            leases.set_owner(taken, RunOwner(token, at, decision.slot_us))
        return replace(decision, lease=taken)
    return decision


def _within_lead(state: QueueState, decision: Decision) -> bool:
    """Whether ``decision`` waits for its slot only (every other wait is positive and not
    the distance to its slot), and the slot is within the lead."""
    if decision.verdict is not Verdict.WAIT or decision.full:
        return False
    return decision.wait_us == decision.slot_us - decision.now_us <= start_lead_us(state.interval_us)


def decide(
    state: QueueState, ticket: int, epoch: str, now_us: int, *, finished: bool = False, cost: int = 1,
    lost: bool = False, window: Window | None = None, leases: Leases | None = None, running_us: int = 0,
) -> Decision:  # fmt: skip
    """What :func:`start` would answer, without recording a start (it may still shift a
    long-overdue line: that is the state's own repair, due whatever the answer).
    Ticket :data:`FREE` has no place in the line: it takes the next free slot. A start
    whose slot came while the concurrency cap is full answers WAIT with ``full`` and a
    short poll (:func:`lease_wait`); so does a start behind tickets that keep their claim on
    the free leases (:func:`lease_turn`), until the first claim it waits for lapses."""
    if finished:
        return Decision(Verdict.DUPLICATE, ticket, now_us)
    if running_us > now_us:  # a copy of this task runs: neither a slot nor a lease is taken
        return Decision(Verdict.RUNNING, ticket, now_us, running_us - now_us, interval_us=state.interval_us)
    if lost:
        return Decision(Verdict.LOST, ticket, now_us)
    if ticket == FREE:
        if state.paused:
            return Decision(Verdict.PAUSED, ticket, now_us, interval_us=state.interval_us)
        full = bool(state.concurrency) and _live(state, leases, now_us) >= state.concurrency
        slot = max(cap(state), window_slot(state, window, FREE, cost, now_us))
        if now_us < slot:
            return Decision(Verdict.WAIT, ticket, now_us, slot - now_us, slot, state.interval_us)
        if full:
            assert leases is not None
            wait = lease_wait(leases, now_us)
            return Decision(Verdict.WAIT, ticket, now_us, wait, slot, state.interval_us, full=True)
        if state.pending_us > now_us:
            return Decision(Verdict.WAIT, ticket, now_us, pending_wait(state, now_us), slot, state.interval_us)
        return Decision(Verdict.AUTHORIZED, ticket, now_us, 0, slot, state.interval_us)
    if epoch != state.epoch or ticket < 1 or ticket + cost - 1 > state.ticket:
        return Decision(Verdict.RECLAIM, ticket, now_us)
    if state.paused:
        # wait_us: how far behind the head of the line this ticket is, so a caller that
        # comes back after the resume can come back in ticket order.
        offset = max(ticket - state.current - 1, 0) * state.interval_us
        return Decision(Verdict.PAUSED, ticket, now_us, wait_us=offset, interval_us=state.interval_us)
    live = _live(state, leases, now_us)  # first: a release may move the line
    full = bool(state.concurrency) and live >= state.concurrency
    units = window_units(state, window, now_us)
    if ticket > state.current:  # a head held by the window or by a full cap is not late
        held = max(0 if units is None else units.slot(state.current + 1, 1), now_us if full else 0)
        shift_after_outage(state, now_us, held_us=held)
    slot = max(slot_of(state, ticket), 0 if units is None else units.slot(ticket, cost))
    if now_us < slot:
        return Decision(Verdict.WAIT, ticket, now_us, slot - now_us, slot, state.interval_us)
    turn = lease_turn(state, ticket, live) if leases is not None else 0  # the tickets ahead keep their claims
    if full or now_us < turn:
        assert leases is not None
        wait = lease_wait(leases, now_us) if full else min(lease_wait(leases, now_us), turn - now_us)
        return Decision(Verdict.WAIT, ticket, now_us, wait, slot, state.interval_us, full=True)
    if state.pending_us > now_us:  # the last start's body has not said it began: its start may still move
        return Decision(Verdict.WAIT, ticket, now_us, pending_wait(state, now_us), slot, state.interval_us)
    return Decision(Verdict.AUTHORIZED, ticket, now_us, 0, slot, state.interval_us)


def commit_start(
    state: QueueState, ticket: int, now_us: int, cost: int = 1, window: Window | None = None,
    leases: Leases | None = None, lease: tuple[str, int] | None = None, begin_wait_us: int = 0,
) -> str:  # fmt: skip
    """Record an authorized start. The line continues from it: for a late ticket (ticket
    <= current) that means it took the slot ticket current+1 was due at, and the line
    behind it shifts by one slot, keeping its order (so does a FREE start). A line whose
    head is due later (an outage's settle, a resume's grace, a kept first slot) stays
    where it is: a late ticket that starts before it never pulls it forward.

    GCRA: the theoretical arrival time becomes max(T, now) + cost x interval (burst 0:
    now + cost x interval, as the cap held now >= T). With a burst the line keeps its
    grid, lagging the arrival time by at most ``burst`` intervals, so a late line catches
    up by at most ``burst`` slots. The start takes ``lease`` = (member, expiry) if given, one
    whatever its cost (a queue without a cap first forgets its expired ones: a capped
    queue's are read, and forgotten, by :func:`decide`); the member taken, or "".
    ``begin_wait_us``: the start's body will report when it began (:func:`began`); later
    starts wait for that report, ``begin_wait_us`` at most (0: a start that does not report)."""
    i = state.interval_us
    old_current = state.current
    if ticket != FREE:
        state.current = max(state.current, ticket + cost - 1)
    due = state.last_start_us + state.interval_us  # the earliest this start could count from (GCRA's T)
    state.pending_us, state.pending_due_us = (now_us + begin_wait_us, due) if begin_wait_us else (0, 0)
    state.started_us = now_us  # what the status shows; the cap counts from the last slot used
    state.last_start_us = max(state.last_start_us + i, now_us) + (cost - 1) * i
    grid = state.anchor_us + (state.current - old_current) * i
    state.anchor_us = max(grid, state.last_start_us - state.burst * i)
    if state.quota and window is not None:
        window.add(now_us, min(cost, state.quota))
    if leases is None or lease is None:
        return ""
    if not state.concurrency:
        leases.trim(now_us)
    leases.add(*lease)
    return lease[0]


def start_all(
    states: list[QueueState], tickets: list[int], epochs: list[str], now_us: int, *, finished: bool = False,
    cost: int = 1, lost: bool = False, windows: Sequence[Window | None] | None = None,
    leases: Sequence[Leases | None] | None = None, lease: tuple[str, int] | None = None, running_us: int = 0,
    token: str = "", own: RunOwner | None = None, begin_wait_us: int = 0, run: bool = True,
) -> list[Decision]:  # fmt: skip
    """One start that must pass several queues at once (a per-second and a per-day limit):
    authorized in all of them, or recorded in none. Queues that would authorize while
    another says wait answer WAIT with ``wait_us`` 0, so nothing is held in one queue
    while the start waits for another. The start has a place in one queue's line (its
    ticket); in the others its ticket is :data:`FREE`. When every queue authorizes, the
    first queue takes ``lease`` if it is the run's (``run``: named by the task id, checked
    there: ``running_us``) and each queue with a concurrency cap takes one under the same
    member (start_all.lua: the same). ``token`` and ``own``:
    as in :func:`start` (the owner is kept with the first queue's lease, with the latest of
    the queues' slots, which every queue answers again). ``begin_wait_us``: the body reports
    when it began, to every queue (:func:`commit_start`)."""
    if own is not None and not finished:  # this call's own start, its reply lost: the same, charged once
        member = lease[0] if lease else ""
        return [
            Decision(Verdict.AUTHORIZED, t, own.now_us, 0, own.slot_us, state.interval_us,
                     member if i == 0 or state.concurrency else "")
            for i, (state, t) in enumerate(zip(states, tickets, strict=True))
        ]  # fmt: skip
    if all(t == FREE for t in tickets) and not finished and not lost:  # a start needs a place in some line
        return [Decision(Verdict.RECLAIM, t, now_us) for t in tickets]
    wins = list(windows) if windows is not None else [None] * len(states)
    held = list(leases) if leases is not None else [None] * len(states)
    decisions = [
        decide(
            state,
            ticket,
            epoch,
            now_us,
            finished=finished,
            cost=cost,
            lost=lost,
            window=window,
            leases=lz,
            running_us=running_us,
        )
        for state, ticket, epoch, window, lz in zip(states, tickets, epochs, wins, held, strict=True)
    ]
    if all(d.authorized for d in decisions):
        # the run's lease in the first queue (where running_us was read), a cap's in each capped queue
        taken = [lease if (i == 0 and run) or state.concurrency else None for i, state in enumerate(states)]
        started = [
            replace(d, lease=commit_start(state, ticket, now_us, cost, window, lz, mine, begin_wait_us))
            for d, state, ticket, window, lz, mine in zip(decisions, states, tickets, wins, held, taken, strict=True)
        ]
        first = held[0]
        if token and started[0].lease and first is not None:
            first.set_owner(started[0].lease, RunOwner(token, now_us, max(d.slot_us for d in started)))
        return started
    return [replace(d, verdict=Verdict.WAIT, wait_us=0) if d.authorized else d for d in decisions]


def pause(state: QueueState) -> None:
    state.paused = True


def resume(state: QueueState, now_us: int, grace_us: int = 0) -> None:
    """The line continues ``grace_us`` from now: ticket current+1 is due then (subject to
    the cap). The grace gives every waiter that polls a paused queue time to come back
    before its slot, so the line resumes in ticket order (grace >= the longest poll).
    Resuming a queue that is not paused changes nothing (a second resume must not delay
    the line again)."""
    if not state.paused:
        return
    state.paused = False
    state.anchor_us = max(state.anchor_us, now_us + grace_us - state.interval_us)


def restamp(state: QueueState, epoch: str, started_us: int, now_us: int, window: Window | None = None) -> int | None:
    """Move the last start to ``now_us`` if it is still the last start of this epoch (the
    last slot it used is ``started_us``: its start time, or for a start of cost c, c - 1
    intervals after it, as :func:`commit_start` records it); return the new start time,
    else None. The start and its last slot move by the same time.

    A caller whose authorization reply came back slowly (its process was descheduled)
    starts its body later than the store recorded; re-stamping makes the next start wait
    a full interval from (nearly) the real start. It can only delay later starts. With a
    window quota the start moves in the window too (it leaves the window later). A queue
    with a burst is never re-stamped: its bound is on the store's clock (at most
    ceil(W / I) + B starts in any window W), and a late body is what the burst lets the
    line catch up on, which moving the start forward would take away.
    """
    began = state.started_us  # the start itself (its last slot is later with a cost > 1)
    if state.burst or state.epoch != epoch or state.last_start_us != started_us or now_us < began:
        return None
    if not 0 < began <= state.last_start_us:  # no start recorded (a state without one): nothing to move
        return None
    state.last_start_us += now_us - began
    state.started_us = now_us
    state.anchor_us = max(state.anchor_us, state.last_start_us)
    if state.quota and window is not None:
        window.move(began, now_us)
    return now_us


def began(state: QueueState, started_us: int, now_us: int, window: Window | None = None) -> int | None:
    """The body of the start authorized at ``started_us`` reports, as it begins, that it
    began: if that start is still the last one and pending (:func:`commit_start`), it is
    placed as if it had been authorized at ``now_us`` (the store's time when the report
    came: the report is written just before the body's first statement, so it reaches the
    store after the body began, and no worker's clock is trusted), and later starts stop
    waiting for it. Returns the start's new time, or None when the start is not the last
    pending one any more (a later start came after its wait expired, or while its process
    stood still: the caller must not begin its body now), unless a burst has room for it
    now (:func:`charge_overtaken`: charged as one more start).

    Its last slot is worked out again from ``pending_due_us`` (T = L + I, the slot used
    before it plus the interval then), as :func:`commit_start` did from the authorization:
    max(T, now) + (c - 1) I instead of max(T, auth) + (c - 1) I (an interval changed since
    does not change T). Without a burst that moves it by the whole delay; a start that came early
    under a burst moves only by what the delay takes it past L + I, so the burst bound
    (ceil(W / I) + B starts in any window W) holds between the bodies' own starts, and a
    line that catches up keeps its rate. With a window quota the start moves in the window
    too. It can only delay later starts.

    A body whose process stood still after its report (the report's own send can hand the
    CPU to the store) reports again, and the start moves again, while no later start came:
    ``pending_us`` then holds minus the authorization's time, which no later start waits for."""
    again = state.pending_us < 0 and state.pending_us == -started_us  # reported already: a report sent again
    if not again and (state.pending_us <= 0 or state.started_us != started_us):
        return charge_overtaken(state, now_us)
    at = max(now_us, state.started_us)
    i = state.interval_us
    base = state.pending_due_us
    state.last_start_us += max(base, at) - max(base, state.started_us)
    state.anchor_us = max(state.anchor_us, state.last_start_us - state.burst * i)
    if state.quota and window is not None and at != state.started_us:
        window.move(state.started_us, at)
    state.started_us = at
    state.pending_us = -started_us  # reported: nothing waits for it, and a report sent again finds it
    return at
