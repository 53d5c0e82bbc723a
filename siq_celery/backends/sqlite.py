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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar
from urllib.parse import unquote, urlsplit

from ..errors import ConfigurationError, StoreUnavailableError, redacted
from ..ledger import LedgerRow
from ..types import NO_LIMITS, ClaimResult, Limits
from .sqlite_schema import LEDGER_COLUMNS, SCHEMA, add_ledger_columns, number_window
from .sqlite_tx import SqliteTransaction
from .stored import match_names
from .transaction import Transaction
from .transactional import ModelBackend

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
            conn.executescript(SCHEMA)
            add_ledger_columns(conn)
            number_window(conn)
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
            txs = [SqliteTransaction(self, conn, queue, replace_corrupt) for queue in queues]
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
                assert isinstance(tx, SqliteTransaction)
                tx.trim_ledger(self.ledger_max)

    def ledger(self, queue: str, since_us: int | None = None, until_us: int | None = None) -> Iterator[LedgerRow]:
        self.keys(queue)
        low, high = since_us if since_us is not None else -1, until_us if until_us is not None else 1 << 62
        with _unavailable_on_lock(self.path, queue):
            # its own connection: a long export must not hold this thread's transaction
            conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s)
        try:
            cursor = conn.execute(
                f"SELECT {', '.join(LEDGER_COLUMNS)} FROM siq_ledger WHERE prefix=? AND queue=? "
                "AND start_us >= ? AND start_us < ? ORDER BY rowid",
                (self.key_prefix, queue, low, high),
            )
            while batch := cursor.fetchmany(10_000):
                for values in batch:
                    row = dict(zip(LEDGER_COLUMNS, values, strict=True))
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
