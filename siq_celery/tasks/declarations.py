"""The code's ``interval=`` is the source of truth for a deploy.

Each queue keeps the interval the code *declared* last next to the *effective* one it
runs at (rules/declarations.py: ``declare``, ``override``, ``effective_interval``). A worker node:

* at start (``worker_init``, before it takes a task) *announces* the declarations of
  its app's interval tasks: one that differs from the stored declaration becomes the
  declaration and the effective interval at once, replacing an operator's override, and
  the worker logs one line saying queue, old -> new and who changed it;
* registers each declaration under its node name for ``siq_declaration_ttl`` seconds
  and renews it every third of that (its upkeep thread), so while old and new code run
  side by side the queue runs at the slowest live declaration; a node that stops
  withdraws its declarations, and one that dies stops counting after the TTL (every
  operation that decides by the interval follows the expiry: rules.follow_expiry);
* declares a per-key queue (``interval_queue`` a callable) when one of its pool
  processes first uses the key, renews it while it keeps using it, and withdraws it when
  the process stops.

Producers never write the interval (client/queue.py: ``note_stored_interval`` logs once when
theirs differs); ``celery -A app siq sync`` announces the app's declarations from a
script, without registering a node.
"""

from __future__ import annotations

import copy
import logging
import multiprocessing
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ..client.control import who
from ..client.queue import IntervalQueue
from ..errors import SiqError, StoreUnavailableError
from ..intervals import format_interval
from ..limits import NO_SPACING_US, format_limits, format_override
from ..logs import Throttle
from ..lru import LRUCache
from ..rules import strictest
from ..types import NO_LIMITS, Declared, Limits
from .app_state import siq_state

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
            by_name[queue.name] = (queue, task.name) if seen is None else (_stricter(seen, queue, task.name), seen[1])
    return [q for q, _ in by_name.values()]


def _stricter(seen: tuple[IntervalQueue, str], queue: IntervalQueue, task: str) -> IntervalQueue:
    """Two tasks of one app declare one queue: the slower interval holds, and the strictest
    of their limits (rules.strictest), each with a warning naming both tasks."""
    first, by = seen
    slower = max(first, queue, key=lambda q: q.interval_us or 0)
    if first.interval_us != queue.interval_us:
        logger.warning("siq_celery: tasks %s and %s declare queue %r at %s and %s; the slower holds",
                       by, task, queue.name, format_interval(first.interval_us or 0),
                       format_interval(queue.interval_us or 0))  # fmt: skip
    if first.limits == queue.limits:
        return slower
    limits = strictest([first.limits, queue.limits])
    logger.warning("siq_celery: tasks %s and %s declare queue %r with %s and %s; the strictest holds: %s",
                   by, task, queue.name, format_limits(first.limits), format_limits(queue.limits),
                   format_limits(limits))  # fmt: skip
    if limits == slower.limits:
        return slower
    both = copy.copy(slower)  # the app's cached object stays as its task declared it
    both.limits = limits
    return both


def describe(queue: str, done: Declared, origin: str) -> str | None:
    """One line for the log when a declaration changed something, else None."""
    if done.created:
        limits = f" and limits {format_limits(done.limits)}" if done.limits != NO_LIMITS else ""
        interval = format_interval(done.interval_us)
        return f"queue {queue!r} created with interval {interval}{limits}, declared by {origin}"
    if done.old_interval_us <= NO_SPACING_US and done.old_limits == NO_LIMITS and not done.old_declared_us:
        # a queue paused before any worker (rules.paused_new_state): this is its first interval
        limits = f" and limits {format_limits(done.limits)}" if done.limits != NO_LIMITS else ""
        return (
            f"queue {queue!r}: interval {format_interval(done.interval_us)}{limits} declared by {origin}; paused "
            f"before any worker, it stays paused until resume"
        )
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
    parts += _describe_limits(queue, done)
    return f"queue {queue!r}: " + "; ".join(parts) if parts else None


def _describe_limits(queue: str, done: Declared) -> list[str]:
    """What the declaration changed of the limits, for :func:`describe`."""
    parts = []
    old, new = done.old_declared_limits, done.declared_limits
    if done.limits_declaration_changed and old is not None and new is not None:
        parts.append(f"declared limits {format_limits(old)} -> {format_limits(new)}")
    if done.replaced_limits:
        parts.append(f"replaces the limits override {format_override(done.replaced_limits)} set by "
                     f"{done.replaced_limits_by or 'unknown'}")  # fmt: skip
    if done.old_limits != done.limits:
        parts.append(f"effective limits {format_limits(done.old_limits)} -> {format_limits(done.limits)}")
    elif done.limits_declaration_changed and old is not None and new is not None and done.limits != new:
        parts.append(f"effective limits stay {format_limits(done.limits)} (an override, or the declarations of "
                     f"live workers: see `siq status {queue}`)")  # fmt: skip
    return parts


#: The first and the longest wait between attempts to announce while the store is unreachable.
ANNOUNCE_RETRY_S = (0.1, 2.0)
#: How often a task waiting for its node's announcement looks again.
ANNOUNCED_POLL_S = 0.05


