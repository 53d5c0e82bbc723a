"""Values passed between the queue, its backends and their callers.

Times are integer microseconds on the *store's* clock (``*_us``); the properties that
return seconds are for people and for Celery's countdowns.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

US = 1_000_000


@dataclass
class QueueState:
    """The shared state of one queue (see docs/design.md, "The model").

    ``anchor_us`` is the slot at which ticket ``current`` was due; ticket ``t > current``
    is due at ``anchor_us + (t - current) * interval_us``. ``last_start_us`` is the store
    time of the last slot used: no start is authorized before it plus the interval (a start
    of cost c counts as using its last slot c - 1 intervals after it began; a back-off moves
    it on). ``started_us`` is when the last start was authorized (0: none yet), and
    ``held_until_us`` when the last back-off ends: what people are shown, never part of a
    decision.

    The queue's other limits (:class:`Limits`): ``burst`` starts may come closer than the
    interval to catch up (GCRA: ``last_start_us + interval_us`` is the theoretical arrival
    time, a start may come ``burst`` intervals before it); ``quota`` cost units at most in
    any sliding window of ``window_us`` (0: none), counted over the starts the store keeps
    apart from the state (the queue's window); at most ``concurrency`` bodies running at once
    (0: no cap), counted over the leases the store keeps apart from the state (the queue's
    leases: one per running body, with an expiry).

    A start whose body reports when it began (:func:`siq_celery.rules.line.began`) leaves
    ``pending_us``: until then, at the latest, no later start is authorized, so the next
    start counts from the body's own start, not from its authorization (0: none pending;
    minus the start's authorization once its body reported); ``pending_due_us`` is the last
    slot used before that start plus the interval then (its report re-computes the start's
    place from it, as if it had been authorized when its body began).
    """

    epoch: str
    interval_us: int
    ticket: int
    current: int
    anchor_us: int
    last_start_us: int
    paused: bool
    started_us: int = 0
    held_until_us: int = 0
    burst: int = 0
    quota: int = 0
    window_us: int = 0
    concurrency: int = 0
    margin_us: int = 0
    # Not compared, nor shown by the status: what a start waits for, not what the queue is.
    pending_us: int = field(default=0, compare=False)
    pending_due_us: int = field(default=0, compare=False)

    @property
    def limits(self) -> Limits:
        """The limits as declared: the window without the margin (``window_us`` holds both)."""
        return Limits(self.burst, self.quota, self.window_us - self.margin_us if self.quota else 0, self.concurrency,
                      self.margin_us)  # fmt: skip

    @property
    def declared_interval_us(self) -> int:
        """The interval without the margin (``interval_us``, the spacing in force, holds both)."""
        return self.interval_us - self.margin_us

    @property
    def backlog(self) -> int:
        """Tickets claimed but not yet passed by ``current`` (some may be lost)."""
        return self.ticket - self.current


@dataclass(frozen=True)
class Limits:
    """A queue's limits beyond its interval, as the store keeps them: ``burst`` (starts that
    may come closer than the interval, 0: strict spacing), a window quota of ``quota``
    cost units in any ``window_us`` (0: none) and a concurrency cap of ``concurrency``
    bodies running at once (0: none). See docs/design.md, "The model" (Burst, Window quota,
    Concurrency cap)."""

    burst: int = 0
    quota: int = 0
    window_us: int = 0
    concurrency: int = 0
    #: Added to the spacing and to the quota's window (docs/design.md, "Margin").
    margin_us: int = 0


NO_LIMITS = Limits()


@dataclass(frozen=True)
class LimitsOverride:
    """An operator's override of a queue's limits, kind by kind (``siq set-limits``): a
    kind left ``None`` follows the declarations; ``burst`` 0, ``quota`` 0 (with
    ``window_us`` 0) and ``concurrency`` 0 lift that kind (strict spacing, no quota, no
    cap). See docs/design.md, "The model" (the interval's and the limits' sources)."""

    burst: int | None = None
    quota: int | None = None
    window_us: int = 0
    concurrency: int | None = None
    margin_us: int | None = None

    def __bool__(self) -> bool:
        return (
            self.burst is not None or self.quota is not None or self.concurrency is not None
            or self.margin_us is not None
        )  # fmt: skip

    def merged(self, other: LimitsOverride) -> LimitsOverride:
        """This override with the kinds ``other`` sets replaced by ``other``'s."""
        burst = self.burst if other.burst is None else other.burst
        quota, window = (self.quota, self.window_us) if other.quota is None else (other.quota, other.window_us)
        concurrency = self.concurrency if other.concurrency is None else other.concurrency
        margin = self.margin_us if other.margin_us is None else other.margin_us
        return LimitsOverride(burst, quota, window, concurrency, margin)

    def apply(self, limits: Limits) -> Limits:
        """``limits`` with the overridden kinds replaced."""
        return Limits(
            limits.burst if self.burst is None else self.burst,
            limits.quota if self.quota is None else self.quota,
            limits.window_us if self.quota is None else self.window_us,
            limits.concurrency if self.concurrency is None else self.concurrency,
            limits.margin_us if self.margin_us is None else self.margin_us,
        )


