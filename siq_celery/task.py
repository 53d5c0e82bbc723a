"""IntervalTask: every start of the task takes its turn in a shared interval queue.

>>> @app.task(base=IntervalTask, interval="200ms", interval_queue="geocoder", acks_late=True)
... def geocode(address): ...

**Producer side** (``apply_async``/``delay``, canvases, ``retry``, Flower's HTTP API, which
calls ``apply_async``): claims a ticket, puts it in three message headers (see
:mod:`siq_celery.messages`) and sets a countdown that brings the task
``siq_countdown_margin`` before its estimated slot (as an ETA on the store's clock, so
the producer's own clock does not matter). If the store is unreachable at
publish, the task is published without a ticket and the worker claims one (nothing is
lost; the worker then waits for the store).

**Worker side** (``before_start``, inside Celery's trace): asks the store for the start.
Waits up to ``siq_max_sleep`` are slept precisely in the worker process; longer ones,
and paused queues, re-publish the same task (same id, same ticket, same retry count) by
countdown and end this delivery with ``Ignore``: a deferral never counts against
``max_retries`` and never shows as a failure. A message without a valid ticket (sent by
name, from another language, tampered) claims one here. A redelivered copy of a task
that already finished is skipped and logged; a copy whose worker died mid-run runs
again, as a new start. A ``self.retry()`` is a new start with a new ticket.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from celery import Task, signals
from celery.exceptions import Ignore
from kombu.utils.uuid import uuid

from .combined import CombinedQueue
from .config import siq_state
from .errors import ConfigurationError, CorruptStateError, QueueNotFoundError, SiqError, StoreUnavailableError
from .intervals import IntervalLike, parse_duration, parse_interval
from .ledger import StartRecord
from .messages import HEADER_NAMES, ticket_from_headers, ticket_headers
from .parking import ReleaseThrottle, park, parked_message, release_due
from .queue import DeferralNeeded, DuplicateTaskError, IntervalQueue, PendingTicket, validate_cost
from .types import Decision, QueueState, Ticket, Verdict
from .worker_hooks import WORKER_SENDS_TASK_EVENTS

logger = logging.getLogger("siq_celery")

#: apply_async option (popped, never sent) that re-publishes with the ticket in headers.
KEEP_TICKET = "siq_keep_ticket"
#: Message header: times the task was deferred (sent back to wait), for the ledger.
DEFERRALS = "siq_deferrals"


class IntervalTask(Task):  # type: ignore[misc]
    """A Celery task whose starts share one interval with every worker of its queue."""

    #: Least time between two starts of this task's interval queue: seconds, a timedelta,
    #: "200ms", "2s", or a rate "5/s". Falls back to ``app.conf.siq_default_interval``.
    #: The declaration: a worker starting with a new one makes it the queue's interval
    #: for every worker (declarations.py); producers never write it.
    interval: IntervalLike | None = None

    #: The interval queue's name; several task types may share one queue (one API, one
    #: quota). Defaults to the task's name. Or a callable receiving the call's ``args``
    #: (a list) and ``kwargs`` (a dict) and returning the name: one queue per customer,
    #: user or API key, created on first use with ``interval``, expiring after
    #: ``siq_key_idle_expiry`` of idleness (Redis).
    interval_queue: str | Callable[[list[Any], dict[str, Any]], str] | Sequence[str] | Mapping[str, Any] | None = None
    #: Several limits: a list of names (with ``interval`` a list of the same length), or a
    #: mapping of name to interval (``{"{geo}per-second": "100ms", "{geo}per-day":
    #: "10/2s"}``): every start must pass all of them at once (see combined.py).

    #: Slots one start takes (a search that costs 10 points of a 100-point budget): the
    #: next start of the queue waits ``cost`` intervals. A whole number >= 1, or a callable
    #: like ``interval_queue``'s.
    cost: int | Callable[[list[Any], dict[str, Any]], int] = 1

    #: Celery's request, reading the message's ETA on the state store's clock (clock.py).
    Request = "siq_celery.clock:StoreClockRequest"

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
            if value is not None:
                try:
                    parse_interval(value)
                except SiqError as exc:
                    raise ConfigurationError(f"task {name}: interval {value!r}: {exc}") from None

    def siq_declared_queues(self) -> list[IntervalQueue]:
        """The queues whose interval this task's code declares, each with that interval
        (declarations.py: a worker announces them at start); none for per-key queues,
        which are declared when a key is first used."""
        declared = _declared(self, self.interval_queue)
        if callable(declared):
            return []
        limits = self.siq_limits()
        return list(limits.queues) if limits is not None else [self.siq_queue()]

    def siq_queue(self, args: Any = None, kwargs: Any = None) -> IntervalQueue:
        """The IntervalQueue of a call with ``args`` and ``kwargs`` (cached on the app);
        the arguments matter only when ``interval_queue`` is a callable."""
        name = _declared(self, self.interval_queue)
        limits = self.siq_limits(args, kwargs)
        if limits is not None:
            return limits.primary
        if callable(name):
            return siq_state(self.app).queue(_per_call(self, "interval_queue", name, args, kwargs), self.interval,
                                             per_key=True)  # fmt: skip
        return siq_state(self.app).queue(name or self.name, self.interval)

    def siq_limits(self, args: Any = None, kwargs: Any = None) -> CombinedQueue | None:
        """The combined limit of a task with several interval queues, else None."""
        declared = _declared(self, self.interval_queue)
        if declared is None or isinstance(declared, str) or callable(declared):
            return None
        return siq_state(self.app).combined(self.name, declared, self.interval)

    def _line(self, args: Any, kwargs: Any) -> tuple[IntervalQueue, IntervalQueue | CombinedQueue]:
        """The queue a call's ticket is for, and what its start must pass (that queue, or
        all the queues of several limits)."""
        limits = self.siq_limits(args, kwargs)
        if limits is not None:
            return limits.primary, limits
        queue = self.siq_queue(args, kwargs)
        return queue, queue

    def siq_cost(self, args: Any = None, kwargs: Any = None) -> int:
        """Slots a call with ``args`` and ``kwargs`` takes."""
        cost = _declared(self, self.cost)
        if callable(cost):
            cost = _per_call(self, "cost", cost, args, kwargs)
        try:
            return validate_cost(cost)
        except ConfigurationError as exc:
            raise ConfigurationError(f"task {self.name}: {exc}") from None

    def siq_backoff(self, seconds: float | str) -> None:
        """From inside a running task: hold every start of this task's queue, on every
        worker, for ``seconds`` (say, a 429's Retry-After), then run this task again with
        its arguments, id and retry count unchanged, first in line after the hold. A
        back-off is not a retry: it never counts against ``max_retries``. Ends this run
        (raises Celery's ``Ignore``)."""
        request = self.request
        queue, line = self._line(request.args, request.kwargs)
        queues = line.queues if isinstance(line, CombinedQueue) else [queue]
        states: dict[str, QueueState] = {}
        for q in queues:
            try:
                states[q.name] = q.backoff(seconds, keep_first=True)
            except (StoreUnavailableError, CorruptStateError, QueueNotFoundError) as exc:
                # The call is re-published all the same (below): it must not be lost.
                logger.warning("%s[%s]: could not hold %r: %s", self.name, request.id, q.name, exc)
        decision = getattr(request, "siq_decision", None)
        if decision is not None:  # the run ends here: its ledger row says why
            try:
                for q in queues:
                    q.backend.finish(q.name, request.id, "BACKOFF", remember=False)
            except (StoreUnavailableError, CorruptStateError) as exc:
                logger.warning("%s[%s]: could not record the back-off: %s", self.name, request.id, exc)
        # Its old ticket, now behind the line's head: a late ticket, it takes the first free
        # slot after the hold (which the back-off keeps for it). Without its queue's state
        # (gone, or unreachable) it comes back without one and claims one at the worker.
        headers = {k: v for k, v in (request.headers or {}).items() if k not in HEADER_NAMES}
        held = states.get(queue.name)
        if held is not None:
            number = decision.ticket if decision is not None else 1
            headers.update(ticket_headers(Ticket(queue.name, number, held.epoch, 0, 0)))
        margin = siq_state(self.app).settings.countdown_margin
        if states:
            hold_end = max(st.last_start_us + st.interval_us for st in states.values()) / 1e6
            eta = datetime.fromtimestamp(hold_end - margin, UTC)
        else:  # no store answered: after the hold, on this host's clock
            eta = datetime.now(UTC) + timedelta(microseconds=parse_duration(seconds))
        logger.info("%s[%s]: %s held for %ss; this task runs again after it",
                    self.name, request.id, list(states), seconds)  # fmt: skip
        signature = self.signature_from_request(request, request.args, request.kwargs, headers=headers)
        signature.apply_async(eta=eta, **{KEEP_TICKET: True})
        raise Ignore()

    # -- producer -------------------------------------------------------------------

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
        keep_ticket = options.pop(KEEP_TICKET, False)
        if keep_ticket or self.app.conf.task_always_eager:
            return super().apply_async(args, kwargs, task_id, producer, link, link_error, shadow, **options)
        queue = self.siq_queue(args, kwargs)  # a queue with no interval anywhere fails here, at publish
        cost = self.siq_cost(args, kwargs)
        # A retry arrives with the old ticket's headers: it is a new start, with a new ticket.
        options["headers"] = {
            k: v for k, v in (options.get("headers") or {}).items() if k not in (*HEADER_NAMES, DEFERRALS)
        }
        settings = siq_state(self.app).settings
        task_id = task_id or uuid()
        # Protocol 1 keeps the ETA in the body, and a queue with a long backlog may need
        # parking: both claim first. Otherwise the claim's round trip overlaps Celery
        # building the message, and the ticket is read back in before_task_publish
        # (_put_ticket_in_headers), just before it is sent.
        if self.app.conf.task_protocol == 1 or queue.last_delay > settings.horizon / 2:
            ticket = self._claim_into(queue, options, cost)
            if ticket is not None and ticket.delay > settings.horizon:
                extra = {"link": link, "link_error": link_error, "shadow": shadow}
                message = parked_message(self.name, args, kwargs, {**options, **extra, "task_id": task_id})
                if park(queue, [(ticket, task_id, message)]):
                    self._release_now_and_then(queue)
                    return self.AsyncResult(task_id)
                options.pop("eta", None)  # the line moved on (reset): publish it, the worker re-claims
            return super().apply_async(args, kwargs, task_id, producer, link, link_error, shadow, **options)
        try:
            pending = queue.claim_later(cost)
        except NO_TICKET_ERRORS as exc:
            _warn_no_ticket(self.name, exc)
            return super().apply_async(args, kwargs, task_id, producer, link, link_error, shadow, **options)
        _CLAIMS_IN_FLIGHT[task_id] = (pending, queue, settings.countdown_margin, settings.horizon)
        try:
            return super().apply_async(args, kwargs, task_id, producer, link, link_error, shadow, **options)
        finally:
            unread = _CLAIMS_IN_FLIGHT.pop(task_id, None)
            if unread is not None:  # not published through send_task_message: no ticket went out
                unread[0].discard()

    def _claim_into(self, queue: IntervalQueue, options: dict[str, Any], cost: int) -> Ticket | None:
        try:
            ticket = queue.claim(cost)
        except NO_TICKET_ERRORS as exc:
            _warn_no_ticket(self.name, exc)
            return None
        options["headers"].update(ticket_headers(ticket))
        settings = siq_state(self.app).settings
        if options.get("eta") is None and options.get("countdown") is None and ticket.delay <= settings.horizon:
            eta = _eta(ticket, settings.countdown_margin)
            if eta is not None:
                options["eta"] = eta
        return ticket

    def apply_many(
        self, calls: Iterable[Sequence[Any] | tuple[Sequence[Any], Mapping[str, Any]]], chunk_size: int = 500,
        **options: Any,
    ) -> list[Any]:  # fmt: skip
        """Publish one task per call, claiming tickets ``chunk_size`` at a time (one store
        round trip per chunk); tasks whose slot is beyond the horizon are parked, a chunk
        at a time. A call is an args sequence, or an ``(args, kwargs)`` pair. Returns the
        AsyncResults, in order."""
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or not 1 <= chunk_size <= 10_000:
            raise ConfigurationError(f"apply_many(chunk_size) takes a whole number from 1 to 10000, not {chunk_size!r}")
        normalized = [_call(c) for c in calls]
        for args, kwargs in normalized:  # any call may be parked, as JSON: refuse what JSON cannot carry
            parked_message(self.name, args, kwargs, {})
        # Bad input (a call, its queue, its cost) fails here, before anything is claimed.
        routed = [
            (self.siq_queue(args, kwargs), self.siq_cost(args, kwargs), args, kwargs) for args, kwargs in normalized
        ]
        settings = siq_state(self.app).settings
        by_queue: dict[str, list[int]] = {}
        for i, (queue, *_) in enumerate(routed):
            by_queue.setdefault(queue.name, []).append(i)
        results: list[Any] = [None] * len(routed)
        with self.app.producer_or_acquire() as producer:
            for indexes in by_queue.values():
                queue = routed[indexes[0]][0]
                for start in range(0, len(indexes), chunk_size):
                    chunk = indexes[start : start + chunk_size]
                    tickets = queue.claim_costs([routed[i][1] for i in chunk])
                    to_park, parked_calls = [], []
                    for i, ticket in zip(chunk, tickets, strict=True):
                        _, _, args, kwargs = routed[i]
                        task_id = uuid()
                        opts = {**options, "headers": {**(options.get("headers") or {}), **ticket_headers(ticket)}}
                        if ticket.delay > settings.horizon:
                            message = parked_message(self.name, args, kwargs, {**opts, "task_id": task_id})
                            to_park.append((ticket, task_id, message))
                            parked_calls.append((args, kwargs, task_id))
                        else:
                            eta = _eta(ticket, settings.countdown_margin)
                            super().apply_async(args, kwargs, task_id, producer, eta=eta, **opts)
                        results[i] = self.AsyncResult(task_id)
                    if to_park and not park(queue, to_park):
                        for args, kwargs, task_id in parked_calls:  # the line moved on (reset): the worker re-claims
                            super().apply_async(args, kwargs, task_id, producer, **options)
                self._release_now_and_then(queue)
        return results

    def _release_now_and_then(self, queue: IntervalQueue) -> None:
        """Release parked tasks that came within the horizon (at most once a second)."""
        if not _RELEASE_THROTTLE.due(queue.name):
            return
        settings = siq_state(self.app).settings
        try:
            release_due(self.app, queue, settings.horizon_us, settings.countdown_margin)
        except Exception as exc:  # workers' release threads try again; nothing is lost
            logger.warning("%s: could not release parked tasks of %r: %s", self.name, queue.name, exc)

    # -- worker ---------------------------------------------------------------------

    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        request = self.request
        cost = self.siq_cost(args, kwargs)
        queue, line = self._line(args, kwargs)
        per_key = siq_state(self.app).per_key_declarations
        if per_key is not None and callable(_declared(self, self.interval_queue)):
            per_key.on_use(queue, request.hostname or "")
        ticket, problem = ticket_from_headers(request.headers, queue.name)
        if problem:
            logger.warning("%s[%s]: %s; claiming a fresh ticket", self.name, task_id, problem)
        eager = bool(request.is_eager)
        settings = siq_state(self.app).settings
        record = StartRecord(
            self.name, task_id, request.hostname or socket.gethostname(), os.getpid(), _deferrals(request.headers)
        )
        try:
            decision = line.wait_for_turn(
                ticket,
                task_id=task_id,
                max_sleep=None if eager else settings.max_sleep,
                defer_paused=not eager,
                record=record,
                cost=cost,
            )
        except DeferralNeeded as deferral:
            self._defer(deferral.ticket, deferral.decision, deferral.own_wait)
        except DuplicateTaskError:
            logger.info("%s[%s] already finished: a redelivered copy, not run again", self.name, task_id)
            raise Ignore() from None
        request.siq_decision = decision
        super().before_start(task_id, args, kwargs)

    def _defer(self, ticket: Ticket, decision: Decision, own_wait: float | None = None) -> None:
        """Re-publish this very task (same id, ticket, retry count) later, or park it in the
        store if its slot is beyond the horizon; end this delivery. (With several limits,
        only if its own queue's slot is that far: a release follows that queue's line.)"""
        settings = siq_state(self.app).settings
        if decision.verdict is Verdict.PAUSED:
            countdown = paused_countdown(decision, settings.paused_poll, settings.countdown_margin)
        else:
            countdown = max(decision.wait - settings.countdown_margin, 0.0)
        request = self.request
        headers = {**(request.headers or {}), **ticket_headers(ticket), DEFERRALS: _deferrals(request.headers) + 1}
        signature = self.signature_from_request(request, request.args, request.kwargs, headers=headers)
        own_far = own_wait is None or own_wait > settings.horizon
        if decision.verdict is Verdict.WAIT and decision.wait > settings.horizon and own_far:
            message = parked_message(self.name, request.args, request.kwargs, dict(signature.options))
            if park(self.siq_queue(request.args, request.kwargs), [(ticket, request.id, message)]):
                logger.info("%s[%s]: ticket %s of %r parked, %.0fs from its slot",
                            self.name, request.id, ticket.number, ticket.queue, decision.wait)  # fmt: skip
                self._send_deferred_event(ticket, decision, decision.wait)
                raise Ignore()
        countdown = min(countdown, settings.horizon)  # nothing waits in a worker beyond the horizon
        # An ETA on the store's clock, like the producer's: a countdown would become an ETA
        # on this worker's clock, and a worker whose clock is off would send the task to
        # every other worker that much early or late.
        eta = datetime.fromtimestamp(decision.now_us / 1e6 + countdown, UTC)
        signature.apply_async(eta=eta, **{KEEP_TICKET: True})
        logger.info("%s[%s]: %s; ticket %s of %r deferred %.3fs",
                    self.name, request.id, decision.verdict.value, ticket.number, ticket.queue, countdown)  # fmt: skip
        self._send_deferred_event(ticket, decision, countdown)
        raise Ignore()

    def _send_deferred_event(self, ticket: Ticket, decision: Decision, countdown: float) -> None:
        """A ``task-deferred`` event for monitors: Flower shows the task in state
        DEFERRED (never FAILURE) until it succeeds, and the ETA of its next delivery;
        ``celery events --dump`` and event consumers also get queue, ticket and slot."""
        if not WORKER_SENDS_TASK_EVENTS[0] or not self.send_events:
            return
        try:
            self.send_event(
                "task-deferred", retry=False, queue=ticket.queue, ticket=ticket.number, epoch=ticket.epoch,
                reason=decision.verdict.value, slot=decision.slot_us / 1e6 if decision.slot_us else None,
                wait=round(decision.wait, 6),
                countdown=round(countdown, 6),
            )  # fmt: skip
        except Exception as exc:  # monitoring must never cost the task its deferral
            logger.warning("%s[%s]: could not send the task-deferred event: %s", self.name, self.request.id, exc)

    def after_return(self, status: str, retval: Any, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        # Called for SUCCESS and FAILURE only (not RETRY, not our Ignore): the task is done,
        # so a redelivered copy of it must not run again.
        queue, line = self._line(args, kwargs)
        try:
            line.finish(task_id, "SUCCESS" if status == "SUCCESS" else "FAILURE")
        except (StoreUnavailableError, CorruptStateError) as exc:
            logger.warning("%s[%s]: could not record the finish (a redelivered copy may run again): %s",
                           self.name, task_id, exc)  # fmt: skip
        self._release_now_and_then(queue)
        super().after_return(status, retval, task_id, args, kwargs, einfo)


def _declared(task: IntervalTask, value: Any) -> Any:
    """An attribute as declared: Celery's task decorator makes options class attributes,
    so a function given as ``interval_queue=`` or ``cost=`` comes back bound to the task."""
    if getattr(value, "__self__", None) is task:
        return value.__func__
    return value


def _per_call(task: IntervalTask, what: str, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """``fn(args, kwargs)`` for one call of ``task``; a failure names the task and the call."""
    call_args, call_kwargs = list(args or ()), dict(kwargs or {})
    try:
        return fn(call_args, call_kwargs)
    except Exception as exc:
        raise ConfigurationError(
            f"task {task.name}: {what}({call_args!r}, {call_kwargs!r}) raised {type(exc).__name__}: {exc}"
        ) from exc


def _deferrals(headers: dict[str, Any] | None) -> int:
    """How many times the task was sent back to wait (for the ledger; bad values count 0)."""
    value = (headers or {}).get(DEFERRALS, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 31 else 0


#: Claims sent by apply_async whose answers before_task_publish reads, by task id. It holds
#: a claim only for the duration of one apply_async call.
_CLAIMS_IN_FLIGHT: dict[str, tuple[PendingTicket, IntervalQueue, float, float]] = {}
_RELEASE_THROTTLE = ReleaseThrottle()


def _call(call: Any) -> tuple[Sequence[Any], dict[str, Any]]:
    """``args`` or ``(args, kwargs)``, as apply_many takes them."""
    if (
        isinstance(call, tuple) and len(call) == 2 and isinstance(call[0], (list, tuple))
        and isinstance(call[1], Mapping)
    ):  # fmt: skip
        return call[0], dict(call[1])
    if isinstance(call, (list, tuple)):
        return call, {}
    raise ConfigurationError(f"apply_many: a call is an args list/tuple or an (args, kwargs) pair, not {call!r}")


#: A producer that meets these publishes the task without a ticket (nothing is lost): the
#: worker claims one, and waits, logging why, until the store answers or is repaired.
NO_TICKET_ERRORS = (StoreUnavailableError, CorruptStateError)


def _warn_no_ticket(task: object, exc: Exception) -> None:
    if isinstance(exc, CorruptStateError):
        logger.error("%s: published without a ticket; the worker will claim one once the state is repaired: %s",
                     task, exc)  # fmt: skip
    else:
        logger.warning("%s: state store unreachable at publish; the worker will claim a ticket: %s", task, exc)


def _eta(ticket: Ticket, margin: float) -> datetime | None:
    """The ETA that brings a task ``margin`` before its estimated slot, on the store's clock
    (not a countdown: Celery turns a countdown into an ETA with the producer's own clock,
    so a producer whose clock is off would delay or hurry its tasks by that much)."""
    if ticket.delay <= margin:
        return None
    return datetime.fromtimestamp(ticket.estimated_start - margin, UTC)


def _put_ticket_in_headers(sender: Any = None, headers: dict[str, Any] | None = None, **_: Any) -> None:
    claim = _CLAIMS_IN_FLIGHT.pop(headers.get("id", ""), None) if headers else None
    if claim is None or headers is None:
        return
    pending, queue, margin, horizon = claim
    try:
        ticket = pending.ticket()
    except NO_TICKET_ERRORS as exc:
        _warn_no_ticket(sender, exc)
        return
    queue.last_delay = ticket.delay  # a long backlog: the next publish claims first, to park
    headers.update(ticket_headers(ticket))
    # The caller's own countdown or eta stands. Beyond the horizon no ETA at all: the
    # worker parks the task at once instead of holding it in memory.
    if headers.get("eta") is None and ticket.delay <= horizon:
        eta = _eta(ticket, margin)
        if eta is not None:
            headers["eta"] = eta.isoformat()


signals.before_task_publish.connect(_put_ticket_in_headers, weak=False)


def paused_countdown(decision: Decision, poll: float, margin: float) -> float:
    """Seconds until a task of a paused queue looks again.

    Every paused task looks again on one grid of the store clock (multiples of ``poll``),
    shifted by its distance behind the head of the line (``decision.wait``). The grid is
    kept in each ticket's own "virtual time" (now minus its offset), so tickets never
    drift onto different phases of it: after a resume they come back in ticket order,
    one interval apart, instead of all at once or in the order their polls happened.
    """
    now, offset = decision.now_us / 1e6, decision.wait
    virtual = now - offset
    tick = (virtual // poll + 1) * poll
    countdown = tick + offset - margin - now
    return countdown if countdown >= 0.05 else countdown + poll
