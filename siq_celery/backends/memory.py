"""In-process state store: one process, a lock. For tests, eager mode and single-process
scripts. ``memory://`` URLs with the same name share one store within the process
(``memory://`` alone is the default store), so two IntervalQueue objects for one queue
coordinate, as they would on Redis."""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar
from urllib.parse import urlsplit

from ..ledger import LedgerRow, complete
from ..parked import FairBacklog, ParkedTask
from ..rules import FREE, LAST_COUNTED, DictFairLines, DictLeases, ListWindow
from ..types import IntervalSources, QueueState
from .stored import copy_state, match_names
from .transaction import Transaction
from .transactional import ModelBackend


@dataclass
class _Store:
    lock: threading.RLock = field(default_factory=threading.RLock)
    states: dict[str, QueueState] = field(default_factory=dict)
    finished: dict[str, OrderedDict[str, int]] = field(default_factory=dict)
    #: per queue: task id -> (starts without a finish, time of the last), oldest first
    unfinished: dict[str, OrderedDict[str, tuple[int, int]]] = field(default_factory=dict)
    ledgers: dict[str, deque[LedgerRow]] = field(default_factory=dict)
    #: per queue: task id -> (parked task, lease deadline or None)
    parked: dict[str, dict[str, tuple[ParkedTask, int | None]]] = field(default_factory=dict)
    sources: dict[str, IntervalSources] = field(default_factory=dict)
    #: per queue: verdict -> starts refused with it
    refusals: dict[str, dict[str, int]] = field(default_factory=dict)
    #: per queue: the counters of authorized starts (rules.start_counts)
    start_counts: dict[str, dict[str, int]] = field(default_factory=dict)
    #: per queue: the starts its window quota counts
    windows: dict[str, ListWindow] = field(default_factory=dict)
    #: per queue: the leases its concurrency cap counts
    leases: dict[str, DictLeases] = field(default_factory=dict)
    #: per queue: its fair lines, and the messages of the tasks waiting in them
    fair: dict[str, DictFairLines] = field(default_factory=dict)
    fair_messages: dict[str, _Messages] = field(default_factory=dict)
    #: per queue: the last wake (the next ticket then, the store's time), and its waiters' condition
    wakes: dict[str, tuple[int, int]] = field(default_factory=dict)
    woken: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self.woken = threading.Condition(self.lock)


class _Messages(dict[str, str]):
    def keep(self, task_id: str, message: str) -> None:
        self[task_id] = message

    def take(self, task_id: str) -> str:
        return self.pop(task_id)


_NAMED_STORES: dict[str, _Store] = {}
_NAMED_LOCK = threading.Lock()