NO_OVERRIDE = LimitsOverride()


@dataclass(frozen=True)
class NodeDeclaration:
    """The interval one live worker node declares for a queue (its code's ``interval=``)
    and its other limits (``None``: a node of an earlier version, which declared the
    interval only), counted until ``expires_us`` unless the node renews it."""

    node: str
    interval_us: int
    expires_us: int
    limits: Limits | None = None


@dataclass(frozen=True)
class IntervalSources:
    """Where a queue's effective interval (``QueueState.interval_us``) and limits
    (``QueueState.limits``) come from.

    ``declared_us``: what the code said last (the last worker start, or ``siq sync``, with
    a new declaration), 0 if never declared. ``override_us``: an operator's runtime
    override (``set-interval``), 0 if none. ``nodes``: the live workers' declarations.
    The effective interval is the override if set, else the slowest live declaration,
    else the last declaration (:func:`siq_celery.rules.declarations.effective_interval`).

    ``declared_limits``: the limits the code said last (None: never declared, or declared
    by an earlier version). ``limits_override``: an operator's override of some kinds
    (``set-limits``), recorded with ``limits_override_by`` and ``limits_override_at_us``.
    The effective limits are, kind by kind, the override if set, else the strictest of
    the live declarations, else the last declaration, else what the state holds
    (:func:`siq_celery.rules.declarations.effective_limits`).
    """

    declared_us: int = 0
    declared_by: str = ""
    declared_at_us: int = 0
    override_us: int = 0
    override_by: str = ""
    override_at_us: int = 0
    nodes: tuple[NodeDeclaration, ...] = ()
    declared_limits: Limits | None = None
    limits_override: LimitsOverride = NO_OVERRIDE
    limits_override_by: str = ""
    limits_override_at_us: int = 0

    def live(self, now_us: int) -> tuple[NodeDeclaration, ...]:
        return tuple(n for n in self.nodes if n.expires_us > now_us)


@dataclass(frozen=True)
class StartCounts:
    """What the store counted of a queue's authorized starts, in the same atomic step as
    each start (:func:`siq_celery.rules.counters.start_counts`): counters that never go down while
    the queue exists, whoever reads them and however often. ``lateness_buckets``: the
    starts per lateness bucket (``rules.LATENESS_BUCKETS_US``, then one past the last),
    not cumulative."""

    starts: int = 0
    deferrals: int = 0
    gaps_below_interval: int = 0
    lateness_sum_us: int = 0
    lateness_buckets: tuple[int, ...] = ()


@dataclass(frozen=True)
class Declared:
    """What a declaration did (see :meth:`Backend.declare`): the declared and effective
    intervals before and after, and the override it replaced (``replaced_override_us``
    0: none); the same for the limits (``old_declared_limits`` None: none declared
    before; ``replaced_limits``: the kinds of the limits override it replaced). ``created``:
    the queue's state was created by it."""

    created: bool
    old_declared_us: int
    declared_us: int
    old_interval_us: int
    interval_us: int
    replaced_override_us: int = 0
    replaced_override_by: str = ""
    old_declared_limits: Limits | None = None
    declared_limits: Limits | None = None
    old_limits: Limits = NO_LIMITS
    limits: Limits = NO_LIMITS
    replaced_limits: LimitsOverride = NO_OVERRIDE
    replaced_limits_by: str = ""

    @property
    def declaration_changed(self) -> bool:
        return self.old_declared_us != self.declared_us

    @property
    def limits_declaration_changed(self) -> bool:
        return self.old_declared_limits != self.declared_limits


