"""The worker side of IntervalTask: the gate a task passes before its body runs.

:func:`authorize` runs in ``before_start``, inside Celery's trace, so raising ``Ignore``
there ends the delivery cleanly. It asks the store for the start: waits up to
``siq_max_sleep`` are slept precisely in the worker process; longer ones, and paused
queues, re-publish the same task (same id, same ticket, same retry count) by ETA, or
park it beyond the horizon (:func:`defer`): a deferral never counts against
``max_retries`` and never shows as a failure. A message without a valid ticket (sent by
name, from another language, tampered) claims one here. A redelivered copy of a task
that already finished is skipped and logged; a copy whose worker died mid-run runs
again, as a new start, until ``siq_max_lost_deliveries`` copies in a row died with their
worker: then it fails with LostDeliveriesError (a poison message). :func:`record_finish`
(``after_return``) remembers the finish, :func:`record_retry` ends a run that retries;
:func:`back_off` holds the queue for a service that said "retry after". In a queue with a
concurrency cap the start takes a lease, kept (renewed: client/leases.py) while the body runs and
given back by each of these in the finish's own step; a run that ends any other way (the
body raised Ignore or Reject) gives it back after the task (:func:`release_leftover_lease`);
a process that dies (SIGKILL, a hard time limit, a revoke that terminates) leaves it to
expire after ``siq_lease_timeout``.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from contextlib import nullcontext
from datetime import UTC, datetime, timedelta
from typing import Any, NoReturn

from celery.exceptions import Ignore, Reject

from ..broker.admission import ADMISSION
from ..broker.green import nap
from ..client.body import begin_body
from ..client.combined import CombinedQueue
from ..client.leases import FINISH_RETRY_S, KEEPER, PendingFinish
from ..client.queue import IntervalQueue
from ..client.waiting import DeferralNeeded, DuplicateTaskError
from ..errors import CorruptStateError, LostDeliveriesError, QueueNotFoundError, StoreUnavailableError
from ..intervals import IntervalLike, parse_duration
from ..ledger import StartRecord
from ..messages import (
    DEFERRALS,
    HEADER_NAMES,
    HELD,
    KEEP_TICKET,
    deferrals,
    fair_from_headers,
    held,
    ticket_from_headers,
    ticket_headers,
)
from ..parked import FairTask
from ..types import Decision, QueueState, Ticket, Verdict
from .app_state import siq_state
from .deferral_log import note_deferral
from .parking import RELEASE_AFTER_START, park, parked_message, release_fair, release_now_and_then
from .publish import REJOIN_AFTER_S
from .task_api import IntervalTaskLike
from .worker_hooks import WORKER

logger = logging.getLogger("siq_celery")


def authorize(task: IntervalTaskLike, task_id: str, args: Any, kwargs: Any) -> Decision:
    """Wait for the start of this delivery and return the store's authorization (kept on
    the request as ``siq_decision``); or defer it, or skip a finished task's copy (both end
    the delivery with ``Ignore``)."""
    request = task.request
    cost = task.siq_cost(args, kwargs)
    queue, line = task.siq_line(args, kwargs)
    state = siq_state(task.app)
    if state.node_declarations is not None and not request.is_eager:
        state.node_declarations.wait_announced()  # a deploy's interval applies before the first task
    if state.per_key_declarations is not None and task.siq_per_key:
        state.per_key_declarations.on_use(queue, request.hostname or "", task.name)
    ticket, problem = ticket_from_headers(request.headers, queue.name)
    eager = bool(request.is_eager)
    joins = ticket is None and task.siq_fair and not eager
    if problem:
        then = "joining its fair line" if joins else "claiming a fresh ticket"
        logger.warning("%s[%s]: %s; %s", task.name, task_id, problem, then)
    if joins:
        join_fair_line(task, queue, task_id, cost)  # ends the delivery, unless the store is out
    settings = siq_state(task.app).settings
    fair_key, fair_tag, fair_weight = fair_from_headers(request.headers)  # given at release (tasks/parking.py)
    record = StartRecord(
        task.name, task_id, request.hostname or socket.gethostname(), os.getpid(), deferrals(request.headers),
        fair_key, fair_tag, fair_weight,
    )  # fmt: skip
    # On a green pool the waiting tasks of a queue take their turn in ticket order, a few at
    # a time: the others wait without asking the store (broker/admission.py); a wait holds only a
    # greenlet, so longer ones are slept (siq_green_max_sleep) rather than re-published.
    in_order = WORKER.green and not eager
    max_sleep = None if eager else settings.green_max_sleep if WORKER.green else settings.max_sleep

    def wait(ticket: Ticket | None) -> Decision:
        # The body reports when it begins (the last step here): the start counts from there.
        return line.wait_for_turn(
            ticket, task_id=task_id, max_sleep=max_sleep,
            full_hold=full_hold(max_sleep, request.headers, line.backend.can_wake),
            defer_paused=not eager, record=record, cost=cost, reports=True,
        )  # fmt: skip

    tickets = [ticket]  # a start given back (this process stood still too long) waits for a fresh slot

    def next_wait() -> Decision:
        own = tickets.pop() if tickets else None
        with ADMISSION.turn(own.queue, own.number) if in_order and own is not None else nullcontext():
            return wait(own)

    def release_after_start() -> None:  # a slot was taken: hand the next one out, off the body's path
        if task.siq_fair and not eager:
            RELEASE_AFTER_START.ask(task.app, queue, task.name)

    if task.siq_fair and not eager:
        RELEASE_AFTER_START.ready()  # its thread made or woken now, not as the body is about to begin
    try:
        decision = begin_body(line, task_id, next_wait, release_after_start)
        request.siq_lease = decision.lease
        return decision
    except DeferralNeeded as deferral:
        defer(task, deferral.ticket, deferral.decision, deferral.own_wait)
    except DuplicateTaskError:
        logger.info("%s[%s] already finished: a redelivered copy, not run again", task.name, task_id)
        raise Ignore() from None
    except LostDeliveriesError:
        # A poison message: raised here, inside Celery's trace, it makes the task FAILURE
        # (stored, acknowledged, errbacks called), and after_return remembers the finish.
        error = LostDeliveriesError.of(f"{task.name}[{task_id}]", line.max_lost_deliveries)
        logger.error("%s", error)
        request.siq_poison = True
        raise error from None


def join_fair_line(task: IntervalTaskLike, queue: IntervalQueue, task_id: str, cost: int) -> None:
    """A fair task that reached a worker without a ticket (a call with its own ETA or
    countdown, a retry's, now due; one published while the store was out) joins its key's
    line like a fresh publish, and a release hands it a ticket in fair order: a ticket
    claimed here would be out of fair order, and a key's retries would fill the lookahead.
    Ends the delivery (``Ignore``); if the store does not answer, returns: the task claims
    a ticket of its own, outside the fair order, as at a publish the store did not answer."""
    request = task.request
    key, weight = task.siq_fair_share(request.args, request.kwargs)
    signature = task.signature_from_request(request, request.args, request.kwargs, headers=request.headers or {})
    message = parked_message(task.name, request.args, request.kwargs, dict(signature.options))
    try:
        still_parked = queue.fair_park(key, weight, [FairTask(task_id, message, cost)])
    except (StoreUnavailableError, CorruptStateError) as exc:
        logger.warning("%s[%s]: could not join the line of %r: %s; claiming a ticket", task.name, task_id, key, exc)
        return
    if still_parked:  # its last run's releaser has not yet forgotten it, and would drop it
        logger.debug("%s[%s]: still parked from its last run; joins in %.1fs", task.name, task_id, REJOIN_AFTER_S)
        republish(task, signature, "rejoin", countdown=REJOIN_AFTER_S)  # no ticket: it comes back here
        raise Ignore()
    logger.debug("%s[%s]: joined the fair line of %r in %r", task.name, task_id, key, queue.name)
    release_fair(task.app, queue, task.name)
    raise Ignore()


def _lease(task: IntervalTaskLike) -> str:
    """The run lease the running body holds, named by its task id ("" none; it also holds the
    body's place under a concurrency cap)."""
    return getattr(task.request, "siq_lease", "") or ""


def _dropped(task: IntervalTaskLike, line: IntervalQueue | CombinedQueue) -> None:
    """The run's lease was given back (or left to expire): no longer renewed here."""
    lease = _lease(task)
    if lease:
        KEEPER.drop(line.backend, line.queue_names, lease)
        task.request.siq_lease = ""


def defer(task: IntervalTaskLike, ticket: Ticket, decision: Decision, own_wait: float | None = None) -> NoReturn:
    """Re-publish this very task (same id, ticket, retry count) later, or park it in the
    store if its slot is beyond the horizon; end this delivery. (With several limits,
    only if its own queue's slot is that far: a release follows that queue's line.)"""
    settings = siq_state(task.app).settings
    request = task.request
    in_a_row = held(request.headers) if decision.full else 0
    if decision.verdict is Verdict.PAUSED:
        countdown = paused_countdown(decision, settings.paused_poll, settings.countdown_margin)
    else:
        countdown = max(decision.wait - settings.countdown_margin, 0.0)
    headers = {k: v for k, v in (request.headers or {}).items() if k != HELD}
    headers.update(ticket_headers(ticket))
    headers[DEFERRALS] = deferrals(request.headers) + 1
    if decision.full:
        headers[HELD] = in_a_row + 1
    signature = task.signature_from_request(request, request.args, request.kwargs, headers=headers)
    own_far = own_wait is None or own_wait > settings.horizon
    far = decision.verdict is Verdict.WAIT and decision.wait > settings.horizon and own_far
    if far and park_this_run(task, task.siq_queue(request.args, request.kwargs), ticket, signature):
        logger.debug("%s[%s]: ticket %s of %r parked, %.0fs from its slot",
                     task.name, request.id, ticket.number, ticket.queue, decision.wait)  # fmt: skip
        note_deferral(ticket.queue, request.id)
        send_deferred_event(task, ticket, decision, decision.wait)
        raise Ignore()
    countdown = min(countdown, settings.horizon)  # nothing waits in a worker beyond the horizon
    # An ETA on the store's clock, like the producer's: a countdown would become an ETA
    # on this worker's clock, and a worker whose clock is off would send the task to
    # every other worker that much early or late.
    eta = datetime.fromtimestamp(decision.now_us / 1e6 + countdown, UTC)
    republish(task, signature, "deferral", eta=eta, **{KEEP_TICKET: True})
    # Waiting is normal: a line per deferral at DEBUG, a summary a minute at INFO, and
    # Celery's "Task ... ignored" of this delivery left out (tasks/deferral_log.py).
    logger.debug("%s[%s]: %s; ticket %s of %r deferred %.3fs",
                 task.name, request.id, decision.verdict.value, ticket.number, ticket.queue, countdown)  # fmt: skip
    note_deferral(ticket.queue, request.id)
    send_deferred_event(task, ticket, decision, countdown)
    raise Ignore()


#: The longest a start held by a full concurrency cap polls for a lease in its worker process
#: before it goes back to the broker (seconds). Each deferral in a row held by the cap polls
#: twice as long (``siq_max_sleep``, 2x, 4x ... up to this; the ``siq_held`` header counts
#: them): a long body costs a few re-publishes, not one every ``siq_max_sleep``, and the head
#: of the line keeps asking, so a lease given back is taken within a poll (waiting in the
#: broker instead would leave it unused: the lease is kept for the head for its grace). A
#: store that wakes its waiters (a lease given back wakes the head at once: ``can_wake``)
#: holds this long from the first delivery: the wait costs a few asks, not a publish.
FULL_HOLD_MAX_S = 1.6


def full_hold(max_sleep: float | None, headers: Any, woken: bool = False) -> float | None:
    """How long this delivery may poll a full cap in its process (see FULL_HOLD_MAX_S)."""
    if max_sleep is None:
        return None
    in_a_row: int = held(headers)
    return max(max_sleep, FULL_HOLD_MAX_S if woken else min(max_sleep * 2.0**in_a_row, FULL_HOLD_MAX_S))


def park_this_run(task: IntervalTaskLike, queue: IntervalQueue, ticket: Ticket, signature: Any) -> bool:
    """Park the running task (as ``signature`` would re-publish it) in ``queue`` under
    ``ticket``; False if the store refused (the line moved on): re-publish it instead."""
    request = task.request
    message = parked_message(task.name, request.args, request.kwargs, dict(signature.options))
    return park(queue, [(ticket, request.id, message)])


def send_deferred_event(task: IntervalTaskLike, ticket: Ticket, decision: Decision, countdown: float) -> None:
    """A ``task-deferred`` event for monitors: Flower shows the task in state
    DEFERRED (never FAILURE) until it succeeds, and the ETA of its next delivery;
    ``celery events --dump`` and event consumers also get queue, ticket and slot."""
    if not WORKER.sends_task_events or not task.send_events:
        return
    try:
        task.send_event(
            "task-deferred", retry=False, queue=ticket.queue, ticket=ticket.number, epoch=ticket.epoch,
            reason=decision.verdict.value, slot=decision.slot_us / 1e6 if decision.slot_us else None,
            wait=round(decision.wait, 6),
            countdown=round(countdown, 6),
        )  # fmt: skip
    except Exception as exc:  # monitoring must never cost the task its deferral
        logger.warning("%s[%s]: could not send the task-deferred event: %s", task.name, task.request.id, exc)


def record_finish(task: IntervalTaskLike, status: str, task_id: str, args: Any, kwargs: Any) -> None:
    """After SUCCESS or FAILURE (not RETRY, not our Ignore): the task is done, so a
    redelivered copy of it must not run again; parked tasks due by now are released. Only
    for a body that started (or a poison message, refused for good): a task that failed
    before its start (a bad cost, a route that raised) is not remembered as finished."""
    request = task.request
    if getattr(request, "siq_decision", None) is None and not getattr(request, "siq_poison", False):
        return
    queue, line = task.siq_line(args, kwargs)
    outcome, lease = "SUCCESS" if status == "SUCCESS" else "FAILURE", _lease(task)
    try:
        line.finish(task_id, outcome, lease=lease)
    except (StoreUnavailableError, CorruptStateError) as exc:
        # Tried again from this process until the store takes it, the run's lease renewed
        # meanwhile: a redelivered copy finds it live (RUNNING), then finished (DUPLICATE).
        logger.warning("%s[%s]: could not record the finish yet; trying again every %.1fs, its lease kept: %s",
                       task.name, task_id, FINISH_RETRY_S, exc)  # fmt: skip
        KEEPER.finish_later(PendingFinish(
            line.backend, line.queue_names, lease or task_id, lambda: line.finish(task_id, outcome, lease=lease),
            f"the finish of {task.name}[{task_id}]",
        ))  # fmt: skip
        task.request.siq_lease = ""  # the keeper holds it now
    finally:
        _dropped(task, line)  # unless the keeper holds it now
    release_now_and_then(task.app, queue, task.name)


def release_leftover_lease(task: IntervalTaskLike, state: str) -> None:
    """After any run (Celery's task_postrun): a run that ended without a finish of ours (the
    body raised Ignore or Reject) still holds its lease: give it back, recording the end
    (not remembered: the task may come again)."""
    if not _lease(task):
        return
    request = task.request
    _, line = task.siq_line(request.args, request.kwargs)
    try:
        line.finish(request.id, state or "ENDED", remember=False, lease=_lease(task))
    except (StoreUnavailableError, CorruptStateError) as exc:
        logger.warning("%s[%s]: could not give back its run lease (it expires): %s",
                       task.name, request.id, exc)  # fmt: skip
    finally:
        _dropped(task, line)


def record_retry(task: IntervalTaskLike) -> None:
    """``self.retry()``: this run ends here, and the retry is a new start with a new
    ticket. Its ledger row says so, and its start is no longer one without a finish (a
    task that retries is not a poison message)."""
    request = task.request
    if getattr(request, "siq_decision", None) is None:  # not started through the gate
        return
    _, line = task.siq_line(request.args, request.kwargs)
    try:
        line.finish(request.id, "RETRY", remember=False, lease=_lease(task))
    except (StoreUnavailableError, CorruptStateError) as exc:
        logger.warning("%s[%s]: could not record the retry: %s", task.name, request.id, exc)
    finally:
        _dropped(task, line)


def back_off(task: IntervalTaskLike, seconds: IntervalLike) -> NoReturn:
    """:meth:`IntervalTask.siq_backoff`: hold every queue of the task, re-publish it with
    its old ticket just after the hold, end this run."""
    request = task.request
    queue, line = task.siq_line(request.args, request.kwargs)
    queues = line.queues if isinstance(line, CombinedQueue) else [queue]
    states: dict[str, QueueState] = {}
    for q in queues:
        try:
            states[q.name] = q.backoff(seconds, keep_first=True)
        except (StoreUnavailableError, CorruptStateError, QueueNotFoundError) as exc:
            # The call is re-published all the same (below): it must not be lost.
            logger.warning("%s[%s]: could not hold %r: %s", task.name, request.id, q.name, exc)
    decision = getattr(request, "siq_decision", None)
    if decision is not None:  # the run ends here: its ledger row says why
        try:
            for q in queues:
                q.backend.finish(q.name, request.id, "BACKOFF", remember=False, lease=_lease(task))
        except (StoreUnavailableError, CorruptStateError) as exc:
            logger.warning("%s[%s]: could not record the back-off: %s", task.name, request.id, exc)
        finally:
            _dropped(task, line)
    # Its old ticket, now behind the line's head: a late ticket, it takes the first free
    # slot after the hold (which the back-off keeps for it). Without its queue's state
    # (gone, or unreachable) it comes back without one and claims one at the worker.
    headers = {k: v for k, v in (request.headers or {}).items() if k not in HEADER_NAMES}
    held = states.get(queue.name)
    ticket = None
    if held is not None:
        ticket = Ticket(queue.name, decision.ticket if decision is not None else 1, held.epoch, 0, 0)
        headers.update(ticket_headers(ticket))
    settings = siq_state(task.app).settings
    hold_us = parse_duration(seconds)
    logger.info("%s[%s]: %s held for %ss; this task runs again after it",
                task.name, request.id, list(states), seconds)  # fmt: skip
    signature = task.signature_from_request(request, request.args, request.kwargs, headers=headers)
    # A hold beyond the horizon: the task waits parked in the store, as a long backlog
    # does, and is released for the slot the back-off keeps for it.
    far = decision is not None and hold_us > settings.horizon_us
    if ticket is not None and far and park_this_run(task, queue, ticket, signature):
        logger.info("%s[%s]: ticket %s of %r parked until the hold ends",
                    task.name, request.id, ticket.number, queue.name)  # fmt: skip
        raise Ignore()
    if states:
        hold_end = max(st.last_start_us + st.interval_us for st in states.values()) / 1e6
        eta = datetime.fromtimestamp(hold_end - settings.countdown_margin, UTC)
    else:  # no store answered: after the hold, on this host's clock
        eta = datetime.now(UTC) + timedelta(microseconds=hold_us)
    republish(task, signature, "back-off", eta=eta, **{KEEP_TICKET: True})
    raise Ignore()


#: Pauses (seconds) before a re-publish the broker refused is tried again in the worker; then
#: a task acknowledged late goes back to the broker, one acknowledged early keeps trying.
REPUBLISH_RETRY_S = (0.1, 0.5, 2.0)
#: How long a task acknowledged on receipt keeps trying: the broker holds no copy of it.
REPUBLISH_EARLY_ACK_S = 60.0


def republish(task: IntervalTaskLike, signature: Any, what: str, **options: Any) -> None:
    """Send this very task again (a deferral or a back-off) and return; never lose it. A
    broker that refuses is asked again after each of :data:`REPUBLISH_RETRY_S`; then the
    delivery is given back to the broker (Celery's ``Reject`` with requeue: interval tasks
    are acknowledged after they ran), so another delivery asks the store again later. A task
    acknowledged on receipt (``acks_late=False``) has no copy in the broker: it keeps
    trying for :data:`REPUBLISH_EARLY_ACK_S`, then the error is raised."""
    request = task.request
    late = bool(getattr(task, "acks_late", False)) and not request.is_eager
    pauses = iter(REPUBLISH_RETRY_S)
    began = time.monotonic()
    while True:
        try:
            signature.apply_async(**options)
            return
        except Exception as exc:  # kombu's OperationalError, a connection error, ...
            pause = next(pauses, None)
            if pause is None and late:
                logger.warning("%s[%s]: the broker refused the %s's publish: the message goes back to the broker "
                               "(asked again on its next delivery): %s", task.name, request.id, what, exc)  # fmt: skip
                raise Reject(exc, requeue=True) from None
            if pause is None:
                pause = REPUBLISH_RETRY_S[-1]
                if time.monotonic() - began + pause > REPUBLISH_EARLY_ACK_S:
                    logger.error("%s[%s]: the broker refused the %s's publish for %.0fs, and the task was "
                                 "acknowledged on receipt (acks_late=False): it is lost: %s",
                                 task.name, request.id, what, time.monotonic() - began, exc)  # fmt: skip
                    raise
            logger.warning("%s[%s]: the broker refused the %s's publish; trying again in %.1fs: %s",
                           task.name, request.id, what, pause, exc)  # fmt: skip
            nap(pause)


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