class _MemoryTransaction(Transaction):
    def __init__(self, backend: MemoryBackend, queue: str) -> None:
        self._backend, self._queue = backend, queue
        self._store = backend.store
        stored = self._store.states.get(queue)
        self.state = copy_state(stored) if stored is not None else None
        self.now_us = backend.now_us()

    def window(self) -> ListWindow:
        return self._store.windows.setdefault(self._queue, ListWindow())

    def leases(self) -> DictLeases:
        return self._store.leases.setdefault(self._queue, DictLeases())

    def _finished(self) -> OrderedDict[str, int]:
        return self._store.finished.setdefault(self._queue, OrderedDict())

    def is_finished(self, task_id: str) -> bool:
        return task_id in self._store.finished.get(self._queue, {})

    def add_finished(self, task_id: str) -> None:
        done = self._finished()
        done[task_id] = self.now_us
        done.move_to_end(task_id)
        oldest_kept = self.now_us - self._backend.finished_retention_us
        while done and (len(done) > self._backend.finished_max or next(iter(done.values())) < oldest_kept):
            done.popitem(last=False)

    def finished_count(self) -> int:
        return len(self._store.finished.get(self._queue, {}))

    def unfinished_starts(self, task_id: str) -> int:
        counts = self._store.unfinished.get(self._queue)
        starts, last_us = counts.get(task_id, (0, 0)) if counts is not None else (0, 0)
        return starts if last_us >= self.now_us - self._backend.finished_retention_us else 0

    def count_unfinished(self, task_id: str) -> None:
        counts = self._store.unfinished.setdefault(self._queue, OrderedDict())
        counts[task_id] = (self.unfinished_starts(task_id) + 1, self.now_us)
        counts.move_to_end(task_id)
        oldest_kept = self.now_us - self._backend.finished_retention_us
        while counts and (len(counts) > self._backend.finished_max or next(iter(counts.values()))[1] < oldest_kept):
            counts.popitem(last=False)

    def clear_unfinished(self, task_id: str) -> None:
        counts = self._store.unfinished.get(self._queue)
        if counts is not None:
            counts.pop(task_id, None)

    def record_start(self, row: LedgerRow) -> None:
        ledger = self._store.ledgers.get(self._queue)
        if ledger is None or ledger.maxlen != self._backend.ledger_max:
            ledger = self._store.ledgers[self._queue] = deque(ledger or (), maxlen=self._backend.ledger_max)
        ledger.append(row)

    def count_refusal(self, verdict: str) -> None:
        counts = self._store.refusals.setdefault(self._queue, {})
        counts[verdict] = counts.get(verdict, 0) + 1

    def refusals(self) -> tuple[int, int]:
        counts = self._store.refusals.get(self._queue, {})
        return counts.get("duplicate", 0), counts.get("reclaim", 0)

    def count_start(self, added: Mapping[str, int], start_us: int) -> None:
        counts = self._store.start_counts.setdefault(self._queue, {})
        for name, n in added.items():
            counts[name] = counts.get(name, 0) + n
        counts[LAST_COUNTED] = start_us

    def start_counts(self) -> dict[str, int]:
        return dict(self._store.start_counts.get(self._queue, {}))

    def record_began(self, task_id: str, start_us: int, began_us: int) -> None:
        for row in reversed(self._store.ledgers.get(self._queue, ())):
            if row.start_us == start_us and (row.task_id or "") == task_id:
                if row.finish_us is None:  # a report after the finish is dropped (ledger.join_finishes)
                    row.began_us = began_us
                return

    def record_finish(self, task_id: str, outcome: str, lease: str = "", returned: bool = False) -> None:
        rows = self._store.ledgers.get(self._queue, ())
        if lease:  # the start that took it (ledger.join_finishes: the same rules)
            for row in reversed(rows):
                if row.lease == lease and row.task_id == task_id and row.finish_us is None:
                    complete(row, self.now_us, outcome, returned)
                    return
        for row in reversed(rows):
            if row.task_id == task_id:
                if row.finish_us is None and not (lease and row.lease):
                    complete(row, self.now_us, outcome, False)
                return

    def _parked(self) -> dict[str, tuple[ParkedTask, int | None]]:
        return self._store.parked.setdefault(self._queue, {})

    def park(self, tasks: Sequence[ParkedTask]) -> None:
        parked = self._parked()
        for task in tasks:
            parked[task.task_id] = (task, None)

    def leasable(self, cutoff: int | None, now_us: int, limit: int) -> list[ParkedTask]:
        entries = sorted(self._parked().values(), key=lambda e: e[0].ticket)
        expired = [t for t, lease in entries if lease is not None and lease <= now_us]
        due = [t for t, lease in entries if lease is None and cutoff is not None and t.ticket <= cutoff]
        return (expired + due)[:limit]

    def lease(self, task_ids: Sequence[str], until_us: int) -> None:
        parked = self._parked()
        for task_id in task_ids:
            parked[task_id] = (parked[task_id][0], until_us)

    def unpark(self, task_ids: Sequence[str]) -> None:
        parked = self._parked()
        for task_id in task_ids:
            parked.pop(task_id, None)

    def is_parked(self, task_id: str) -> bool:
        return task_id in self._parked()

    def parked_count(self) -> int:  # the tasks waiting in fair lines are parked without a ticket
        return len(self._store.parked.get(self._queue, {})) + len(self._store.fair_messages.get(self._queue, {}))

    def fair_lines(self) -> DictFairLines:
        return self._store.fair.setdefault(self._queue, DictFairLines())

    def fair_messages(self) -> _Messages:
        return self._store.fair_messages.setdefault(self._queue, _Messages())

    def fair_backlog(self, top: int) -> FairBacklog:
        lines = self._store.fair.get(self._queue)
        if lines is None:
            return FairBacklog()
        waiting = lines.lines  # only keys with tasks waiting have a line
        entries = ((key, len(line), lines.weights[key]) for key, line in waiting.items())
        return FairBacklog.ranked(len(waiting), len(self._store.fair_messages.get(self._queue, {})), entries, top)

    def renumber_parked(self) -> int:
        parked = self._parked()
        ordered = sorted(parked.values(), key=lambda e: e[0].ticket)
        for number, (task, _) in enumerate(ordered, start=1):
            parked[task.task_id] = (replace(task, ticket=number), None)
        return len(ordered)

    def sources(self) -> IntervalSources:
        return self._store.sources.get(self._queue, IntervalSources())

    def save_sources(self, sources: IntervalSources) -> None:
        self._store.sources[self._queue] = sources

    def delete(self) -> bool:
        self._store.sources.pop(self._queue, None)
        self._store.refusals.pop(self._queue, None)
        self._store.start_counts.pop(self._queue, None)
        had_parked = bool(self._store.parked.pop(self._queue, None))
        self._store.fair.pop(self._queue, None)
        had_parked = bool(self._store.fair_messages.pop(self._queue, None)) or had_parked
        had_state = self._store.states.pop(self._queue, None) is not None
        self._store.unfinished.pop(self._queue, None)
        self._store.windows.pop(self._queue, None)
        self._store.leases.pop(self._queue, None)
        had_records = bool(self._store.finished.pop(self._queue, None))
        had_ledger = bool(self._store.ledgers.pop(self._queue, None))
        return had_state or had_records or had_ledger or had_parked

    def commit(self) -> None:
        if self.state is not None:
            self._store.states[self._queue] = self.state