@dataclass(frozen=True)
class QueueStatus:
    """A snapshot of one queue for people and dashboards."""

    queue: str
    state: QueueState
    now_us: int
    finished: int
    parked: int = 0  #: tasks parked in the store (beyond the horizon), releasing ones included
    sources: IntervalSources = IntervalSources()  #: where the interval comes from
    duplicates_refused: int = 0  #: starts refused because the task id had finished
    reclaims: int = 0  #: starts answered RECLAIM (the ticket's epoch was gone)
    counts: StartCounts = StartCounts()  #: the store's counters of authorized starts
    window_used: int = 0  #: cost units started in the window ending now (a quota's use)
    in_flight: int = 0  #: live leases: bodies running now (a concurrency cap's use)
    #: When the window quota lets the head of the line (the next ticket) start, as a start of
    #: cost 1 (0: the window allows it now, or there is no quota): rules.status_window.
    window_next_us: int = 0
    #: When the window quota lets the last ticket claimed start (0: as above, or no backlog).
    window_last_us: int = 0
    #: Fair shares: the fairness keys with tasks waiting in their lines, and those tasks
    #: (counted in ``parked`` too); who waits most: Backend.fair_backlog.
    fair_keys: int = 0
    fair_tasks: int = 0

    @property
    def next_start_us(self) -> int:
        """Earliest store time at which the next ticket could start (now, if it could start
        at once): its slot by the interval, the rate cap less the burst credit (GCRA), and
        the window quota, as a claim or a start computes it (rules.slot_of, window_slot). A
        pause, a full concurrency cap and an outage's settle are not counted."""
        s = self.state
        cap = s.last_start_us + s.interval_us - s.burst * s.interval_us
        return max(s.anchor_us + s.interval_us, cap, self.window_next_us, self.now_us)

    @property
    def held_until_us(self) -> int:
        """When the back-off holding the queue ends, or 0 if none holds it now. The slots a
        weighted start takes are not a hold, nor is a pause."""
        s = self.state
        return s.held_until_us if not s.paused and s.held_until_us > self.now_us else 0

    def as_dict(self) -> dict[str, object]:
        s, src = self.state, self.sources
        return {
            "queue": self.queue,
            "interval_s": s.declared_interval_us / US,
            "ticket": s.ticket,
            "current": s.current,
            "backlog": s.backlog,
            "paused": s.paused,
            "epoch": s.epoch,
            "last_start": s.started_us / US if s.started_us else None,
            "next_start": self.next_start_us / US,
            "held_until": self.held_until_us / US if self.held_until_us else None,
            "now": self.now_us / US,
            "finished_recorded": self.finished,
            "parked": self.parked,
            "fair_keys_waiting": self.fair_keys,
            "fair_tasks_waiting": self.fair_tasks,
            "duplicates_refused": self.duplicates_refused,
            "reclaims": self.reclaims,
            "starts_counted": self.counts.starts,
            "declared_s": src.declared_us / US if src.declared_us else None,
            "declared_by": src.declared_by or None,
            "override_s": src.override_us / US if src.override_us else None,
            "override_by": src.override_by or None,
            "override_at": src.override_at_us / US if src.override_us else None,
            "declarations": {n.node: n.interval_us / US for n in src.live(self.now_us)},
            "burst": s.burst,
            "quota": s.quota or None,
            "window_s": s.limits.window_us / US if s.quota else None,
            "window_used": self.window_used if s.quota else None,
            "concurrency": s.concurrency or None,
            "in_flight": self.in_flight if s.concurrency else None,
            "margin_s": s.margin_us / US if s.margin_us else None,
            "declared_limits": _limits_dict(src.declared_limits),
            "limits_override": _override_dict(src.limits_override),
            "limits_override_by": src.limits_override_by or None,
            "limits_override_at": src.limits_override_at_us / US if src.limits_override else None,
            "limit_declarations": {
                n.node: _limits_dict(n.limits) for n in src.live(self.now_us) if n.limits is not None
            },
        }


def _limits_dict(limits: Limits | None) -> dict[str, object] | None:
    if limits is None:
        return None
    return {
        "burst": limits.burst,
        "quota": limits.quota or None,
        "window_s": limits.window_us / US if limits.quota else None,
        "concurrency": limits.concurrency or None,
        **({"margin_s": limits.margin_us / US} if limits.margin_us else {}),
    }


def _override_dict(override: LimitsOverride) -> dict[str, object] | None:
    """The kinds overridden (a lifted quota or cap: 0)."""
    if not override:
        return None
    out: dict[str, object] = {}
    if override.burst is not None:
        out["burst"] = override.burst
    if override.quota is not None:
        out["quota"] = override.quota
        out["window_s"] = override.window_us / US if override.quota else None
    if override.concurrency is not None:
        out["concurrency"] = override.concurrency
    if override.margin_us is not None:
        out["margin_s"] = override.margin_us / US
    return out


