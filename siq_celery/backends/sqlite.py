"""SQLite state store: several processes on one host, no server.

Each operation is one ``BEGIN IMMEDIATE`` transaction (the write lock is taken before the
state is read, so two processes never decide from the same state). WAL journal, a busy
timeout, one connection per process and thread (a connection is never shared across
``fork``: Celery's prefork pool forks after the app is loaded).

Two things keep a start punctual under contention. SQLite's own busy handler sleeps in
steps of 1 to 5 ms when the write lock is taken, so the lock is retried here every
0.1 ms instead. And the WAL is checkpointed after claims and finishes, never by
automatic checkpoint inside a start's COMMIT (a checkpoint fsyncs: milliseconds).

URLs follow SQLAlchemy: ``sqlite:///relative.db``, ``sqlite:////abs/path.db``.
The clock is the host's (every process on one host shares it).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar
from urllib.parse import unquote, urlsplit

from ..errors import ConfigurationError, CorruptStateError, StoreUnavailableError, redacted
from ..ledger import LedgerRow
from ..rules import LAST_COUNTED, RunOwner
from ..types import NO_LIMITS, ClaimResult, FairBacklog, IntervalSources, Limits, ParkedTask
from .base import ModelBackend, Transaction, match_names, sources_from_json, sources_to_json, state_from_fields

_SCHEMA = """
CREATE TABLE IF NOT EXISTS siq_queues (
    prefix TEXT NOT NULL, queue TEXT NOT NULL, epoch TEXT NOT NULL,
    interval_us INTEGER NOT NULL, ticket INTEGER NOT NULL, current INTEGER NOT NULL,
    anchor_us INTEGER NOT NULL, last_start_us INTEGER NOT NULL, paused INTEGER NOT NULL,
    PRIMARY KEY (prefix, queue)
);
CREATE TABLE IF NOT EXISTS siq_finished (
    prefix TEXT NOT NULL, queue TEXT NOT NULL, task_id TEXT NOT NULL,
    finished_us INTEGER NOT NULL, PRIMARY KEY (prefix, queue, task_id)
);
CREATE INDEX IF NOT EXISTS siq_finished_by_time ON siq_finished (prefix, queue, finished_us);
CREATE TABLE IF NOT EXISTS siq_unfinished (
    prefix TEXT NOT NULL, queue TEXT NOT NULL, task_id TEXT NOT NULL, starts INTEGER NOT NULL,
    last_start_us INTEGER NOT NULL, PRIMARY KEY (prefix, queue, task_id)
);
CREATE INDEX IF NOT EXISTS siq_unfinished_by_time ON siq_unfinished (prefix, queue, last_start_us);
CREATE TABLE IF NOT EXISTS siq_ledger (
    prefix TEXT NOT NULL, queue TEXT NOT NULL, epoch TEXT NOT NULL, ticket INTEGER NOT NULL,
    task_id TEXT, task_name TEXT NOT NULL, slot_us INTEGER NOT NULL, start_us INTEGER NOT NULL,
    interval_us INTEGER NOT NULL, finish_us INTEGER, outcome TEXT, deferrals INTEGER NOT NULL,
    host TEXT NOT NULL, pid INTEGER NOT NULL, cost INTEGER NOT NULL DEFAULT 1, burst INTEGER NOT NULL DEFAULT 0,
    quota INTEGER NOT NULL DEFAULT 0, window_us INTEGER NOT NULL DEFAULT 0, concurrency INTEGER NOT NULL DEFAULT 0,
    lease_us INTEGER NOT NULL DEFAULT 0, lease_returned INTEGER, lease TEXT, fair_key TEXT NOT NULL DEFAULT '',
    fair_tag INTEGER NOT NULL DEFAULT -1, fair_weight INTEGER NOT NULL DEFAULT 0, began_us INTEGER
);
CREATE INDEX IF NOT EXISTS siq_ledger_by_start ON siq_ledger (prefix, queue, start_us);
CREATE INDEX IF NOT EXISTS siq_ledger_by_task ON siq_ledger (prefix, queue, task_id);
CREATE TABLE IF NOT EXISTS siq_parked (
    prefix TEXT NOT NULL, queue TEXT NOT NULL, task_id TEXT NOT NULL, ticket INTEGER NOT NULL,
    message TEXT NOT NULL, lease_until INTEGER, PRIMARY KEY (prefix, queue, task_id)
);
CREATE INDEX IF NOT EXISTS siq_parked_by_ticket ON siq_parked (prefix, queue, ticket);
CREATE TABLE IF NOT EXISTS siq_refusals (
    prefix TEXT NOT NULL, queue TEXT NOT NULL, verdict TEXT NOT NULL, n INTEGER NOT NULL,
    PRIMARY KEY (prefix, queue, verdict)
);
-- When the last start was authorized and the last back-off ends (shown by the status):
-- a table of their own, so that processes of an earlier version go on writing siq_queues.
CREATE TABLE IF NOT EXISTS siq_queue_times (
    prefix TEXT NOT NULL, queue TEXT NOT NULL, started_us INTEGER NOT NULL, held_until_us INTEGER NOT NULL,
    PRIMARY KEY (prefix, queue)
);
CREATE TABLE IF NOT EXISTS siq_start_counts (
    prefix TEXT NOT NULL, queue TEXT NOT NULL, name TEXT NOT NULL, n INTEGER NOT NULL,
    PRIMARY KEY (prefix, queue, name)
);
-- A queue's burst and window quota, and the starts its window counts (rules.Window): tables
-- of their own too. A reset keeps both; a deleted queue loses both.
CREATE TABLE IF NOT EXISTS siq_queue_limits (
    prefix TEXT NOT NULL, queue TEXT NOT NULL, burst INTEGER NOT NULL, quota INTEGER NOT NULL,
    window_us INTEGER NOT NULL, PRIMARY KEY (prefix, queue)
);
CREATE TABLE IF NOT EXISTS siq_window (
    prefix TEXT NOT NULL, queue TEXT NOT NULL, t_us INTEGER NOT NULL, cost INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS siq_window_by_time ON siq_window (prefix, queue, t_us);
-- A queue's concurrency cap, and the leases it counts (rules.Leases): one per running body,
-- with its expiry. Tables of their own (processes of an earlier version go on writing
-- siq_queue_limits); a reset keeps both, a deleted queue loses both.
CREATE TABLE IF NOT EXISTS siq_queue_concurrency (
    prefix TEXT NOT NULL, queue TEXT NOT NULL, concurrency INTEGER NOT NULL, PRIMARY KEY (prefix, queue)
);
-- A queue's margin (rules.set_limits: already in siq_queues.interval_us and in the window
-- of siq_queue_limits, the spacing and window in force), in a table of its own as the
-- concurrency cap is.
CREATE TABLE IF NOT EXISTS siq_queue_margin (
    prefix TEXT NOT NULL, queue TEXT NOT NULL, margin_us INTEGER NOT NULL, PRIMARY KEY (prefix, queue)
);
CREATE TABLE IF NOT EXISTS siq_leases (
    prefix TEXT NOT NULL, queue TEXT NOT NULL, member TEXT NOT NULL, expires_us INTEGER NOT NULL,
    PRIMARY KEY (prefix, queue, member)
);
-- Who took a run's lease (rules.RunOwner): the asking call's token and the start it was
-- given. A table of its own (processes of an earlier version write siq_leases as it was);
-- a row goes with its lease.
CREATE TABLE IF NOT EXISTS siq_lease_owners (
    prefix TEXT NOT NULL, queue TEXT NOT NULL, member TEXT NOT NULL, token TEXT NOT NULL,
    start_us INTEGER NOT NULL, slot_us INTEGER NOT NULL, PRIMARY KEY (prefix, queue, member)
);
-- A start whose body has not reported that it began (types.QueueState.pending_us): until
-- when later starts wait for it, and the last slot used before it. A table of its own
-- (processes of an earlier version neither report nor wait); no row: none pending.
CREATE TABLE IF NOT EXISTS siq_pending (
    prefix TEXT NOT NULL, queue TEXT NOT NULL, until_us INTEGER NOT NULL, due_us INTEGER NOT NULL,
    PRIMARY KEY (prefix, queue)
);
CREATE TABLE IF NOT EXISTS siq_interval_sources (
    prefix TEXT NOT NULL, queue TEXT NOT NULL, sources TEXT NOT NULL, PRIMARY KEY (prefix, queue)
);
-- A fair queue's lines (rules.FairLines): its virtual time (no row: 0); per key with waiting
-- work or a kept finish tag, its head's tag (NULL: no waiting work), its finish tag (NULL:
-- none kept), its weight and how many of its tasks wait (a key with neither tag has no row);
-- per waiting task, in its key's order (the rowid), its cost and message. The partial
-- indexes make the smallest head and the finish tags one search, whatever the keys' number,
-- and the keys with the most waiting (siq status, siq top, the exporter) the first rows of one.
-- A reset keeps them; a deleted queue loses them.
CREATE TABLE IF NOT EXISTS siq_fair_vtime (
    prefix TEXT NOT NULL, queue TEXT NOT NULL, vtime INTEGER NOT NULL, PRIMARY KEY (prefix, queue)
);
CREATE TABLE IF NOT EXISTS siq_fair_keys (
    prefix TEXT NOT NULL, queue TEXT NOT NULL, fair_key TEXT NOT NULL, head_tag INTEGER, finish_tag INTEGER,
    weight INTEGER, waiting INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (prefix, queue, fair_key)
);
CREATE INDEX IF NOT EXISTS siq_fair_keys_by_head ON siq_fair_keys (prefix, queue, head_tag, fair_key)
    WHERE head_tag IS NOT NULL;