class MemoryBackend(ModelBackend):
    schemes: ClassVar[tuple[str, ...]] = ("memory",)

    def __init__(self, store: _Store | None = None, **options: Any) -> None:
        super().__init__(**options)
        self.store = store or _Store()

    @classmethod
    def from_url(cls, url: str, **options: Any) -> MemoryBackend:
        name = urlsplit(url).netloc
        with _NAMED_LOCK:
            store = _NAMED_STORES.setdefault(name, _Store())
        return cls(store, **options)

    @contextmanager
    def transactions(self, queues: Sequence[str], *, replace_corrupt: bool = False) -> Iterator[list[Transaction]]:
        for queue in queues:
            self.keys(queue)  # validates the name
        with self.store.lock:
            txs = [_MemoryTransaction(self, queue) for queue in queues]
            yield list(txs)
            for tx in txs:
                tx.commit()

    can_wake = True

    def _woke(self, queue: str, next_ticket: int, now_us: int) -> None:
        with self.store.woken:  # held already: called inside the transaction
            self.store.wakes[queue] = (next_ticket, now_us)
            self.store.woken.notify_all()

    def wait_for_wake(self, queue: str, ticket: int, after_us: int, seconds: float) -> bool | None:
        def woken() -> bool:
            wake = self.store.wakes.get(queue)
            return wake is not None and wake[1] > after_us and (ticket == FREE or ticket <= wake[0])

        with self.store.woken:
            return self.store.woken.wait_for(woken, seconds)

    def ledger(self, queue: str, since_us: int | None = None, until_us: int | None = None) -> Iterator[LedgerRow]:
        self.keys(queue)
        with self.store.lock:
            rows = [replace(r) for r in self.store.ledgers.get(queue, ())]
        low, high = since_us if since_us is not None else -1, until_us if until_us is not None else 1 << 62
        yield from (r for r in rows if low <= r.start_us < high)

    def queues(self, pattern: str = "*") -> list[str]:
        with self.store.lock:
            return match_names(list(self.store.states), pattern)


def forget_memory_store(name: str) -> None:
    """Drop the named store of ``memory://name`` (a backend holding it keeps it)."""
    with _NAMED_LOCK:
        _NAMED_STORES.pop(name, None)
