"""IntervalQueue: one named interval shared by every process that uses the same store.

>>> q = IntervalQueue("geocoder", url="redis://localhost:6379/0", interval="200ms")
>>> with q.slot():          # blocks until this caller's turn
...     call_api()

Everything that decides is an atomic operation of the backend on the store's clock; this
class only claims, asks, and sleeps precisely in between. Waits are always relative
(microseconds the store says remain), so the caller's own clock never matters.
"""

from __future__ import annotations

import contextlib
import functools
import getpass
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, ParamSpec, Protocol, TypeVar

from celery.exceptions import SoftTimeLimitExceeded

from ..backends import Backend, backend_from_url
from ..backends.base import PendingClaim
from ..broker import green
from ..broker.green import nap
from ..errors import (
    ConfigurationError,
    CorruptStateError,
    IntervalMismatchError,
    LostDeliveriesError,
    QueueExistsError,
    QueueNotFoundError,
    SiqError,
    StoreUnavailableError,
)
from ..intervals import MAX_BACKOFF_US, IntervalLike, format_interval, parse_duration, parse_interval
from ..keys import DEFAULT_KEY_PREFIX, validate_queue_name
from ..ledger import LedgerRow, StartRecord
from ..limits import Limit, QuotaLike, format_limits, interval_and_limits, limits_override
from ..rules import BEGIN_WAIT_US, start_lead_us
from ..types import US, ClaimResult, Decision, Declared, FairTask, QueueState, QueueStatus, Ticket, Verdict
from .leases import KEEPER
from .reply_clock import ReplyClock

logger = logging.getLogger("siq_celery")

P = ParamSpec("P")
R = TypeVar("R")

MAX_CLAIM = 100_000
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
MAX_RESTAMPS = 3
RESUME_GRACE_S = 1.0  # the longest paused poll of wait_for_turn
MAX_RESUME_GRACE_S = 86_400.0  # one day, like the longest interval
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


class PendingTicket:
    """A ticket whose claim is on its way: :meth:`ticket` waits for it; :meth:`discard`
    reads and drops it (call one of the two, once, so the connection is freed)."""

    def __init__(self, queue: IntervalQueue, pending: PendingClaim, cost: int = 1) -> None:
        self.queue, self._pending, self._cost = queue, pending, cost

    def ticket(self) -> Ticket:
        r = self._pending.result()
        self.queue.note_stored_interval(r.interval_us)
        return self.queue.ticket_of(r, r.first, self._cost)

    def discard(self) -> None:
        self._pending.discard()


def new_epoch() -> str:
    return secrets.token_hex(8)


def who(node: str = "") -> str:
    """This process, for the record of who changed an interval: ``user@host pid N``, after
    the worker ``node``'s name if given."""
    try:
        user = getpass.getuser()
    except Exception:  # no user name in a container without a passwd entry
        user = str(os.getuid())
    me = f"{user}@{socket.gethostname()} pid {os.getpid()}"
    return f"{node} ({me})" if node else me