CREATE INDEX IF NOT EXISTS siq_fair_keys_by_finish ON siq_fair_keys (prefix, queue, finish_tag)
    WHERE finish_tag IS NOT NULL;
CREATE INDEX IF NOT EXISTS siq_fair_keys_by_waiting ON siq_fair_keys (prefix, queue, waiting DESC, fair_key)
    WHERE waiting > 0;
CREATE TABLE IF NOT EXISTS siq_fair_tasks (
    seq INTEGER PRIMARY KEY, prefix TEXT NOT NULL, queue TEXT NOT NULL, fair_key TEXT NOT NULL,
    task_id TEXT NOT NULL, cost INTEGER NOT NULL, message TEXT
);
CREATE INDEX IF NOT EXISTS siq_fair_tasks_by_key ON siq_fair_tasks (prefix, queue, fair_key, seq);
CREATE UNIQUE INDEX IF NOT EXISTS siq_fair_tasks_by_id ON siq_fair_tasks (prefix, queue, task_id);
"""
_LEDGER_COLUMNS = (
    "queue", "epoch", "ticket", "task_id", "task_name", "slot_us", "start_us", "interval_us", "finish_us",
    "outcome", "deferrals", "host", "pid", "cost", "burst", "quota", "window_us", "concurrency", "lease_us",
    "lease_returned", "lease", "fair_key", "fair_tag", "fair_weight", "began_us",
)  # fmt: skip
#: Ledger columns added after the table was first made, with their definitions (ledger schema 2 to 5).
_LEDGER_ADDED = {
    "cost": "INTEGER NOT NULL DEFAULT 1", "burst": "INTEGER NOT NULL DEFAULT 0", "quota": "INTEGER NOT NULL DEFAULT 0",
    "window_us": "INTEGER NOT NULL DEFAULT 0", "concurrency": "INTEGER NOT NULL DEFAULT 0",
    "lease_us": "INTEGER NOT NULL DEFAULT 0", "lease_returned": "INTEGER", "lease": "TEXT",
    "fair_key": "TEXT NOT NULL DEFAULT ''", "fair_tag": "INTEGER NOT NULL DEFAULT -1",
    "fair_weight": "INTEGER NOT NULL DEFAULT 0", "began_us": "INTEGER",
}  # fmt: skip
_FIELDS = ("epoch", "interval_us", "ticket", "current", "anchor_us", "last_start_us", "paused")

#: The window's starts numbered by their cost units (rules.ListWindow's running count): per
#: start of siq_window a row of siq_window_units with ``cum``, the units of the queue's
#: window up to and including that start, in time order (equal times: as they came). So the
#: units kept are the newest's ``cum`` less the units before the oldest (its ``cum - cost``)
#: and the start holding a unit is one search of index siq_window_units_by_cum: a full
#: window of 20,000 starts is not read on every decision. Triggers on siq_window keep the
#: numbers, so that a process of an earlier version (which writes siq_window by its own
#: statements, its INSERT naming no columns: a column added there would fail it) numbers its
#: starts too. A start that comes before the newest counts the later ones up by its cost; a
#: re-stamp (an UPDATE) leaves its place, counting the later ones down, and comes in at its
#: new time. Starts leave oldest first (a trim) or all at once, so the numbers of the starts
#: kept need no change when some go. Equal starts (queue, time and cost) are one and the
#: same to the window: a trigger takes the last numbered of them.
_COUNT_IN = (
    "UPDATE siq_window_units SET cum = cum + NEW.cost WHERE prefix = NEW.prefix AND queue = NEW.queue "
    "AND t_us > NEW.t_us; "
    "INSERT INTO siq_window_units VALUES (NEW.prefix, NEW.queue, NEW.t_us, NEW.cost, COALESCE("
    "(SELECT cum FROM siq_window_units WHERE prefix = NEW.prefix AND queue = NEW.queue AND t_us <= NEW.t_us "
    "ORDER BY t_us DESC, cum DESC LIMIT 1) + NEW.cost, "  # after the starts at or before its time
    "(SELECT cum - cost FROM siq_window_units WHERE prefix = NEW.prefix AND queue = NEW.queue "
    "ORDER BY cum LIMIT 1), "  # before them all: what was before the oldest, counted up by its cost above
    "NEW.cost)); "  # the only start
)
_THE_START = (
    "(SELECT {} FROM siq_window_units WHERE prefix = OLD.prefix AND queue = OLD.queue AND t_us = OLD.t_us "
    "AND cost = OLD.cost ORDER BY cum DESC LIMIT 1)"
)
_COUNT_OUT = f"DELETE FROM siq_window_units WHERE rowid = {_THE_START.format('rowid')}; "
_COUNT_DOWN = (
    "UPDATE siq_window_units SET cum = cum - OLD.cost WHERE prefix = OLD.prefix AND queue = OLD.queue "
    f"AND cum > {_THE_START.format('cum')}; "
)
_WINDOW_UNITS = (
    "CREATE TABLE siq_window_units (prefix TEXT NOT NULL, queue TEXT NOT NULL, t_us INTEGER NOT NULL, "
    "cost INTEGER NOT NULL, cum INTEGER NOT NULL)",
    "CREATE INDEX siq_window_units_by_cum ON siq_window_units (prefix, queue, cum)",
    "CREATE INDEX siq_window_units_by_time ON siq_window_units (prefix, queue, t_us, cum)",
    f"CREATE TRIGGER siq_window_count_in AFTER INSERT ON siq_window BEGIN {_COUNT_IN}END",
    f"CREATE TRIGGER siq_window_count_out AFTER DELETE ON siq_window BEGIN {_COUNT_OUT}END",
    f"CREATE TRIGGER siq_window_count_moved AFTER UPDATE ON siq_window BEGIN {_COUNT_DOWN}{_COUNT_OUT}{_COUNT_IN}END",
)
#: The units before the oldest start kept and up to the newest (both NULL: none kept).
_WINDOW_BOUNDS = (
    "SELECT (SELECT cum - cost FROM siq_window_units WHERE prefix=? AND queue=? ORDER BY cum LIMIT 1), "
    "(SELECT MAX(cum) FROM siq_window_units WHERE prefix=? AND queue=?)"
)


def _number_window(conn: sqlite3.Connection) -> None:
    """A database made before the window's starts were numbered by their units gets
    siq_window_units and its triggers, and its starts kept are numbered (read whole once),
    all in one transaction: no start another process records meanwhile goes unnumbered."""
    made = "SELECT 1 FROM sqlite_master WHERE type='table' AND name='siq_window_units'"
    if conn.execute(made).fetchone():
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        if not conn.execute(made).fetchone():  # another process may have made it first
            for statement in _WINDOW_UNITS:
                conn.execute(statement)
            rows, cum, queue = [], 0, None
            for prefix, name, t_us, cost in conn.execute(
                "SELECT prefix, queue, t_us, cost FROM siq_window ORDER BY prefix, queue, t_us, rowid"
            ):
                cum = (cum if (prefix, name) == queue else 0) + cost
                queue = (prefix, name)
                rows.append((prefix, name, t_us, cost, cum))
            conn.executemany("INSERT INTO siq_window_units VALUES (?, ?, ?, ?, ?)", rows)
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def _add_ledger_columns(conn: sqlite3.Connection) -> None:
    """A database made before the ledger recorded each start's cost (schema 2), the limits
    in force (schema 3), a fair task's share (schema 4) and its body's report (schema 5)
    gets the columns: its rows read as cost 1, no limits, no lease, no fair share and no
    report (as do the rows a process of an earlier version goes on writing). Another process may add them first."""
    have = {row[1] for row in conn.execute("PRAGMA table_info(siq_ledger)")}
    for name, definition in _LEDGER_ADDED.items():
        if name in have:
            continue
        try:
            conn.execute(f"ALTER TABLE siq_ledger ADD COLUMN {name} {definition}")
        except sqlite3.OperationalError as exc:
            if "duplicate column" not in str(exc):
                raise


class _SqliteTransaction(Transaction):
    def __init__(self, backend: SqliteBackend, conn: sqlite3.Connection, queue: str, replace_corrupt: bool) -> None:
        self._b, self._c, self._queue = backend, conn, queue
        self._key = (backend.key_prefix, queue)
        self.now_us = backend.now_us()
        row = conn.execute(
            f"SELECT {', '.join('q.' + f for f in _FIELDS)}, t.started_us, t.held_until_us, l.burst, l.quota, "
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
        self._window: _SqliteWindow | None = None
        self._leases: _SqliteLeases | None = None
        self._fair: _SqliteFairLines | None = None
        if row is not None:
            try:
                self.state = state_from_fields(queue, self._where(), dict(zip(_FIELDS, row, strict=False)))
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

    def window(self) -> _SqliteWindow:
        if self._window is None:
            self._window = _SqliteWindow(self._c, self._key)
        return self._window

    def leases(self) -> _SqliteLeases:
        if self._leases is None:
            self._leases = _SqliteLeases(self._c, self._key)
        return self._leases

    def fair_lines(self) -> _SqliteFairLines:
        if self._fair is None:
            self._fair = _SqliteFairLines(self._c, self._key)
        return self._fair

    def fair_messages(self) -> _SqliteFairMessages:
        return _SqliteFairMessages(self._c, self._key, self.fair_lines())

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
        values = [getattr(row, name) for name in _LEDGER_COLUMNS]
        self._c.execute(
            f"INSERT INTO siq_ledger (prefix, {', '.join(_LEDGER_COLUMNS)}) VALUES (?{', ?' * len(values)})",
            (self._b.key_prefix, *values),
        )

    def record_began(self, task_id: str, start_us: int, began_us: int) -> None:
        self._c.execute(
            "UPDATE siq_ledger SET began_us=? WHERE rowid = (SELECT rowid FROM siq_ledger WHERE prefix=? AND "
            "queue=? AND start_us=? AND task_id IS ? ORDER BY rowid DESC LIMIT 1)",
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


class _SqliteWindow:
    """The queue's window (rules.Window) in table siq_window, inside the transaction; read
    by the numbers of siq_window_units (_COUNT_IN), never whole."""

    def __init__(self, conn: sqlite3.Connection, key: tuple[str, str]) -> None:
        self._c, self._key = conn, key
        self._bounds: tuple[int, int] | None = None  # the units before the oldest start kept, up to the newest

    def _units(self) -> tuple[int, int]:
        if self._bounds is None:
            below, top = self._c.execute(_WINDOW_BOUNDS, (*self._key, *self._key)).fetchone()
            self._bounds = (0, 0) if top is None else (int(below), int(top))
        return self._bounds

    def trim(self, cutoff_us: int) -> None:
        gone = self._c.execute(
            "DELETE FROM siq_window WHERE prefix=? AND queue=? AND t_us <= ?", (*self._key, cutoff_us)
        )
        if gone.rowcount:
            self._bounds = None

    def used(self) -> int:
        below, top = self._units()
        return top - below

    def unit_time(self, unit: int) -> int:
        row = self._c.execute(
            "SELECT t_us FROM siq_window_units WHERE prefix=? AND queue=? AND cum >= ? ORDER BY cum LIMIT 1",
            (*self._key, self._units()[0] + unit),
        ).fetchone()
        if row is None:
            raise IndexError(unit)
        return int(row[0])

    def add(self, t_us: int, cost: int) -> None:
        self._c.execute("INSERT INTO siq_window VALUES (?, ?, ?, ?)", (*self._key, t_us, cost))
        self._bounds = None

    def move(self, from_us: int, to_us: int) -> None:
        self._c.execute(
            "UPDATE siq_window SET t_us=? WHERE rowid = (SELECT rowid FROM siq_window WHERE prefix=? AND queue=? "
            "AND t_us=? ORDER BY rowid DESC LIMIT 1)",
            (to_us, *self._key, from_us),
        )
        self._bounds = None


class _SqliteLeases:
    """The queue's run and concurrency leases (rules.Leases) in table siq_leases, inside the transaction."""

    def __init__(self, conn: sqlite3.Connection, key: tuple[str, str]) -> None:
        self._c, self._key = conn, key

    def count(self) -> int:
        (n,) = self._c.execute("SELECT COUNT(*) FROM siq_leases WHERE prefix=? AND queue=?", self._key).fetchone()
        return int(n)

    def trim(self, now_us: int) -> list[int]:
        gone = [int(e) for (e,) in self._c.execute(
            "SELECT expires_us FROM siq_leases WHERE prefix=? AND queue=? AND expires_us <= ? ORDER BY expires_us",
            (*self._key, now_us),
        )]  # fmt: skip
        if gone:
            self._c.execute(
                "DELETE FROM siq_leases WHERE prefix=? AND queue=? AND expires_us <= ?", (*self._key, now_us)
            )
            self._c.execute(
                "DELETE FROM siq_lease_owners WHERE prefix=? AND queue=? AND member NOT IN "
                "(SELECT member FROM siq_leases WHERE prefix=? AND queue=?)", (*self._key, *self._key),
            )  # fmt: skip
        return gone

    def earliest(self) -> int | None:
        (e,) = self._c.execute(
            "SELECT MIN(expires_us) FROM siq_leases WHERE prefix=? AND queue=?", self._key
        ).fetchone()
        return None if e is None else int(e)

    def add(self, member: str, expires_us: int) -> None:
        self._c.execute("INSERT OR REPLACE INTO siq_leases VALUES (?, ?, ?, ?)", (*self._key, member, expires_us))
        self._drop_owner(member)

    def expires(self, member: str) -> int | None:
        row = self._c.execute(
            "SELECT expires_us FROM siq_leases WHERE prefix=? AND queue=? AND member=?", (*self._key, member)
        ).fetchone()
        return int(row[0]) if row else None

    def remove(self, member: str) -> bool:
        done = self._c.execute("DELETE FROM siq_leases WHERE prefix=? AND queue=? AND member=?", (*self._key, member))
        self._drop_owner(member)
        return done.rowcount > 0

    def owner(self, member: str) -> RunOwner | None:
        row = self._c.execute(
            "SELECT token, start_us, slot_us FROM siq_lease_owners WHERE prefix=? AND queue=? AND member=?",
            (*self._key, member),
        ).fetchone()
        return RunOwner(str(row[0]), int(row[1]), int(row[2])) if row else None

    def set_owner(self, member: str, owner: RunOwner) -> None:
        self._c.execute(
            "INSERT OR REPLACE INTO siq_lease_owners VALUES (?, ?, ?, ?, ?, ?)", (*self._key, member, *owner)
        )

    def _drop_owner(self, member: str) -> None:
        self._c.execute("DELETE FROM siq_lease_owners WHERE prefix=? AND queue=? AND member=?", (*self._key, member))

    def renew(self, members: Sequence[str], expires_us: int) -> int:
        n = 0
        for member in set(members):
            n += self._c.execute(
                "UPDATE siq_leases SET expires_us=? WHERE prefix=? AND queue=? AND member=?",
                (expires_us, *self._key, member),
            ).rowcount
        return n

    def live(self, now_us: int) -> int:
        (n,) = self._c.execute(
            "SELECT COUNT(*) FROM siq_leases WHERE prefix=? AND queue=? AND expires_us > ?", (*self._key, now_us)
        ).fetchone()
        return int(n)


