"""The interval-queue rules as pure functions over :class:`QueueState`.

This module is the reference semantics: the memory and SQLite backends run it inside a
transaction, and the Redis Lua scripts (``backends/lua``) implement the same rules line
for line. All times are integer microseconds on the store's clock.

Rules (docs/design.md, "The model"):

* a ticket ``t > current`` is due at ``anchor + (t - current) * interval``; a ticket
  ``t <= current`` (it turned up after a higher one started) takes the next free slot;
* no start is authorized before ``last_start + interval`` (the rate cap);
* an authorized start moves ``current``, and the anchor up to the start itself (to its
  last slot, with a cost), never back: a line whose head is due later (an outage's settle,
  a resume's grace, a kept first slot) stays there. (A lagging anchor would gain nothing
  for the next ticket, which the cap holds to last start + interval anyway, and it would
  shrink the margin that keeps later tickets from overtaking a late head: with the anchor
  at the start, ticket ``current + 2`` is due a full interval after the head's slot.)
* a claim on a queue whose whole line is overdue re-bases the anchor so the new ticket is
  due at the first free slot (a burst after an idle period keeps ticket order);
* a task id whose last ``max_lost`` authorized starts never finished (each time its
  worker process died) is refused, LOST, without taking a slot (:func:`too_many_lost`);
* burst (GCRA): ``last_start + interval`` is the theoretical arrival time T; a start may
  come ``burst`` intervals before it (:func:`cap`), then T = max(T, now) + cost x interval
  (:func:`commit_start`); burst 0 is the spacing above, bit for bit;
* window quota: at most ``quota`` cost units start in any sliding window of ``window_us``
  (:func:`window_slot`), over the starts the queue's :class:`Window` keeps; ticket order
  holds, tickets behind the head are estimated from the window's pattern;
* concurrency cap: at most ``concurrency`` bodies running at once, counted over the queue's
  :class:`Leases` (a start takes one, its finish gives it back, a lease of a process that
  died expires); a start whose slot came while the cap is full waits (:func:`read_leases`),
  and a line the cap held is due from the release (:func:`release_shift`).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple, Protocol

from .limits import NO_SPACING_US
from .types import (
    NO_LIMITS,
    NO_OVERRIDE,
    ClaimResult,
    Decision,
    Declared,
    IntervalSources,
    Limits,
    LimitsOverride,
    NodeDeclaration,
    QueueState,
    StartCounts,
    Verdict,
)

#: The ticket of a start with no place in a queue's line (the other queues of a combined
#: limit): it takes the next free slot, as a late ticket does.
FREE = 0

#: The head of a line may be this late (or 10 intervals, if longer) before the line shifts.
OUTAGE_MIN_US = 1_000_000


class Window(Protocol):
    """The starts of a queue with a window quota, oldest first: (store time, cost) each.
    A store keeps them apart from the state (Redis: a sorted set in the queue's hash tag;
    SQLite: a table; memory: :class:`ListWindow`)."""

    def trim(self, cutoff_us: int) -> None:
        """Forget the starts at or before ``cutoff_us`` (they left the window)."""

    def used(self) -> int:
        """Cost units of the starts kept."""

    def unit_time(self, unit: int) -> int:
        """When the ``unit``-th cost unit kept (1-based, oldest first) started."""

    def add(self, t_us: int, cost: int) -> None:
        """A start of ``cost`` units at ``t_us``."""

    def move(self, from_us: int, to_us: int) -> None:
        """A start recorded at ``from_us`` began at ``to_us`` (a re-stamp)."""


class ListWindow:
    """A :class:`Window` in memory (the memory store's, and the reference's). ``units[i]``
    counts the units of the starts up to ``entries[i]`` (and of those gone before), so a
    unit's start is found by bisection, never by walking the window."""

    def __init__(self, entries: Sequence[tuple[int, int]] = ()) -> None:
        self.entries: list[tuple[int, int]] = sorted(entries)
        self.units: list[int] = list(itertools.accumulate(c for _, c in self.entries))
        self._gone = 0  # the units of the starts trimmed

    def trim(self, cutoff_us: int) -> None:
        gone = bisect.bisect_right(self.entries, (cutoff_us, 1 << 62))
        if gone:
            self._gone = self.units[gone - 1]
            del self.entries[:gone], self.units[:gone]

    def used(self) -> int:
        return self.units[-1] - self._gone if self.units else 0

    def unit_time(self, unit: int) -> int:
        at = bisect.bisect_left(self.units, self._gone + unit)
        if at == len(self.units):
            raise IndexError(unit)
        return self.entries[at][0]

    def add(self, t_us: int, cost: int) -> None:
        at = bisect.bisect_right(self.entries, (t_us, cost))
        self.entries.insert(at, (t_us, cost))
        self._count_from(at)  # a start out of time order: the units after it counted anew

    def _count_from(self, at: int) -> None:
        below = self.units[at - 1] if at else self._gone
        self.units[at:] = itertools.accumulate((c for _, c in self.entries[at:]), initial=below)
        del self.units[at]  # the initial value

    def move(self, from_us: int, to_us: int) -> None:
        at = bisect.bisect_right(self.entries, (from_us, 1 << 62)) - 1
        if at >= 0 and self.entries[at][0] == from_us:
            _, cost = self.entries.pop(at)
            self._count_from(at)
            self.add(to_us, cost)


class RunOwner(NamedTuple):
    """Who took a run's lease: the ``token`` of the call that asked (one per wait_in_line
    call, sent with each of its asks), and the start it was given (store time and slot; a
    start of several queues: the latest of their slots). A call whose reply was lost asks
    again and is given that start again (:func:`own_start`)."""

    token: str
    now_us: int
    slot_us: int


