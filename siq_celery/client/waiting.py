"""The wait for a start: :func:`wait_in_line` asks the store and sleeps, claims anew, backs
off or defers according to its answers, until the start is authorized in every queue of
the line (a :class:`Line`: an :class:`~siq_celery.IntervalQueue`, or a
:class:`~siq_celery.CombinedQueue` of several), and how long it sleeps before asking again
(:func:`_sleep_before_asking`). What a body does once authorized is body.py's.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import replace
from typing import Protocol

from celery.exceptions import SoftTimeLimitExceeded

from ..backends import Backend
from ..broker import green
from ..errors import CorruptStateError, LostDeliveriesError, SiqError, StoreUnavailableError
from ..ledger import StartRecord
from ..rules import start_lead_us
from ..types import US, Decision, Ticket, Verdict

logger = logging.getLogger("siq_celery")

#: Waits longer than this are slept in steps that end this far before the slot, then the
#: store is asked again (so a pause or an interval change is noticed in time) ...
COARSE_WAIT_S = 0.005
NEAR_SLOT_S = 0.002
#: ... on a green pool, whose long naps are the hub's timer (a millisecond late: broker/green.py).
#: Elsewhere a sleep ends tens of microseconds late whatever its length, and a wait up to
#: this is slept in one nap: one ask a start fewer at short intervals (its CPU, a round
#: trip), and a pause or a changed interval is still met by the ask at the slot.
ONE_NAP_S = 0.05
MAX_SLEEP_STEP_S = 0.5
PAUSED_POLL_S = (0.05, 1.0)  # first and largest poll period while paused
#: First and largest retry period while the store is down: after a failover a start reaches the
#: promoted master within a second of the promotion.
UNAVAILABLE_RETRY_S = (0.1, 1.0)
CORRUPT_RETRY_S = (1.0, 30.0)  # ... while the queue's state is corrupt (an operator must act)


class DuplicateTaskError(SiqError):
    """The task id given to :meth:`IntervalQueue.wait_for_turn` already finished."""


class SlotTimeoutError(SiqError, TimeoutError):
    """No slot was authorized within the timeout (the claimed ticket is given up)."""


class DeferralNeeded(Exception):
    """Raised by :meth:`IntervalQueue.wait_for_turn` when told not to wait this out here
    (a long wait, or a paused queue): the caller re-schedules ``ticket`` elsewhere."""

    def __init__(self, ticket: Ticket, decision: Decision, own_wait: float | None = None) -> None:
        super().__init__(f"ticket {ticket.number} of {ticket.queue!r}: {decision.verdict.value}")
        self.ticket, self.decision = ticket, decision
        #: The wait of the ticket's own queue (with several limits, another may wait longer):
        #: parking in that queue helps only if it is itself far from the slot.
        self.own_wait = decision.wait if own_wait is None else own_wait


class Line(Protocol):
    """What :func:`wait_in_line` needs: an IntervalQueue, or a CombinedQueue of several."""

    name: str
    backend: Backend

    @property
    def queue_names(self) -> list[str]: ...

    @property
    def max_lost_deliveries(self) -> int: ...
    def claim_tickets(self, cost: int) -> list[Ticket]: ...
    def ask(
        self,
        tickets: list[Ticket],
        task_id: str | None,
        record: StartRecord | None,
        cost: int,
        token: str = "",
        reports: bool = False,
    ) -> list[Decision]: ...
    def settle(self, decision: Decision, tickets: list[Ticket], round_trip: float) -> Decision: ...
    def began(self, decision: Decision, *, wait: bool = False, task_id: str = "") -> bool: ...
    def finish(self, task_id: str, outcome: str = ..., *, remember: bool = ..., lease: str = ...) -> None: ...
    def _nap(self, seconds: float, deadline: float | None) -> None: ...
    def _wake_nap(self, ticket: Ticket, after_us: int, seconds: float, deadline: float | None) -> None: ...
    def _read_answer(self, decision: Decision, asked_at: float, answered_at: float) -> float: ...
    def _monotonic(self) -> float: ...


def wait_in_line(
    line: Line,
    tickets: list[Ticket] | None,
    *,
    task_id: str | None,
    timeout: float | None,
    max_sleep: float | None,
    defer_paused: bool,
    record: StartRecord | None,
    cost: int,
    full_hold: float | None = None,
    reports: bool = False,
) -> tuple[Decision, list[Ticket]]:
    """The loop behind ``wait_for_turn``: ask, and sleep, re-claim, back off or defer
    according to the answers, until the start is authorized (in every queue of the line);
    that decision and the tickets that got it. A start held by a full concurrency cap polls
    briefly; with ``max_sleep`` it defers once it has waited that long for a lease in all,
    so it never holds a process longer than a waiting start does. Each ask carries this
    call's token: an ask whose reply was lost (the store unreachable to it, a timeout) may
    have been authorized, and the next ask is given that start again (not RUNNING by its
    own lease, nor charged twice). ``reports``: the caller reports when the body begins
    (``line.began``); the authorization is not re-stamped then (the report places it)."""
    deadline = None if timeout is None else line._monotonic() + timeout
    token = secrets.token_hex(8)
    paused_poll, unavailable_retry = PAUSED_POLL_S[0], UNAVAILABLE_RETRY_S[0]
    corrupt_retry = CORRUPT_RETRY_S[0]
    full_since: float | None = None  # when a full concurrency cap first held this start
    while True:
        try:
            if tickets is None:
                tickets = line.claim_tickets(cost)
            sent = line._monotonic()
            decisions = line.ask(tickets, task_id, record, cost, token, reports)
            round_trip = line._monotonic() - sent
        except StoreUnavailableError as exc:
            logger.warning("queue %r: state store unreachable, nothing starts; retrying in %.1fs: %s",
                           line.name, unavailable_retry, exc)  # fmt: skip
            line._nap(unavailable_retry, deadline)
            unavailable_retry = min(unavailable_retry * 2, UNAVAILABLE_RETRY_S[1])
            continue
        except CorruptStateError as exc:
            # Fail closed and keep the task: nothing starts until an operator repairs or
            # resets the state; the task goes on when they have (no crash loop).
            logger.error("%s; retrying in %.0fs", exc, corrupt_retry)
            line._nap(corrupt_retry, deadline)
            corrupt_retry = min(corrupt_retry * 2, CORRUPT_RETRY_S[1])
            continue
        except (SiqError, SoftTimeLimitExceeded):
            # A clear error of ours (a refused ACL, a bad cost): before anything is charged;
            # or the task's own soft time limit, which a wait must not outlive.
            raise
        except Exception as exc:
            # Whatever else the store's client raised: no answer is no start (fail closed).
            # Raised into Celery's trace it would fail a task whose body never ran.
            logger.error("queue %r: unexpected error from the state store, nothing starts; retrying in %.0fs: "
                         "%s: %s", line.name, corrupt_retry, type(exc).__name__, exc)  # fmt: skip
            line._nap(corrupt_retry, deadline)
            corrupt_retry = min(corrupt_retry * 2, CORRUPT_RETRY_S[1])
            continue
        unavailable_retry = UNAVAILABLE_RETRY_S[0]
        slot_at = line._read_answer(decisions[0], sent, sent + round_trip) if len(decisions) == 1 else 0.0
        verdicts = {d.verdict for d in decisions}
        if verdicts == {Verdict.AUTHORIZED}:
            if reports:  # the body's report places the start: no re-stamp
                answered = replace(combined(decisions), asked_at=sent, answered_at=sent + round_trip, slot_at=slot_at)
                return answered, tickets
            return line.settle(combined(decisions), tickets, round_trip), tickets
        if Verdict.DUPLICATE in verdicts:
            raise DuplicateTaskError(f"queue {line.name!r}: task {task_id!r} already finished")
        if Verdict.RUNNING in verdicts:  # a copy of this task runs (a redelivery): after it ends, or its holder dies
            running = next(d for d in decisions if d.verdict is Verdict.RUNNING)
            logger.info("queue %r: task %s is running elsewhere (this is a redelivered copy); asking again "
                        "in %.1fs at most", line.name, task_id, running.wait)  # fmt: skip
            if max_sleep is not None and running.wait > max_sleep:
                raise DeferralNeeded(tickets[0], running)
            line._nap(min(running.wait, RUNNING_POLL_S), deadline)
            continue
        if Verdict.LOST in verdicts:
            raise LostDeliveriesError.of(f"task {task_id}", line.max_lost_deliveries)
        if Verdict.RECLAIM in verdicts:
            stale = [t for t, d in zip(tickets, decisions, strict=True) if d.verdict is Verdict.RECLAIM]
            logger.info("queue %r: ticket %s was not issued in the queue's current life (a reset, a lost store, "
                        "or never claimed); claiming anew", stale[0].queue, stale[0].number)  # fmt: skip
            tickets = None  # every ticket anew: each claim costs only a slot
            continue
        if Verdict.PAUSED in verdicts:
            paused = next(d for d in decisions if d.verdict is Verdict.PAUSED)
            if defer_paused:
                raise DeferralNeeded(tickets[0], paused)
            line._nap(paused_poll, deadline)
            paused_poll = min(paused_poll * 2, PAUSED_POLL_S[1])
            continue
        waiting = combined(decisions)
        if max_sleep is not None and waiting.wait > max_sleep:
            own = max(decisions, key=lambda d: d.ticket)  # the queue where the ticket has its place
            raise DeferralNeeded(tickets[0], waiting, own.wait)
        if waiting.full:  # the slot came, the concurrency cap is full: short polls, at most full_hold in all
            full_since = line._monotonic() if full_since is None else full_since
            hold = None if max_sleep is None else max(max_sleep, full_hold or 0.0)
            if hold is not None and line._monotonic() - full_since + waiting.wait > hold:
                raise DeferralNeeded(tickets[0], waiting, waiting.wait)
        early = START_LEAD_SHARE * start_lead_us(waiting.interval_us) / US if reports and len(decisions) == 1 else 0.0
        nap = _sleep_before_asking(max(waiting.wait - early, 0.0), round_trip)
        held = waiting.full or waiting.wait_us != waiting.slot_us - waiting.now_us  # not the wait for its slot
        if held and len(decisions) == 1:  # woken by the lease it waits for
            line._wake_nap(tickets[0], waiting.now_us, nap, deadline)
        else:
            line._nap(nap, deadline)


#: A start whose body reports asks this share of the lead before its slot
#: (:func:`~siq_celery.rules.spacing.start_lead_us`), so that its ask reaches the store within the
#: lead: it is authorized for its slot and holds its body until then.
START_LEAD_SHARE = 0.75


def combined(decisions: list[Decision]) -> Decision:
    """One decision for a start asked of several queues: the longest wait, the latest slot,
    and the ticket of the one queue where the start has a place in line."""
    if len(decisions) == 1:
        return decisions[0]
    longest = max(decisions, key=lambda d: (d.wait_us, d.slot_us))
    return replace(
        longest, ticket=max(d.ticket for d in decisions), slot_us=max(d.slot_us for d in decisions),
        lease=next((d.lease for d in decisions if d.lease), ""), full=any(d.full for d in decisions),
    )  # fmt: skip


#: How often a start that found a copy of its task running asks again, at most (without
#: ``max_sleep``; a worker defers it instead): the copy may end long before its lease would
#: expire.
RUNNING_POLL_S = 1.0


def _sleep_before_asking(wait: float, round_trip: float) -> float:
    """How long to sleep before asking the store again after it said "wait".

    Far from the slot: sleep to just before it (and ask again, which also notices a pause
    or an interval change). The store worked the wait out somewhen during the round trip:
    a reply that came back late (a busy process, a green pool's hub) must not make the
    sleep end late, so the round trip is taken off. Near it: aim for the request to *reach* the store at the slot,
    i.e. leave one round trip early (the answer took half of one to come back, the next
    request takes half of one to get there); if that is early, the store says so and the
    remaining wait is tiny.
    """
    if wait > (COARSE_WAIT_S if green.GREEN else ONE_NAP_S):
        return max(min(wait - NEAR_SLOT_S - round_trip, MAX_SLEEP_STEP_S), 0.0)
    return max(wait - round_trip, 0.0)
