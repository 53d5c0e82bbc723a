"""Several limits on one start: a per-second and a per-day quota, say.

>>> store = backend_from_url(URL)  # one store (one client) for the combined queues
>>> limits = CombinedQueue([IntervalQueue("{geo}per-second", backend=store, interval="100ms"),
...                         IntervalQueue("{geo}per-day", backend=store, quota="10000/d")])
>>> with limits.slot():
...     call_api()

A start is authorized in every queue in one atomic step of the store, or recorded in
none: nothing is held in one queue while the start waits for another, so there is no
deadlock. The start has a place in line (a ticket) in one queue only, the *primary*: the
slowest limit, by its interval or its window quota's average pace, the limit that binds.
In the others it takes the next free slot, as a late ticket does, and so never reserves
a slot there: a paused or exhausted daily quota holds nothing of the per-second queue,
whose other users go on at its pace.

A Celery task declares one with ``interval_queue`` a list or a mapping of queues
(:func:`declared_combined_queue`).

On Redis Cluster one script can only use keys of one hash slot: give the combined queues
a shared hash tag, ``{geo}per-second`` and ``{geo}per-day`` (see keys.py). A single Redis
server, SQLite and memory take any names.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from ..errors import ConfigurationError, StoreUnavailableError
from ..ledger import StartRecord
from ..limits import check_not_a_quota
from ..rules import BEGIN_WAIT_US, FREE
from ..types import Decision, Ticket
from .body import begin_body, report_again_if_late
from .control import new_epoch
from .leases import KEEPER
from .queue import IntervalQueue, logger, validate_cost
from .waiting import wait_in_line


def pace_us(queue: IntervalQueue) -> float:
    """A queue's slowest pace: its interval, or its window over its quota if longer."""
    limits = queue.limits
    return max(queue.interval_us or 0, limits.window_us / limits.quota if limits.quota else 0)


