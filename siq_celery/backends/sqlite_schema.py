"""The SQLite store's tables (:data:`SCHEMA`), and the steps that bring a database an earlier
version wrote up to them: the window's units numbered by triggers, the ledger's added
columns. Times in integer microseconds on the host's clock."""

from __future__ import annotations

import sqlite3

SCHEMA = """
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


LEDGER_COLUMNS = (
    "queue", "epoch", "ticket", "task_id", "task_name", "slot_us", "start_us", "interval_us", "finish_us",
    "outcome", "deferrals", "host", "pid", "cost", "burst", "quota", "window_us", "concurrency", "lease_us",
    "lease_returned", "lease", "fair_key", "fair_tag", "fair_weight", "began_us",
)  # fmt: skip


#: Ledger columns added after the table was first made, with their definitions (ledger schema 2 to 5).
LEDGER_ADDED = {
    "cost": "INTEGER NOT NULL DEFAULT 1", "burst": "INTEGER NOT NULL DEFAULT 0", "quota": "INTEGER NOT NULL DEFAULT 0",
    "window_us": "INTEGER NOT NULL DEFAULT 0", "concurrency": "INTEGER NOT NULL DEFAULT 0",
    "lease_us": "INTEGER NOT NULL DEFAULT 0", "lease_returned": "INTEGER", "lease": "TEXT",
    "fair_key": "TEXT NOT NULL DEFAULT ''", "fair_tag": "INTEGER NOT NULL DEFAULT -1",
    "fair_weight": "INTEGER NOT NULL DEFAULT 0", "began_us": "INTEGER",
}  # fmt: skip


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


WINDOW_UNITS = (
    "CREATE TABLE siq_window_units (prefix TEXT NOT NULL, queue TEXT NOT NULL, t_us INTEGER NOT NULL, "
    "cost INTEGER NOT NULL, cum INTEGER NOT NULL)",
    "CREATE INDEX siq_window_units_by_cum ON siq_window_units (prefix, queue, cum)",
    "CREATE INDEX siq_window_units_by_time ON siq_window_units (prefix, queue, t_us, cum)",
    f"CREATE TRIGGER siq_window_count_in AFTER INSERT ON siq_window BEGIN {_COUNT_IN}END",
    f"CREATE TRIGGER siq_window_count_out AFTER DELETE ON siq_window BEGIN {_COUNT_OUT}END",
    f"CREATE TRIGGER siq_window_count_moved AFTER UPDATE ON siq_window BEGIN {_COUNT_DOWN}{_COUNT_OUT}{_COUNT_IN}END",
)


#: The units before the oldest start kept and up to the newest (both NULL: none kept).
WINDOW_BOUNDS = (
    "SELECT (SELECT cum - cost FROM siq_window_units WHERE prefix=? AND queue=? ORDER BY cum LIMIT 1), "
    "(SELECT MAX(cum) FROM siq_window_units WHERE prefix=? AND queue=?)"
)


def number_window(conn: sqlite3.Connection) -> None:
    """A database made before the window's starts were numbered by their units gets
    siq_window_units and its triggers, and its starts kept are numbered (read whole once),
    all in one transaction: no start another process records meanwhile goes unnumbered."""
    made = "SELECT 1 FROM sqlite_master WHERE type='table' AND name='siq_window_units'"
    if conn.execute(made).fetchone():
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        if not conn.execute(made).fetchone():  # another process may have made it first
            for statement in WINDOW_UNITS:
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


def add_ledger_columns(conn: sqlite3.Connection) -> None:
    """A database made before the ledger recorded each start's cost (schema 2), the limits
    in force (schema 3), a fair task's share (schema 4) and its body's report (schema 5)
    gets the columns: its rows read as cost 1, no limits, no lease, no fair share and no
    report (as do the rows a process of an earlier version goes on writing). Another process may add them first."""
    have = {row[1] for row in conn.execute("PRAGMA table_info(siq_ledger)")}
    for name, definition in LEDGER_ADDED.items():
        if name in have:
            continue
        try:
            conn.execute(f"ALTER TABLE siq_ledger ADD COLUMN {name} {definition}")
        except sqlite3.OperationalError as exc:
            if "duplicate column" not in str(exc):
                raise