class NodeDeclarations:
    """One worker node's declarations: announced at start, renewed, withdrawn at stop.

    Lives in the worker's main process. When the store is unreachable at the start, the
    announcement is retried at once in a thread (every 0.1 s at first, then at most every
    2 s) until it is made; meanwhile the node's interval tasks wait for it
    (:meth:`wait_announced`, in the pool processes too: the flag is in memory they share)."""

    def __init__(self, app: Any, node: str) -> None:
        self.app, self.node = app, node
        self.ttl = siq_state(app).settings.declaration_ttl
        self.origin = who(node)
        self._announced: set[str] = set()
        #: The effective interval and limits each queue had at this node's last declaration: a
        #: start may have followed an expiry since (rules.follow_expiry), and the renewal says so.
        self._effective: dict[str, tuple[int, Limits]] = {}
        self._next_renewal = 0.0
        self._closed = False
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        #: 1 once the announcement is made; shared with the pool processes forked after worker_init.
        self._made = multiprocessing.RawValue("b", 0)
        self._retrying: threading.Thread | None = None

    @property
    def announced(self) -> bool:
        """Whether the announcement was made (every declaration tried on a reachable store)."""
        return bool(self._made.value)

    def _declare(self, queue: IntervalQueue, *, announce: bool, ttl: float | None = None) -> Declared:
        return queue.declare(node=self.node, ttl=self.ttl if ttl is None else ttl, announce=announce,
                             origin=self.origin)  # fmt: skip

    def announce(self) -> bool:
        """Announce every declaration (before the node takes a task); True when made. If the
        store is unreachable, a thread retries until it is made, and False is returned."""
        try:
            self._announce_pending()
            return True
        except StoreUnavailableError as exc:
            logger.warning("siq_celery: could not announce this worker's interval declarations, the state store "
                           "is unreachable; retrying from %.1fs on, and this worker's interval tasks wait until "
                           "it is made: %s", ANNOUNCE_RETRY_S[0], exc)  # fmt: skip
        self._retrying = threading.Thread(target=self._retry, name="siq-announce", daemon=True)
        self._retrying.start()
        return False

    def _retry(self) -> None:
        delay, since = ANNOUNCE_RETRY_S[0], time.monotonic()
        while not self._stopped.wait(delay):
            try:
                self._announce_pending()
            except StoreUnavailableError:
                delay = min(delay * 2, ANNOUNCE_RETRY_S[1])
                continue
            except Exception as exc:  # never leave the node's tasks waiting on a crashed thread
                logger.error("siq_celery: announcing interval declarations failed: %s", exc)
                self._made.value = 1
                return
            logger.warning(
                "siq_celery: interval declarations announced %.1fs after the worker started (the "
                "state store was unreachable); its interval tasks go on",
                time.monotonic() - since,
            )
            return

    def _announce_pending(self) -> None:
        """Announce the declarations not yet made; StoreUnavailableError at the first
        timeout (without a timeout per queue). A declaration refused for another reason is
        logged and left to the renewals."""
        with self._lock:
            if self._closed:
                return
            for queue in app_declarations(self.app):
                if queue.name not in self._announced:
                    self._announce(queue)
            self._next_renewal = time.monotonic() + self.ttl / 3
            self._made.value = 1

    def _announce(self, queue: IntervalQueue) -> None:
        """Announce one declaration and log what it changed."""
        try:
            done = self._declare(queue, announce=True)
        except StoreUnavailableError:
            raise
        except SiqError as exc:
            logger.warning("siq_celery: could not declare the interval of queue %r (retrying with the renewals): %s",
                           queue.name, exc)  # fmt: skip
            return
        self._announced.add(queue.name)
        self._effective[queue.name] = (done.interval_us, done.limits)
        line = describe(queue.name, done, self.origin)
        if line:
            logger.warning("siq_celery: %s", line)
        else:
            logger.info("siq_celery: queue %r: interval %s as declared", queue.name, format_interval(done.interval_us))

    def wait_announced(self, sleep: Callable[[float], None] = time.sleep) -> None:
        """Return once the node's announcement is made: a task must not start at the
        interval stored before it (the deploy's new one applies before the first task)."""
        if self.announced:
            return
        logger.warning("siq_celery: waiting for this worker's announcement of its interval declarations (the "
                       "state store was unreachable at its start) before starting interval tasks")  # fmt: skip
        while not self.announced and not self._stopped.is_set():
            sleep(ANNOUNCED_POLL_S)

    def renew_if_due(self) -> None:
        """Renew every declaration (every third of the TTL); announce the ones not yet made.
        StoreUnavailableError at the first timeout (the caller logs the outage once)."""
        if time.monotonic() < self._next_renewal:
            return
        with self._lock:
            if self._closed:
                return
            self._next_renewal = time.monotonic() + self.ttl / 3
            for queue in app_declarations(self.app):
                if queue.name not in self._announced:
                    self._announce(queue)
                    continue
                try:
                    done = self._declare(queue, announce=False)
                except StoreUnavailableError:
                    raise
                except SiqError as exc:
                    logger.warning("siq_celery: could not renew the declaration of queue %r: %s", queue.name, exc)
                    continue
                before, limits = self._effective.get(queue.name, (done.old_interval_us, done.old_limits))
                self._effective[queue.name] = (done.interval_us, done.limits)
                if before != done.interval_us:
                    logger.warning("siq_celery: queue %r: effective %s -> %s (a worker's declaration expired or "
                                   "was withdrawn, or an operator changed it)", queue.name, format_interval(before),
                                   format_interval(done.interval_us))  # fmt: skip
                if limits != done.limits:
                    logger.warning("siq_celery: queue %r: effective limits %s -> %s (a worker's declaration expired "
                                   "or was withdrawn, or an operator changed them)", queue.name, format_limits(limits),
                                   format_limits(done.limits))  # fmt: skip

    def withdraw(self) -> None:
        """The node stops: its declarations stop counting now (not after the TTL). Stops at
        the first timeout of an unreachable store (they expire on their own)."""
        self._stopped.set()
        with self._lock:
            self._closed = True
            for queue in app_declarations(self.app):
                if queue.name in self._announced:
                    try:
                        self._declare(queue, announce=False, ttl=0.0)
                    except StoreUnavailableError as exc:
                        logger.info("siq_celery: could not withdraw this worker's declarations, the state store is "
                                    "unreachable (they expire within %.0fs): %s", self.ttl, exc)  # fmt: skip
                        break
                    except SiqError as exc:
                        logger.info("siq_celery: could not withdraw the declaration of queue %r (it expires within "
                                    "%.0fs): %s", queue.name, self.ttl, exc)  # fmt: skip
            self._announced.clear()


