"""Waiting in ticket order inside one process that runs many tasks at once (a green pool).

A prefork process waits for one start at a time. A gevent or eventlet worker with ``-c 50``
holds up to 50 tasks of a queue at once, most of them for slots far down the line (at a
short interval their tasks wait in the broker's queue and whichever greenlet is free takes
the next one: 100 greenlets of a fleet hold a second of line at 10 ms). Left to itself each
would ask the store again and again as its slot nears: the store's estimate of a slot far
down a line that runs late is early, so it asked about 8 times per start, every one of them
a round trip through the one hub that also wakes the bodies (measured: round trips of
1.7 ms median, 23 ms p99, on loopback), and those beyond ``siq_max_sleep`` were sent back
to the broker (a re-publish and Celery's Ignore handling each, which held the hub for tens
of milliseconds: 478 deferrals for 300 tasks).

:class:`Admission` lets only the ``width`` tasks with the lowest tickets of a queue in this
process wait for their turn (ask the store, sleep, ask again, or be deferred); the others
wait here without a word to the store, and are let in, in ticket order, as those ahead of
them start (or end their wait any other way). The head of a process's line is the head of
the fleet's give or take the other nodes' tickets in between, so its wait is a few
intervals, well within ``siq_max_sleep``.

Nothing here decides a start: the store still authorizes every one, and a task let in late
(a ticket below one that started) takes the next free slot as any late ticket does. It
uses the threading module's primitives, which a green pool's monkey-patching makes
cooperative.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

#: Tasks of one queue that wait for their turn at once in one process (the others wait
#: here). Two: while the head asks for its slot, the next one is already near its own.
WIDTH = 2


@dataclass
class _Line:
    admitted: int = 0
    waiting: list[tuple[int, int, threading.Event]] = field(default_factory=list)


class Admission:
    """The tasks of this process waiting for their turn, by queue and ticket."""

    def __init__(self, width: int = WIDTH) -> None:
        self.width = width
        self._lock = threading.Lock()
        self._lines: dict[str, _Line] = {}
        self._order = itertools.count()  # equal tickets (another epoch's): first come first

    @contextmanager
    def turn(self, queue: str, ticket: int) -> Iterator[None]:
        """Wait until ticket ``ticket`` of ``queue`` is among the ``width`` lowest of this
        process's waiting tasks of that queue, then run the ``with`` body (the wait for the
        store's authorization); leaving it lets the next one in."""
        entry = (ticket, next(self._order), threading.Event())
        with self._lock:
            line = self._lines.setdefault(queue, _Line())
            heapq.heappush(line.waiting, entry)
            self._let_in(line)
        admitted = False
        try:
            entry[2].wait()
            admitted = True
            yield
        finally:
            with self._lock:
                if admitted or entry[2].is_set():
                    line.admitted -= 1
                else:  # killed while waiting here (a revoke that terminates, a time limit)
                    line.waiting.remove(entry)
                    heapq.heapify(line.waiting)
                self._let_in(line)
                if not line.admitted and not line.waiting:
                    del self._lines[queue]

    def _let_in(self, line: _Line) -> None:
        while line.admitted < self.width and line.waiting:
            _, _, event = heapq.heappop(line.waiting)
            line.admitted += 1
            event.set()

    def waiting(self, queue: str) -> tuple[int, int]:
        """(let in, waiting here) of ``queue`` (for tests and people)."""
        with self._lock:
            line = self._lines.get(queue)
            return (line.admitted, len(line.waiting)) if line is not None else (0, 0)


#: The admission of this process (used by the gate on a green pool).
ADMISSION = Admission()