#: The active key with the smallest (tag, key), and the largest finish tag kept: each one
#: search of a partial index of siq_fair_keys, however many keys there are.
FAIR_SMALLEST = (
    "SELECT head_tag, fair_key FROM siq_fair_keys WHERE prefix=? AND queue=? AND head_tag IS NOT NULL "
    "ORDER BY head_tag, fair_key LIMIT 1"
)
FAIR_LARGEST_FINISH = "SELECT MAX(finish_tag) FROM siq_fair_keys WHERE prefix=? AND queue=? AND finish_tag IS NOT NULL"
#: The keys whose finish tags the virtual time reached (FAIR_FORGET: those with nothing
#: else kept, whose rows go; FAIR_FORGET_TAGS: the others, which keep their head).
FAIR_FORGET = (
    "DELETE FROM siq_fair_keys WHERE prefix=? AND queue=? AND finish_tag <= ? AND head_tag IS NULL AND waiting = 0"
)
FAIR_FORGET_TAGS = "UPDATE siq_fair_keys SET finish_tag=NULL WHERE prefix=? AND queue=? AND finish_tag <= ?"
#: The keys with tasks waiting and the tasks (FAIR_WAITING), and the keys with the most
#: waiting, ties by key (FAIR_MOST_WAITING): read in index siq_fair_keys_by_waiting.
FAIR_WAITING = "SELECT COUNT(*), SUM(waiting) FROM siq_fair_keys WHERE prefix=? AND queue=? AND waiting > 0"
FAIR_MOST_WAITING = (
    "SELECT fair_key, waiting, weight FROM siq_fair_keys WHERE prefix=? AND queue=? AND waiting > 0 "
    "ORDER BY waiting DESC, fair_key LIMIT ?"
)