class Leases(Protocol):
    """The leases of a queue: member -> expiry (store time), one per running body. A start
    with a task id takes one named by its task id (a copy of it is not started while that
    lease is live: :func:`running_copy`); a start without one takes one only under a
    concurrency cap, which counts them all. A store keeps them apart from the state (Redis: a sorted set in the
    queue's hash tag; SQLite: a table; memory: :class:`DictLeases`)."""

    def count(self) -> int:
        """Leases kept (expired ones not yet trimmed included)."""

    def trim(self, now_us: int) -> list[int]:
        """Forget the leases that expired (expiry <= now); their expiries, oldest first."""

    def earliest(self) -> int | None:
        """The earliest expiry kept (None: none)."""

    def add(self, member: str, expires_us: int) -> None:
        """Take ``member``'s lease (with no owner: :meth:`set_owner`)."""

    def expires(self, member: str) -> int | None:
        """When ``member``'s lease expires (None: not kept)."""

    def remove(self, member: str) -> bool:
        """Give back ``member``'s lease (and its owner); whether it was kept."""

    def owner(self, member: str) -> RunOwner | None:
        """Who took ``member``'s lease (None: not known, or not kept). :meth:`trim` forgets
        the owners of the leases it forgets."""

    def set_owner(self, member: str, owner: RunOwner) -> None: ...

    def renew(self, members: Sequence[str], expires_us: int) -> int:
        """Move the expiry of those of ``members`` kept to ``expires_us`` (never adds one);
        how many were kept."""

    def live(self, now_us: int) -> int:
        """Leases not expired at ``now_us`` (read only)."""


class DictLeases:
    """:class:`Leases` in memory (the memory store's)."""

    def __init__(self) -> None:
        self.expiry: dict[str, int] = {}
        self.owners: dict[str, RunOwner] = {}

    def count(self) -> int:
        return len(self.expiry)

    def trim(self, now_us: int) -> list[int]:
        gone = sorted(e for e in self.expiry.values() if e <= now_us)
        if gone:
            self.expiry = {m: e for m, e in self.expiry.items() if e > now_us}
            self.owners = {m: o for m, o in self.owners.items() if m in self.expiry}
        return gone

    def earliest(self) -> int | None:
        return min(self.expiry.values(), default=None)

    def add(self, member: str, expires_us: int) -> None:
        self.expiry[member] = expires_us
        self.owners.pop(member, None)

    def expires(self, member: str) -> int | None:
        return self.expiry.get(member)

    def remove(self, member: str) -> bool:
        self.owners.pop(member, None)
        return self.expiry.pop(member, None) is not None

    def owner(self, member: str) -> RunOwner | None:
        return self.owners.get(member)

    def set_owner(self, member: str, owner: RunOwner) -> None:
        self.owners[member] = owner

    def renew(self, members: Sequence[str], expires_us: int) -> int:
        kept = [m for m in set(members) if m in self.expiry]
        for m in kept:
            self.expiry[m] = expires_us
        return len(kept)

    def live(self, now_us: int) -> int:
        return sum(1 for e in self.expiry.values() if e > now_us)


#: While the concurrency cap is full, a start whose slot came is told to ask again after this
#: (or at the earliest lease expiry, if sooner): a finish frees a lease at a time no one knows.
LEASE_POLL_US = 10_000
#: A ticket whose slot came keeps its claim on a free lease this long after its slot (after
#: the release, for a line the full cap held): the tickets behind it take no lease it needs
#: meanwhile. Twice the poll of a start the full cap holds, so the head asks in time even
#: when its poll comes a round trip or a scheduling delay late.
LEASE_GRACE_US = 2 * LEASE_POLL_US


def release_shift(state: QueueState, at_us: int) -> None:
    """A lease came back at ``at_us`` while the cap was full: if the head of the line was
    due before then, the cap held it, and the line is due from the release (the anchor
    moves so the head's slot is ``at_us``). A head the cap held is not late: the line
    behind keeps its spacing from the release, so a later ticket whose slot passed
    meanwhile does not take the freed lease ahead of it, and no outage shift follows."""
    if state.ticket > state.current and state.anchor_us + state.interval_us < at_us:
        state.anchor_us = at_us - state.interval_us


def read_leases(state: QueueState | None, leases: Leases | None, now_us: int) -> int:
    """The live leases at ``now_us`` (mutates ``leases``, and ``state`` through
    :func:`release_shift`): the expired ones are forgotten; if that brought a full cap
    below it, the release happened at the expiry that did."""
    if leases is None:
        return 0
    before = leases.count()
    if not before:
        return 0
    gone = leases.trim(now_us)
    n = state.concurrency if state is not None else 0
    if state is not None and n and gone and before >= n > before - len(gone):
        release_shift(state, gone[before - n])
    return before - len(gone)


def lease_turn(state: QueueState, ticket: int, live: int) -> int:
    """When ``ticket`` may take one of the free leases, as far as the tickets ahead of it in
    line go (0: now). Each ticket ahead (``current + 1 .. ticket - 1``) keeps a claim on a
    lease until :data:`LEASE_GRACE_US` after its slot; ``ticket`` may take a lease only if
    one is left over for each claim still held (``live``: the leases taken). So a lease freed
    while the cap was full goes to the head of the line, which polls every
    :data:`LEASE_POLL_US`, not to a later ticket that asks first; a ticket that never asks
    holds a lease back for the grace, no more. A ticket passed over (``<= current``) or
    :data:`FREE` has no place in the line and no one ahead of it."""
    ahead = ticket - state.current - 1
    if not state.concurrency or ticket == FREE or ahead <= 0:
        return 0
    claims = ahead - (state.concurrency - live - 1)  # claims beyond the leases left over: must lapse first
    if claims <= 0:
        return 0
    return slot_of(state, state.current + claims) + LEASE_GRACE_US


def lease_wait(leases: Leases, now_us: int) -> int:
    """How long a start held by a full cap waits before asking again (at least 1 µs)."""
    earliest = leases.earliest()
    return max(min(LEASE_POLL_US, (earliest if earliest is not None else now_us + LEASE_POLL_US) - now_us), 1)


