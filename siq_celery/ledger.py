"""The execution ledger: one record per authorized start, completed by its finish.

The store writes a start record in the same atomic step that authorizes the start (on
Redis: the same script, into a capped stream with the queue's hash tag; on SQLite: a
row in the same transaction), and the finish record with the finish. ``siq export``
turns them into rows of the schema below, which ``siq audit`` reads.

Schema version 5 (``v``), one row per authorized start; times are integer microseconds
since the Unix epoch on the store's clock:

======================  ======================================================
``v``                   schema version (5)
``queue``               interval queue
``epoch``               life of the queue's state the ticket belongs to
``ticket``              ticket number (ticket order is start order); a start of cost c holds
                        tickets ``ticket .. ticket + c - 1``; 0: a start with no place in
                        this queue's line (a combined limit's other queues)
``task_id``             Celery task id (or the id given to ``slot()``); may be null
``task_name``           task name (``slot()`` users: ``"slot"`` unless named)
``slot_us``             the slot the start was measured against
``start_us``            the authorized start
``interval_us``         the queue's interval when the start was authorized
``finish_us``           when the finish was recorded (null: not finished, or lost)
``outcome``             ``SUCCESS`` / ``FAILURE`` (null without a finish); ``RETRY``,
                        ``BACKOFF`` or the state of a body that ended otherwise
``deferrals``           times the task was sent back to wait before this start
``host``                worker node name (Celery) or host name
``pid``                 process id of the starting process
``cost``                slots the start took (``cost=``): the next start may come
                        ``cost x interval`` after it
``burst``               the queue's burst when the start was authorized (0: none)
``quota``               its window quota, in cost units (0: none); the start counts
                        ``min(cost, quota)`` units of the window
``window_us``           the quota's window (0: no quota)
``concurrency``         its concurrency cap (0: none); a start under a cap took a lease
``lease_us``            the time to live of the lease the start took (0: it took none): it
                        held its lease at least until ``start_us + lease_us`` unless its
                        finish gave it back first (renewals keep it longer)
``lease_returned``      true: the finish gave the start's lease back, in the same atomic step
                        that recorded ``finish_us``; false: the lease had expired before the
                        finish came; null: no finish, or no lease
``fair_key``            a fair queue's task: its fairness key (``""``: not a fair task)
``fair_tag``            its virtual start tag: where the fair order served it when it was
                        handed its ticket (-1: not a fair task)
``fair_weight``         its key's weight then (0: not a fair task)
``began_us``            when the body's report that it began reached the store: what the
                        limits count from (docs/design.md, "The guarantees"); the last
                        report if it was sent again. Null: no report (a start not asked
                        with ``reports``, a report lost, a body that did not begin, a
                        report that reached the store after the body's finish)
======================  ======================================================

Version 1 had no ``cost``: a reader takes a missing or null ``cost`` as 1. Version 2 had
none of ``burst`` .. ``lease_returned``: a reader takes them as 0 or null (no such limit).
Version 3 had none of the ``fair_`` columns: a reader takes them as not a fair task.
Version 4 had no ``began_us``: a reader takes it as null (no report).

A start that took a lease is matched to its finish by the lease (a copy of a task still
running while another copy starts has a lease of its own); otherwise by its task id, the
finish completing the latest start of that id.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any

from .types import Limits

SCHEMA_VERSION = 5

#: Default cap on start records kept per queue (finishes are kept alongside). About
#: 5.5 hours of starts at 200 ms; export more often, or raise ``siq_ledger_max``.
DEFAULT_LEDGER_MAX = 100_000


@dataclass(frozen=True)
class StartRecord:
    """Who is starting: written to the ledger with an authorized start."""

    task_name: str
    task_id: str | None = None
    host: str = ""
    pid: int = 0
    deferrals: int = 0
    #: A fair queue's task: its key, virtual start tag and weight (messages.fair_from_headers).
    fair_key: str = ""
    fair_tag: int = -1
    fair_weight: int = 0

    @classmethod
    def here(cls, task_name: str = "slot", task_id: str | None = None) -> StartRecord:
        """A record for a start made by this process (``IntervalQueue.slot()`` users)."""
        return cls(task_name=task_name, task_id=task_id, host=socket.gethostname(), pid=os.getpid())


@dataclass
class LedgerRow:
    """One row of the exported ledger (schema version 5: see the module docstring)."""

    queue: str
    epoch: str
    ticket: int
    task_id: str | None
    task_name: str
    slot_us: int
    start_us: int
    interval_us: int
    finish_us: int | None = None
    outcome: str | None = None
    deferrals: int = 0
    host: str = ""
    pid: int = 0
    cost: int = 1
    burst: int = 0
    quota: int = 0
    window_us: int = 0
    concurrency: int = 0
    lease_us: int = 0
    lease_returned: bool | None = None
    fair_key: str = ""
    fair_tag: int = -1
    fair_weight: int = 0
    began_us: int | None = None
    v: int = SCHEMA_VERSION
    #: The lease the start took, as the store wrote it (not exported: it matches the
    #: start with its finish; a store may keep it shortened).
    lease: str | None = field(default=None, repr=False, compare=False)

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in COLUMNS}

    @property
    def limits(self) -> Limits:
        """The limits in force at the start (besides its interval)."""
        return Limits(self.burst, self.quota, self.window_us, self.concurrency)


#: Column names in schema order (what ``siq export`` writes).
COLUMNS = tuple(f.name for f in fields(LedgerRow) if f.name != "lease")


def arrow_schema() -> Any:
    """The ledger schema as a pyarrow schema (for Parquet export)."""
    import pyarrow as pa

    types = {
        "queue": pa.string(), "epoch": pa.string(), "ticket": pa.int64(), "task_id": pa.string(),
        "task_name": pa.string(), "slot_us": pa.int64(), "start_us": pa.int64(), "interval_us": pa.int64(),
        "finish_us": pa.int64(), "outcome": pa.string(), "deferrals": pa.int32(), "host": pa.string(),
        "pid": pa.int32(), "cost": pa.int32(), "burst": pa.int32(), "quota": pa.int64(),
        "window_us": pa.int64(), "concurrency": pa.int32(), "lease_us": pa.int64(), "lease_returned": pa.bool_(),
        "fair_key": pa.string(), "fair_tag": pa.int64(), "fair_weight": pa.int32(), "began_us": pa.int64(),
        "v": pa.int16(),
    }  # fmt: skip
    return pa.schema([(name, types[name]) for name in COLUMNS])


@dataclass(frozen=True)
class FinishEntry:
    """A finish as Redis keeps it, apart from its start: ``lease`` the lease it named (None:
    none), ``returned`` whether it gave that lease back (False: it had expired)."""

    task_id: str
    finish_us: int
    outcome: str
    lease: str | None = None
    returned: bool = True


@dataclass(frozen=True)
class BeganEntry:
    """A body's report that it began, as Redis keeps it apart from its start: the start
    authorized at ``start_us`` (of ``task_id``, None: a start without one) began, as far
    as the store can tell, at ``began_us``."""

    task_id: str | None
    start_us: int
    began_us: int


def complete(row: LedgerRow, finish_us: int, outcome: str, returned: bool) -> None:
    """Complete ``row`` with its finish; ``returned``: the finish gave the start's lease back
    (a row without a lease records none)."""
    row.finish_us, row.outcome = finish_us, outcome
    row.lease_returned = returned if row.lease_us else None


def join_finishes(entries: Iterable[LedgerRow | FinishEntry | BeganEntry]) -> Iterator[LedgerRow]:
    """Rows from a time-ordered stream of start rows, reports and finish entries (as Redis
    keeps them): a report gives the start it names its ``began_us`` (the last report of a
    start counts; one that comes after the start's finish is dropped, on every store); a
    finish that names a lease completes the start that took it; any other completes the
    latest unfinished start of its task id. A row is yielded when its finish
    arrives, or at the end of the stream (not finished); one without a task id at the next
    start (its report came before it). A start without a lease that is followed by another
    start of its task id never finished (its worker died); one with a lease may still be
    running (a redelivered copy runs beside it) and waits for its own finish. Memory holds
    only the starts still waiting for their finish."""
    waiting: dict[str, list[LedgerRow]] = {}
    anonymous: LedgerRow | None = None  # the last start without a task id, until the next start
    for entry in entries:
        if isinstance(entry, LedgerRow):
            if anonymous is not None:
                yield anonymous
                anonymous = None
            if entry.task_id is None:
                anonymous = entry
                continue
            earlier = waiting.setdefault(entry.task_id, [])
            if any(r.lease is None for r in earlier):  # started again: those never finished
                yield from (r for r in earlier if r.lease is None)
                earlier[:] = [r for r in earlier if r.lease is not None]
            earlier.append(entry)
        elif isinstance(entry, BeganEntry):
            candidates = [anonymous] if entry.task_id is None and anonymous else waiting.get(entry.task_id or "", [])
            for row in reversed(candidates):
                if row.start_us == entry.start_us:  # a report whose start was trimmed away is dropped
                    row.began_us = entry.began_us
                    break
        else:
            rows = waiting.get(entry.task_id)
            if not rows:  # a finish whose start was trimmed away is dropped
                continue
            at = _matching(rows, entry.lease)
            if at is None:
                continue
            row = rows.pop(at)
            if not rows:
                del waiting[entry.task_id]
            complete(row, entry.finish_us, entry.outcome, entry.lease is not None and entry.returned)
            yield row
    if anonymous is not None:
        yield anonymous
    for rows in waiting.values():
        yield from rows


def _matching(rows: list[LedgerRow], lease: str | None) -> int | None:
    """Which of a task id's waiting ``rows`` (oldest first) a finish naming ``lease``
    completes: the start that took that lease (else the latest written without one: an
    older writer's); without a lease, the latest."""
    if lease is None:
        return len(rows) - 1
    for wanted in (lease, None):
        for i in range(len(rows) - 1, -1, -1):
            if rows[i].lease == wanted:
                return i
    return None
