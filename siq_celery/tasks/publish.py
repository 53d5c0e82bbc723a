"""The producer side of IntervalTask: claim a ticket, put it in the headers, set the ETA.

``apply_async`` (and so ``delay``, canvases, ``retry`` and Flower's HTTP API) claims a
ticket, puts it in three message headers (messages.py) and sets an ETA that brings the
task ``siq_countdown_margin`` before its estimated slot, on the store's clock, so the
producer's own clock does not matter. The claim's round trip overlaps Celery building
the message: the reply is read in ``before_task_publish`` (:func:`put_ticket_in_headers`).
A task whose slot is beyond ``siq_horizon`` is parked in the store (tasks/parking.py). If the
store is unreachable, the task is published without a ticket and the worker claims one:
nothing is lost.

``send`` below is Celery's own ``Task.apply_async`` of the task (what ``super()`` would
call), which publishes one message.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kombu.utils.uuid import uuid

from ..client.queue import IntervalQueue, PendingTicket
from ..errors import ConfigurationError, CorruptStateError, StoreUnavailableError
from ..messages import DEFERRALS, FAIR_HEADERS, HEADER_NAMES, HELD, ticket_headers
from ..parked import FairTask
from ..types import Ticket
from .app_state import siq_state
from .parking import park, parked_message, release_fair, release_now_and_then
from .settings import SiqSettings
from .task_api import IntervalTaskLike

logger = logging.getLogger("siq_celery")

Send = Callable[..., Any]

#: A producer that meets these publishes the task without a ticket (nothing is lost): the
#: worker claims one, and waits, logging why, until the store answers or is repaired.
NO_TICKET_ERRORS = (StoreUnavailableError, CorruptStateError)

#: A fair task still parked under its id (its last run's releaser has not yet forgotten it)
#: is sent again this many seconds later, with no ticket, and joins its line from the worker.
REJOIN_AFTER_S = 1.0

#: The headers a publish writes: a caller's old ones (a retry's) never go out again.
OUR_HEADERS = frozenset((*HEADER_NAMES, DEFERRALS, HELD, *FAIR_HEADERS))

#: Claims sent by apply_async whose answers before_task_publish reads, by task id. It holds
#: a claim only for the duration of one apply_async call.
_CLAIMS_IN_FLIGHT: dict[str, tuple[PendingTicket, IntervalQueue, SiqSettings]] = {}


def publish(
    task: IntervalTaskLike, send: Send, args: Any, kwargs: Any, task_id: str | None, producer: Any, link: Any,
    link_error: Any, shadow: str | None, options: dict[str, Any],
) -> Any:  # fmt: skip
    """``apply_async`` of an interval task: a ticket in the headers, an ETA near its slot
    (or parked beyond the horizon)."""
    queue = task.siq_queue(args, kwargs)  # a queue with no interval anywhere fails here, at publish
    cost = task.siq_cost(args, kwargs)
    # A retry arrives with the old ticket's headers: it is a new start, with a new ticket.
    given = options.get("headers")
    options["headers"] = {k: v for k, v in given.items() if k not in OUR_HEADERS} if given else {}
    settings = siq_state(task.app).settings
    task_id = task_id or uuid()
    if task.siq_fair and not has_own_eta(options):
        return publish_fair(task, queue, cost, args, kwargs, task_id, options, link, link_error, shadow, send, producer)
    if task.siq_fair:  # its own time: held by the broker until then, then it joins its line
        task.siq_fair_share(args, kwargs)  # a bad key fails here, with nothing sent
        return send(args, kwargs, task_id, producer, link, link_error, shadow, **options)
    # Protocol 1 keeps the ETA in the body, and a queue with a long backlog may need
    # parking: both claim first. Otherwise the claim's round trip overlaps Celery
    # building the message, and the ticket is read back in before_task_publish
    # (put_ticket_in_headers), just before it is sent.
    if settings.protocol_1 or queue.last_delay > settings.horizon / 2:
        ticket = claim_into(task, queue, options, cost)
        if ticket is not None and ticket.delay > settings.horizon:
            extra = {"link": link, "link_error": link_error, "shadow": shadow, "reply_to": reply_to(task, options)}
            message = parked_message(task.name, args, kwargs, {**options, **extra, "task_id": task_id})
            if park(queue, [(ticket, task_id, message)]):
                release_now_and_then(task.app, queue, task.name)
                return task.AsyncResult(task_id)
            options.pop("eta", None)  # the line moved on (reset): publish it, the worker re-claims
        return send(args, kwargs, task_id, producer, link, link_error, shadow, **options)
    try:
        pending = queue.claim_later(cost)
    except NO_TICKET_ERRORS as exc:
        warn_no_ticket(task.name, exc)
        return send(args, kwargs, task_id, producer, link, link_error, shadow, **options)
    _CLAIMS_IN_FLIGHT[task_id] = (pending, queue, settings)
    try:
        return send(args, kwargs, task_id, producer, link, link_error, shadow, **options)
    finally:
        unread = _CLAIMS_IN_FLIGHT.pop(task_id, None)
        if unread is not None:  # not published through send_task_message: no ticket went out
            unread[0].discard()


def publish_fair(
    task: IntervalTaskLike, queue: IntervalQueue, cost: int, args: Any, kwargs: Any, task_id: str,
    options: dict[str, Any], link: Any, link_error: Any, shadow: str | None, send: Send, producer: Any,
) -> Any:  # fmt: skip
    """A task with a fairness key waits in its key's line in the store, with no ticket; a
    release hands it one in fair order and publishes it (tasks/parking.py), at once if the
    queue has room, else when a start tops the queue's lookahead up."""
    key, weight = task.siq_fair_share(args, kwargs)
    extra = {"link": link, "link_error": link_error, "shadow": shadow, **later_options(task, options)}
    message = parked_message(task.name, args, kwargs, {**extra, **options, "task_id": task_id})
    try:
        still_parked = queue.fair_park(key, weight, [FairTask(task_id, message, cost)])
    except NO_TICKET_ERRORS as exc:
        warn_no_ticket(task.name, exc)  # nothing is lost: it runs, outside the fair order
        return send(args, kwargs, task_id, producer, link, link_error, shadow, **options)
    if still_parked:  # a retry of a run its releaser has not yet forgotten: it joins a moment later
        return send(args, kwargs, task_id, producer, link, link_error, shadow, **options, countdown=REJOIN_AFTER_S)
    expect_result(task, producer, task_id, options)
    release_fair(task.app, queue, task.name)
    return task.AsyncResult(task_id)