def give_back(state: QueueState | None, leases: Leases, member: str, now_us: int) -> bool:
    """The end of a body gives its lease back (a finish of any kind, in the finish's own
    step); whether it was kept. A full cap's release shifts the line (:func:`release_shift`)."""
    count = read_leases(state, leases, now_us)
    kept = leases.remove(member)
    if kept and state is not None and state.concurrency and count >= state.concurrency:
        release_shift(state, now_us)
    return kept


def renew_leases(state: QueueState | None, leases: Leases, members: Sequence[str], now_us: int, lease_us: int) -> int:
    """The bodies of ``members`` still run: their leases now expire ``lease_us`` from now
    (those already expired and forgotten are not taken again); how many were renewed."""
    read_leases(state, leases, now_us)
    return leases.renew(members, now_us + lease_us)


def new_state(now_us: int, interval_us: int, epoch: str, limits: Limits = NO_LIMITS) -> QueueState:
    # last_start = now: a state created from nothing (a new queue, or one whose store was
    # wiped) cannot know when the last start happened, so the first start waits one
    # interval. That is the whole cost of surviving a lost state without a burst. With a
    # burst, the credit starts spent (T = now + (burst + 1) intervals): still one interval.
    state = QueueState(epoch, interval_us, 0, 0, now_us, now_us, False, 0, 0)
    set_limits(state, limits)
    state.last_start_us = now_us + state.burst * state.interval_us
    return state


def _limit_fields(limits: Limits) -> tuple[int, int, int, int, int]:
    quota = limits.quota if limits.window_us > 0 else 0
    return (max(limits.burst, 0), max(quota, 0), limits.window_us if quota > 0 else 0, max(limits.concurrency, 0),
            max(limits.margin_us, 0))  # fmt: skip


def set_limits(state: QueueState, limits: Limits) -> None:
    """The code declares other limits (mutates ``state``). A smaller burst takes its
    credit away at once (the theoretical arrival time is kept, so the cap moves later),
    a larger one gives credit as the line runs. A smaller concurrency cap holds new starts
    until enough running bodies give their leases back; none is taken away. The margin is
    added to the interval and the window in force (``interval_us``, ``window_us``): every
    decision spaces starts and counts windows with it."""
    interval = state.declared_interval_us
    state.burst, state.quota, window, state.concurrency, state.margin_us = _limit_fields(limits)
    state.interval_us = interval + state.margin_us
    state.window_us = window + state.margin_us if state.quota else 0


def cap(state: QueueState) -> int:
    """The rate cap: no start before it. GCRA: the theoretical arrival time
    ``last_start + interval`` less the burst tolerance (burst 0: ``last_start + interval``)."""
    return state.last_start_us + state.interval_us - state.burst * state.interval_us


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


class WindowUnits:
    """The window's cost units as one sequence: the units kept (1 .. m, oldest first),
    then the units of the tickets in line (m + j: ticket current + j), each estimated to
    start at the later of its interval slot and the time the unit ``quota`` places before
    it leaves the window. Memoized: a claim estimates many tickets at once.

    Built first by every operation that reads the window: it forgets the starts that left
    the window, and when the window held the head until one of them left, the line is due
    from that time (the anchor moves there): a head the window held is not late, so
    neither the outage shift nor the burst counts the wait as lateness.

    The last start is kept while its body may still report (:func:`began`), however old:
    its report moves it to when the body began, where the window must count it. A unit
    older than the window places no slot later than now, so keeping it delays nothing."""

    def __init__(self, state: QueueState, window: Window, now_us: int) -> None:
        cutoff = now_us - state.window_us
        # The unit whose leaving lets the head in (a full window held it): if it left, the
        # line is due from then, not late (mutates ``state``: the anchor).
        unit = window.used() + 1 - state.quota
        if unit >= 1 and (left := window.unit_time(unit)) <= cutoff:
            state.anchor_us = max(state.anchor_us, left + state.window_us - state.interval_us)
        window.trim(window_cutoff(state, now_us))
        self.state, self.window, self.m = state, window, window.used()
        self._times: dict[int, int] = {}

    def time(self, unit: int) -> int | None:
        """When unit ``unit`` starts (None: before the first unit kept, long gone)."""
        if unit < 1:
            return None
        if unit <= self.m:
            return self.window.unit_time(unit)
        s, chain = self.state, []
        while unit > self.m and unit not in self._times:  # down the chain, a quota at a time
            chain.append(unit)
            unit -= s.quota
        below = self._times.get(unit) if unit > self.m else self.time(unit)
        for u in reversed(chain):
            spacing = max(s.anchor_us + (u - self.m) * s.interval_us, cap(s))
            below = spacing if below is None else max(spacing, below + s.window_us)
            self._times[u] = below
        return below

    def slot(self, ticket: int, cost: int) -> int:
        """When the window lets ``ticket`` start with ``cost`` (0: now): the unit ``quota``
        places before its last unit must have left, counting the units of the tickets
        ahead of it in line; and in any case (a ticket ahead that never came) the window
        must hold its own cost."""
        s = self.state
        units = min(cost, s.quota)  # a start costlier than the quota counts as the whole quota
        ahead = ticket - s.current - 1 if ticket > s.current else 0
        hard = self.time(self.m + units - s.quota)
        line = self.time(self.m + ahead + units - s.quota)
        return max(0 if hard is None else hard + s.window_us, 0 if line is None else line + s.window_us)


def window_cutoff(state: QueueState, now_us: int) -> int:
    """The window forgets the starts at or before this time: those that left it (the window
    ending now), but not the last start while its body may still report that it began
    (``pending_us`` not 0: awaited, or reported and may report again; see :func:`began`)."""
    cutoff = now_us - state.window_us
    return min(cutoff, state.started_us - 1) if state.pending_us else cutoff