class IntervalQueue:
    """A named interval queue in a state store chosen by URL.

    ``url``: ``redis://...``, ``rediss://...``, ``redis+cluster://...``,
    ``redis+sentinel://...``, ``unix://...``, ``sqlite:///path.db`` or ``memory://``.
    ``interval``: seconds, a ``timedelta``, ``"200ms"``, ``"2s"``, or a rate ``"5/s"``; used
    to create the queue's state when it has none, and by :meth:`declare` (a claim never
    changes a stored interval: :meth:`declare` and :meth:`set_interval` do). ``idle_expiry`` (seconds, or text
    like ``"1h"``): on Redis, the queue's keys disappear that long after its last claim,
    start or finish, unless it is paused or has parked tasks; the next use starts it
    afresh (a new epoch, whose first start waits one interval). ``clock`` pins the store
    clock (microseconds; tests), ``sleep`` and ``monotonic`` replace the local time
    functions.

    ``burst`` (0 to 10 000, default 0): up to that many starts may come closer than the
    interval, to catch up after lateness or idleness. ``quota`` (``"10000/d"``): at most N
    cost units start in any sliding window of the period (limits.py). ``concurrency`` (N):
    at most N bodies running at once (a start takes a lease, :meth:`finish` gives it back;
    :meth:`slot` does both). ``margin`` (a duration, ``"5ms"``; default 0): added to the
    spacing and to the quota's window, for what lies between a body's start and the
    provider's count of it. Without an interval a quota or a concurrency cap has no spacing
    of its own. ``interval`` may also be a :class:`Limit` of all of them.
    Like the interval they are declared by :meth:`declare` (a worker start) and used to
    create the queue's state.
    """

    def __init__(
        self,
        name: str,
        url: str | None = None,
        interval: IntervalLike | Limit | None = None,
        *,
        burst: int | None = None,
        quota: QuotaLike | None = None,
        concurrency: int | None = None,
        margin: IntervalLike | None = None,
        backend: Backend | None = None,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        clock: Callable[[], int] | None = None,
        sleep: Callable[[float], None] = nap,
        monotonic: Callable[[], float] = time.monotonic,
        idle_expiry: IntervalLike | None = None,
        **backend_options: Any,
    ) -> None:
        self.name = validate_queue_name(name)
        self.interval_us: int | None
        self.interval_us, self.limits = interval_and_limits(interval, burst, quota, concurrency, margin)
        if backend is None:
            if url is None:
                raise ConfigurationError(
                    f"IntervalQueue({name!r}) needs a state store: url='redis://host:6379/0', "
                    f"'sqlite:///path.db' or 'memory://'"
                )
            backend = backend_from_url(url, key_prefix=key_prefix, clock=clock, **backend_options)
        self.backend = backend
        if idle_expiry is not None:
            idle_us = parse_duration(idle_expiry)
            if idle_us < 1_000_000:
                raise ConfigurationError(f"queue {name!r}: idle_expiry is at least 1s, not {idle_expiry!r}")
            backend.expire_when_idle(self.name, idle_us)
        self._sleep, self._monotonic = sleep, monotonic
        self._replies: ReplyClock | None = None  # this process's clock against the store's: made at the first answer
        #: Seconds from claim to estimated start of the last ticket this object claimed:
        #: a producer uses it to see that its queue has a long backlog.
        self.last_delay = 0.0
        self._noted_interval = False

    def __repr__(self) -> str:
        interval = format_interval(self.interval_us) if self.interval_us else "stored"
        extra = f" burst={self.limits.burst}" if self.limits.burst else ""
        if self.limits.quota:
            extra += f" quota={self.limits.quota}/{format_interval(self.limits.window_us)}"
        if self.limits.concurrency:
            extra += f" concurrency={self.limits.concurrency}"
        if self.limits.margin_us:
            extra += f" margin={format_interval(self.limits.margin_us)}"
        return f"<IntervalQueue {self.name!r} interval={interval}{extra} backend={type(self.backend).__name__}>"

    # -- state ----------------------------------------------------------------------

    def ensure(
        self, interval: IntervalLike | None = None, *, reset: bool = False, fail_if_exists: bool = False
    ) -> QueueState:
        """Create the queue's shared state, or check the existing one.

        An existing queue keeps its stored interval: a different ``interval`` here raises
        IntervalMismatchError (nothing is changed) because the stored one may have been set
        on purpose by an operator; use :meth:`set_interval` to change it, or
        ``reset=True`` to start the queue afresh with this interval. An ``interval`` given
        here acts on the store; this object keeps its own (:meth:`_adopt`).
        """
        interval_us = self._adopt(interval, "ensure")
        if reset:
            return self.backend.reset(self.name, interval_us, new_epoch(), who(), limits=self.limits)
        state, created = self.backend.ensure(self.name, interval_us, new_epoch(), limits=self.limits)
        if not created:
            if fail_if_exists:
                raise QueueExistsError(f"queue {self.name!r} already exists (fail_if_exists=True)")
            if state.limits != self.limits:
                raise IntervalMismatchError(
                    f"queue {self.name!r} is stored with {format_limits(state.limits)}, not "
                    f"{format_limits(self.limits)}; the stored ones stay in force. A worker start with this "
                    f"code (or declare()) makes them the queue's"
                )
            if state.declared_interval_us != interval_us:
                raise IntervalMismatchError(
                    f"queue {self.name!r} is stored with interval {format_interval(state.declared_interval_us)}, "
                    f"not {format_interval(interval_us)}; the stored one stays in force. Change it "
                    f"for every worker with set_interval({format_interval(interval_us)!r}) or "
                    f"`celery siq set-interval {self.name} {format_interval(interval_us)}`"
                )
        return state

    def _adopt(self, interval: IntervalLike | None, caller: str) -> int:
        """The interval an ``ensure`` or ``declare`` call acts with: the one given, else this
        object's. An object built without an interval takes the first one it is given (its
        claims then create a lost state with it); one with its own keeps it, since the app
        caches one object per declaration and a worker's renewals declare its interval."""
        interval_us = parse_interval(interval) if interval is not None else self.interval_us
        if interval_us is None:
            raise ConfigurationError(f"queue {self.name!r}: {caller}() needs an interval")
        if self.interval_us is None:
            self.interval_us = interval_us
        return interval_us

    def status(self) -> QueueStatus:
        """Ticket, current, backlog, interval, paused, epoch, last and next start."""
        status = self.backend.status(self.name)
        if status is None:
            raise QueueNotFoundError(f"queue {self.name!r} has no state in this store")
        return status

    def pause(self) -> QueueState:
        """Stop all starts of this queue, for every worker, until :meth:`resume`."""
        return self.backend.pause(self.name)

    def resume(self, grace: float = RESUME_GRACE_S) -> QueueState:
        """Continue in ticket order, the first start ``grace`` seconds from now.

        Waiters of a paused queue poll it (in-process waiters at most every second, Celery
        tasks every ``siq_paused_poll``); the grace lets each of them come back before its
        slot, so the line resumes in ticket order. ``grace=0`` restarts at once."""
        if not grace <= MAX_RESUME_GRACE_S:  # also NaN
            raise ConfigurationError(f"queue {self.name!r}: a resume grace of {grace!r} s is over one day")
        return self.backend.resume(self.name, round(max(grace, 0.0) * 1e6))

    def set_interval(self, interval: IntervalLike | None, *, origin: str | None = None) -> QueueState:
        """Override the shared interval at runtime, for every worker, from the next start
        (recorded with ``origin``, by default this user, host and process). The override
        holds across worker restarts whose code declares the same interval; a deploy that
        declares a different one replaces it. ``None`` clears it: back to the declaration."""
        interval_us = parse_interval(interval) if interval is not None else None
        return self.backend.set_interval(self.name, interval_us, origin or who())

    def set_limits(
        self, *, burst: int | str | None = None, quota: QuotaLike | None = None, concurrency: int | str | None = None,
        margin: IntervalLike | None = None, clear: bool = False, origin: str | None = None,
    ) -> QueueState:  # fmt: skip
        """Override some of the shared limits at runtime, for every worker, from the next
        start (recorded with ``origin``, by default this user, host and process): the kinds
        given (``burst``; ``quota`` ``"100/1m"``, or ``"none"``; ``concurrency`` N, or
        ``"none"``; ``margin`` ``"5ms"``, or ``"none"``) replace the declared ones, the
        others keep theirs (an earlier override of them stays). Each kind's override holds
        across worker restarts whose code declares the same value for it; a deploy that
        declares another replaces it.
        ``clear=True`` removes every override of the limits: back to the declarations."""
        override = limits_override(burst, quota, concurrency, margin)
        if clear == bool(override):
            raise ConfigurationError(
                f"queue {self.name!r}: set_limits() takes burst=, quota=, concurrency= or margin=, or clear=True "
                f"(not both)"
            )
        return self.backend.set_limits(self.name, None if clear else override, origin or who())

    def declare(
        self, interval: IntervalLike | None = None, *, node: str = "", ttl: float = 0.0, announce: bool = True,
        origin: str | None = None,
    ) -> Declared:  # fmt: skip
        """Declare the interval the code wants (default: this object's), creating the
        queue's state if missing. A declaration that differs from the last one becomes the
        declaration and the effective interval at once, replacing an operator's override
        (a deploy that changed ``interval=``): what a worker does at start, and ``siq
        sync`` for scripts. ``node`` registers it as a live worker's for ``ttl`` seconds
        (the queue never runs faster than its slowest live declaration); ``announce=False``
        only renews it. This object's limits (burst, quota, concurrency) are declared with
        it, by the same rules: the strictest live declaration holds, and an announcement
        that changes a kind replaces that kind's override. An ``interval`` given here acts
        on the store; this object keeps its own (:meth:`_adopt`)."""
        interval_us = self._adopt(interval, "declare")
        return self.backend.declare(
            self.name, interval_us, new_epoch(), node=node, ttl_us=round(ttl * 1e6), origin=origin or who(node),
            announce=announce, limits=self.limits,
        )  # fmt: skip

    def reset(self) -> QueueState:
        """Start afresh: new epoch (outstanding tickets re-claim), pause cleared; the last
        start and finished-task records are kept, so no burst and no re-run follow."""
        return self.backend.reset(self.name, self.interval_us, new_epoch(), who(), limits=self.limits)

    def delete(self) -> bool:
        """Remove the queue's state entirely. True if there was any."""
        return self.backend.delete(self.name)

    # -- tickets --------------------------------------------------------------------

    def claim(self, cost: int = 1) -> Ticket:
        """Take the next ticket (one round trip). A ticket of ``cost`` c holds c slots: its
        start keeps the next one c intervals away (start it with the same ``cost``)."""
        r = self.backend.claim(self.name, self.checked_cost(cost), self.interval_us or 0, new_epoch(),
                               limits=self.limits)  # fmt: skip
        self.note_stored_interval(r.interval_us)
        ticket = self.ticket_of(r, r.first, cost)
        self.last_delay = ticket.delay
        return ticket

    def fair_park(self, key: str, weight: int, tasks: Sequence[FairTask]) -> list[str]:
        """``tasks`` of fairness key ``key`` wait in its line in the store, without a
        ticket, until a release hands them one in fair order (one round trip; see
        :meth:`Backend.fair_park`); the ids of those still parked under a ticket, which did
        not join: send them again later."""
        for task in tasks:
            self.checked_cost(task.cost)
        return self.backend.fair_park(
            self.name, key, weight, tasks, self.interval_us or 0, new_epoch(), limits=self.limits
        )

    def ticket_of(self, r: ClaimResult, number: int, cost: int = 1) -> Ticket:
        """Ticket ``number`` of a claim's reply, with its estimate (``cost``: as it starts)."""
        estimate = r.estimate_us(number, cost)
        window_bound = estimate > r.spacing_us(number)
        return Ticket(self.name, number, r.epoch, estimate, r.now_us, r.interval_us, window_bound)

    def checked_cost(self, cost: object) -> int:
        """``cost`` if valid here: a whole number from 1 to 10 000, at most the quota."""
        cost = validate_cost(cost)
        if self.limits.quota and cost > self.limits.quota:
            raise ConfigurationError(f"queue {self.name!r}: a cost of {cost} is more than its quota "
                                     f"({self.limits.quota}): it could never start")  # fmt: skip
        return cost

    def claim_later(self, cost: int = 1) -> PendingTicket:
        """Send a claim for one ticket now and read the answer later: the round trip
        overlaps whatever the caller does meanwhile (Redis; other stores claim at once)."""
        pending = self.backend.claim_later(
            self.name, self.checked_cost(cost), self.interval_us or 0, new_epoch(), limits=self.limits
        )
        return PendingTicket(self, pending, cost)

    def claim_many(self, count: int) -> list[Ticket]:
        """Take ``count`` consecutive tickets in one round trip."""
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_CLAIM:
            raise ConfigurationError(f"claim_many(count) takes a whole number from 1 to {MAX_CLAIM}, not {count!r}")
        result = self.backend.claim(self.name, count, self.interval_us or 0, new_epoch(), limits=self.limits)
        self.note_stored_interval(result.interval_us)
        tickets = self._tickets(result)
        self.last_delay = tickets[-1].delay
        return tickets

    def claim_costs(self, costs: Sequence[int]) -> list[Ticket]:
        """One ticket per cost, consecutive, in one round trip: a ticket of cost c holds c
        slots (start it with that cost)."""
        checked = [self.checked_cost(c) for c in costs]
        total = sum(checked)
        if not 1 <= total <= MAX_CLAIM:
            raise ConfigurationError(f"claim_costs: {total} slots in one claim; 1 to {MAX_CLAIM} can be claimed")
        r = self.backend.claim(self.name, total, self.interval_us or 0, new_epoch(), limits=self.limits)
        self.note_stored_interval(r.interval_us)
        tickets, number = [], r.first
        for cost in checked:
            tickets.append(self.ticket_of(r, number, cost))
            number += cost
        self.last_delay = tickets[-1].delay
        return tickets

    def note_stored_interval(self, interval_us: int) -> None:
        """Say once, in this process, that the queue runs at another interval (``interval_us``,
        the spacing in force: the interval and the margin) than this object declares: a claim
        never rewrites the stored interval (a producer with old code must not undo a
        deploy), worker starts and ``siq sync`` do."""
        if (
            interval_us != (self.interval_us or 0) + self.limits.margin_us
            and self.interval_us
            and not self._noted_interval
        ):
            self._noted_interval = True
            logger.info(
                "queue %r runs at %s (the store's effective interval: see `siq status %s`); this process "
                "declares %s. A worker start with this code, or `siq sync`, makes it the declaration",
                self.name, format_interval(interval_us), self.name, format_interval(self.interval_us),
            )  # fmt: skip

    def _tickets(self, r: ClaimResult) -> list[Ticket]:
        return [self.ticket_of(r, n) for n in range(r.first, r.first + r.count)]

    def start(
        self, ticket: Ticket, *, task_id: str | None = None, record: StartRecord | None = None, cost: int = 1,
        lease: str = "", token: str = "", reports: bool = False,
    ) -> Decision:  # fmt: skip
        """Ask the store whether ``ticket`` may start now (authorizes it if so, and writes
        ``record`` to the ledger with it). ``cost``: as claimed. With a concurrency cap an
        authorized start holds ``Decision.lease`` (named ``lease``, or a new member) until
        :meth:`finish` gives it back. ``token``: the asking call's, the same in each of its
        asks: one whose reply was lost is given that start again (see Backend.start).
        ``reports``: the caller will report when the body begins (:meth:`began`); later
        starts wait for that report (:data:`~siq_celery.rules.spacing.BEGIN_WAIT_US` at most)."""
        return self.backend.start(
            self.name,
            ticket.number,
            ticket.epoch,
            task_id=task_id,
            interval_us=self.interval_us or 0,
            new_epoch=new_epoch(),
            record=record,
            cost=cost,
            limits=self.limits,
            lease=lease,
            token=token,
            begin_wait_us=BEGIN_WAIT_US if reports else 0,
        )

    def began(self, decision: Decision, *, wait: bool = False, task_id: str = "") -> bool:
        """The body of the start ``decision`` authorized (asked with ``reports``; of
        ``task_id``, for the ledger) begins now: the store places the start at its own time
        when this report arrives, and later starts stop waiting for it. Sent without
        waiting for the reply, unless ``wait``; waited for, False means the start is no
        longer the queue's last pending one (its wait expired and a later start came): the
        body must not begin now."""
        if not wait:
            self.backend.began_soon(self.name, decision.now_us, task_id)
            return True
        return self.backend.began(self.name, decision.now_us, task_id) is not None

    def backoff(self, seconds: IntervalLike, *, keep_first: bool = False) -> QueueState:
        """Hold every start of this queue, on every worker, for ``seconds`` from now (a
        service answered 429 with Retry-After). The line keeps its order; a back-off
        never brings a start closer than the interval. ``keep_first``: the first slot
        after the hold is kept for a passed-over ticket (the task that backed off)."""
        hold = parse_duration(seconds)
        if hold > MAX_BACKOFF_US:
            raise ConfigurationError(f"queue {self.name!r}: a back-off is at most a day, not {seconds!r}")
        return self.backend.backoff(self.name, hold, keep_first)

    def finish(self, task_id: str, outcome: str = "SUCCESS", *, remember: bool = True, lease: str = "") -> None:
        """Record that ``task_id`` finished (a redelivered copy is then not started, unless
        not ``remember``: a run that ended in a retry), complete its ledger row and give
        back its ``lease`` (``Decision.lease``: its run lease, or a concurrency lease), in one step."""
        self.backend.finish(self.name, task_id, outcome, remember=remember, lease=lease)

    def renew_leases(self, leases: Sequence[str]) -> int:
        """The bodies holding ``leases`` still run: renew them (see Backend.renew_leases)."""
        return self.backend.renew_leases(self.name, leases)

    @property
    def max_lost_deliveries(self) -> int:
        """Starts of one task id without a finish after which it is refused (the store's setting)."""
        return self.backend.max_lost_deliveries

    def ledger(self, since: float | None = None, until: float | None = None) -> Iterator[LedgerRow]:
        """This queue's ledger rows (starts in ``[since, until)``, Unix seconds), streamed."""
        return self.backend.ledger(
            self.name, None if since is None else round(since * 1e6), None if until is None else round(until * 1e6)
        )

    # -- blocking helpers -----------------------------------------------------------

    def wait_for_turn(
        self,
        ticket: Ticket | None = None,
        *,
        task_id: str | None = None,
        timeout: float | None = None,
        max_sleep: float | None = None,
        defer_paused: bool = False,
        record: StartRecord | None = None,
        cost: int = 1,
        full_hold: float | None = None,
        reports: bool = False,
    ) -> Decision:
        """Block until a start is authorized and return that decision.

        Claims a ticket if none is given and claims anew if the queue's state changed
        life (reset or lost). While paused it polls with backoff; while the store is
        unreachable, or its state corrupt, nothing starts: it logs why and retries with
        backoff (fail closed).
        With ``max_sleep`` (seconds), a longer wait raises DeferralNeeded instead; with
        ``defer_paused``, so does a paused queue. A ``task_id`` that finished raises
        DuplicateTaskError; one whose last starts never finished, LostDeliveriesError; one
        with a copy running (its lease live), it asks again when that copy could have ended.
        ``record`` goes to the ledger with the authorized start. ``cost``: the slots this
        start takes (claimed together). ``full_hold``: how long a start whose slot came
        while the concurrency cap is full polls for a lease before it defers (at least
        ``max_sleep``, the default). ``reports``: the caller reports when the body begins
        (:meth:`began`, as its last step before the body): the start then counts from there.
        """
        try:
            return wait_in_line(
                self, None if ticket is None else [ticket], task_id=task_id, timeout=timeout, max_sleep=max_sleep,
                defer_paused=defer_paused, record=record, cost=cost, full_hold=full_hold, reports=reports,
            )[0]  # fmt: skip
        finally:
            with contextlib.suppress(Exception):  # best effort, never into a start
                self.backend.wake_done(self.name)

    # -- the hooks of wait_in_line ---------------------------------------------------

    def claim_tickets(self, cost: int) -> list[Ticket]:
        return [self.claim(cost)]

    def ask(
        self, tickets: list[Ticket], task_id: str | None, record: StartRecord | None, cost: int, token: str = "",
        reports: bool = False,
    ) -> list[Decision]:  # fmt: skip
        return [self.start(tickets[0], task_id=task_id, record=record, cost=cost, token=token, reports=reports)]

    def settle(self, decision: Decision, tickets: list[Ticket], round_trip: float) -> Decision:
        return self._settle(decision, tickets[0].epoch, round_trip)

    def _settle(self, decision: Decision, epoch: str, round_trip: float) -> Decision:
        """If the authorization came back slowly, the body starts later than the store
        recorded: re-stamp the start (while it is still the last one) so the next start
        waits a full interval from nearly the real start. Not with a burst: a late body is
        what the burst lets the line catch up on."""
        late_after = late_reply_threshold(decision.interval_us or self.interval_us)  # the stored interval
        if self.limits.burst:  # the store would refuse it (rules.restamp): spare the round trip
            return decision
        if green.GREEN:
            # A green pool's replies come back late as a rule (the hub wakes the greenlet
            # when it can): a re-stamp waited for was late too, and three in a row cost a
            # start a few milliseconds. Sent without waiting, it reaches the store about when
            # the body starts, once.
            if round_trip > late_after:
                self.backend.restamp_soon(self.name, epoch, decision.now_us)
            return decision
        for _ in range(MAX_RESTAMPS):
            if round_trip <= late_after:
                break
            sent = self._monotonic()
            try:
                restamped = self.backend.restamp(self.name, epoch, decision.now_us)
            except StoreUnavailableError:
                break  # the start stands as authorized
            round_trip = self._monotonic() - sent
            if restamped is None:
                break
            decision = replace(decision, now_us=restamped)
        return decision

    def _nap(self, seconds: float, deadline: float | None) -> None:
        if deadline is not None:
            left = deadline - self._monotonic()
            if left <= 0 or seconds > left:
                if left > 0:
                    self._sleep(left)
                raise SlotTimeoutError(f"queue {self.name!r}: no slot within the timeout")
        if seconds > 0:
            self._sleep(seconds)

    def _wake_nap(self, ticket: Ticket, after_us: int, seconds: float, deadline: float | None) -> None:
        """:meth:`_nap` before asking again while the slot came and the line is held (the
        last start's body has not reported, or the concurrency cap is full), cut short by a
        wake of the ticket's queue published after ``after_us`` (store time): a lease was
        given back (:meth:`~siq_celery.backends.base.Backend.wait_for_wake`). A report wakes
        nobody (design.md, "Wakes"): the wait for it stays a poll.
        A store that cannot wake, a deadline, or a pinned sleep (tests): the nap as it was."""
        if deadline is None and seconds > 0 and self._sleep is nap:
            began = self._monotonic()
            try:
                woken = self.backend.wait_for_wake(ticket.queue, ticket.number, after_us, seconds)
            except Exception:  # never into a start: the nap as it was
                woken = None
            if woken:
                return
            seconds -= self._monotonic() - began  # what is left: a fraction of a millisecond, or all of it
        self._nap(seconds, deadline)

    def _read_answer(self, decision: Decision, asked_at: float, answered_at: float) -> float:
        """Read this process's clock against the store's from an answer (sent at
        ``asked_at``, back at ``answered_at``: :class:`~siq_celery.reply_clock.ReplyClock`); for a
        start authorized ahead of its slot, when that slot comes on this clock at the latest
        (:attr:`~siq_celery.types.Decision.slot_at`), else 0. Only with the store's own clock
        and real sleeps (a pinned clock is not this process's)."""
        if self.backend.clock is not None or self._sleep is not nap or self._monotonic is not time.monotonic:
            return 0.0
        ahead = decision.wait_us if decision.authorized else 0
        try:
            if self._replies is None:  # not with the queue: a per-key queue that never starts costs nothing
                self._replies = ReplyClock()
            low = self._replies.note(asked_at, answered_at, decision.now_us - ahead)
        except Exception:  # never into a start: the hold timed from the answer alone
            return 0.0
        return decision.now_us / US - low if ahead > 0 else 0.0

    @contextmanager
    def slot(
        self, *, task_id: str | None = None, timeout: float | None = None, name: str = "slot", cost: int = 1
    ) -> Iterator[Decision]:
        """Block until this caller's turn, then run the ``with`` body. The start and the
        finish (SUCCESS, or FAILURE if the body raised) go to the ledger under ``name``.
        ``cost``: slots this call takes (the next start waits ``cost`` intervals)."""
        # Without a task id of the caller's, the id only joins the ledger's start and finish:
        # it is not remembered as finished (nothing could be redelivered under it).
        remember = task_id is not None
        ledger_id = task_id or secrets.token_hex(16)
        record, cost = StartRecord.here(name, ledger_id), validate_cost(cost)
        decision = begin_body(
            self, ledger_id,
            lambda: self.wait_for_turn(task_id=task_id, timeout=timeout, record=record, cost=cost, reports=True),
        )  # fmt: skip
        outcome = "FAILURE"
        try:
            report_again_if_late(decision)
            yield decision
            outcome = "SUCCESS"
        finally:
            KEEPER.drop(self.backend, self.queue_names, decision.lease)
            if remember or self.backend.ledger_max or decision.lease:
                try:
                    self.backend.finish(self.name, ledger_id, outcome, remember=remember, lease=decision.lease)
                except StoreUnavailableError as exc:  # the body ran; only its record is missing
                    logger.warning("queue %r: could not record the finish of %s: %s", self.name, ledger_id, exc)

    def limited(self, fn: Callable[P, R]) -> Callable[P, R]:
        """Decorator: every call of ``fn`` takes its turn in this queue."""

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            with self.slot(name=getattr(fn, "__qualname__", "slot")):
                return fn(*args, **kwargs)

        return wrapper

    def close(self) -> None:
        self.backend.close()

    @property
    def queue_names(self) -> list[str]:
        """The store queues a start of this line is recorded in (its lease held in each)."""
        return [self.name]


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


