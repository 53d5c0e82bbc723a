"""Long waits: tasks whose slot is beyond the horizon wait in the store, not in a worker.

Celery keeps every countdown task in worker memory until it is due, the Redis broker
redelivers an unacknowledged one after ``visibility_timeout``, and RabbitMQ closes the
channel past ``consumer_timeout``. So no interval task is delayed by countdown beyond
``siq_horizon``: a task whose estimated start is further out is *parked* in the store
(ordered by ticket) as the signature that publishes it again unchanged (same id,
arguments, headers, retry count, routing), and *released* back to the broker, with its
ticket and an ETA, once its slot comes within the horizon.

Releases need no leader: whoever parks, every worker after a task finishes (at most once
a second per queue and process), and every worker's upkeep thread (tasks/upkeep.py, every
``siq_release_every`` seconds, so an idle fleet still releases) call :func:`release_due`.
The store leases each parked task to one releaser at a time, and hands it out again
only if that releaser dies before publishing it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from kombu.exceptions import EncodeError
from kombu.utils.json import dumps, loads  # Celery's JSON: datetimes, UUIDs, Decimals

from ..backends.base import RELEASE_LIMIT
from ..client.queue import IntervalQueue
from ..lru import LRUCache
from ..messages import DEFERRALS, FAIR_HEADERS, fair_headers, fair_share, ticket_headers
from ..parked import ParkedTask
from ..types import Ticket
from .app_state import siq_state

logger = logging.getLogger("siq_celery")


#: The siq_ headers a task parked again keeps (the others are the ticket's, given at release).
_KEPT_HEADERS = frozenset((DEFERRALS, *FAIR_HEADERS))


def parked_message(name: str, args: Any, kwargs: Any, options: dict[str, Any]) -> str:
    """The JSON that publishes a task again unchanged (its ticket headers are added back
    at release, from the store; its deferrals and a fair task's share go with it, for the
    ledger)."""
    opts = {k: v for k, v in options.items() if k not in ("eta", "countdown") and v is not None}
    given = opts.get("headers") or {}
    headers = {k: v for k, v in given.items() if not k.startswith("siq_") or (k in _KEPT_HEADERS and v is not None)}
    opts["headers"] = headers
    message = {"task": name, "args": list(args or ()), "kwargs": dict(kwargs or {}), "options": opts}
    try:
        return str(dumps(message))  # type: ignore[no-untyped-call]
    except (TypeError, ValueError) as exc:  # what a JSON publish of the task raises, too
        raise EncodeError(f"task {name}: cannot park it, its call is not JSON: {exc}") from exc


def park(queue: IntervalQueue, tickets_and_messages: Iterable[tuple[Ticket, str, str]]) -> bool:
    """Park ``(ticket, task id, message)`` triples of one epoch; False if the epoch moved on."""
    items = list(tickets_and_messages)
    if not items:
        return True
    epoch = items[0][0].epoch
    return queue.backend.park(queue.name, epoch, [ParkedTask(t.number, task_id, msg) for t, task_id, msg in items])


def release_due(app: Any, queue: IntervalQueue, horizon_us: int, margin: float) -> int:
    """Publish every parked task of ``queue`` whose slot is within the horizon; how many."""
    released = 0
    while True:
        batch = queue.backend.release(queue.name, horizon_us)
        if not batch.tasks:
            return released
        published: list[str] = []
        try:
            for parked, estimate_us in batch.tasks:
                try:
                    message = _readable(parked.message)
                except ValueError as exc:
                    # Left parked (an operator can read it with `siq export --parked`) and
                    # skipped: one unreadable entry must not hold back the rest.
                    where = queue.backend.keys(queue.name).parked_messages
                    logger.error("siq_celery: parked task %s (ticket %s) of %r in %r is unreadable, not released: %s",
                                 parked.task_id, parked.ticket, queue.name, where, exc)  # fmt: skip
                    continue
                options = dict(message["options"])
                ticket = Ticket(queue.name, parked.ticket, batch.epoch, estimate_us, batch.now_us)
                options["headers"] = {**options.get("headers", {}), **ticket_headers(ticket)}
                if "fair" in message:  # handed its ticket by a fair queue's promotion
                    options["headers"].update(fair_headers(*message["fair"]))
                due = estimate_us / 1e6 - margin
                if due > batch.now_us / 1e6:
                    options["eta"] = datetime.fromtimestamp(due, UTC)
                options["task_id"] = parked.task_id
                options["add_to_parent"] = False  # a task that releases others is not their parent
                app.send_task(message["task"], args=message["args"], kwargs=message["kwargs"], **options)
                published.append(parked.task_id)
        finally:
            # Published ones are forgotten; the rest come back when their lease ends.
            queue.backend.unpark(queue.name, published)
        released += len(published)
        if len(batch.tasks) < RELEASE_LIMIT:
            return released


def _readable(text: str) -> dict[str, Any]:
    """A parked message as :func:`parked_message` wrote it (with ``"fair"``: a fair task's
    share, as its promotion put it in front: :func:`siq_celery.messages.with_fair_share`),
    or ValueError saying what is off (the store is outside this process: its values are
    checked, never trusted)."""
    try:
        message = loads(text)  # type: ignore[no-untyped-call]
    except Exception as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not (
        isinstance(message, dict) and isinstance(message.get("task"), str) and isinstance(message.get("args"), list)
        and isinstance(message.get("kwargs"), dict) and isinstance(message.get("options"), dict)
        and isinstance(message["options"].get("headers", {}), dict)
    ):  # fmt: skip
        raise ValueError(f"not a parked task message: {text[:200]!r}")
    if "fair" in message:
        message["fair"] = fair_share(message["fair"])
    return message


class ReleaseThrottle:
    """At most one release per queue per ``every`` seconds in this process."""

    def __init__(self, every: float = 1.0) -> None:
        self.every = every
        # Bounded: a queue forgotten is released once more than once a second, no harm.
        self._last: LRUCache[str, float] = LRUCache(10_000)
        self._lock = threading.Lock()

    def due(self, queue: str) -> bool:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(queue)
            if last is not None and now - last < self.every:
                return False
            self._last[queue] = now
            return True


_RELEASE_THROTTLE = ReleaseThrottle()


def release_now_and_then(app: Any, queue: IntervalQueue, who: str) -> None:
    """Release ``queue``'s parked tasks that came within the horizon, at most once a second
    per queue in this process (a producer after parking, a worker after a task finishes)."""
    if _RELEASE_THROTTLE.due(queue.name):
        release_fair(app, queue, who)


def release_fair(app: Any, queue: IntervalQueue, who: str) -> None:
    """Release ``queue``'s parked tasks that came within the horizon now, unthrottled; on a
    fair queue this first tops its lookahead up (rules.fair_promote): after each publish
    and each start, so the queue never runs dry while keys have work (one round trip; a
    release that finds the lookahead full hands out nothing)."""
    try:
        settings = siq_state(app).settings
        release_due(app, queue, settings.horizon_us, settings.countdown_margin)
    except Exception as exc:  # the next start, or the workers' upkeep, tries again; nothing is lost
        logger.warning("%s: could not release parked tasks of %r: %s", who, queue.name, exc)


class ReleaseAfterStart:
    """The fair release that follows a start, made by a thread of this process (on a green
    pool, a greenlet) rather than between the start's authorization and its body: a
    provider counts a request when the body makes it, and that release is a store round
    trip plus a publish per ticket handed out (its bodies began p50 2.5-6 ms, p99 16-43 ms
    after their authorization when the start made it). Asks for one queue of one app
    coalesce while one is pending; a release this process never makes (it died) is made
    by the next start or by a worker's upkeep.

    An ask comes just before a body begins, and waking a thread there is a point where a
    loaded host's scheduler may give the CPU to another task after the store placed the
    start. So while asks keep coming (within :data:`IDLE_AFTER_S` of the last) the thread
    looks for them every :data:`POLL_S` and an ask does not wake it; and a fair start, as
    its wait begins, makes the thread (the first in a process) or wakes it after a quiet
    spell (:meth:`ready`), so that the ask after its report finds it looking. Only an ask
    after a wait longer than the quiet spell wakes it there. The lookahead a release tops
    up is a quarter second of slots: a release a few tens of milliseconds later hands out
    the same tickets."""

    #: How often the thread looks for asks while they keep coming.
    POLL_S = 0.02
    #: After this long without an ask the thread sleeps until the next one wakes it.
    IDLE_AFTER_S = 2.0

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._pid = 0
        self._pending: dict[tuple[int, str], tuple[Any, IntervalQueue, str]] = {}  # by app and queue
        self._thread: threading.Thread | None = None
        self._asleep = False  #: the thread waits for a wake-up (no asks for IDLE_AFTER_S)
        self._awake_until = 0.0  #: a start is waited for: the thread looks for asks until then

    def ready(self) -> None:
        """A fair start is about to be waited for: its ask comes after its report, just
        before its body, so the thread is made now (the first in this process), or woken
        now if it sleeps, and looks for asks for :data:`IDLE_AFTER_S` from now."""
        with self._lock:
            self._here()
            self._awake_until = time.monotonic() + self.IDLE_AFTER_S
            self._wake()

    def ask(self, app: Any, queue: IntervalQueue, who: str) -> None:
        """Release ``queue``'s due tasks soon, in the background (see :func:`release_fair`)."""
        with self._lock:
            self._here()
            self._pending[id(app), queue.name] = (app, queue, who)  # two apps' queues of one name are two
            self._wake()

    def _here(self) -> None:
        """In a forked child, the parent's thread and asks are not here (lock held)."""
        if self._pid != os.getpid():
            self._pid, self._pending, self._thread, self._asleep, self._awake_until = os.getpid(), {}, None, False, 0.0

    def _wake(self) -> None:
        """The thread, made if this process has none, woken if it sleeps (lock held)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="siq-fair-release", daemon=True)
            self._thread.start()
        elif self._asleep:
            self._lock.notify()

    def _run(self) -> None:
        last = time.monotonic()
        while True:
            with self._lock:
                while not self._pending:
                    self._asleep = time.monotonic() > max(last + self.IDLE_AFTER_S, self._awake_until)
                    self._lock.wait(None if self._asleep else self.POLL_S)
                self._asleep = False
                asked, self._pending = list(self._pending.values()), {}
            last = time.monotonic()
            for app, queue, who in asked:
                release_fair(app, queue, who)  # logs what it could not do; never raises (the thread lives on)


RELEASE_AFTER_START = ReleaseAfterStart()
