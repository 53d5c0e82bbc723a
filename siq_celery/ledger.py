"""The execution ledger: one record per authorized start, completed by its finish.

The store writes a start record in the same atomic step that authorizes the start (on
Redis: the same script, into a capped stream with the queue's hash tag; on SQLite: a
row in the same transaction), and the finish record with the finish. ``siq export``
turns them into rows of the schema below, which ``siq audit`` reads.

Schema version 2 (``v``), one row per authorized start; times are integer microseconds
since the Unix epoch on the store's clock:

======================  ======================================================
``v``                   schema version (2)
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
``outcome``             ``SUCCESS`` / ``FAILURE`` (null without a finish)
``deferrals``           times the task was sent back to wait before this start
``host``                worker node name (Celery) or host name
``pid``                 process id of the starting process
``cost``                slots the start took (``cost=``): the next start may come
                        ``cost x interval`` after it
======================  ======================================================

Version 1 had no ``cost``: a reader takes a missing or null ``cost`` as 1.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, fields
from typing import Any

SCHEMA_VERSION = 2

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

    @classmethod
    def here(cls, task_name: str = "slot", task_id: str | None = None) -> StartRecord:
        """A record for a start made by this process (``IntervalQueue.slot()`` users)."""
        return cls(task_name=task_name, task_id=task_id, host=socket.gethostname(), pid=os.getpid())


@dataclass
class LedgerRow:
    """One row of the exported ledger (schema version 2: see the module docstring)."""

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
    v: int = SCHEMA_VERSION

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


#: Column names in schema order.
COLUMNS = tuple(f.name for f in fields(LedgerRow))


def arrow_schema() -> Any:
    """The ledger schema as a pyarrow schema (for Parquet export)."""
    import pyarrow as pa

    types = {
        "queue": pa.string(), "epoch": pa.string(), "ticket": pa.int64(), "task_id": pa.string(),
        "task_name": pa.string(), "slot_us": pa.int64(), "start_us": pa.int64(), "interval_us": pa.int64(),
        "finish_us": pa.int64(), "outcome": pa.string(), "deferrals": pa.int32(), "host": pa.string(),
        "pid": pa.int32(), "cost": pa.int32(), "v": pa.int16(),
    }  # fmt: skip
    return pa.schema([(name, types[name]) for name in COLUMNS])


@dataclass(frozen=True)
class FinishEntry:
    task_id: str
    finish_us: int
    outcome: str


def join_finishes(entries: Iterable[LedgerRow | FinishEntry]) -> Iterator[LedgerRow]:
    """Rows from a time-ordered stream of start rows and finish entries (as Redis keeps
    them): each finish completes the latest unfinished start of its task id. A row is
    yielded when its finish arrives, or at the end of the stream (not finished). Memory
    holds only the starts still waiting for their finish."""
    waiting: dict[str, LedgerRow] = {}
    for entry in entries:
        if isinstance(entry, LedgerRow):
            if entry.task_id is None:
                yield entry
                continue
            earlier = waiting.pop(entry.task_id, None)
            if earlier is not None:  # started again (a worker died mid-run): the first never finished
                yield earlier
            waiting[entry.task_id] = entry
        else:
            row = waiting.pop(entry.task_id, None)
            if row is not None:  # a finish whose start was trimmed away is dropped
                row.finish_us, row.outcome = entry.finish_us, entry.outcome
                yield row
    yield from waiting.values()