#: A body about to begin later than this after its ask was sent reports and waits for the
#: answer (:func:`body_may_begin`): half of the time a pending start holds the queue.
LATE_BEGIN_S = BEGIN_WAIT_US / 2 / US


#: A report whose send took longer than this (the process stood still in it) is sent
#: again, until one is sent quickly (:data:`REPORTS` in all at most): the store places the
#: start when a report comes, so the last one sent counts. Never waited for: a process
#: blocked on the answer of a loaded host waits milliseconds for the CPU after it, all of
#: it between the place the store recorded and the body.
REPORT_AGAIN_S = 0.0001
REPORTS = 10


def body_may_begin(line: Line, decision: Decision, task_id: str = "") -> bool:
    """Report that the body of ``decision`` (a wait with ``reports``) begins now; the last
    step before the body. Sent without waiting (:func:`_report`), unless the authorization
    may be older than :data:`LATE_BEGIN_S` (this process stood still since it asked: a
    loaded host, a pause): then the store's answer says whether the start still holds.
    False: it does not (a later start came while this process stood still, or the store
    could not be asked); the body must not begin now, and the caller gives the start back
    and waits again. A report sent without waiting is looked at once more by
    :func:`still_holds` and :func:`report_again_if_late`, the caller's last steps."""
    _LAST_REPORT.line = _LAST_REPORT.decision = None
    hold_until(line, decision)
    if not decision.asked_at or line._monotonic() - decision.asked_at <= LATE_BEGIN_S:
        return _report(line, decision, task_id)
    try:
        held = line.began(decision, wait=True, task_id=task_id)
    except Exception as exc:  # no answer is no start (fail closed)
        logger.warning("queue %r: could not report a late body's start, waiting again: %s: %s",
                       line.name, type(exc).__name__, exc)  # fmt: skip
        return False
    if not held:
        logger.warning("queue %r: this body was about to begin %.0f ms after its start was authorized, when a "
                       "later start may have come: waiting again", line.name,
                       (line._monotonic() - decision.asked_at) * 1e3)  # fmt: skip
    return held