def has_own_eta(options: Mapping[str, Any]) -> bool:
    """A call with its own ETA or countdown (a retry's, a caller's): a fair task so called
    is published without a ticket and keeps its time (the fair lines hand out the next
    slots, not a time); when it reaches a worker at that time it joins its key's line
    (gate.join_fair_line), so it takes no ticket out of fair order."""
    return options.get("eta") is not None or options.get("countdown") is not None


def later_options(task: IntervalTaskLike, options: Mapping[str, Any]) -> dict[str, Any]:
    """What Celery's apply_async would have put on a message published later by someone
    else (a release): the task's routing and other execution options, and where its
    result goes back to (this caller: rpc://), unless the call says otherwise."""
    exec_options = getattr(task, "_get_exec_options", None)
    found = dict(exec_options()) if callable(exec_options) else {}
    found["reply_to"] = reply_to(task, options)
    return {k: v for k, v in found.items() if v is not None}


def reply_to(task: IntervalTaskLike, options: Mapping[str, Any]) -> Any:
    """Where the result of a task published later by someone else goes back to: this
    caller, as Celery's send_task would have said."""
    return options.get("reply_to") or task.app.thread_oid


def expect_result(task: IntervalTaskLike, producer: Any, task_id: str, options: Mapping[str, Any]) -> None:
    """A result backend that must be told of a call before its result comes (rpc://: the
    caller's reply queue) is told now, as Celery's send_task does, for a task whose
    message someone else publishes later."""
    from celery.backends.base import Backend as ResultBackend

    backend = task.app.backend
    hook = getattr(type(backend), "on_task_call", None)
    if hook is None or hook is ResultBackend.on_task_call:
        return
    if options.get("ignore_result", getattr(task, "ignore_result", False)):
        return
    with task.app.producer_or_acquire(producer) as acquired:
        backend.on_task_call(acquired, task_id)


