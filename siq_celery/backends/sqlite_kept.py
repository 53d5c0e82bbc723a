"""What the SQLite store keeps beside a queue's state, as the rules read it: the window's
starts (:class:`SqliteWindow`, a :class:`~siq_celery.rules.Window`), the leases
(:class:`SqliteLeases`) and a fair queue's lines and messages (:class:`SqliteFairLines`,
:class:`SqliteFairMessages`), each in its tables, inside the transaction. Times in integer
microseconds on the host's clock."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

from ..rules import RunOwner
from .sqlite_schema import WINDOW_BOUNDS


class SqliteWindow:
    """The queue's window (rules.Window) in table siq_window, inside the transaction; read
    by the numbers of siq_window_units (_COUNT_IN), never whole."""

    def __init__(self, conn: sqlite3.Connection, key: tuple[str, str]) -> None:
        self._c, self._key = conn, key
        self._bounds: tuple[int, int] | None = None  # the units before the oldest start kept, up to the newest

    def _units(self) -> tuple[int, int]:
        if self._bounds is None:
            below, top = self._c.execute(WINDOW_BOUNDS, (*self._key, *self._key)).fetchone()
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


class SqliteLeases:
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


class SqliteFairLines:
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


class SqliteFairMessages:
    """The messages of the queue's fair waiting tasks (base.FairMessages): column message
    of siq_fair_tasks, by task id; a task popped from its line in this transaction has its
    message in the lines' ``popped`` until taken."""

    def __init__(self, conn: sqlite3.Connection, key: tuple[str, str], lines: SqliteFairLines) -> None:
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