def hold_until(line: Line, decision: Decision) -> None:
    """A start authorized ahead of its slot (``wait_us``: how far ahead, when the store
    answered) holds its body until ``wait_us`` after the answer came back: the answer left
    the store before it came, so the body never begins before the slot on the store's
    clock (timing the hold from the ask would not know how long the ask took to get
    there, on a loaded host milliseconds), and the report reaches the store just after."""
    if decision.wait_us <= 0 or not decision.answered_at:
        return
    until = decision.answered_at + decision.wait_us / US
    if decision.slot_at:  # read against the store's clock from recent answers too: less late
        until = min(until, decision.slot_at)
    left = until - line._monotonic()
    if left > HOLD_SPIN_S and decision.slot_at and not green.GREEN:  # time.monotonic's: the last of it awake
        line._nap(left - HOLD_SPIN_S, None)
        end = min(until, time.monotonic() + HOLD_SPIN_S)
        while time.monotonic() < end:
            pass
    elif left > 0:
        line._nap(left, None)


#: A body held for its slot sleeps until this long before it, then waits the rest awake:
#: a sleep ends 50-100 µs late (the kernel's timer slack, the wake), which every start
#: would add to the line. Not on a green pool: its nap ends on time by yielding
#: (broker/green.py), and a wait awake would hold the hub.
HOLD_SPIN_S = 0.00015


