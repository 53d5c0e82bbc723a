"""The window quota: at most ``quota`` cost units start in any sliding window of
``window_us`` (:func:`window_slot`), over the starts the queue's :class:`Window` keeps;
ticket order holds, and the tickets behind the head are estimated from the window's
pattern (:class:`WindowUnits`).

Twin: ``window.lua`` beside this module. Times in integer microseconds, store's clock."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

from ..types import QueueState
from .spacing import cap


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