class _SqliteFairLines:
    """The queue's fair lines (rules.FairLines) in tables siq_fair_vtime, siq_fair_keys and
    siq_fair_tasks, inside the transaction. A key's row goes once it has neither a head nor
    a finish tag: keys served and forgotten leave nothing behind."""

    def __init__(self, conn: sqlite3.Connection, key: tuple[str, str]) -> None:
        self._c, self._key = conn, key
        #: the messages of the tasks popped in this transaction, until taken (their rows are gone)
        self.popped: dict[str, str] = {}

    def vtime(self) -> int:
        row = self._c.execute("SELECT vtime FROM siq_fair_vtime WHERE prefix=? AND queue=?", self._key).fetchone()
        return int(row[0]) if row else 0

    def set_vtime(self, vtime: int) -> None:
        if vtime:
            self._c.execute("INSERT OR REPLACE INTO siq_fair_vtime VALUES (?, ?, ?)", (*self._key, vtime))
        else:  # 0, where an idle queue starts over: no row
            self._c.execute("DELETE FROM siq_fair_vtime WHERE prefix=? AND queue=?", self._key)

    def _column(self, column: str, key: str) -> int | None:
        row = self._c.execute(
            f"SELECT {column} FROM siq_fair_keys WHERE prefix=? AND queue=? AND fair_key=?", (*self._key, key)
        ).fetchone()
        return None if row is None or row[0] is None else int(row[0])

    def _drop_if_idle(self, key: str) -> None:
        self._c.execute(
            "DELETE FROM siq_fair_keys WHERE prefix=? AND queue=? AND fair_key=? "
            "AND head_tag IS NULL AND finish_tag IS NULL AND waiting = 0",
            (*self._key, key),
        )

    def head_tag(self, key: str) -> int | None:
        return self._column("head_tag", key)

    def smallest(self) -> tuple[int, str] | None:
        row = self._c.execute(FAIR_SMALLEST, self._key).fetchone()
        return None if row is None else (int(row[0]), str(row[1]))

    def set_head_tag(self, key: str, tag: int | None) -> None:
        if tag is None:
            self._c.execute(
                "UPDATE siq_fair_keys SET head_tag=NULL WHERE prefix=? AND queue=? AND fair_key=?", (*self._key, key)
            )
            self._drop_if_idle(key)
        else:
            self._c.execute(
                "INSERT INTO siq_fair_keys (prefix, queue, fair_key, head_tag) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (prefix, queue, fair_key) DO UPDATE SET head_tag=excluded.head_tag",
                (*self._key, key, tag),
            )

    def finish_tag(self, key: str) -> int | None:
        return self._column("finish_tag", key)

    def set_finish_tag(self, key: str, tag: int) -> None:
        self._c.execute(
            "INSERT INTO siq_fair_keys (prefix, queue, fair_key, finish_tag) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (prefix, queue, fair_key) DO UPDATE SET finish_tag=excluded.finish_tag",
            (*self._key, key, tag),
        )

    def largest_finish_tag(self) -> int | None:
        (tag,) = self._c.execute(FAIR_LARGEST_FINISH, self._key).fetchone()
        return None if tag is None else int(tag)

    def forget_finish_tags(self, through: int) -> None:
        self._c.execute(FAIR_FORGET, (*self._key, through))
        self._c.execute(FAIR_FORGET_TAGS, (*self._key, through))

    def push(self, key: str, task_id: str, cost: int, weight: int) -> None:
        # the message comes with FairMessages.keep (NULL until then)
        self._c.execute(
            "INSERT INTO siq_fair_tasks (prefix, queue, fair_key, task_id, cost) VALUES (?, ?, ?, ?, ?)",
            (*self._key, key, task_id, cost),
        )
        self._c.execute(
            "INSERT INTO siq_fair_keys (prefix, queue, fair_key, weight, waiting) VALUES (?, ?, ?, ?, 1) "
            "ON CONFLICT (prefix, queue, fair_key) DO UPDATE SET weight=excluded.weight, waiting=waiting + 1",
            (*self._key, key, weight),
        )

    def pop(self, key: str) -> tuple[str, int, int]:
        row = self._c.execute(
            "SELECT t.seq, t.task_id, t.cost, t.message, k.weight FROM siq_fair_tasks t JOIN siq_fair_keys k "
            "USING (prefix, queue, fair_key) WHERE t.prefix=? AND t.queue=? AND t.fair_key=? ORDER BY t.seq LIMIT 1",
            (*self._key, key),
        ).fetchone()
        if row is None:
            raise KeyError(key)
        seq, task_id, cost, message, weight = row
        self._c.execute("DELETE FROM siq_fair_tasks WHERE seq=?", (seq,))
        self._c.execute(
            "UPDATE siq_fair_keys SET waiting=waiting - 1 WHERE prefix=? AND queue=? AND fair_key=?", (*self._key, key)
        )
        if message is not None:
            self.popped[task_id] = message
        return str(task_id), int(cost), int(weight)

    def waiting(self, key: str) -> int:
        return self._column("waiting", key) or 0


