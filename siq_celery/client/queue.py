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
import logging
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, ParamSpec, TypeVar

from ..backends import Backend, backend_from_url
from ..backends.base import PendingClaim
from ..broker import green
from ..broker.green import nap
from ..errors import ConfigurationError, StoreUnavailableError
from ..intervals import IntervalLike, format_interval, parse_duration
from ..keys import DEFAULT_KEY_PREFIX, validate_queue_name
from ..ledger import LedgerRow, StartRecord
from ..limits import Limit, QuotaLike, interval_and_limits
from ..parked import FairTask
from ..rules import BEGIN_WAIT_US
from ..types import US, ClaimResult, Decision, Ticket
from .body import begin_body, report_again_if_late
from .control import QueueControl, new_epoch
from .leases import KEEPER
from .reply_clock import ReplyClock
from .waiting import SlotTimeoutError, wait_in_line

logger = logging.getLogger("siq_celery")

P = ParamSpec("P")
R = TypeVar("R")

MAX_CLAIM = 100_000
MAX_RESTAMPS = 3


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


class IntervalQueue(QueueControl):
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
