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
from datetime import UTC, datetime
from typing import Any

from celery import Task, signals
from celery.exceptions import Ignore
from kombu.utils.uuid import uuid

from .config import siq_state
from .errors import StoreUnavailableError
from .intervals import IntervalLike
from .ledger import StartRecord
from .messages import HEADER_NAMES, ticket_from_headers, ticket_headers
from .queue import DeferralNeeded, DuplicateTaskError, IntervalQueue, PendingTicket
from .types import Decision, Ticket, Verdict

logger = logging.getLogger("siq_celery")

#: apply_async option (popped, never sent) that re-publishes with the ticket in headers.
KEEP_TICKET = "siq_keep_ticket"
#: Message header: times the task was deferred (sent back to wait), for the ledger.
DEFERRALS = "siq_deferrals"


class IntervalTask(Task):  # type: ignore[misc]
    """A Celery task whose starts share one interval with every worker of its queue."""

    #: Least time between two starts of this task's interval queue: seconds, a timedelta,
    #: "200ms", "2s", or a rate "5/s". Falls back to ``app.conf.siq_default_interval``.
    #: Used to create the queue's state; afterwards the stored interval is shared.
    interval: IntervalLike | None = None

    #: The interval queue's name; several task types may share one queue (one API, one
    #: quota). Defaults to the task's name.
    interval_queue: str | None = None

    def siq_queue(self) -> IntervalQueue:
        """This task's IntervalQueue (cached on the app)."""
        return siq_state(self.app).queue(self.interval_queue or self.name, self.interval)

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
        queue = self.siq_queue()  # a queue with no interval anywhere fails here, at publish
        # A retry arrives with the old ticket's headers: it is a new start, with a new ticket.
        options["headers"] = {
            k: v for k, v in (options.get("headers") or {}).items() if k not in (*HEADER_NAMES, DEFERRALS)
        }
        if self.app.conf.task_protocol == 1:  # the ETA lives in the body there: claim first
            self._claim_into(queue, options)
            return super().apply_async(args, kwargs, task_id, producer, link, link_error, shadow, **options)
        # The claim's round trip overlaps Celery building the message; the ticket is read
        # back in before_task_publish (_put_ticket_in_headers), just before it is sent.
        task_id = task_id or uuid()
        try:
            pending = queue.claim_later()
        except StoreUnavailableError as exc:
            logger.warning("%s: state store unreachable at publish; the worker will claim a ticket: %s", self.name, exc)
            return super().apply_async(args, kwargs, task_id, producer, link, link_error, shadow, **options)
        _CLAIMS_IN_FLIGHT[task_id] = (pending, siq_state(self.app).settings.countdown_margin)
        try:
            return super().apply_async(args, kwargs, task_id, producer, link, link_error, shadow, **options)
        finally:
            unread = _CLAIMS_IN_FLIGHT.pop(task_id, None)
            if unread is not None:  # not published through send_task_message: no ticket went out
                unread[0].discard()

    def _claim_into(self, queue: IntervalQueue, options: dict[str, Any]) -> None:
        try:
            ticket = queue.claim()
        except StoreUnavailableError as exc:
            logger.warning("%s: state store unreachable at publish; the worker will claim a ticket: %s", self.name, exc)
            return
        options["headers"].update(ticket_headers(ticket))
        if options.get("eta") is None and options.get("countdown") is None:
            eta = _eta(ticket, siq_state(self.app).settings.countdown_margin)
            if eta is not None:
                options["eta"] = eta

    # -- worker ---------------------------------------------------------------------

    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        request = self.request
        queue = self.siq_queue()
        ticket, problem = ticket_from_headers(request.headers, queue.name)
        if problem:
            logger.warning("%s[%s]: %s; claiming a fresh ticket", self.name, task_id, problem)
        eager = bool(request.is_eager)
        settings = siq_state(self.app).settings
        record = StartRecord(
            self.name, task_id, request.hostname or socket.gethostname(), os.getpid(), _deferrals(request.headers)
        )
        try:
            decision = queue.wait_for_turn(
                ticket,
                task_id=task_id,
                max_sleep=None if eager else settings.max_sleep,
                defer_paused=not eager,
                record=record,
            )
        except DeferralNeeded as deferral:
            self._defer(deferral.ticket, deferral.decision)
        except DuplicateTaskError:
            logger.info("%s[%s] already finished: a redelivered copy, not run again", self.name, task_id)
            raise Ignore() from None
        request.siq_decision = decision
        super().before_start(task_id, args, kwargs)

    def _defer(self, ticket: Ticket, decision: Decision) -> None:
        """Re-publish this very task (same id, ticket, retry count) later; end this delivery."""
        settings = siq_state(self.app).settings
        if decision.verdict is Verdict.PAUSED:
            countdown = paused_countdown(decision, settings.paused_poll, settings.countdown_margin)
        else:
            countdown = max(decision.wait - settings.countdown_margin, 0.0)
        request = self.request
        headers = {**(request.headers or {}), **ticket_headers(ticket), DEFERRALS: _deferrals(request.headers) + 1}
        signature = self.signature_from_request(
            request, request.args, request.kwargs, countdown=countdown, headers=headers
        )
        signature.apply_async(**{KEEP_TICKET: True})
        logger.info("%s[%s]: %s; ticket %s of %r deferred %.3fs",
                    self.name, request.id, decision.verdict.value, ticket.number, ticket.queue, countdown)  # fmt: skip
        self._send_deferred_event(ticket, decision, countdown)
        raise Ignore()

    def _send_deferred_event(self, ticket: Ticket, decision: Decision, countdown: float) -> None:
        """A ``task-deferred`` event for monitors: Flower shows the task in state
        DEFERRED (never FAILURE) until it succeeds, and the ETA of its next delivery;
        ``celery events --dump`` and event consumers also get queue, ticket and slot."""
        if not _WORKER_SENDS_TASK_EVENTS[0] or not self.send_events:
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
        try:
            self.siq_queue().finish(task_id, "SUCCESS" if status == "SUCCESS" else "FAILURE")
        except StoreUnavailableError as exc:
            logger.warning("%s[%s]: could not record the finish (a redelivered copy may run again): %s",
                           self.name, task_id, exc)  # fmt: skip
        super().after_return(status, retval, task_id, args, kwargs, einfo)