def window_used(window: Window, cutoff_us: int) -> int:
    """Cost units of the starts after ``cutoff_us`` (the window ending now), read only: a
    reader forgets nothing, since the starts that left decide where the anchor moves (see
    :class:`WindowUnits`)."""
    lo, hi = 0, window.used()  # the units at or before the cutoff: 1 .. lo (oldest first)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if window.unit_time(mid) <= cutoff_us:
            lo = mid
        else:
            hi = mid - 1
    return window.used() - lo


class _ReadView:
    """A :class:`Window` read without a write: its trim only hides the starts that left."""

    def __init__(self, window: Window) -> None:
        self.window, self.gone = window, 0

    def trim(self, cutoff_us: int) -> None:
        self.gone = self.window.used() - window_used(self.window, cutoff_us)

    def used(self) -> int:
        return self.window.used() - self.gone

    def unit_time(self, unit: int) -> int:
        return self.window.unit_time(unit + self.gone)

    def add(self, t_us: int, cost: int) -> None:
        raise TypeError("a status reads the window, it does not write it")

    def move(self, from_us: int, to_us: int) -> None:
        raise TypeError("a status reads the window, it does not write it")


def status_window(state: QueueState, window: Window | None, now_us: int) -> tuple[int, int]:
    """When the window quota lets the head of the line start, and the last ticket claimed
    (0 when it allows it now, or without a quota or a backlog), each as a start of cost 1,
    as a claim estimates it (:meth:`WindowUnits.slot`); read only, for the status (neither
    ``state`` nor ``window`` changes)."""
    if not state.quota or window is None:
        return 0, 0
    units = WindowUnits(replace(state), _ReadView(window), now_us)
    last = units.slot(state.ticket, 1) if state.ticket > state.current else 0
    return units.slot(state.current + 1, 1), last


def window_units(state: QueueState, window: Window | None, now_us: int) -> WindowUnits | None:
    """The window read at ``now_us`` (see :class:`WindowUnits`; mutates ``state``), or None
    without a quota."""
    if not state.quota or window is None:
        return None
    return WindowUnits(state, window, now_us)


def window_slot(state: QueueState, window: Window | None, ticket: int, cost: int, now_us: int) -> int:
    """The earliest store time at which the window quota lets ``ticket`` start with
    ``cost`` (0: the window allows it now, or the queue has no quota)."""
    units = window_units(state, window, now_us)
    return 0 if units is None else units.slot(ticket, cost)


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


def too_many_lost(unfinished: int, max_lost: int) -> bool:
    """Whether a task id is refused as a poison message: ``unfinished`` counts its
    authorized starts since its last finish of any kind (success, failure, a retry's, a
    back-off's), each one a delivery lost with its worker process (or a copy still
    running); at ``max_lost`` of them it is not started again (0: no limit). The count is
    kept as long as finished records are, and goes with the queue's state."""
    return 0 < max_lost <= unfinished


def running_copy(leases: Leases | None, task_id: str | None, now_us: int) -> int:
    """The expiry of the live lease of a run of ``task_id`` (0: none). A start takes a lease
    named by its task id, renewed while its body runs and given back by its finish, so a
    live one means a copy of this task still runs (or its process died less than
    ``siq_lease_timeout`` ago): another copy (a redelivery, a broker's visibility timeout
    passed) is not started now but answered RUNNING, and asks again at the expiry."""
    if leases is None or not task_id:
        return 0
    expires = leases.expires(task_id)
    return expires if expires is not None and expires > now_us else 0


def own_start(leases: Leases | None, task_id: str | None, token: str, now_us: int) -> RunOwner | None:
    """The start the call holding ``token`` was given already: the live lease of a run of
    ``task_id`` taken by that call (None: none). Its reply was lost on the way back and it
    asks again (the store unreachable to it, a timeout): it adopts that start, and is not
    answered RUNNING by its own lease, which only another delivery of the task is."""
    if not token or not running_copy(leases, task_id, now_us):
        return None
    assert leases is not None and task_id
    owner = leases.owner(task_id)
    return owner if owner is not None and owner.token == token else None


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