def _report(line: Line, decision: Decision, task_id: str, ask: bool = False) -> bool:
    """Send the body's report, the last step before the body, without waiting for the
    answer: the store places the start when it arrives. A send that took long (over
    :data:`REPORT_AGAIN_S`: the process stood still in it, and may have stood still long
    enough for a later start to come) is followed by one whose answer is waited for
    (``ask`` starts there): False if the start no longer holds (the body must not begin
    now), else one more sent without waiting, since the process waited for that answer:
    the last quick send places the start (:data:`REPORTS` sends at most). True: the body
    may begin (also when the store could not be told: the start stands as authorized,
    and later starts wait for it :data:`BEGIN_WAIT_US` at most)."""
    for _ in range(REPORTS):
        sent = line._monotonic()
        if not ask:
            if not _tell(line, decision, task_id):
                return True
            held = True
        else:
            try:
                held = line.began(decision, wait=True, task_id=task_id)
            except Exception as exc:  # no answer is no start (fail closed), as for a late body
                logger.warning("queue %r: could not ask whether a body's start still holds, waiting again: %s: %s",
                               line.name, type(exc).__name__, exc)  # fmt: skip
                return False
        done = line._monotonic()
        if ask and not held:
            logger.warning("queue %r: this process stood still after its body's report, and a later start came: "
                           "waiting again", line.name)  # fmt: skip
            return False
        if not ask and done - sent <= REPORT_AGAIN_S:
            _LAST_REPORT.line, _LAST_REPORT.decision, _LAST_REPORT.task_id, _LAST_REPORT.sent = (
                line, decision, task_id, done,
            )  # fmt: skip
            return True
        ask = not ask  # a slow send: ask next; an answer waited for: send once more without waiting
    return True