class _SqliteFairMessages:
    """The messages of the queue's fair waiting tasks (base.FairMessages): column message
    of siq_fair_tasks, by task id; a task popped from its line in this transaction has its
    message in the lines' ``popped`` until taken."""

    def __init__(self, conn: sqlite3.Connection, key: tuple[str, str], lines: _SqliteFairLines) -> None:
        self._c, self._key, self._popped = conn, key, lines.popped

    def get(self, task_id: str) -> str | None:
        if task_id in self._popped:
            return self._popped[task_id]
        row = self._c.execute(
            "SELECT message FROM siq_fair_tasks WHERE prefix=? AND queue=? AND task_id=?", (*self._key, task_id)
        ).fetchone()
        return None if row is None or row[0] is None else str(row[0])

    def keep(self, task_id: str, message: str) -> None:
        """The message of a task pushed (FairLines.push) in this transaction."""
        if task_id in self._popped:
            self._popped[task_id] = message
            return
        kept = self._c.execute(
            "UPDATE siq_fair_tasks SET message=? WHERE prefix=? AND queue=? AND task_id=?",
            (message, *self._key, task_id),
        )
        if kept.rowcount == 0:
            raise KeyError(f"task {task_id!r} waits in no fair line of queue {self._key[1]!r}")

    def take(self, task_id: str) -> str:
        """The message of a task popped from its line in this transaction."""
        return self._popped.pop(task_id)