@dataclass(frozen=True)
class ClaimResult:
    """Tickets ``first .. first + count - 1`` of one epoch, and what is needed to estimate
    each one's slot without another round trip: ``max(base_us + (n - first) * interval_us,
    floor_us)``, and, for a queue with a window quota, the time the window lets ticket
    ``first + i`` be the last unit of a start (``window_us[i]``; empty: the window binds
    none of them)."""

    first: int
    count: int
    epoch: str
    base_us: int
    floor_us: int
    interval_us: int
    now_us: int
    window_us: tuple[int, ...] = ()

    def spacing_us(self, number: int) -> int:
        """Ticket ``number``'s estimate by the interval alone."""
        return max(self.base_us + (number - self.first) * self.interval_us, self.floor_us)

    def estimate_us(self, number: int, cost: int = 1) -> int:
        spacing = self.spacing_us(number)
        last = number + cost - 1 - self.first  # the start's last unit is the one the window must fit
        if 0 <= last < len(self.window_us):
            return max(spacing, self.window_us[last])
        return spacing


@dataclass(frozen=True)
class Ticket:
    """One claimed place in a queue's line."""

    queue: str
    number: int
    epoch: str
    estimated_start_us: int  #: store clock, microseconds since the Unix epoch
    claimed_at_us: int  #: store clock at the claim
    interval_us: int = 0  #: the queue's effective interval at the claim (0: not known)
    window_bound: bool = False  #: the window quota, not the spacing, sets the estimate

    @property
    def estimated_start(self) -> float:
        """Estimated start, seconds since the Unix epoch on the store's clock."""
        return self.estimated_start_us / US

    @property
    def delay(self) -> float:
        """Seconds from the claim to the estimated start (clock-skew free: use this for
        countdowns, not ``estimated_start - time.time()``)."""
        return (self.estimated_start_us - self.claimed_at_us) / US


class Verdict(enum.Enum):
    AUTHORIZED = "authorized"  #: start now
    WAIT = "wait"  #: too early: ask again after ``wait`` seconds
    PAUSED = "paused"  #: the queue is paused: ask again later
    RECLAIM = "reclaim"  #: the ticket is not of this state's life (epoch changed): claim anew
    DUPLICATE = "duplicate"  #: this task id already finished: do not run it again
    LOST = "lost"  #: this task id's last starts never finished (their worker died): refuse it
    #: a copy of this task id runs (its run's lease is live): ask again after ``wait`` (its
    #: expiry, unless renewed); by then it finished (DUPLICATE) or its holder died
    RUNNING = "running"


@dataclass(frozen=True)
class Decision:
    """The store's answer to "may ticket N start now?"."""

    verdict: Verdict
    ticket: int
    now_us: int
    wait_us: int = 0  #: WAIT: microseconds until the slot; PAUSED: distance behind the head
    slot_us: int = 0  #: with AUTHORIZED/WAIT: the slot the start was measured against
    interval_us: int = 0  #: the queue's stored interval when it answered (0: not known)
    #: AUTHORIZED in a queue with a concurrency cap: the lease taken (give it back with the
    #: finish; renew it while the body runs). "" without one.
    lease: str = ""
    #: WAIT: the slot has come but the concurrency cap is full (``wait_us`` is a short poll).
    full: bool = False
    #: AUTHORIZED, from a wait that reports its body's start: the asker's monotonic clock
    #: when it sent the ask that was authorized (the authorization is no older than that).
    asked_at: float = field(default=0.0, compare=False)
    #: AUTHORIZED, as ``asked_at``: when the answer came back. An answer authorized ahead of
    #: its slot (``wait_us``: how far ahead when the store answered) holds the body until
    #: ``answered_at`` + ``wait_us``, never before the slot on the store's clock.
    answered_at: float = field(default=0.0, compare=False)
    #: AUTHORIZED ahead of its slot, with the asker's clock read against the store's
    #: (:class:`~siq_celery.client.reply_clock.ReplyClock`): when, on the asker's monotonic clock, the slot
    #: comes on the store's, at the latest; never after ``answered_at`` + ``wait_us``. 0: not known.
    slot_at: float = field(default=0.0, compare=False)

    @property
    def authorized(self) -> bool:
        return self.verdict is Verdict.AUTHORIZED

    @property
    def wait(self) -> float:
        """Seconds to wait before asking again (WAIT only)."""
        return self.wait_us / US

    @property
    def lateness(self) -> float:
        """Seconds between the slot and the authorized start (AUTHORIZED only)."""
        return (self.now_us - self.slot_us) / US