def _tell(line: Line, decision: Decision, task_id: str) -> bool:
    """Send the body's report without waiting for the answer; False (logged) if it could
    not be sent: the start stands where the store last placed it."""
    try:
        line.began(decision, task_id=task_id)
    except Exception as exc:
        logger.warning("queue %r: could not report a body's start: %s: %s", line.name, type(exc).__name__, exc)
        return False
    return True


class _LastReport(threading.local):
    """The report this thread (greenlet, on a green pool) sent last without waiting, until
    its body begins (:func:`still_holds`, :func:`report_again_if_late`)."""

    line: Line | None = None
    decision: Decision | None = None
    task_id: str = ""
    sent: float = 0.0


_LAST_REPORT = _LastReport()


def _stood_still(decision: Decision) -> bool:
    """Whether this process stood still since it reported ``decision`` without waiting (the
    record is this thread's, or greenlet's: one that belongs to another start says nothing)."""
    last = _LAST_REPORT
    return last.decision is decision and last.line is not None and last.line._monotonic() - last.sent > REPORT_AGAIN_S


def still_holds(decision: Decision) -> bool:
    """After the caller's own steps between the report and the body (a fair queue's
    release asked of another thread, which may take the GIL): a process that stood still
    since the report of ``decision`` was sent asks whether the start still holds, as a
    slow send does (:func:`_report`). False: the body must not begin now."""
    last = _LAST_REPORT
    if not _stood_still(decision):
        return True
    assert last.line is not None
    line, task_id = last.line, last.task_id
    last.line = last.decision = None
    return _report(line, decision, task_id, ask=True)