def claim_into(task: IntervalTaskLike, queue: IntervalQueue, options: dict[str, Any], cost: int) -> Ticket | None:
    """Claim now; put the ticket, and an ETA near its slot, into ``options`` (None: it is
    published without a ticket)."""
    try:
        ticket = queue.claim(cost)
    except NO_TICKET_ERRORS as exc:
        warn_no_ticket(task.name, exc)
        return None
    options["headers"].update(ticket_headers(ticket))
    settings = siq_state(task.app).settings
    if options.get("eta") is None and options.get("countdown") is None and ticket.delay <= settings.horizon:
        eta = eta_for(ticket, settings.countdown_margin, settings.broker_wait_below)
        if eta is not None:
            options["eta"] = eta
    return ticket


@dataclass
class Progress:
    """What :func:`publish_many` has done so far, for a caller that must report it even
    if a later chunk fails (the Spark bulk submit)."""

    published: int = 0  #: sent to the broker or parked in the store
    parked: int = 0
    claims: int = 0  #: store round trips that claimed tickets


def publish_many(
    task: IntervalTaskLike, send: Send, calls: Iterable[Sequence[Any] | tuple[Sequence[Any], Mapping[str, Any]]],
    chunk_size: int, options: dict[str, Any], progress: Progress | None = None,
) -> list[Any]:  # fmt: skip
    """``apply_many``: tickets claimed ``chunk_size`` at a time per queue, each call with
    its own queue and cost (one round trip per chunk of a queue), tasks beyond the
    horizon parked a chunk at a time. ``options`` are ``apply_async``'s, checked before
    anything is claimed; a caller's ``eta`` or ``countdown`` stands, as in ``apply_async``.
    A chunk whose claim the store does not answer is published without tickets (the
    worker claims them), as ``apply_async`` does."""
    progress = progress if progress is not None else Progress()
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or not 1 <= chunk_size <= 10_000:
        raise ConfigurationError(f"apply_many(chunk_size) takes a whole number from 1 to 10000, not {chunk_size!r}")
    options = dict(options)
    producer_given = options.pop("producer", None)
    check_many_options(options)
    options["headers"] = {  # as in publish: old ticket headers never go out again
        k: v for k, v in (options.get("headers") or {}).items() if k not in OUR_HEADERS
    }
    own_eta = options.get("eta") is not None or options.get("countdown") is not None
    normalized = [normalize_call(c) for c in calls]
    for args, kwargs in normalized:  # any call may be parked, as JSON: refuse what JSON cannot carry
        parked_message(task.name, args, kwargs, {})
    # Bad input (a call, its queue, its cost) fails here, before anything is claimed.
    routed = [(task.siq_queue(args, kwargs), task.siq_cost(args, kwargs), args, kwargs) for args, kwargs in normalized]
    if task.siq_fair and not own_eta:
        if task.app.conf.task_always_eager:  # run here, as apply_many of any task does
            return [send(args, kwargs, None, producer_given, **options) for _, _, args, kwargs in routed]
        return publish_many_fair(task, send, routed, chunk_size, options, progress)
    if task.siq_fair:  # their own time: held by the broker, then each joins its line (as publish)
        for _, _, args, kwargs in routed:
            task.siq_fair_share(args, kwargs)  # bad keys fail before anything is sent
        with task.app.producer_or_acquire(producer_given) as producer:
            sent = []
            for _, _, args, kwargs in routed:
                task_id = uuid()
                send(args, kwargs, task_id, producer, **options)
                sent.append(task.AsyncResult(task_id))
                progress.published += 1
        return sent
    settings = siq_state(task.app).settings
    by_queue: dict[str, list[int]] = {}
    for i, (queue, *_) in enumerate(routed):
        by_queue.setdefault(queue.name, []).append(i)
    results: list[Any] = [None] * len(routed)
    with task.app.producer_or_acquire(producer_given) as producer:
        for indexes in by_queue.values():
            queue, claimed = routed[indexes[0]][0], False
            for start in range(0, len(indexes), chunk_size):
                chunk = indexes[start : start + chunk_size]
                try:
                    tickets = queue.claim_costs([routed[i][1] for i in chunk])
                except NO_TICKET_ERRORS as exc:
                    warn_no_ticket(task.name, exc)
                    for i in chunk:
                        task_id = uuid()
                        send(routed[i][2], routed[i][3], task_id, producer, **options)
                        results[i] = task.AsyncResult(task_id)
                        progress.published += 1
                    continue
                progress.claims += 1
                claimed = True
                to_park, parked_calls = [], []
                for i, ticket in zip(chunk, tickets, strict=True):
                    _, _, args, kwargs = routed[i]
                    task_id = uuid()
                    opts = {**options, "headers": {**(options.get("headers") or {}), **ticket_headers(ticket)}}
                    if ticket.delay > settings.horizon:
                        message = parked_message(task.name, args, kwargs, {**opts, "task_id": task_id})
                        to_park.append((ticket, task_id, message))
                        parked_calls.append((args, kwargs, task_id))
                    else:
                        if not own_eta:
                            opts["eta"] = eta_for(ticket, settings.countdown_margin, settings.broker_wait_below)
                        send(args, kwargs, task_id, producer, **opts)
                        progress.published += 1
                    results[i] = task.AsyncResult(task_id)
                if not to_park:
                    continue
                if park(queue, to_park):
                    progress.published += len(to_park)
                    progress.parked += len(to_park)
                    continue
                for args, kwargs, task_id in parked_calls:  # the line moved on (reset): the worker re-claims
                    send(args, kwargs, task_id, producer, **options)
                    progress.published += 1
            if claimed:  # a store that answered no claim is not asked to release either
                release_now_and_then(task.app, queue, task.name)
    return results