#: At most this long is spent withdrawing per-key declarations when a process stops.
PER_KEY_WITHDRAW_S = 2.0


class PerKeyDeclarations:
    """Per-key queues' declarations, made by the pool process that uses a key: on first
    use (an announcement), then renewed on use every third of the TTL, and withdrawn when
    the process stops (those still live, for at most :data:`PER_KEY_WITHDRAW_S`).

    A deploy that changes a per-key interval is logged once per task and change, not once
    per key; a declaration that fails is logged at most once a minute."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._renewed: OrderedDict[str, tuple[float, IntervalQueue, str]] = OrderedDict()
        self._lock = threading.Lock()
        self._failures = Throttle(60.0)
        self._changes: LRUCache[tuple[object, ...], bool] = LRUCache(1_000)

    def on_use(self, queue: IntervalQueue, node: str, task: str = "") -> None:
        now = time.monotonic()
        with self._lock:
            last = self._renewed.get(queue.name)
            if last is not None and now - last[0] < self.ttl / 3:
                self._renewed.move_to_end(queue.name)
                return
            self._renewed[queue.name] = (now, queue, node)
            self._renewed.move_to_end(queue.name)
            while len(self._renewed) > PER_KEY_REMEMBERED:
                self._renewed.popitem(last=False)
        origin = who(node)
        try:
            done = queue.declare(node=node, ttl=self.ttl, announce=last is None, origin=origin)
        except SiqError as exc:  # the start itself fails closed, and says why
            if (left_out := self._failures.due("declare")) is not None:
                more = f" (and {left_out} more since the last line)" if left_out else ""
                logger.warning("siq_celery: could not declare the interval of per-key queue %r%s; declared again "
                               "on its next use: %s", queue.name, more, exc)  # fmt: skip
            with self._lock:
                self._renewed.pop(queue.name, None)
            return
        line = describe(queue.name, done, origin) if not done.created else None
        if line:
            change = (task, done.old_declared_us, done.declared_us, done.replaced_override_us,
                      done.old_declared_limits, done.declared_limits, done.replaced_limits)  # fmt: skip
            if change in self._changes:
                logger.debug("siq_celery: %s", line)
                return
            self._changes[change] = True
            of = f"task {task}" if task else "this task"
            logger.warning("siq_celery: %s (the other keys of %s that change alike are not logged)", line, of)

    def withdraw(self) -> None:
        """The process stops: the declarations it keeps live stop counting now. Bounded:
        at the first timeout of an unreachable store, or after PER_KEY_WITHDRAW_S, the rest
        expire on their own."""
        now = time.monotonic()
        with self._lock:
            live = [(q, node) for at, q, node in self._renewed.values() if now - at < self.ttl]
            self._renewed.clear()
        deadline = now + PER_KEY_WITHDRAW_S
        for queue, node in live:
            if time.monotonic() > deadline:
                break
            try:
                queue.declare(node=node, ttl=0.0, announce=False, origin=who(node))
            except StoreUnavailableError:
                break
            except SiqError as exc:
                logger.debug("siq_celery: could not withdraw the declaration of %r: %s", queue.name, exc)


def sync_app(app: Any) -> list[tuple[str, Declared]]:
    """``siq sync``: announce every declaration of ``app`` from a script (no node is
    registered: a script does not stay to renew it). What each did."""
    origin = f"siq sync ({who()})"
    results = []
    for queue in app_declarations(app):
        results.append((queue.name, queue.declare(origin=origin)))
    return results