LOCK_RETRY_S = 0.0001
CHECKPOINT_EVERY = 200  # claims and finishes per connection between WAL checkpoints
_UNAVAILABLE = ("locked", "busy", "unable to open", "disk i/o", "readonly")


@contextmanager
def _unavailable_on_lock(path: str, queue: str) -> Iterator[None]:
    """Turn "cannot get at the database" errors into StoreUnavailableError (fail closed)."""
    try:
        yield
    except sqlite3.OperationalError as exc:
        if any(word in str(exc).lower() for word in _UNAVAILABLE):
            raise StoreUnavailableError(
                f"queue {queue!r}: SQLite store {path!r} unavailable: {exc}{_absolute_hint(path)}"
            ) from exc
        raise


def _absolute_hint(path: str) -> str:
    """What to write for an absolute path, when ``path`` is relative and its folder does
    not exist: ``sqlite:///var/siq.db`` is ``var/siq.db``, under the working directory."""
    folder = os.path.dirname(path)
    if os.path.isabs(path) or not folder or os.path.isdir(folder):
        return ""
    return (
        f" (folder {folder!r} does not exist under {os.getcwd()!r}: the path of sqlite:///{path} is relative; an "
        f"absolute path takes four slashes: sqlite:////{path})"
    )


class SqliteBackend(ModelBackend):
    schemes: ClassVar[tuple[str, ...]] = ("sqlite",)

    def __init__(self, path: str, *, busy_timeout_s: float = 30.0, **options: Any) -> None:
        super().__init__(**options)
        if not path:
            raise ConfigurationError("sqlite URL needs a file path: sqlite:///relative.db or sqlite:////abs.db")
        self.path = path
        self.busy_timeout_s = busy_timeout_s
        self._local = threading.local()

    @classmethod
    def from_url(cls, url: str, **options: Any) -> SqliteBackend:
        parts = urlsplit(url)
        if parts.netloc:
            raise ConfigurationError(
                f"sqlite URL {redacted(url)!r} has a host part; write sqlite:///relative.db or sqlite:////abs/path.db"
            )
        path = unquote(parts.path[1:] if parts.path.startswith("/") else parts.path)
        if "\x00" in path:
            raise ConfigurationError(f"sqlite URL {redacted(url)!r} has a NUL character in its path")
        return cls(path, **options)

    def _connection(self) -> sqlite3.Connection:
        # One connection per (process, thread): a connection opened before a fork must
        # not be used by the child.
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None or getattr(self._local, "pid", None) != os.getpid():
            conn = sqlite3.connect(
                self.path, timeout=self.busy_timeout_s, isolation_level=None, check_same_thread=False
            )
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.executescript(_SCHEMA)
            _add_ledger_columns(conn)
            _number_window(conn)
            conn.execute("PRAGMA busy_timeout=0")  # BEGIN IMMEDIATE is retried by _begin
            conn.execute("PRAGMA wal_autocheckpoint=0")  # see _checkpoint
            self._local.conn, self._local.pid = conn, os.getpid()
        return conn

    @contextmanager
    def transactions(self, queues: Sequence[str], *, replace_corrupt: bool = False) -> Iterator[list[Transaction]]:
        for queue in queues:
            self.keys(queue)  # validates the name
        with _unavailable_on_lock(self.path, queues[0]):
            conn = self._connection()
            self._begin(conn)
        try:
            txs = [_SqliteTransaction(self, conn, queue, replace_corrupt) for queue in queues]
            yield list(txs)
            for tx in txs:
                tx.commit()
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        with _unavailable_on_lock(self.path, queues[0]):
            conn.execute("COMMIT")

    def _begin(self, conn: sqlite3.Connection) -> None:
        deadline = time.monotonic() + self.busy_timeout_s
        while True:
            try:
                conn.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as exc:
                if ("locked" not in str(exc) and "busy" not in str(exc)) or time.monotonic() > deadline:
                    raise
                time.sleep(LOCK_RETRY_S)

    def _checkpoint(self) -> bool:
        """Move the WAL into the database once it has grown (PASSIVE: never waits).
        True when it ran."""
        self._local.commits = getattr(self._local, "commits", 0) + 1
        if self._local.commits % CHECKPOINT_EVERY:
            return False
        with _unavailable_on_lock(self.path, "(checkpoint)"):
            self._connection().execute("PRAGMA wal_checkpoint(PASSIVE)")
        return True

    def claim(self, queue: str, count: int, interval_us: int, epoch: str, *, limits: Limits = NO_LIMITS) -> ClaimResult:
        result = super().claim(queue, count, interval_us, epoch, limits=limits)
        self._checkpoint()
        return result

    def finish(
        self, queue: str, task_id: str, outcome: str = "SUCCESS", *, remember: bool = True, lease: str = ""
    ) -> None:
        super().finish(queue, task_id, outcome, remember=remember, lease=lease)
        if self._checkpoint() and self.ledger_max:
            with self.transaction(queue) as tx:  # the cap, kept off the start path
                assert isinstance(tx, _SqliteTransaction)
                tx.trim_ledger(self.ledger_max)

    def ledger(self, queue: str, since_us: int | None = None, until_us: int | None = None) -> Iterator[LedgerRow]:
        self.keys(queue)
        low, high = since_us if since_us is not None else -1, until_us if until_us is not None else 1 << 62
        with _unavailable_on_lock(self.path, queue):
            # its own connection: a long export must not hold this thread's transaction
            conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s)
        try:
            cursor = conn.execute(
                f"SELECT {', '.join(_LEDGER_COLUMNS)} FROM siq_ledger WHERE prefix=? AND queue=? "
                "AND start_us >= ? AND start_us < ? ORDER BY rowid",
                (self.key_prefix, queue, low, high),
            )
            while batch := cursor.fetchmany(10_000):
                for values in batch:
                    row = dict(zip(_LEDGER_COLUMNS, values, strict=True))
                    if row["lease_returned"] is not None:
                        row["lease_returned"] = bool(row["lease_returned"])
                    yield LedgerRow(**row)
        finally:
            conn.close()

    def queues(self, pattern: str = "*") -> list[str]:
        with _unavailable_on_lock(self.path, pattern):
            rows = (
                self._connection().execute("SELECT queue FROM siq_queues WHERE prefix=?", (self.key_prefix,)).fetchall()
            )
        return match_names([r[0] for r in rows], pattern)

    def warm(self) -> None:
        with _unavailable_on_lock(self.path, "(warm)"):
            self._connection()

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None and getattr(self._local, "pid", None) == os.getpid():
            conn.close()
        self._local.conn = None