def publish_many_fair(
    task: IntervalTaskLike, send: Send, routed: list[tuple[IntervalQueue, int, Any, Any]], chunk_size: int,
    options: dict[str, Any], progress: Progress,
) -> list[Any]:  # fmt: skip
    """``apply_many`` of a task with a fairness key: each call waits in its key's line,
    ``chunk_size`` calls of a key per round trip, in order; then one release per queue."""
    shares = [task.siq_fair_share(args, kwargs) for _, _, args, kwargs in routed]  # bad keys fail before any write
    extra = later_options(task, options)
    by_line: dict[tuple[str, str], list[int]] = {}
    for i, (queue, *_) in enumerate(routed):
        by_line.setdefault((queue.name, shares[i][0]), []).append(i)
    results: list[Any] = [None] * len(routed)
    for (_, key), indexes in by_line.items():
        queue, weight = routed[indexes[0]][0], shares[indexes[0]][1]
        for start in range(0, len(indexes), chunk_size):
            chunk = indexes[start : start + chunk_size]
            tasks = []
            for i in chunk:
                _, cost, args, kwargs = routed[i]
                task_id = uuid()
                message = parked_message(task.name, args, kwargs, {**extra, **options, "task_id": task_id})
                tasks.append(FairTask(task_id, message, cost))
                results[i] = task.AsyncResult(task_id)
            try:
                queue.fair_park(key, weight, tasks)
            except NO_TICKET_ERRORS as exc:
                warn_no_ticket(task.name, exc)  # published as they are, outside the fair order
                for i, fair_task in zip(chunk, tasks, strict=True):
                    send(routed[i][2], routed[i][3], fair_task.task_id, None, **options)
                progress.published += len(chunk)
                continue
            for fair_task in tasks:
                expect_result(task, None, fair_task.task_id, options)
            progress.claims += 1
            progress.published += len(chunk)
            progress.parked += len(chunk)
    for queue in {q.name: q for q, *_ in routed}.values():
        release_fair(task.app, queue, task.name)
    return results


#: What apply_many sets per call itself: a caller's value could only be shared by all calls.
PER_CALL_OPTIONS = ("args", "kwargs", "task_id")