def report_again_if_late(decision: Decision | None) -> None:
    """The very last step before a body, after the caller's own (Celery's ``before_start``,
    the ``with`` of a slot): a process that stood still since the report of ``decision``
    was sent reports again, without waiting (the body can no longer be held back here), so
    the store places the start when its body begins, while it is still the last start."""
    last = _LAST_REPORT
    line = last.line
    if line is None or decision is None or last.decision is not decision:
        return
    stood = _stood_still(decision)
    last.line = last.decision = None
    if stood:
        _tell(line, decision, last.task_id)


def begin_body(
    line: Line, ledger_id: str, wait: Callable[[], Decision], begun: Callable[[], None] | None = None
) -> Decision:
    """Wait for a start (``wait()``, asked with ``reports``) and let its body begin: its
    lease held (renewed while the body runs), then the report, the last step before the
    body (:func:`body_may_begin`), then ``begun()``: work for another thread (a fair
    queue's next release) is asked for only then, since a thread woken before the report
    takes the GIL as the report is sent, and the body waits for it after the store placed
    its start. A start overtaken while this process stood still is given back
    (:func:`give_back_late_start`) and the wait begins again, for a fresh slot. Returns the
    start the body begins on."""
    while True:
        decision = wait()
        KEEPER.hold(line.backend, line.queue_names, decision.lease, run=decision.lease == ledger_id)
        if body_may_begin(line, decision, ledger_id):
            if begun is not None:
                begun()  # the woken thread waits for the GIL: this thread holds it into the body
            if still_holds(decision):
                return decision
        KEEPER.drop(line.backend, line.queue_names, decision.lease)
        give_back_late_start(line, ledger_id, decision)


def give_back_late_start(line: Line, task_id: str, decision: Decision) -> None:
    """A start whose body did not begin (:func:`body_may_begin` said no): recorded as
    finished LATE, not remembered (the task is still to run), its lease given back. Best
    effort: a lease not given back expires."""
    try:
        line.finish(task_id, "LATE", remember=False, lease=decision.lease)
    except Exception as exc:
        logger.warning("queue %r: could not give back the late start of %s: %s", line.name, task_id, exc)


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

MAX_COST = 10_000


def validate_cost(cost: object) -> int:
    """``cost`` if it is a whole number of slots from 1 to MAX_COST, else ConfigurationError."""
    if isinstance(cost, bool) or not isinstance(cost, int) or not 1 <= cost <= MAX_COST:
        raise ConfigurationError(f"a cost is a whole number of slots from 1 to {MAX_COST}, not {cost!r}")
    return cost


def late_reply_threshold(interval_us: int | None) -> float:
    """Seconds of round trip beyond which an authorization is re-stamped: 5% of the
    interval, within 0.25 to 2 ms (half the 10% a body may be late by, and above a
    loopback round trip)."""
    return max(0.00025, min((interval_us or 20_000) * 0.05 / 1e6, 0.002))


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
