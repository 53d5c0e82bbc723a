"""IntervalTask: every start of the task takes its turn in a shared interval queue.

>>> @app.task(base=IntervalTask, interval="200ms", interval_queue="geocoder")
... def geocode(address): ...

This module is the declaration: the task's attributes, which queue (or queues) a call
belongs to and what it costs. Each side lives in a module of its own, read by one reader:

* the producer side (``apply_async``, ``apply_many``): claim a ticket, put it in the
  headers, set an ETA near its slot, park beyond the horizon: tasks/publish.py;
* the worker side (``before_start``, ``after_return``, ``siq_backoff``): the gate that
  authorizes, sleeps, defers or parks, and records the finish: tasks/gate.py;
* the worker around its tasks (signals: warm-up, declarations, upkeep): tasks/worker_hooks.py.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NoReturn

from celery import Task, signals
from celery.exceptions import Ignore

from ..broker.kombu_api import kombu_problem
from ..broker.transit import guard_transit
from ..client.body import report_again_if_late
from ..client.combined import CombinedQueue
from ..client.queue import IntervalQueue, validate_cost
from ..errors import ConfigurationError, InvalidQueueNameError, LostDeliveriesError, SiqError
from ..intervals import IntervalLike, parse_interval
from ..keys import validate_queue_name
from ..limits import Limit, check_not_a_quota, parse_quota, validate_burst, validate_concurrency, validate_margin
from ..messages import DEFERRALS, KEEP_TICKET
from ..rules import MAX_FAIR_WEIGHT
from ..types import Decision
from .app_state import siq_state
from .gate import authorize, back_off, paused_countdown, record_finish, record_retry, release_leftover_lease
from .publish import publish, publish_many, put_ticket_in_headers
from .retry_after import BackoffSource, backoff_hold
from .task_api import check_interval_options
from .worker_hooks import connect_worker_hooks

__all__ = ["DEFERRALS", "KEEP_TICKET", "IntervalTask", "paused_countdown"]

logger = logging.getLogger("siq_celery")


class IntervalTask(Task):  # type: ignore[misc]
    """A Celery task whose starts share one interval with every worker of its queue."""

    #: Least time between two starts of this task's interval queue: seconds, a timedelta,
    #: "200ms", "2s", or a rate "5/s". Falls back to ``app.conf.siq_default_interval``.
    #: The declaration: a worker starting with a new one makes it the queue's interval
    #: for every worker (tasks/declarations.py); producers never write it.
    interval: IntervalLike | None = None

    #: The interval queue's name; several task types may share one queue (one API, one
    #: quota). Defaults to the task's name. Or a callable receiving the call's ``args``
    #: (a list) and ``kwargs`` (a dict) and returning the name: one queue per customer,
    #: user or API key, created on first use with ``interval``, expiring after
    #: ``siq_key_idle_expiry`` of idleness (Redis).
    #: Several limits: a list of names (with ``interval`` a list of the same length), or a
    #: mapping of name to interval (``{"{geo}per-second": "100ms", "{geo}per-day":
    #: "10/2s"}``): every start must pass all of them at once (see client/combined.py).
    interval_queue: str | Callable[[list[Any], dict[str, Any]], str] | Sequence[str] | Mapping[str, Any] | None = None

    #: Starts that may come closer than the interval to catch up after lateness or idleness
    #: (0 to 10 000): in any window of length W at most ceil(W / interval) + burst starts.
    #: Falls back to ``app.conf.siq_default_burst``, then 0 (strict spacing).
    burst: int | None = None

    #: At most N cost units started in any sliding window of the period: ``"10000/d"``,
    #: ``"50/10s"`` (store clock), as fast as the interval allows; the line keeps its order
    #: and waits for the oldest start to leave the window. Falls back to
    #: ``app.conf.siq_default_quota``. Several limits with a quota of their own: a mapping
    #: value ``Limit(interval="100ms", quota="10000/d")`` (limits.py).
    quota: str | tuple[int, Any] | None = None

    #: At most N bodies of the queue (of each per-key queue) running at once, on every node:
    #: a start takes a lease, the end of its body (success, failure, retry, back-off)
    #: gives it back, a lease of a process that died comes back after ``siq_lease_timeout``.
    #: Falls back to ``app.conf.siq_default_concurrency``; several limits: a mapping value
    #: ``Limit(concurrency=5)``.
    concurrency: int | None = None

    #: Added to the spacing and to the quota's window (a duration: ``"5ms"``, 0 to 60 s), for
    #: what lies between a body's start and the provider's count of it (connection set-up,
    #: the network). Falls back to ``app.conf.siq_default_margin``, then 0; several limits:
    #: a mapping value ``Limit(interval="100ms", margin="5ms")``.
    margin: str | float | None = None

    #: Slots one start takes (a search that costs 10 points of a 100-point budget): the
    #: next start of the queue waits ``cost`` intervals. A whole number >= 1, or a callable
    #: like ``interval_queue``'s.
    cost: int | Callable[[list[Any], dict[str, Any]], int] = 1

    #: Fair shares among the keys of one queue (tenants, customers): a callable like a
    #: per-key ``interval_queue``'s, returning the call's key. Its tasks wait in their
    #: key's line in the store, with no ticket, and the queue's slots go to the keys with
    #: waiting work in weighted round robin (start-time fair queuing:
    #: docs/design.md, "Fair shares"); within a key, in the order published. One queue
    #: only (not several limits).
    fair_key: Callable[[list[Any], dict[str, Any]], str] | None = None

    #: Each fairness key's weight, 1 to 1,000 (default 1): its share of the slots while it
    #: has work is its weight over the weights of the keys with work. A mapping of key to
    #: weight, or a callable of the key.
    fair_weight: Mapping[str, int] | Callable[[str], int] | None = None

    #: Celery's request, reading the message's ETA on the state store's clock (clock.py).
    Request = "siq_celery.clock:StoreClockRequest"

    #: Durable by default: a task is acknowledged after it ran, and given back to the
    #: broker if its worker process dies, unless the task (``acks_late=False``) or the app
    #: (``task_acks_late``, ``task_reject_on_worker_lost``) says otherwise. Celery's own
    #: defaults acknowledge on receipt: a SIGKILLed worker would lose the tasks it held,
    #: and an interval queue holds many (waiting for their slot, or running).
    DURABLE_DEFAULTS = (("acks_late", "task_acks_late"), ("reject_on_worker_lost", "task_reject_on_worker_lost"))

    @classmethod
    def bind(cls, app: Any) -> Any:
        install()
        # Celery binds every task of the app when it finalizes it, after creating them all:
        # a task given an interval task's option on another base is refused here.
        check_interval_options(app)
        for attribute, setting in cls.DURABLE_DEFAULTS:
            if getattr(cls, attribute, None) is None and not _app_sets(app, setting):
                setattr(cls, attribute, True)
        if LostDeliveriesError not in cls.throws:  # the gate logs it in one line: no traceback
            cls.throws = (*cls.throws, LostDeliveriesError)
        return super().bind(app)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A declaration that cannot be parsed fails here, when the task is defined (at
        import, or when the app is finalized at worker start), naming the task: not at its
        first publish hours later."""
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name") or cls.__name__
        declared = cls.__dict__.get("interval_queue")
        intervals = cls.__dict__.get("interval")
        if isinstance(declared, Mapping):
            intervals = list(declared.values())
        for value in intervals if isinstance(intervals, (list, tuple)) else [intervals]:
            if value is not None and not isinstance(value, Limit):
                try:
                    parse_interval(value)
                except SiqError as exc:
                    raise ConfigurationError(f"task {name}: interval {value!r}: {exc}") from None
        if isinstance(declared, Mapping) and len(declared) > 1:
            for queue, value in declared.items():
                check_not_a_quota(value, f"task {name}: interval_queue[{queue!r}]")
        several = isinstance(declared, (Mapping, list, tuple)) and len(declared) > 1
        for option in ("burst", "quota", "concurrency", "margin"):
            if several and cls.__dict__.get(option) is not None:  # it would bind no queue
                raise ConfigurationError(
                    f"task {name}: {option}= applies to one interval queue, not to several: give each "
                    f"queue its own in the mapping, interval_queue={{'name': Limit(interval=..., {option}=...)}}"
                )
        checks = (("burst", validate_burst), ("quota", parse_quota), ("concurrency", validate_concurrency),
                  ("margin", validate_margin))  # fmt: skip
        for option, check in checks:
            if cls.__dict__.get(option) is not None:
                try:
                    check(cls.__dict__[option])
                except SiqError as exc:
                    raise ConfigurationError(f"task {name}: {exc}") from None
        fair_key, fair_weight = cls.__dict__.get("fair_key"), cls.__dict__.get("fair_weight")
        if fair_key is not None and not callable(fair_key):
            raise ConfigurationError(f"task {name}: fair_key= takes a callable of (args, kwargs), not {fair_key!r}")
        if fair_key is not None and several:
            raise ConfigurationError(f"task {name}: fair_key= shares one interval queue, not several limits")
        if isinstance(fair_weight, Mapping):
            for key, weight in fair_weight.items():
                _check_weight(name, key, weight)
        elif fair_weight is not None and not callable(fair_weight):
            raise ConfigurationError(f"task {name}: fair_weight= takes a mapping or a callable of the key")
        names = list(declared) if isinstance(declared, (Mapping, list, tuple)) else [declared]
        for queue in names:
            if isinstance(queue, str):  # "" is refused, not taken for "the task's name"
                try:
                    validate_queue_name(queue)
                except SiqError as exc:
                    raise InvalidQueueNameError(f"task {name}: interval_queue={queue!r}: {exc}") from None

    def siq_declared_queues(self) -> list[IntervalQueue]:
        """The queues whose interval this task's code declares, each with that interval
        (tasks/declarations.py: a worker announces them at start); none for per-key queues,
        which are declared when a key is first used."""
        if self.siq_per_key:
            return []
        limits = self.siq_limits()
        return list(limits.queues) if limits is not None else [self.siq_queue()]

    def siq_queue(self, args: Any = None, kwargs: Any = None) -> IntervalQueue:
        """The IntervalQueue of a call with ``args`` and ``kwargs`` (cached on the app);
        the arguments matter only when ``interval_queue`` is a callable."""
        name = declared(self, self.interval_queue)
        limits = self.siq_limits(args, kwargs)
        if limits is not None:
            return limits.primary
        state = siq_state(self.app)
        if isinstance(name, Mapping):  # one queue, named with its limit
            ((name, limit),) = name.items()
            return state.queue(name, limit, burst=self.burst, quota=self.quota, concurrency=self.concurrency,
                               margin=self.margin)  # fmt: skip
        if callable(name):
            return state.queue(_per_call(self, "interval_queue", name, args, kwargs), self.interval, per_key=True,
                               burst=self.burst, quota=self.quota, concurrency=self.concurrency,
                               margin=self.margin)  # fmt: skip
        return state.queue(
            self.name if name is None else name, self.interval, burst=self.burst, quota=self.quota,
            concurrency=self.concurrency, margin=self.margin,
        )  # fmt: skip

    def siq_limits(self, args: Any = None, kwargs: Any = None) -> CombinedQueue | None:
        """The combined limit of a task with several interval queues, else None."""
        queues = declared(self, self.interval_queue)
        if queues is None or isinstance(queues, str) or callable(queues) or len(queues) == 1:
            return None
        return siq_state(self.app).combined(self.name, queues, self.interval)

    def siq_line(self, args: Any, kwargs: Any) -> tuple[IntervalQueue, IntervalQueue | CombinedQueue]:
        """The queue a call's ticket is for, and what its start must pass (that queue, or
        all the queues of several limits)."""
        limits = self.siq_limits(args, kwargs)
        if limits is not None:
            return limits.primary, limits
        queue = self.siq_queue(args, kwargs)
        return queue, queue

    @property
    def siq_per_key(self) -> bool:
        """Whether ``interval_queue`` is a callable: one queue per key."""
        return callable(declared(self, self.interval_queue))

    def siq_cost(self, args: Any = None, kwargs: Any = None) -> int:
        """Slots a call with ``args`` and ``kwargs`` takes."""
        cost = declared(self, self.cost)
        if callable(cost):
            cost = _per_call(self, "cost", cost, args, kwargs)
        try:
            return validate_cost(cost)
        except ConfigurationError as exc:
            raise ConfigurationError(f"task {self.name}: {exc}") from None

    @property
    def siq_fair(self) -> bool:
        """Whether the task declares a fairness key."""
        return declared(self, self.fair_key) is not None

    def siq_fair_share(self, args: Any = None, kwargs: Any = None) -> tuple[str, int]:
        """A call's fairness key and that key's weight."""
        key = _per_call(self, "fair_key", declared(self, self.fair_key), args, kwargs)
        if not isinstance(key, str) or not key or len(key) > MAX_FAIR_KEY or not key.isprintable():
            raise ConfigurationError(f"task {self.name}: fair_key({list(args or ())!r}, {dict(kwargs or {})!r}) "
                                     f"gave {key!r}: a key is printable text of 1 to {MAX_FAIR_KEY} "
                                     "characters")  # fmt: skip
        weights = declared(self, self.fair_weight)
        if weights is None:
            return key, 1
        if isinstance(weights, Mapping):
            return key, weights.get(key, 1)
        try:
            weight = weights(key)
        except Exception as exc:
            raise ConfigurationError(
                f"task {self.name}: fair_weight({key!r}) raised {type(exc).__name__}: {exc}"
            ) from exc
        return key, _check_weight(self.name, key, weight)

    def siq_backoff(self, seconds: BackoffSource, *, default: IntervalLike | None = None) -> NoReturn:
        """From inside a running task: hold every start of this task's queue, on every
        worker, for ``seconds``, then run this task again with its arguments, id and retry
        count unchanged, first in line after the hold. A back-off is not a retry: it never
        counts against ``max_retries``. Ends this run (raises Celery's ``Ignore``).

        ``seconds`` may be the service's response itself (requests, httpx, aiohttp,
        urllib's HTTPError) or its headers: the hold is then read from Retry-After,
        RateLimit-Reset or X-RateLimit-Reset (tasks/retry_after.py says how). A response that
        has none of them, or one that cannot be read or asks for more than a day, does
        not fail the task: the hold is ``default`` if given, else ``siq_backoff_default``
        (60 s), with one warning naming the header and its value (none for a ``default``
        standing in for absent headers, as asked)."""
        fallback = siq_state(self.app).settings.backoff_default
        hold, unread = backoff_hold(seconds, default=default, fallback=fallback)
        if unread is not None:
            logger.warning(
                "%s[%s]: %s; held for %ss instead (%s)", self.name, self.request.id, unread, hold,
                "default=" if default is not None else "siq_backoff_default",
            )  # fmt: skip
        back_off(self, hold)

    # -- producer (tasks/publish.py) -------------------------------------------------------

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> Any:
        if _UNGUARDED:
            _say_unguarded()
        keep_ticket = options.pop(KEEP_TICKET, False)
        if keep_ticket or self.app.conf.task_always_eager:
            return super().apply_async(args, kwargs, task_id, producer, link, link_error, shadow, **options)
        return publish(self, super().apply_async, args, kwargs, task_id, producer, link, link_error, shadow, options)

    def apply_many(
        self, calls: Iterable[Sequence[Any] | tuple[Sequence[Any], Mapping[str, Any]]], chunk_size: int = 500,
        **options: Any,
    ) -> list[Any]:  # fmt: skip
        """Publish one task per call, claiming tickets ``chunk_size`` at a time (one store
        round trip per chunk); tasks whose slot is beyond the horizon are parked, a chunk
        at a time. A call is an args sequence, or an ``(args, kwargs)`` pair. Returns the
        AsyncResults, in order."""
        if _UNGUARDED:
            _say_unguarded()
        return publish_many(self, super().apply_async, calls, chunk_size, options)

    # -- worker (tasks/gate.py) -----------------------------------------------------------

    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        try:
            decision: Decision | None = authorize(self, task_id, args, kwargs)
        except Ignore:  # deferred, parked, a finished copy: this delivery ends
            decision = None
        if decision is None:
            # Raised again here, outside the ``except``: Celery formats an Ignore's traceback
            # twice (billiard's ExceptionInfo, each frame's positions listed) and pickles it
            # to the pool's parent; from our wait's frames and its chained exception that cost
            # a busy worker more CPU per deferral than the rest of the start (bench/peers.py
            # --scenarios spacing --intervals 20: about 9 ms a task), from here two frames.
            raise Ignore()
        self.request.siq_decision = decision
        super().before_start(task_id, args, kwargs)
        report_again_if_late(decision)  # the last step before Celery calls the body

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        record_retry(self)  # before the retry is published: its start must not see this run as lost
        return super().retry(*args, **kwargs)

    def after_return(self, status: str, retval: Any, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        # Called for SUCCESS and FAILURE only (not RETRY, not our Ignore).
        record_finish(self, status, task_id, args, kwargs)
        super().after_return(status, retval, task_id, args, kwargs, einfo)


def _release_leftover_lease(sender: Any = None, state: str | None = None, **_: Any) -> None:
    """task_postrun: a run of an interval task that ended without giving back its
    run lease (the body raised Ignore or Reject) gives it back now."""
    if isinstance(sender, IntervalTask):
        release_leftover_lease(sender, state or "")


def install() -> None:
    """Install, once per process, what interval tasks need outside the package: on a Redis
    broker no interval task is lost between its list and a worker's unacked hash (the
    transit guard on kombu's Redis transport: broker/transit.py; a purge drops the records
    of what it purged), the ticket in the headers of a publish (tasks/publish.py) and the
    worker's signal handlers (tasks/worker_hooks.py). Called when an
    interval task binds to an app: a producer's first use of its tasks, a worker's start
    (Celery finalizes the app before ``worker_init``). Importing a module installs nothing."""
    global _INSTALLED
    with _INSTALLING:
        if _INSTALLED:
            return
        if not guard_transit():
            _UNGUARDED.append(kombu_problem())  # said at the first publish (a worker refuses to start)
        connect_worker_hooks()
        signals.before_task_publish.connect(put_ticket_in_headers, weak=False, dispatch_uid="siq_celery.publish")
        signals.task_postrun.connect(_release_leftover_lease, weak=False, dispatch_uid="siq_celery.task.release")
        _INSTALLED = True


_INSTALLED = False
_INSTALLING = threading.Lock()
#: Why the transit guard is not in place (a kombu without what it patches), until said once.
_UNGUARDED: list[str | None] = []


def _say_unguarded() -> None:
    problem = _UNGUARDED.pop() if _UNGUARDED else None
    if problem is not None:
        logger.warning("siq_celery: %s; interval tasks are published without transit records", problem)


def _app_sets(app: Any, setting: str) -> bool:
    """Whether the app's configuration gives ``setting`` (anywhere but Celery's defaults,
    the last layer of ``app.conf``)."""
    conf = app.conf
    conf.get(setting)  # the first read loads a pending configuration into its layers
    return any(setting in layer for layer in conf.maps[:-1])


def declared(task: IntervalTask, value: Any) -> Any:
    """An attribute as declared: Celery's task decorator makes options class attributes,
    so a function given as ``interval_queue=`` or ``cost=`` comes back bound to the task."""
    if getattr(value, "__self__", None) is task:
        return value.__func__
    return value


#: The longest fairness key: it names a line in the store and labels a metric.
MAX_FAIR_KEY = 200


def _check_weight(task: str, key: Any, weight: Any) -> int:
    if isinstance(weight, bool) or not isinstance(weight, int) or not 1 <= weight <= MAX_FAIR_WEIGHT:
        raise ConfigurationError(f"task {task}: fair_weight of {key!r} is {weight!r}: "
                                 f"a whole number from 1 to {MAX_FAIR_WEIGHT}")  # fmt: skip
    return weight


def _per_call(task: IntervalTask, what: str, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """``fn(args, kwargs)`` for one call of ``task``; a failure names the task and the call."""
    call_args, call_kwargs = list(args or ()), dict(kwargs or {})
    try:
        return fn(call_args, call_kwargs)
    except Exception as exc:
        raise ConfigurationError(
            f"task {task.name}: {what}({call_args!r}, {call_kwargs!r}) raised {type(exc).__name__}: {exc}"
        ) from exc