def check_many_options(options: Mapping[str, Any]) -> None:
    """Refuse, before anything is claimed, the options of ``apply_many`` that Celery would
    refuse only at the first publish (its tickets claimed by then), or that cannot apply
    to several calls."""
    for name in PER_CALL_OPTIONS:
        if name in options:
            raise ConfigurationError(f"apply_many() gives each call its own {name}; remove {name}={options[name]!r}")
    eta, countdown = options.get("eta"), options.get("countdown")
    if eta is not None and not isinstance(eta, datetime):
        raise ConfigurationError(f"apply_many(eta=...) takes a datetime, not {eta!r}")
    if countdown is not None and (
        isinstance(countdown, bool) or not isinstance(countdown, (int, float)) or not math.isfinite(countdown)
    ):
        raise ConfigurationError(f"apply_many(countdown=...) takes a number of seconds, not {countdown!r}")


def normalize_call(call: Any) -> tuple[Sequence[Any], dict[str, Any]]:
    """``args`` or ``(args, kwargs)``, as apply_many takes them."""
    if (
        isinstance(call, tuple) and len(call) == 2 and isinstance(call[0], (list, tuple))
        and isinstance(call[1], Mapping)
    ):  # fmt: skip
        return call[0], dict(call[1])
    if isinstance(call, (list, tuple)):
        return call, {}
    raise ConfigurationError(f"apply_many: a call is an args list/tuple or an (args, kwargs) pair, not {call!r}")


def warn_no_ticket(task: object, exc: Exception) -> None:
    if isinstance(exc, CorruptStateError):
        logger.error("%s: published without a ticket; the worker will claim one once the state is repaired: %s",
                     task, exc)  # fmt: skip
    else:
        logger.warning("%s: state store unreachable at publish; the worker will claim a ticket: %s", task, exc)


def eta_for(ticket: Ticket, margin: float, broker_wait_below: float = 0.0) -> datetime | None:
    """The ETA that brings a task ``margin`` before its estimated slot, on the store's clock
    (not a countdown: Celery turns a countdown into an ETA with the producer's own clock,
    so a producer whose clock is off would delay or hurry its tasks by that much).

    None (no ETA) when the slot is that near, and for a queue whose interval is below
    ``broker_wait_below``: its tasks wait in the broker's queue, in ticket order, and
    whichever worker process is free takes the next one. A worker takes an ETA task at
    once and holds it until it is due, so at a few milliseconds per slot a task bound to
    a node whose processes are all busy misses its slot while another node idles
    (BENCHMARKS.md, "Peers"). In the broker's queue a task reaches a process only when
    every earlier ticket has one, so its wait there is about one interval per process
    ahead of it, well within ``siq_max_sleep``. A ticket whose slot the window quota sets
    (``window_bound``) is not one of those: it gets its ETA."""
    if ticket.delay <= margin or (0 < ticket.interval_us < broker_wait_below * 1e6 and not ticket.window_bound):
        return None
    return datetime.fromtimestamp(ticket.estimated_start - margin, UTC)


def put_ticket_in_headers(sender: Any = None, headers: dict[str, Any] | None = None, **_: Any) -> None:
    """``before_task_publish``: read the claim :func:`publish` sent, put its ticket and ETA
    in the message's headers."""
    claim = _CLAIMS_IN_FLIGHT.pop(headers.get("id", ""), None) if headers else None
    if claim is None or headers is None:
        return
    pending, queue, settings = claim
    try:
        ticket = pending.ticket()
    except NO_TICKET_ERRORS as exc:
        warn_no_ticket(sender, exc)
        return
    queue.last_delay = ticket.delay  # a long backlog: the next publish claims first, to park
    headers.update(ticket_headers(ticket))
    # The caller's own countdown or eta stands. Beyond the horizon no ETA at all: the
    # worker parks the task at once instead of holding it in memory.
    if headers.get("eta") is None and ticket.delay <= settings.horizon:
        eta = eta_for(ticket, settings.countdown_margin, settings.broker_wait_below)
        if eta is not None:
            headers["eta"] = eta.isoformat()