class CombinedQueue:
    """Interval queues of one store that every start must pass at once."""

    def __init__(self, queues: Sequence[IntervalQueue]) -> None:
        queues = list(queues)
        names = [q.name for q in queues]
        if len(queues) < 2 or len(set(names)) != len(names):
            raise ConfigurationError(f"a combined limit takes two or more different queues, not {names!r}")
        if any(q.backend is not queues[0].backend for q in queues):
            raise ConfigurationError(f"the queues of a combined limit {names!r} must use one store (one backend)")
        self.queues, self.backend, self.name = queues, queues[0].backend, "+".join(names)
        #: The queue where a start has its place in line: the slowest limit (the first of equals),
        #: by its interval or its window quota's average, whichever is longer (a daily quota
        #: binds more than a per-second spacing).
        self.primary = max(queues, key=pace_us)
        self._nap, self._wake_nap, self._monotonic = queues[0]._nap, queues[0]._wake_nap, queues[0]._monotonic
        self._read_answer = queues[0]._read_answer

    @property
    def queue_names(self) -> list[str]:
        """The store queues a start is recorded in: every queue of the limit."""
        return [q.name for q in self.queues]

    def __repr__(self) -> str:
        return f"<CombinedQueue {[q.name for q in self.queues]!r} primary={self.primary.name!r}>"

    def claim(self, cost: int = 1) -> Ticket:
        """A place in the primary queue's line (one round trip)."""
        return self.primary.claim(cost)

    def start(
        self, ticket: Ticket, *, task_id: str | None = None, record: StartRecord | None = None, cost: int = 1,
        token: str = "", reports: bool = False,
    ) -> list[Decision]:  # fmt: skip
        """Ask every queue at once (``ticket`` in the primary, the next free slot in the
        others); authorized in all of them or recorded in none. One decision per queue.
        ``token`` and ``reports``: as in :meth:`IntervalQueue.start`."""
        if ticket.queue != self.primary.name:
            raise ConfigurationError(f"{self!r}: the ticket is for {ticket.queue!r}, not the primary queue")
        mine = [q is self.primary for q in self.queues]
        return self.backend.start_all(
            [q.name for q in self.queues], [ticket.number if m else FREE for m in mine],
            [ticket.epoch if m else "" for m in mine], task_id=task_id,
            interval_us=[q.interval_us or 0 for q in self.queues], new_epoch=new_epoch(), record=record,
            cost=validate_cost(cost), limits=[q.limits for q in self.queues], token=token,
            begin_wait_us=BEGIN_WAIT_US if reports else 0,
        )  # fmt: skip

    def began(self, decision: Decision, *, wait: bool = False, task_id: str = "") -> bool:
        """As :meth:`IntervalQueue.began`, in every queue (the start has one time in all)."""
        return all([q.began(decision, wait=wait, task_id=task_id) for q in self.queues])

    def wait_for_turn(
        self,
        ticket: Ticket | None = None,
        *,
        task_id: str | None = None,
        timeout: float | None = None,
        max_sleep: float | None = None,
        defer_paused: bool = False,
        record: StartRecord | None = None,
        cost: int = 1,
        full_hold: float | None = None,
        reports: bool = False,
    ) -> Decision:
        """As :meth:`IntervalQueue.wait_for_turn` (``ticket`` is the primary queue's):
        blocks until the start is authorized in every queue, and returns the decision
        (its ``slot_us`` is the latest of the queues' slots)."""
        return wait_in_line(
            self, None if ticket is None else [ticket], task_id=task_id, timeout=timeout,
            max_sleep=max_sleep, defer_paused=defer_paused, record=record, cost=cost, full_hold=full_hold,
            reports=reports,
        )[0]  # fmt: skip

    @property
    def max_lost_deliveries(self) -> int:
        return self.backend.max_lost_deliveries

    def finish(self, task_id: str, outcome: str = "SUCCESS", *, remember: bool = True, lease: str = "") -> None:
        """Record the finish in every queue (a redelivered copy is then not started), and
        give back the concurrency ``lease`` in each queue that holds it."""
        for q in self.queues:
            q.backend.finish(q.name, task_id, outcome, remember=remember, lease=lease)

    def renew_leases(self, leases: Sequence[str]) -> int:
        """The bodies holding ``leases`` still run: renew them in every queue."""
        return sum(q.backend.renew_leases(q.name, leases) for q in self.queues)

    @contextmanager
    def slot(
        self, *, task_id: str | None = None, timeout: float | None = None, name: str = "slot", cost: int = 1
    ) -> Iterator[Decision]:
        """Block until every queue lets this caller start, then run the ``with`` body."""
        ledger_id = task_id or secrets.token_hex(16)
        record = StartRecord.here(name, ledger_id)
        decision = begin_body(
            self, ledger_id,
            lambda: self.wait_for_turn(task_id=task_id, timeout=timeout, record=record, cost=cost, reports=True),
        )  # fmt: skip
        outcome = "FAILURE"
        try:
            report_again_if_late(decision)
            yield decision
            outcome = "SUCCESS"
        finally:
            KEEPER.drop(self.backend, self.queue_names, decision.lease)
            try:
                self.finish(ledger_id, outcome, remember=task_id is not None, lease=decision.lease)
            except StoreUnavailableError as exc:  # the body ran; only its record is missing
                logger.warning("%r: could not record the finish of %s: %s", self, ledger_id, exc)

    # -- the hooks of wait_in_line ---------------------------------------------------

    def claim_tickets(self, cost: int) -> list[Ticket]:
        return [self.claim(cost)]

    def ask(
        self, tickets: list[Ticket], task_id: str | None, record: StartRecord | None, cost: int, token: str = "",
        reports: bool = False,
    ) -> list[Decision]:  # fmt: skip
        return self.start(tickets[0], task_id=task_id, record=record, cost=cost, token=token, reports=reports)

    def settle(self, decision: Decision, tickets: list[Ticket], round_trip: float) -> Decision:
        return decision  # a late reply is not re-stamped here: each queue's cap already holds


def declared_combined_queue(
    task: str, declared: Any, interval: Any, queue: Callable[[str, Any], IntervalQueue]
) -> CombinedQueue:
    """The CombinedQueue of a task declared with several interval queues: a mapping of
    name to interval, or a list of names with ``interval`` a list of as many (or one
    interval for all). ``queue(name, interval)`` gives each IntervalQueue (the app's,
    app_state.SiqState.queue)."""
    if isinstance(declared, Mapping):
        names, intervals = list(declared), list(declared.values())
        for queue_name, value in declared.items():
            check_not_a_quota(value, f"task {task}: interval_queue[{queue_name!r}]")
    elif isinstance(declared, (list, tuple)):
        names = list(declared)
        intervals = list(interval) if isinstance(interval, (list, tuple)) else [interval] * len(names)
    else:
        raise ConfigurationError(f"task {task}: interval_queue={declared!r} is not a name, a list or a mapping")
    if len(intervals) != len(names):
        raise ConfigurationError(
            f"task {task}: {len(names)} interval queues but {len(intervals)} intervals ({intervals!r})"
        )
    return CombinedQueue([queue(n, i) for n, i in zip(names, intervals, strict=True)])