def _deferrals(headers: dict[str, Any] | None) -> int:
    """How many times the task was sent back to wait (for the ledger; bad values count 0)."""
    value = (headers or {}).get(DEFERRALS, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 31 else 0


#: Claims sent by apply_async whose answers before_task_publish reads, by task id. It holds
#: a claim only for the duration of one apply_async call.
_CLAIMS_IN_FLIGHT: dict[str, tuple[PendingTicket, float]] = {}


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
    pending, margin = claim
    try:
        ticket = pending.ticket()
    except StoreUnavailableError as exc:
        logger.warning("%s: state store unreachable at publish; the worker will claim a ticket: %s", sender, exc)
        return
    headers.update(ticket_headers(ticket))
    if headers.get("eta") is None:  # the caller's own countdown or eta stands
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


#: Whether this worker sends task events (``-E``, ``worker_send_task_events``), noted at
#: worker start; prefork pool processes inherit it. (Events enabled later by remote
#: control, as Flower can, reach only the main process: start workers with ``-E``.)
_WORKER_SENDS_TASK_EVENTS = [False]


def _note_task_events(sender: Any = None, **_: Any) -> None:
    _WORKER_SENDS_TASK_EVENTS[0] = bool(getattr(sender, "task_events", False))


signals.worker_init.connect(_note_task_events, weak=False)


def warm_interval_queues(app: Any) -> None:
    """Connect to the store and load its scripts for every IntervalTask of ``app``, so the
    first task a fresh worker process runs is not late (a cold start took 60 ms)."""
    queues = {task.siq_queue() for task in app.tasks.values() if isinstance(task, IntervalTask)}
    for queue in queues:
        try:
            queue.backend.warm()
        except Exception as exc:
            logger.warning("siq_celery: could not warm the state store for %r: %s", queue.name, exc)
            return


def _warm_pool_process(**_: Any) -> None:
    from celery import current_app

    warm_interval_queues(current_app)


def _warm_worker(sender: Any = None, **_: Any) -> None:
    # threads and solo pools run tasks in the worker process itself
    if sender is not None and hasattr(sender, "app"):
        warm_interval_queues(sender.app)


signals.worker_process_init.connect(_warm_pool_process, weak=False)
signals.worker_ready.connect(_warm_worker, weak=False)
