"""Write ledgers (:mod:`siq_celery.ledger`) to JSON Lines or Parquet, streaming.

The file is written beside its destination and renamed into place at the end, so a
failed export never leaves a half-written file under the requested name.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from ..backends import Backend
from ..errors import ConfigurationError, MissingDependencyError
from ..ledger import COLUMNS, LedgerRow, arrow_schema

FORMATS = ("jsonl", "parquet")
PARQUET_BATCH = 50_000
PROGRESS_EVERY = 100_000
_AGO = re.compile(r"^(\d+(?:\.\d+)?)\s*(s|m|h|d)$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_time(text: str, now: float | None = None) -> float:
    """Unix seconds from ``2026-11-21T08:00:00`` (UTC unless it says otherwise),
    ``1795250000`` (Unix seconds), or ``2h`` / ``30m`` / ``7d`` (that long ago)."""
    seconds = _parse_time(text, now)
    if not abs(seconds) <= MAX_TIME_S:  # also NaN
        raise ConfigurationError(f"time {text!r} is not between year 1 and 9999")
    return seconds


MAX_TIME_S = 253_402_300_799.0  # 9999-12-31T23:59:59Z; its microseconds fit every store


def _parse_time(text: str, now: float | None) -> float:
    text = text.strip()
    if m := _AGO.match(text):
        return (time.time() if now is None else now) - float(m.group(1)) * _UNIT_S[m.group(2)]
    with contextlib.suppress(ValueError):
        return float(text)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ConfigurationError(
            f"time {text!r}: expected an ISO date/time (2026-11-21T08:00), Unix seconds, or an age like 2h"
        ) from None
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def format_for(path: str, explicit: str | None) -> str:
    if explicit:
        if explicit not in FORMATS:
            raise ConfigurationError(f"format {explicit!r}: expected one of {', '.join(FORMATS)}")
        return explicit
    return "parquet" if path.endswith((".parquet", ".pq")) else "jsonl"


def ledger_rows(
    backend: Backend, queues: Iterable[str], since: float | None = None, until: float | None = None
) -> Iterator[LedgerRow]:
    since_us = None if since is None else round(since * 1e6)
    until_us = None if until is None else round(until * 1e6)
    for queue in queues:
        yield from backend.ledger(queue, since_us, until_us)


def write_rows(rows: Iterable[LedgerRow], out: str, fmt: str, progress: Callable[[int], None] | None = None) -> int:
    """Write ``rows`` to ``out`` (``-``: stdout, JSON Lines only); the number written."""
    if out == "-":
        if fmt != "jsonl":
            raise ConfigurationError("only JSON Lines can be written to stdout; give --out FILE for Parquet")
        return _write_jsonl(rows, sys.stdout, progress)
    with _written_in_place_at_the_end(out) as partial:
        if fmt == "parquet":
            return _write_parquet(rows, partial, progress)
        with open(partial, "w", encoding="utf-8") as f:
            return _write_jsonl(rows, f, progress)


@contextlib.contextmanager
def _written_in_place_at_the_end(out: str) -> Iterator[str]:
    """A temporary path beside ``out``, renamed to ``out`` if the block succeeds and
    removed if it fails: a failed export never leaves a half-written file."""
    target = Path(out)
    if target.parent and not target.parent.is_dir():
        raise ConfigurationError(f"cannot write {out!r}: folder {str(target.parent)!r} does not exist")
    if not out or target.is_dir():
        raise ConfigurationError(f"cannot write {out!r}: it is a folder; give a file name")
    try:
        fd, partial = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    except OSError as exc:
        raise ConfigurationError(f"cannot write {out!r}: {exc.strerror or exc}") from None
    os.close(fd)
    try:
        yield partial
        os.replace(partial, target)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
        if isinstance(exc, OSError):
            raise ConfigurationError(f"cannot write {out!r}: {exc.strerror or exc}") from None
        raise


def _write_jsonl(rows: Iterable[LedgerRow], f: IO[str], progress: Callable[[int], None] | None) -> int:
    count = 0
    for row in rows:
        f.write(json.dumps(row.as_dict(), separators=(",", ":")) + "\n")
        count += 1
        if progress and count % PROGRESS_EVERY == 0:
            progress(count)
    return count


def _write_parquet(rows: Iterable[LedgerRow], path: str, progress: Callable[[int], None] | None) -> int:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise MissingDependencyError("Parquet export needs pyarrow: pip install 'siq_celery[spark]'") from None
    schema = arrow_schema()
    count = 0
    columns: dict[str, list[Any]] = {name: [] for name in COLUMNS}
    with pq.ParquetWriter(path, schema) as writer:

        def flush() -> None:
            if columns["queue"]:
                writer.write_table(pa.table(columns, schema=schema))
                for values in columns.values():
                    values.clear()

        for row in rows:
            for name in COLUMNS:
                columns[name].append(getattr(row, name))
            count += 1
            if count % PARQUET_BATCH == 0:
                flush()
            if progress and count % PROGRESS_EVERY == 0:
                progress(count)
        flush()
    return count


def write_parked(backend: Backend, queues: Iterable[str], out: str) -> int:
    """Parked tasks as JSON Lines: ``{"v": 1, "queue", "ticket", "task_id", "message"}``,
    ``message`` being what publishes the task again (task, args, kwargs, options)."""
    rows = (
        ParkedRow(queue, t.ticket, t.task_id, json.loads(t.message))
        for queue in queues
        for t in backend.parked_tasks(queue)
    )
    if out == "-":
        return _write_json_objects(rows, sys.stdout)
    with _written_in_place_at_the_end(out) as partial, open(partial, "w", encoding="utf-8") as f:
        return _write_json_objects(rows, f)


class ParkedRow(dict[str, Any]):
    def __init__(self, queue: str, ticket: int, task_id: str, message: Any) -> None:
        super().__init__(v=1, queue=queue, ticket=ticket, task_id=task_id, message=message)


def _write_json_objects(rows: Iterable[dict[str, Any]], f: IO[str]) -> int:
    count = 0
    for row in rows:
        f.write(json.dumps(row, separators=(",", ":")) + "\n")
        count += 1
    return count