def start_lead_us(interval_us: int) -> int:
    """How long before its slot a start whose body reports may be authorized: a quarter of
    the interval, 5 ms at most. It is recorded at its slot, and its process holds the body
    until then (the authorization's ``wait_us``), so the work between the authorization and
    the body (the reply, Celery's trace) is done before the slot instead of after it, where
    the body's report would move the line by it."""
    return min(interval_us // 4, 5_000)


def _within_lead(state: QueueState, decision: Decision) -> bool:
    """Whether ``decision`` waits for its slot only (every other wait is positive and not
    the distance to its slot), and the slot is within the lead."""
    if decision.verdict is not Verdict.WAIT or decision.full:
        return False
    return decision.wait_us == decision.slot_us - decision.now_us <= start_lead_us(state.interval_us)


def _live(state: QueueState, leases: Leases | None, now_us: int) -> int:
    """The live leases at ``now_us`` of a queue with a concurrency cap, 0 without one
    (reads the leases: :func:`read_leases`)."""
    return read_leases(state, leases, now_us) if state.concurrency and leases is not None else 0


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
    token: str = "", own: RunOwner | None = None, begin_wait_us: int = 0,
) -> list[Decision]:  # fmt: skip
    """One start that must pass several queues at once (a per-second and a per-day limit):
    authorized in all of them, or recorded in none. Queues that would authorize while
    another says wait answer WAIT with ``wait_us`` 0, so nothing is held in one queue
    while the start waits for another. The start has a place in one queue's line (its
    ticket); in the others its ticket is :data:`FREE`. When every queue authorizes, the
    first queue takes ``lease`` (the run's, checked there: ``running_us``) and each other
    queue with a concurrency cap takes one under the same member. ``token`` and ``own``:
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
        taken = [lease if i == 0 or state.concurrency else None for i, state in enumerate(states)]
        started = [
            replace(d, lease=commit_start(state, ticket, now_us, cost, window, lz, mine, begin_wait_us))
            for d, state, ticket, window, lz, mine in zip(decisions, states, tickets, wins, held, taken, strict=True)
        ]
        first = held[0]
        if token and started[0].lease and first is not None:
            first.set_owner(started[0].lease, RunOwner(token, now_us, max(d.slot_us for d in started)))
        return started
    return [replace(d, verdict=Verdict.WAIT, wait_us=0) if d.authorized else d for d in decisions]


# -- the counters the store keeps of authorized starts (the exporter reads them) --

#: Upper bounds (µs) of the lateness buckets of authorized starts against their slot: fine
#: below 10 ms, where the product's figures live, and on to seconds for a queue that falls
#: behind. The Lua scripts hold the same list (rules/counters.lua: SIQ_LATENESS_BUCKETS).
LATENESS_BUCKETS_US = (
    500, 1_000, 2_000, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000, 1_000_000, 2_500_000, 5_000_000,
    10_000_000,
)  # fmt: skip
#: A start closer than the interval less this to the one before counts as a gap (``siq
#: audit`` counts it the same way); none is expected.
GAP_TOLERANCE_US = 1000
#: Where the store keeps the time of the last start it counted (set, not added).
LAST_COUNTED = "last_us"


def lateness_bucket(late_us: int) -> int:
    """The bucket of a start ``late_us`` after its slot (len(LATENESS_BUCKETS_US): past the last)."""
    for i, bound in enumerate(LATENESS_BUCKETS_US):
        if late_us <= bound:
            return i
    return len(LATENESS_BUCKETS_US)


def start_counts(
    last_counted_us: int | None, now_us: int, slot_us: int, interval_us: int, deferrals: int = 0
) -> dict[str, int]:
    """What one authorized start adds to its queue's counters, kept by the store in the
    same atomic step as the start: ``starts``, ``deferrals`` (the task's, before it
    started), ``gaps`` (closer than ``interval_us`` less :data:`GAP_TOLERANCE_US` to the
    last start counted, at ``last_counted_us``), ``late_us`` (lateness against the slot)
    and ``late:<bucket>``. The store then sets :data:`LAST_COUNTED` to ``now_us``."""
    late = max(0, now_us - slot_us)
    added = {"starts": 1, "late_us": late, f"late:{lateness_bucket(late)}": 1}
    if deferrals > 0:
        added["deferrals"] = deferrals
    if last_counted_us is not None and now_us - last_counted_us < interval_us - GAP_TOLERANCE_US:
        added["gaps"] = 1
    return added


def counts_from_fields(fields: dict[str, int]) -> StartCounts:
    """The counters as a store keeps them (field -> number; missing fields are 0)."""
    return StartCounts(
        starts=fields.get("starts", 0),
        deferrals=fields.get("deferrals", 0),
        gaps_below_interval=fields.get("gaps", 0),
        lateness_sum_us=fields.get("late_us", 0),
        lateness_buckets=tuple(fields.get(f"late:{i}", 0) for i in range(len(LATENESS_BUCKETS_US) + 1)),
    )


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


def pause(state: QueueState) -> None:
    state.paused = True


def paused_new_state(now_us: int, epoch: str) -> QueueState:
    """A queue paused before any worker declared it (an operator preparing a deploy): no
    interval is known yet, so it has no spacing and no limits (:func:`no_limit_known`); the
    first declaration sets them (:func:`declare` takes the first one as the declaration) and
    the pause holds until resume."""
    state = new_state(now_us, NO_SPACING_US, epoch)
    state.paused = True
    return state


def no_limit_known(state: QueueState) -> bool:
    """No spacing, no quota and no cap: a queue paused before any declaration, which must
    not resume into running unlimited (a declaration or an operator's interval first)."""
    return state.interval_us <= NO_SPACING_US and not state.quota and not state.concurrency


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


# -- where the interval and the limits come from: the code's declarations and an operator's override --


def effective_interval(sources: IntervalSources, now_us: int) -> int:
    """The interval a queue runs at: an operator's override if set; else the slowest
    declaration of the live worker nodes (during a rolling deploy, old and new code side
    by side, the queue never runs faster than either); else the last declaration. 0: none
    of these (the interval stays as stored)."""
    if sources.override_us:
        return sources.override_us
    return max((n.interval_us for n in sources.live(now_us)), default=sources.declared_us)


def strictest(declared: Sequence[Limits]) -> Limits:
    """The limits at least as strict as each of ``declared`` (at least one), kind by kind:
    the smallest burst; a quota if any declares one, of the smallest N over the longest
    window among those that do (N' = min N in any W' = max W allows no more than any of
    them in its own window: at most N' <= N_i starts in W' >= W_i); the smallest
    concurrency cap among those that declare one (0, no cap, is the least strict)."""
    quotas = [(d.quota, d.window_us) for d in declared if d.quota > 0 and d.window_us > 0]
    caps = [d.concurrency for d in declared if d.concurrency > 0]
    return Limits(
        min(d.burst for d in declared),
        min(n for n, _ in quotas) if quotas else 0,
        max(w for _, w in quotas) if quotas else 0,
        min(caps, default=0),
        max(d.margin_us for d in declared),
    )


def effective_limits(sources: IntervalSources, now_us: int, stored: Limits) -> Limits:
    """The limits a queue runs at, kind by kind: an operator's override of that kind if
    set; else the strictest of the live worker nodes' declarations (a rolling deploy runs
    at the stricter code: :func:`strictest`); else the last declaration; else ``stored``
    (nothing declared: what the state was created with). Live nodes of an earlier version,
    which declared no limits, have no say."""
    live = [n.limits for n in sources.live(now_us) if n.limits is not None]
    declared = sources.declared_limits if sources.declared_limits is not None else stored
    base = strictest(live) if live else declared
    return _normal(sources.limits_override.apply(base))


def _normal(limits: Limits) -> Limits:
    return Limits(*_limit_fields(limits))


def apply_sources(state: QueueState, sources: IntervalSources, now_us: int) -> None:
    """The state runs at what its sources give (mutates ``state``): the effective interval
    (:func:`effective_interval`; none: the stored one stays) and limits
    (:func:`effective_limits`)."""
    state.interval_us = (effective_interval(sources, now_us) or state.declared_interval_us) + state.margin_us
    set_limits(state, effective_limits(sources, now_us, state.limits))


def follow_expiry(state: QueueState, sources: IntervalSources, now_us: int) -> IntervalSources | None:
    """The effective interval and limits follow the expiry of node declarations: when a
    stored node declaration has expired (a node that died, or missed its renewals), they
    are recomputed from the live ones and the expired ones are dropped; the new sources,
    or None when nothing expired (mutates ``state``). Every operation that decides by the
    interval runs it first, so a killed node's declaration stops counting exactly its TTL
    after its last renewal, on the store's clock, whether or not a live node declares in
    between. (The Lua scripts keep the earliest expiry in the state instead of reading the
    sources each time: ``siq_follow_expiry``.)"""
    if all(n.expires_us > now_us for n in sources.nodes):
        return None
    live = replace(sources, nodes=sources.live(now_us))
    apply_sources(state, live, now_us)
    return live


def _kinds_changed(old: Limits | None, new: Limits) -> LimitsOverride:
    """The kinds (as a :class:`LimitsOverride` whose set kinds are the changed ones, valued
    0) in which declaration ``new`` differs from ``old`` (None: every kind)."""
    return LimitsOverride(
        0 if old is None or old.burst != new.burst else None,
        0 if old is None or (old.quota, old.window_us) != (new.quota, new.window_us) else None,
        0,
        0 if old is None or old.concurrency != new.concurrency else None,
        0 if old is None or old.margin_us != new.margin_us else None,
    )


def _drop_kinds(override: LimitsOverride, kinds: LimitsOverride) -> tuple[LimitsOverride, LimitsOverride]:
    """(``override`` without the kinds set in ``kinds``, the part of it dropped)."""
    keep = LimitsOverride(
        override.burst if kinds.burst is None else None,
        override.quota if kinds.quota is None else None,
        override.window_us if kinds.quota is None else 0,
        override.concurrency if kinds.concurrency is None else None,
        override.margin_us if kinds.margin_us is None else None,
    )
    dropped = LimitsOverride(
        None if kinds.burst is None else override.burst,
        None if kinds.quota is None else override.quota,
        0 if kinds.quota is None or override.quota is None else override.window_us,
        None if kinds.concurrency is None else override.concurrency,
        None if kinds.margin_us is None else override.margin_us,
    )
    return keep, dropped


def _normal_override(override: LimitsOverride | None) -> LimitsOverride | None:
    """A negative value sets nothing (the Lua scripts' -1); a quota without a window is none."""
    if override is None:
        return None
    burst = override.burst if override.burst is not None and override.burst >= 0 else None
    concurrency = override.concurrency if override.concurrency is not None and override.concurrency >= 0 else None
    quota, window = override.quota, override.window_us
    if quota is not None and quota < 0:
        quota, window = None, 0
    elif quota is not None and (quota == 0 or window <= 0):
        quota, window = 0, 0
    margin = override.margin_us if override.margin_us is not None and override.margin_us >= 0 else None
    return LimitsOverride(burst, quota, window if quota is not None else 0, concurrency, margin)


def declare(
    state: QueueState,
    sources: IntervalSources,
    now_us: int,
    interval_us: int,
    *,
    node: str = "",
    ttl_us: int = 0,
    origin: str = "",
    announce: bool = True,
    limits: Limits = NO_LIMITS,
) -> tuple[IntervalSources, Declared]:
    """The code declares ``interval_us`` and ``limits`` for the queue (mutates ``state``).

    ``node`` (a worker's name) registers or renews its declaration for ``ttl_us`` (0:
    withdraws it, a worker shutting down); expired ones are dropped. ``announce`` (a
    worker starting, ``siq sync``) makes a declaration that differs from the last one the
    new declaration, replacing any override of what changed (the interval's override when
    the interval changed; of the limits, the override of each kind that changed): a deploy
    that changes the code wins over an earlier runtime change. A renewal never changes
    the declaration, so old and new workers side by side do not flip it back and forth.
    Then the effective interval and limits are recomputed (:func:`apply_sources`)."""
    limits = _normal(limits)
    nodes = {n.node: n for n in sources.live(now_us)}
    if node:
        if ttl_us > 0:
            nodes[node] = NodeDeclaration(node, interval_us, now_us + ttl_us, limits)
        else:
            nodes.pop(node, None)
    new = replace(sources, nodes=tuple(sorted(nodes.values(), key=lambda n: n.node)))
    replaced_us, replaced_by = 0, ""
    if (announce and interval_us != sources.declared_us) or not sources.declared_us:
        new = replace(new, declared_us=interval_us, declared_by=origin, declared_at_us=now_us)
        if announce and sources.override_us:
            replaced_us, replaced_by = sources.override_us, sources.override_by
            new = replace(new, override_us=0, override_by="", override_at_us=0)
    replaced_limits, replaced_limits_by = NO_OVERRIDE, ""
    if (announce and limits != sources.declared_limits) or sources.declared_limits is None:
        new = replace(new, declared_limits=limits)
        if announce and sources.limits_override:
            changed = _kinds_changed(sources.declared_limits, limits)
            kept, replaced_limits = _drop_kinds(sources.limits_override, changed)
            if replaced_limits:
                replaced_limits_by = sources.limits_override_by
                new = replace(new, limits_override=kept)
                if not kept:
                    new = replace(new, limits_override_by="", limits_override_at_us=0)
    old_interval, old_limits = state.interval_us, state.limits
    apply_sources(state, new, now_us)
    done = Declared(
        False, sources.declared_us, new.declared_us, old_interval, state.interval_us, replaced_us, replaced_by,
        sources.declared_limits, new.declared_limits, old_limits, state.limits, replaced_limits, replaced_limits_by,
    )  # fmt: skip
    return new, done


def pin(sources: IntervalSources, now_us: int, interval_us: int, origin: str = "") -> IntervalSources:
    """A reset that names an interval (``siq reset --interval``, ``ensure(reset=True)``):
    the caller wants that interval now, so it must not be undone by the next renewal of
    the workers' declarations. It becomes the declaration when there is none, clears the
    override when the declarations give it anyway, and is the override otherwise."""
    if not sources.declared_us and not sources.nodes:
        return replace(sources, declared_us=interval_us, declared_by=origin, declared_at_us=now_us)
    if interval_us == effective_interval(replace(sources, override_us=0), now_us):
        return replace(sources, override_us=0, override_by="", override_at_us=0)
    return replace(sources, override_us=interval_us, override_by=origin, override_at_us=now_us)


def override(
    state: QueueState, sources: IntervalSources, now_us: int, interval_us: int | None, origin: str = ""
) -> IntervalSources:
    """An operator sets the queue's interval at runtime (``interval_us``), or clears an
    override (None): back to what the code declares (mutates ``state``). The override
    holds across worker restarts whose declaration is unchanged."""
    if interval_us:
        new = replace(sources, override_us=interval_us, override_by=origin, override_at_us=now_us)
    else:
        new = replace(sources, override_us=0, override_by="", override_at_us=0)
    apply_sources(state, new, now_us)
    return new


def override_limits(
    state: QueueState, sources: IntervalSources, now_us: int, override: LimitsOverride | None, origin: str = ""
) -> IntervalSources:
    """An operator overrides some of the queue's limits at runtime (the kinds ``override``
    sets; the others keep theirs, overridden or not), or clears every override of them
    (None): back to what the code declares (mutates ``state``). The override holds across
    worker restarts whose declaration of a kind is unchanged; an announcement that changes
    a kind replaces its override (:func:`declare`)."""
    override = _normal_override(override)
    if override:
        merged = sources.limits_override.merged(override)
        new = replace(sources, limits_override=merged, limits_override_by=origin, limits_override_at_us=now_us)
    else:
        new = replace(sources, limits_override=NO_OVERRIDE, limits_override_by="", limits_override_at_us=0)
    apply_sources(state, new, now_us)
    return new


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


# Fair shares among keys under one limit: start-time fair queuing
# (docs/design.md, "Fair shares"). Each key with waiting work has the virtual start tag of its head; the next
# ticket of the shared queue goes to the head of the key with the smallest tag (ties: the
# smaller key), which moves the queue's virtual time to that tag and the key's tag on by
# its task's cost over its weight. A key that had no work rejoins at the virtual time (no
# credit for its idle time), or at its last finish tag if it was served so recently that
# the virtual time has not reached it (no jumping ahead by emptying and refilling).
# Virtual time counts FAIR_SCALE per cost unit of weight 1: integers, exact in Lua doubles.
FAIR_SCALE = 720_720  # lcm(1..16): weights 1 to 16 advance tags by whole numbers
MAX_FAIR_WEIGHT = 1_000


class FairLines(Protocol):
    """A fair queue's waiting work by key. A store keeps it beside the queue's state (Redis:
    a sorted set of active keys by tag, one of recent finish tags, a list per key; SQLite:
    tables; memory: :class:`DictFairLines`)."""

    def vtime(self) -> int:
        """The queue's virtual time: the tag of the last head handed a ticket."""

    def set_vtime(self, vtime: int) -> None: ...

    def head_tag(self, key: str) -> int | None:
        """The start tag of ``key``'s head (None: the key has no waiting work)."""

    def smallest(self) -> tuple[int, str] | None:
        """(tag, key) of the active key with the smallest tag (ties: the smaller key)."""

    def set_head_tag(self, key: str, tag: int | None) -> None:
        """``key`` active at ``tag``, or (None) inactive."""

    def finish_tag(self, key: str) -> int | None:
        """The finish tag of ``key``'s last head handed a ticket, while kept."""

    def set_finish_tag(self, key: str, tag: int) -> None: ...

    def largest_finish_tag(self) -> int | None:
        """The largest finish tag kept (None: none)."""

    def forget_finish_tags(self, through: int) -> None:
        """Forget the finish tags at or below ``through`` (the virtual time reached them)."""

    def push(self, key: str, task_id: str, cost: int, weight: int) -> None:
        """Append a task to ``key``'s line (``weight``: the key's, from now on)."""

    def pop(self, key: str) -> tuple[str, int, int]:
        """Take ``key``'s head: (task id, cost, the key's weight)."""

    def waiting(self, key: str) -> int:
        """Tasks in ``key``'s line."""


class DictFairLines:
    """:class:`FairLines` in memory (the memory store's, and the reference's). The smallest
    head and the finish tags to forget are found in heaps, so neither gets slower with the
    number of keys (an entry a key's newer tag replaced is dropped when it comes up)."""

    def __init__(self) -> None:
        self.v = 0
        self.heads: dict[str, int] = {}
        self.finishes: dict[str, int] = {}
        self.lines: dict[str, deque[tuple[str, int]]] = {}
        self.weights: dict[str, int] = {}
        self._head_heap: list[tuple[int, str]] = []
        self._finish_heap: list[tuple[int, str]] = []

    def vtime(self) -> int:
        return self.v

    def set_vtime(self, vtime: int) -> None:
        self.v = vtime

    def head_tag(self, key: str) -> int | None:
        return self.heads.get(key)

    def smallest(self) -> tuple[int, str] | None:
        heap = self._head_heap
        while heap and self.heads.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def set_head_tag(self, key: str, tag: int | None) -> None:
        if tag is None:
            self.heads.pop(key, None)
        else:
            self.heads[key] = tag
            heapq.heappush(self._head_heap, (tag, key))

    def finish_tag(self, key: str) -> int | None:
        return self.finishes.get(key)

    def set_finish_tag(self, key: str, tag: int) -> None:
        self.finishes[key] = tag
        heapq.heappush(self._finish_heap, (tag, key))

    def largest_finish_tag(self) -> int | None:
        return max(self.finishes.values(), default=None)

    def forget_finish_tags(self, through: int) -> None:
        heap = self._finish_heap
        while heap and heap[0][0] <= through:
            tag, key = heapq.heappop(heap)
            if self.finishes.get(key) == tag:
                del self.finishes[key]

    def push(self, key: str, task_id: str, cost: int, weight: int) -> None:
        self.lines.setdefault(key, deque()).append((task_id, cost))
        self.weights[key] = weight

    def pop(self, key: str) -> tuple[str, int, int]:
        task_id, cost = self.lines[key].popleft()
        weight = self.weights[key]
        if not self.lines[key]:
            del self.lines[key], self.weights[key]
        return task_id, cost, weight

    def waiting(self, key: str) -> int:
        return len(self.lines.get(key, ()))


def fair_check(key: str, weight: int, costs: Sequence[int]) -> None:
    """ValueError unless every cost is 1 or more and the weight is 1..MAX_FAIR_WEIGHT."""
    for cost in costs:
        if cost < 1 or not 1 <= weight <= MAX_FAIR_WEIGHT:
            raise ValueError(f"fair share of {key!r}: cost {cost} must be >= 1, weight {weight} 1..{MAX_FAIR_WEIGHT}")
    if not 1 <= weight <= MAX_FAIR_WEIGHT:
        raise ValueError(f"fair share of {key!r}: weight {weight} must be 1..{MAX_FAIR_WEIGHT}")


def fair_push(lines: FairLines, key: str, task_id: str, cost: int, weight: int) -> None:
    """A task of ``key`` waits for its share; a key with no work before joins now. (A cost
    of 0 would never move its key's tag, and a weight of 0 has no share: both refused.)"""
    fair_check(key, weight, [cost])
    if lines.head_tag(key) is None:
        lines.set_head_tag(key, max(lines.vtime(), lines.finish_tag(key) or 0))
    lines.push(key, task_id, cost, weight)


class FairTurn(NamedTuple):
    """A task handed the shared queue's next ticket (:func:`fair_next`): its key, id and
    cost, the virtual start tag it was served at and its key's weight (the last two go
    with it to the ledger, for the audit: see :func:`siq_celery.messages.with_fair_share`)."""

    key: str
    task_id: str
    cost: int
    tag: int
    weight: int


def fair_next(lines: FairLines) -> FairTurn | None:
    """The next task to hand a ticket of the shared queue, taken from its line (None: no
    key has work). The tags served are nondecreasing until no key has work left, when the
    virtual time starts over from 0 (what the audit checks)."""
    head = lines.smallest()
    if head is None:
        return None
    tag, key = head
    task_id, cost, weight = lines.pop(key)
    finish = tag + cost * FAIR_SCALE // weight
    lines.set_finish_tag(key, finish)
    lines.set_head_tag(key, finish if lines.waiting(key) else None)
    # The virtual time moves to the tag served. When no key has work left (SFQ's idle
    # rule: every key rejoins even), nothing is kept and it starts over from 0, so tags
    # stay far below 2**53 (Lua's exact integers) whatever the queue's age.
    if lines.smallest() is None:
        lines.forget_finish_tags(max(tag, lines.largest_finish_tag() or 0))
        lines.set_vtime(0)
    else:
        lines.set_vtime(tag)
        lines.forget_finish_tags(tag)
    return FairTurn(key, task_id, cost, tag, weight)


#: How far ahead a fair queue hands out its tickets: about this much of its slots, at
#: least FAIR_LOOKAHEAD_MIN and at most FAIR_LOOKAHEAD_MAX tickets (a queue without spacing,
#: whose interval is 1 µs, or one at a fraction of a millisecond), and with a concurrency
#: cap at most the cap and FAIR_LOOKAHEAD_MIN more. A key that arrives gets a ticket within
#: the lookahead; a longer one would only delay it.
FAIR_LOOKAHEAD_US = 250_000
FAIR_LOOKAHEAD_MIN = 4
FAIR_LOOKAHEAD_MAX = 64


def fair_lookahead(interval_us: int, concurrency: int = 0) -> int:
    """Tickets a fair queue keeps handed out ahead of its starts."""
    ahead = min(FAIR_LOOKAHEAD_MAX, max(FAIR_LOOKAHEAD_MIN, -(-FAIR_LOOKAHEAD_US // max(interval_us, 1))))
    return min(ahead, concurrency + FAIR_LOOKAHEAD_MIN) if concurrency else ahead


def fair_room(state: QueueState, now_us: int) -> int:
    """How many more tickets a fair queue may hand out now: the lookahead less the tickets
    handed out and not yet started. Those that will never start (a revoked or expired task,
    a lost message, a duplicate) would hold the lookahead forever: once the newest ticket's
    slot is more than :func:`outage_us` past with none of them started since, a whole
    lookahead more goes out (at most once per outage span, as the newest slot then moves)."""
    ahead = fair_lookahead(state.interval_us, state.concurrency)
    handed = state.ticket - state.current
    if handed > 0 and max(slot_of(state, state.ticket), state.last_start_us) + outage_us(state.interval_us) < now_us:
        return ahead
    return ahead - handed


def fair_promote(
    state: QueueState, lines: FairLines, now_us: int, window: Window | None = None
) -> list[tuple[int, FairTurn]]:
    """Hand tickets of the shared queue to the fair heads, in fair order, while fewer than
    the lookahead are handed out and not yet started; (first ticket, turn) of each (a
    task of cost c takes c tickets, as its claim would). None while paused: a key that
    arrives during a pause gets its share when the queue resumes."""
    promoted: list[tuple[int, FairTurn]] = []
    if state.paused:
        return promoted
    room = fair_room(state, now_us)
    while room > 0:
        head = fair_next(lines)
        if head is None:
            break
        promoted.append((claim(state, head.cost, now_us, window).first, head))
        room -= head.cost
    return promoted
