"""One queue's state inside a SQLite transaction (:class:`SqliteTransaction`): its row of
siq_state and the rows kept beside it (finished and unfinished task ids, the ledger, the
counters, parked tasks, the sources). Times in integer microseconds on the host's clock."""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping, Sequence
from typing import Protocol

from ..errors import CorruptStateError
from ..ledger import LedgerRow
from ..parked import FairBacklog, ParkedTask
from ..rules import LAST_COUNTED
from ..types import IntervalSources
from .sqlite_kept import (
    FAIR_MOST_WAITING,
    FAIR_WAITING,
    SqliteFairLines,
    SqliteFairMessages,
    SqliteLeases,
    SqliteWindow,
)
from .sqlite_schema import LEDGER_COLUMNS
from .stored import sources_from_json, sources_to_json, state_from_fields
from .transaction import Transaction


class SqliteStore(Protocol):
    """What a transaction reads of its store (:class:`~siq_celery.backends.sqlite.SqliteBackend`)."""

    path: str
    key_prefix: str
    finished_max: int
    finished_retention_us: int

    def now_us(self) -> int: ...


STATE_FIELDS = ("epoch", "interval_us", "ticket", "current", "anchor_us", "last_start_us", "paused")


class SqliteTransaction(Transaction):
    def __init__(self, backend: SqliteStore, conn: sqlite3.Connection, queue: str, replace_corrupt: bool) -> None:
        self._b, self._c, self._queue = backend, conn, queue
        self._key = (backend.key_prefix, queue)
        self.now_us = backend.now_us()
        row = conn.execute(
            f"SELECT {', '.join('q.' + f for f in STATE_FIELDS)}, t.started_us, t.held_until_us, l.burst, l.quota, "
            f"l.window_us, c.concurrency, m.margin_us, p.until_us, p.due_us FROM siq_queues q "
            f"LEFT JOIN siq_queue_times t USING (prefix, queue) LEFT JOIN siq_queue_limits l USING (prefix, queue) "
            f"LEFT JOIN siq_queue_concurrency c USING (prefix, queue) "
            f"LEFT JOIN siq_queue_margin m USING (prefix, queue) LEFT JOIN siq_pending p USING (prefix, queue) "
            f"WHERE q.prefix=? AND q.queue=?",
            self._key,
        ).fetchone()
        self.state = None
        # What the state's side rows hold, as read; None: not read from a state of this
        # life (missing or corrupt), so a state created here writes them whatever they
        # hold: a stale row (left by a lost state, or by a delete of an earlier version)
        # must not come back as this state's limits or times.
        self._times: tuple[int, int] | None = None
        self._limits: tuple[int, int, int, int, int] | None = None
        self._pending: tuple[int, int] | None = None
        self._window: SqliteWindow | None = None
        self._leases: SqliteLeases | None = None
        self._fair: SqliteFairLines | None = None
        if row is not None:
            try:
                self.state = state_from_fields(queue, self._where(), dict(zip(STATE_FIELDS, row, strict=False)))
            except CorruptStateError:
                if not replace_corrupt:
                    raise
            else:
                self._times = (int(row[-9] or 0), int(row[-8] or 0))
                self.state.started_us, self.state.held_until_us = self._times
                burst, quota, window, cap, margin = (int(v or 0) for v in row[-7:-2])
                self._limits = (burst, quota, window, cap, margin)
                self.state.burst, self.state.quota, self.state.window_us = burst, quota, window
                self.state.concurrency, self.state.margin_us = cap, margin
                self._pending = (int(row[-2] or 0), int(row[-1] or 0))
                self.state.pending_us, self.state.pending_due_us = self._pending

    def window(self) -> SqliteWindow:
        if self._window is None:
            self._window = SqliteWindow(self._c, self._key)
        return self._window

    def leases(self) -> SqliteLeases:
        if self._leases is None:
            self._leases = SqliteLeases(self._c, self._key)
        return self._leases

    def fair_lines(self) -> SqliteFairLines:
        if self._fair is None:
            self._fair = SqliteFairLines(self._c, self._key)
        return self._fair

    def fair_messages(self) -> SqliteFairMessages:
        return SqliteFairMessages(self._c, self._key, self.fair_lines())

    def fair_backlog(self, top: int) -> FairBacklog:
        keys, tasks = self._c.execute(FAIR_WAITING, self._key).fetchone()
        rows = self._c.execute(FAIR_MOST_WAITING, (*self._key, top)).fetchall() if top and keys else []
        return FairBacklog(int(keys), int(tasks or 0), tuple((str(k), int(n), int(w)) for k, n, w in rows))

    def _where(self) -> str:
        return f"{self._b.path}: siq_queues[prefix={self._b.key_prefix!r}, queue={self._queue!r}]"

    def is_finished(self, task_id: str) -> bool:
        row = self._c.execute(
            "SELECT 1 FROM siq_finished WHERE prefix=? AND queue=? AND task_id=?", (*self._key, task_id)
        ).fetchone()
        return row is not None

    def add_finished(self, task_id: str) -> None:
        c = self._c
        c.execute("INSERT OR REPLACE INTO siq_finished VALUES (?, ?, ?, ?)", (*self._key, task_id, self.now_us))
        c.execute(
            "DELETE FROM siq_finished WHERE prefix=? AND queue=? AND finished_us < ?",
            (*self._key, self.now_us - self._b.finished_retention_us),
        )
        excess = self.finished_count() - self._b.finished_max
        if excess > 0:
            c.execute(
                "DELETE FROM siq_finished WHERE rowid IN (SELECT rowid FROM siq_finished "
                "WHERE prefix=? AND queue=? ORDER BY finished_us LIMIT ?)",
                (*self._key, excess),
            )

    def finished_count(self) -> int:
        (n,) = self._c.execute("SELECT COUNT(*) FROM siq_finished WHERE prefix=? AND queue=?", self._key).fetchone()
        return int(n)

    def count_refusal(self, verdict: str) -> None:
        self._c.execute(
            "INSERT INTO siq_refusals (prefix, queue, verdict, n) VALUES (?, ?, ?, 1) "
            "ON CONFLICT (prefix, queue, verdict) DO UPDATE SET n = n + 1",
            (*self._key, verdict),
        )

    def refusals(self) -> tuple[int, int]:
        rows = self._c.execute("SELECT verdict, n FROM siq_refusals WHERE prefix=? AND queue=?", self._key)
        counts = {verdict: int(n) for verdict, n in rows.fetchall()}
        return counts.get("duplicate", 0), counts.get("reclaim", 0)

    def unfinished_starts(self, task_id: str) -> int:
        row = self._c.execute(
            "SELECT starts FROM siq_unfinished WHERE prefix=? AND queue=? AND task_id=? AND last_start_us >= ?",
            (*self._key, task_id, self.now_us - self._b.finished_retention_us),
        ).fetchone()
        return int(row[0]) if row else 0

    def count_unfinished(self, task_id: str) -> None:
        c = self._c
        c.execute(
            "INSERT OR REPLACE INTO siq_unfinished VALUES (?, ?, ?, ?, ?)",
            (*self._key, task_id, self.unfinished_starts(task_id) + 1, self.now_us),
        )
        c.execute(
            "DELETE FROM siq_unfinished WHERE prefix=? AND queue=? AND last_start_us < ?",
            (*self._key, self.now_us - self._b.finished_retention_us),
        )
        (n,) = c.execute("SELECT COUNT(*) FROM siq_unfinished WHERE prefix=? AND queue=?", self._key).fetchone()
        if n > self._b.finished_max:
            c.execute(
                "DELETE FROM siq_unfinished WHERE rowid IN (SELECT rowid FROM siq_unfinished "
                "WHERE prefix=? AND queue=? ORDER BY last_start_us LIMIT ?)",
                (*self._key, n - self._b.finished_max),
            )

    def clear_unfinished(self, task_id: str) -> None:
        self._c.execute("DELETE FROM siq_unfinished WHERE prefix=? AND queue=? AND task_id=?", (*self._key, task_id))

    def count_start(self, added: Mapping[str, int], start_us: int) -> None:
        self._c.executemany(
            "INSERT INTO siq_start_counts (prefix, queue, name, n) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (prefix, queue, name) DO UPDATE SET n = CASE WHEN name = ? THEN excluded.n "
            "ELSE n + excluded.n END",
            [(*self._key, name, n, LAST_COUNTED) for name, n in (*added.items(), (LAST_COUNTED, start_us))],
        )

    def start_counts(self) -> dict[str, int]:
        rows = self._c.execute("SELECT name, n FROM siq_start_counts WHERE prefix=? AND queue=?", self._key)
        return {name: int(n) for name, n in rows.fetchall()}

    def record_start(self, row: LedgerRow) -> None:
        values = [getattr(row, name) for name in LEDGER_COLUMNS]
        self._c.execute(
            f"INSERT INTO siq_ledger (prefix, {', '.join(LEDGER_COLUMNS)}) VALUES (?{', ?' * len(values)})",
            (self._b.key_prefix, *values),
        )

    def record_began(self, task_id: str, start_us: int, began_us: int) -> None:
        self._c.execute(
            "UPDATE siq_ledger SET began_us=? WHERE rowid = (SELECT rowid FROM siq_ledger WHERE prefix=? AND "
            "queue=? AND start_us=? AND task_id IS ? ORDER BY rowid DESC LIMIT 1) AND finish_us IS NULL",
            (began_us, *self._key, start_us, task_id or None),
        )

    def record_finish(self, task_id: str, outcome: str, lease: str = "", returned: bool = False) -> None:
        if (
            lease
            and self._c.execute(  # the start that took the lease (ledger.complete)
                "UPDATE siq_ledger SET finish_us=?, outcome=?, lease_returned=? WHERE rowid = (SELECT rowid FROM "
                "siq_ledger WHERE prefix=? AND queue=? AND task_id IS ? AND lease=? AND finish_us IS NULL "
                "ORDER BY rowid DESC LIMIT 1)",
                (self.now_us, outcome, int(returned), *self._key, task_id, lease),
            ).rowcount
        ):
            return
        self._c.execute(  # else the latest start of the task id, if unfinished (and, a lease named, without one)
            "UPDATE siq_ledger SET finish_us=?, outcome=?, lease_returned=CASE WHEN lease_us > 0 THEN 0 END "
            "WHERE rowid = (SELECT rowid FROM siq_ledger WHERE prefix=? AND queue=? AND task_id=? "
            f"ORDER BY rowid DESC LIMIT 1) AND finish_us IS NULL{' AND lease IS NULL' if lease else ''}",
            (self.now_us, outcome, *self._key, task_id),
        )

    def trim_ledger(self, keep: int) -> None:
        self._c.execute(
            "DELETE FROM siq_ledger WHERE prefix=? AND queue=? AND rowid <= (SELECT rowid FROM siq_ledger "
            "WHERE prefix=? AND queue=? ORDER BY rowid DESC LIMIT 1 OFFSET ?)",
            (*self._key, *self._key, keep),
        )

    def park(self, tasks: Sequence[ParkedTask]) -> None:
        self._c.executemany(
            "INSERT OR REPLACE INTO siq_parked VALUES (?, ?, ?, ?, ?, NULL)",
            [(*self._key, t.task_id, t.ticket, t.message) for t in tasks],
        )

    def leasable(self, cutoff: int | None, now_us: int, limit: int) -> list[ParkedTask]:
        rows = self._c.execute(
            "SELECT ticket, task_id, message FROM siq_parked WHERE prefix=? AND queue=? AND "
            "((lease_until IS NOT NULL AND lease_until <= ?) OR (lease_until IS NULL AND ticket <= ?)) "
            "ORDER BY lease_until IS NULL, ticket LIMIT ?",
            (*self._key, now_us, -1 if cutoff is None else cutoff, limit),
        ).fetchall()
        return [ParkedTask(*row) for row in rows]

    def lease(self, task_ids: Sequence[str], until_us: int) -> None:
        self._c.executemany(
            "UPDATE siq_parked SET lease_until=? WHERE prefix=? AND queue=? AND task_id=?",
            [(until_us, *self._key, t) for t in task_ids],
        )

    def unpark(self, task_ids: Sequence[str]) -> None:
        self._c.executemany(
            "DELETE FROM siq_parked WHERE prefix=? AND queue=? AND task_id=?", [(*self._key, t) for t in task_ids]
        )

    def is_parked(self, task_id: str) -> bool:
        row = self._c.execute(
            "SELECT 1 FROM siq_parked WHERE prefix=? AND queue=? AND task_id=?", (*self._key, task_id)
        ).fetchone()
        return row is not None

    def parked_count(self) -> int:  # the tasks waiting in fair lines are parked without a ticket
        (n,) = self._c.execute(
            "SELECT (SELECT COUNT(*) FROM siq_parked WHERE prefix=? AND queue=?) "
            "+ (SELECT COUNT(*) FROM siq_fair_tasks WHERE prefix=? AND queue=?)",
            (*self._key, *self._key),
        ).fetchone()
        return int(n)

    def renumber_parked(self) -> int:
        ids = [r[0] for r in self._c.execute(
            "SELECT task_id FROM siq_parked WHERE prefix=? AND queue=? ORDER BY ticket", self._key
        )]  # fmt: skip
        self._c.executemany(
            "UPDATE siq_parked SET ticket=?, lease_until=NULL WHERE prefix=? AND queue=? AND task_id=?",
            [(n, *self._key, t) for n, t in enumerate(ids, start=1)],
        )
        return len(ids)

    def sources(self) -> IntervalSources:
        row = self._c.execute(
            "SELECT sources FROM siq_interval_sources WHERE prefix=? AND queue=?", self._key
        ).fetchone()
        where = f"{self._b.path}: siq_interval_sources[prefix={self._b.key_prefix!r}, queue={self._queue!r}]"
        return sources_from_json(row[0] if row else None, self._queue, where)

    def save_sources(self, sources: IntervalSources) -> None:
        self._c.execute("INSERT OR REPLACE INTO siq_interval_sources VALUES (?, ?, ?)",
                        (*self._key, sources_to_json(sources)))  # fmt: skip

    def delete(self) -> bool:
        self._c.execute("DELETE FROM siq_interval_sources WHERE prefix=? AND queue=?", self._key)
        self._c.execute("DELETE FROM siq_refusals WHERE prefix=? AND queue=?", self._key)
        self._c.execute("DELETE FROM siq_queue_times WHERE prefix=? AND queue=?", self._key)
        self._c.execute("DELETE FROM siq_start_counts WHERE prefix=? AND queue=?", self._key)
        self._c.execute("DELETE FROM siq_queue_limits WHERE prefix=? AND queue=?", self._key)
        self._c.execute("DELETE FROM siq_window WHERE prefix=? AND queue=?", self._key)
        self._c.execute("DELETE FROM siq_leases WHERE prefix=? AND queue=?", self._key)
        self._c.execute("DELETE FROM siq_lease_owners WHERE prefix=? AND queue=?", self._key)
        self._c.execute("DELETE FROM siq_queue_concurrency WHERE prefix=? AND queue=?", self._key)
        self._c.execute("DELETE FROM siq_queue_margin WHERE prefix=? AND queue=?", self._key)
        self._c.execute("DELETE FROM siq_pending WHERE prefix=? AND queue=?", self._key)
        self._c.execute("DELETE FROM siq_fair_vtime WHERE prefix=? AND queue=?", self._key)
        self._c.execute("DELETE FROM siq_fair_keys WHERE prefix=? AND queue=?", self._key)
        removed = self._c.execute("DELETE FROM siq_fair_tasks WHERE prefix=? AND queue=?", self._key).rowcount
        removed += self._c.execute("DELETE FROM siq_parked WHERE prefix=? AND queue=?", self._key).rowcount
        removed += self._c.execute("DELETE FROM siq_queues WHERE prefix=? AND queue=?", self._key).rowcount
        removed += self._c.execute("DELETE FROM siq_finished WHERE prefix=? AND queue=?", self._key).rowcount
        self._c.execute("DELETE FROM siq_unfinished WHERE prefix=? AND queue=?", self._key)
        removed += self._c.execute("DELETE FROM siq_ledger WHERE prefix=? AND queue=?", self._key).rowcount
        return removed > 0

    def commit(self) -> None:
        s = self.state
        if s is None:
            return
        self._c.execute(
            "INSERT OR REPLACE INTO siq_queues VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (*self._key, s.epoch, s.interval_us, s.ticket, s.current, s.anchor_us, s.last_start_us, int(s.paused)),
        )
        if self._times is None or (s.started_us, s.held_until_us) != self._times:
            self._c.execute(
                "INSERT OR REPLACE INTO siq_queue_times VALUES (?, ?, ?, ?)",
                (*self._key, s.started_us, s.held_until_us),
            )
        if self._limits is None or (s.burst, s.quota, s.window_us) != self._limits[:3]:
            self._c.execute(
                "INSERT OR REPLACE INTO siq_queue_limits VALUES (?, ?, ?, ?, ?)",
                (*self._key, s.burst, s.quota, s.window_us),
            )
        if self._limits is None or s.concurrency != self._limits[3]:
            self._c.execute(
                "INSERT OR REPLACE INTO siq_queue_concurrency VALUES (?, ?, ?)", (*self._key, s.concurrency)
            )
        if self._limits is None or s.margin_us != self._limits[4]:
            self._c.execute("INSERT OR REPLACE INTO siq_queue_margin VALUES (?, ?, ?)", (*self._key, s.margin_us))
        if self._pending is None or (s.pending_us, s.pending_due_us) != self._pending:
            if s.pending_us:
                pending = (*self._key, s.pending_us, s.pending_due_us)
                self._c.execute("INSERT OR REPLACE INTO siq_pending VALUES (?, ?, ?, ?)", pending)
            else:
                self._c.execute("DELETE FROM siq_pending WHERE prefix=? AND queue=?", self._key)
