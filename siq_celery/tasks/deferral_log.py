"""What a worker logs of its waiting tasks: waiting is normal, so a deferral is a DEBUG
line, and INFO gets at most one summary a minute per queue (in each worker process):
``queue 'geo': 210 deferrals of 100 waiting tasks in the last 60s``.

Celery logs every ``Ignore`` as ``Task ... ignored`` at INFO (celery.app.trace), which a
user reads as a failure; a deferral ends its delivery with ``Ignore``. :func:`note_deferral`
(the worker's deferral path, never an import) puts a filter on that logger that drops the
line of a task this process has just deferred, and only that line: any other ``Ignore``
is logged as before.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ..lru import LRUCache

logger = logging.getLogger("siq_celery")

#: Seconds between two INFO summaries of a queue's deferrals.
SUMMARY_EVERY_S = 60.0
#: Deferred task ids whose ``ignored`` line is still to come (a bound: a line that never
#: comes, the trace having logged nothing, is forgotten).
PENDING_IGNORED = 1_000
#: Queues whose counts a process keeps (per-key queues may be many).
QUEUES_REMEMBERED = 1_000
TRACE_LOGGER = "celery.app.trace"


class DeferralLog:
    """Counts a process's deferrals per queue and writes the summaries."""

    def __init__(self, every: float = SUMMARY_EVERY_S, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.every, self._monotonic = every, monotonic
        self._lock = threading.Lock()
        #: queue -> (start of the period, deferrals, task ids deferred in it)
        self._periods: LRUCache[str, tuple[float, int, set[str]]] = LRUCache(QUEUES_REMEMBERED)
        self._pending: OrderedDict[str, None] = OrderedDict()
        self._filter: IgnoredAfterDeferral | None = None

    def note(self, queue: str, task_id: str) -> None:
        """A task of ``queue`` was deferred (re-published by ETA, or parked): its ``ignored``
        line is dropped; a summary is written when the queue's minute is over (the first
        deferral of a queue in this process writes one at once)."""
        self.install()
        now = self._monotonic()
        with self._lock:
            self._pending[task_id] = None
            while len(self._pending) > PENDING_IGNORED:
                self._pending.popitem(last=False)
            began, count, ids = self._periods.get(queue) or (now - self.every, 0, set())
            count = count + 1
            ids.add(task_id)  # in place: a busy queue defers thousands of times a minute
            if now - began < self.every:
                self._periods[queue] = (began, count, ids)
                return
            self._periods[queue] = (now, 0, set())
        if count == 1:
            logger.info("queue %r: tasks wait for their slots, sent back to the broker until then (deferrals: "
                        "normal, logged at DEBUG; a summary a minute here)", queue)  # fmt: skip
        else:
            logger.info("queue %r: %d deferrals of %d waiting tasks in the last %.0fs",
                        queue, count, len(ids), now - began)  # fmt: skip

    def take_ignored(self, task_id: str) -> bool:
        """Whether ``task_id``'s ``ignored`` line is a deferral's (and forget it)."""
        with self._lock:
            return self._pending.pop(task_id, False) is None

    def install(self) -> None:
        """Put the filter on Celery's trace logger, once per process."""
        if self._filter is None:
            self._filter = IgnoredAfterDeferral(self)
            logging.getLogger(TRACE_LOGGER).addFilter(self._filter)


class IgnoredAfterDeferral(logging.Filter):
    """Drops Celery's ``Task ... ignored`` line of a task this process deferred."""

    def __init__(self, log: DeferralLog) -> None:
        super().__init__()
        self.log = log

    def filter(self, record: logging.LogRecord) -> bool:
        context: Any = record.args
        if not isinstance(context, dict) or context.get("description") != "ignored":
            return True
        return not self.log.take_ignored(str(context.get("id")))


DEFERRALS_LOG = DeferralLog()


def note_deferral(queue: str, task_id: str) -> None:
    DEFERRALS_LOG.note(queue, task_id)
