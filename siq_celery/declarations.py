"""The code's ``interval=`` is the source of truth for a deploy.

Each queue keeps the interval the code *declared* last next to the *effective* one it
runs at (model.py: ``declare``, ``override``, ``effective_interval``). A worker node:

* at start (``worker_init``, before it takes a task) *announces* the declarations of
  its app's interval tasks: one that differs from the stored declaration becomes the
  declaration and the effective interval at once, replacing an operator's override, and
  the worker logs one line saying queue, old -> new and who changed it;
* registers each declaration under its node name for ``siq_declaration_ttl`` seconds
  and renews it every third of that (its upkeep thread), so while old and new code run
  side by side the queue runs at the slowest live declaration; a node that stops
  withdraws its declarations, and one that dies stops counting after the TTL;
* declares a per-key queue (``interval_queue`` a callable) when one of its pool
  processes first uses the key, and renews it while it keeps using it.

Producers never write the interval (queue.py: ``note_stored_interval`` logs once when
theirs differs); ``celery -A app siq sync`` announces the app's declarations from a
script, without registering a node.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any

from .config import siq_state
from .errors import SiqError, StoreUnavailableError
from .intervals import format_interval
from .queue import IntervalQueue, who
from .types import Declared

logger = logging.getLogger("siq_celery")

#: Per-key queues whose declaration one process remembers renewing (least recently used
#: dropped first: a dropped one is simply declared again on its next use).
PER_KEY_REMEMBERED = 10_000


def app_declarations(app: Any) -> list[IntervalQueue]:
    """One IntervalQueue per fixed queue name the app's interval tasks declare (the queues
    of several limits included; per-key queues are declared on use), worked out once per
    app. Tasks that share a queue but declare different intervals: the slowest wins, with
    a warning; a task with no interval anywhere is left out, with an error naming it (its
    publish fails too)."""
    state = siq_state(app)
    if state.declared_queues is None:
        state.declared_queues = _declared_queues(app)
    return list(state.declared_queues)


def _declared_queues(app: Any) -> list[IntervalQueue]:
    by_name: dict[str, tuple[IntervalQueue, str]] = {}
    for task in list(app.tasks.values()):
        declared = getattr(task, "siq_declared_queues", None)
        if declared is None:
            continue
        try:
            queues = declared()
        except SiqError as exc:
            logger.error("siq_celery: task %s declares no usable interval: %s", task.name, exc)
            continue
        for queue in queues:
            seen = by_name.get(queue.name)
            if seen is not None and seen[0].interval_us != queue.interval_us:
                slower = max(seen[0], queue, key=lambda q: q.interval_us or 0)
                logger.warning("siq_celery: tasks %s and %s declare queue %r at %s and %s; the slower holds",
                               seen[1], task.name, queue.name, format_interval(seen[0].interval_us or 0),
                               format_interval(queue.interval_us or 0))  # fmt: skip
                if slower is seen[0]:
                    continue
            by_name[queue.name] = (queue, task.name)
    return [q for q, _ in by_name.values()]


def describe(queue: str, done: Declared, origin: str) -> str | None:
    """One line for the log when a declaration changed something, else None."""
    if done.created:
        return f"queue {queue!r} created with interval {format_interval(done.interval_us)}, declared by {origin}"
    parts = []
    if done.declaration_changed and done.old_declared_us:
        parts.append(f"declared interval {format_interval(done.old_declared_us)} -> "
                     f"{format_interval(done.declared_us)} by {origin}")  # fmt: skip
    if done.replaced_override_us:
        parts.append(f"replaces the override {format_interval(done.replaced_override_us)} set by "
                     f"{done.replaced_override_by or 'unknown'}")  # fmt: skip
    if done.old_interval_us != done.interval_us:
        parts.append(f"effective {format_interval(done.old_interval_us)} -> {format_interval(done.interval_us)}")
    elif done.declaration_changed and done.interval_us != done.declared_us:
        parts.append(f"effective stays {format_interval(done.interval_us)} (an override, or the declarations "
                     f"of live workers: see `siq status {queue}`)")  # fmt: skip
    return f"queue {queue!r}: " + "; ".join(parts) if parts else None


class NodeDeclarations:
    """One worker node's declarations: announced at start, renewed, withdrawn at stop.

    Lives in the worker's main process. A queue whose announcement failed (the store was
    down) is announced at the next renewal."""

    def __init__(self, app: Any, node: str) -> None:
        self.app, self.node = app, node
        self.ttl = siq_state(app).settings.declaration_ttl
        self.origin = who(node)
        self._announced: set[str] = set()
        self._next_renewal = 0.0
        self._closed = False
        self._lock = threading.Lock()

    def _declare(self, queue: IntervalQueue, *, announce: bool, ttl: float | None = None) -> Declared:
        return queue.declare(node=self.node, ttl=self.ttl if ttl is None else ttl, announce=announce,
                             origin=self.origin)  # fmt: skip

    def announce(self) -> None:
        with self._lock:
            for queue in app_declarations(self.app):
                if not self._announce(queue):
                    break  # the store is unreachable: the renewals try again, without a timeout per queue
            self._next_renewal = time.monotonic() + self.ttl / 3

    def _announce(self, queue: IntervalQueue) -> bool:
        """Announce one declaration and log what it changed; False if the store is unreachable."""
        try:
            done = self._declare(queue, announce=True)
        except SiqError as exc:
            logger.warning("siq_celery: could not declare %r's interval (retrying with the renewals): %s",
                           queue.name, exc)  # fmt: skip
            return not isinstance(exc, StoreUnavailableError)
        self._announced.add(queue.name)
        line = describe(queue.name, done, self.origin)
        if line:
            logger.warning("siq_celery: %s", line)
        else:
            logger.info("siq_celery: queue %r: interval %s as declared", queue.name, format_interval(done.interval_us))
        return True

    def renew_if_due(self) -> None:
        """Renew every declaration (every third of the TTL); announce the ones not yet made."""
        if time.monotonic() < self._next_renewal:
            return
        with self._lock:
            if self._closed:
                return
            self._next_renewal = time.monotonic() + self.ttl / 3
            for queue in app_declarations(self.app):
                if queue.name not in self._announced:
                    if not self._announce(queue):
                        return
                    continue
                try:
                    done = self._declare(queue, announce=False)
                except SiqError as exc:
                    logger.warning("siq_celery: could not renew %r's declaration: %s", queue.name, exc)
                    if isinstance(exc, StoreUnavailableError):
                        return
                    continue
                if done.old_interval_us != done.interval_us:
                    logger.warning("siq_celery: queue %r: effective %s -> %s (a worker's declaration expired or "
                                   "was withdrawn)", queue.name, format_interval(done.old_interval_us),
                                   format_interval(done.interval_us))  # fmt: skip

    def withdraw(self) -> None:
        """The node stops: its declarations stop counting now (not after the TTL)."""
        with self._lock:
            self._closed = True
            for queue in app_declarations(self.app):
                if queue.name in self._announced:
                    try:
                        self._declare(queue, announce=False, ttl=0.0)
                    except SiqError as exc:
                        logger.info("siq_celery: could not withdraw %r's declaration (it expires in %.0fs): %s",
                                    queue.name, self.ttl, exc)  # fmt: skip
            self._announced.clear()


class PerKeyDeclarations:
    """Per-key queues' declarations, made by the pool process that uses a key: on first
    use (an announcement), then renewed on use every third of the TTL."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._renewed: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def on_use(self, queue: IntervalQueue, node: str) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._renewed.get(queue.name)
            if last is not None and now - last < self.ttl / 3:
                self._renewed.move_to_end(queue.name)
                return
            self._renewed[queue.name] = now
            self._renewed.move_to_end(queue.name)
            while len(self._renewed) > PER_KEY_REMEMBERED:
                self._renewed.popitem(last=False)
        origin = who(node)
        try:
            done = queue.declare(node=node, ttl=self.ttl, announce=last is None, origin=origin)
        except SiqError as exc:  # the start itself fails closed, and says why
            logger.debug("siq_celery: could not declare %r: %s", queue.name, exc)
            with self._lock:
                self._renewed.pop(queue.name, None)
            return
        line = describe(queue.name, done, origin) if not done.created else None
        if line:
            logger.warning("siq_celery: %s", line)


def sync_app(app: Any) -> list[tuple[str, Declared]]:
    """``siq sync``: announce every declaration of ``app`` from a script (no node is
    registered: a script does not stay to renew it). What each did."""
    origin = f"siq sync ({who()})"
    results = []
    for queue in app_declarations(app):
        results.append((queue.name, queue.declare(origin=origin)))
    return results
