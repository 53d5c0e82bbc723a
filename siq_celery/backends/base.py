"""The state-store interface.

A backend's methods are whole atomic operations of the model (claim, start, finish,
pause, ...), never get/set primitives: two workers racing through a backend must never
see a half-applied operation. Add a backend by subclassing :class:`Backend` (or
:class:`~siq_celery.backends.transactional.ModelBackend`, which runs :mod:`siq_celery.rules` inside a transaction you
provide) and registering its URL scheme with :func:`siq_celery.backends.register_backend`;
then run ``tests/contract`` against it.

All times are integer microseconds on the store's clock.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

from ..errors import ConfigurationError, SiqError, StoreUnavailableError
from ..keys import DEFAULT_KEY_PREFIX, QueueKeys, validate_key_prefix
from ..ledger import DEFAULT_LEDGER_MAX, LedgerRow, StartRecord
from ..lru import LRUCache
from ..parked import FairBacklog, FairTask, ParkedTask, Release
from ..types import NO_LIMITS, ClaimResult, Decision, Declared, Limits, LimitsOverride, QueueState, QueueStatus, Verdict

logger = logging.getLogger("siq_celery")


Clock = Callable[[], int]


#: Verdicts the store counts (the exporter's siq_duplicates_refused_total, siq_reclaims_total).
REFUSALS = (Verdict.DUPLICATE, Verdict.RECLAIM, Verdict.RUNNING)


#: Per-key queues whose idle expiry a client remembers; a queue in use is registered again
#: by each use (app_state.SiqState.queue), so the bound never drops one that is working.
IDLE_EXPIRY_REMEMBERED = 20_000


"""A clock returning microseconds since the Unix epoch (tests pin it)."""


DEFAULT_FINISHED_RETENTION_US = 24 * 3_600 * 1_000_000


DEFAULT_FINISHED_MAX = 1_000_000


RELEASE_LIMIT = 500  # parked tasks handed to one releaser at a time


RELEASE_LEASE_US = 60_000_000  # a releaser that died: its tasks go out again after this


#: How long the lease of a body whose process died is held (siq_lease_timeout): a copy of its
#: task starts after that; a live body's lease is renewed (client/leases.py) every third of it.
DEFAULT_LEASE_TIMEOUT_US = 10_000_000


def system_clock_us() -> int:
    return time.time_ns() // 1_000


class PendingClaim:
    """A claim whose answer may still be on its way (see :meth:`Backend.claim_later`).

    :meth:`result` returns it (once fetched, always the same); :meth:`discard` fetches and
    drops it, so a connection is never left with an unread reply."""

    def __init__(self, fetch: Callable[[], ClaimResult]) -> None:
        self._fetch: Callable[[], ClaimResult] | None = fetch
        self._result: ClaimResult | None = None

    def result(self) -> ClaimResult:
        if self._fetch is not None:
            fetch, self._fetch = self._fetch, None
            self._result = fetch()
        assert self._result is not None
        return self._result

    def discard(self) -> None:
        with contextlib.suppress(Exception):  # nothing waits for this answer any more
            self.result()


class Backend(ABC):
    """Atomic operations on the shared state of interval queues.

    ``clock``: ``None`` means the store's own clock (Redis ``TIME``; the host clock for
    SQLite and memory). Finished-task records (used to skip a redelivered copy of a task
    that already finished) are kept ``finished_retention_us`` and at most
    ``finished_max`` per queue. The ledger (:mod:`siq_celery.ledger`) keeps about the
    last ``ledger_max`` starts per queue (0: no ledger). ``max_lost_deliveries`` (0: no
    limit): a task id whose last that many authorized starts never finished is refused
    (:func:`siq_celery.rules.too_many_lost`); its count is kept like a finished record.
    ``lease_timeout_us``: a run lease or a concurrency lease taken by a start expires that long
    after the start or its last renewal (a body whose process died gives it back that way).
    """

    #: URL schemes this backend is registered for.
    schemes: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        *,
        clock: Clock | None = None,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        finished_retention_us: int = DEFAULT_FINISHED_RETENTION_US,
        finished_max: int = DEFAULT_FINISHED_MAX,
        ledger_max: int = DEFAULT_LEDGER_MAX,
        max_lost_deliveries: int = 0,
        lease_timeout_us: int = DEFAULT_LEASE_TIMEOUT_US,
    ) -> None:
        self.clock = clock
        self.lease_timeout_us = max(int(lease_timeout_us), 1)
        self.max_lost_deliveries = max(int(max_lost_deliveries), 0)
        self.key_prefix = validate_key_prefix(key_prefix)
        self.finished_retention_us = finished_retention_us
        self.finished_max = finished_max
        self.ledger_max = max(int(ledger_max), 0)
        self._keys_cache: dict[str, QueueKeys] = {}
        self._idle_expiry_us: LRUCache[str, int] = LRUCache(IDLE_EXPIRY_REMEMBERED)

    def expire_when_idle(self, queue: str, idle_us: int) -> None:
        """Let ``queue``'s state disappear ``idle_us`` after its last claim, start or
        finish (per-key queues: thousands of idle keys must cost nothing), unless it is
        paused or has parked tasks. It comes back, in a new epoch, on its next use. Only
        stores with expiring keys honour it (Redis); SQLite and memory keep one small
        row per queue."""
        self._idle_expiry_us[queue] = max(int(idle_us), 0)

    def idle_expiry_us(self, queue: str) -> int:
        return self._idle_expiry_us.get(queue) or 0

    @classmethod
    @abstractmethod
    def from_url(cls, url: str, **options: Any) -> Backend:
        """Build the backend from a URL (the scheme selected this class)."""

    def keys(self, queue: str) -> QueueKeys:
        """The queue's keys (validated once per queue name: this is on the hot path)."""
        keys = self._keys_cache.get(queue)
        if keys is None:
            keys = QueueKeys.for_queue(queue, self.key_prefix)
            if len(self._keys_cache) < 10_000:  # bounded: per-key queues may be many
                self._keys_cache[queue] = keys
        return keys

    # -- the atomic operations ------------------------------------------------------

    @abstractmethod
    def ensure(
        self, queue: str, interval_us: int, epoch: str, *, limits: Limits = NO_LIMITS
    ) -> tuple[QueueState, bool]:
        """Create the queue's state if missing (with ``epoch`` and ``limits``); return it
        and whether it was created. Never changes existing state."""

    @abstractmethod
    def claim(self, queue: str, count: int, interval_us: int, epoch: str, *, limits: Limits = NO_LIMITS) -> ClaimResult:
        """Issue ``count`` tickets; creates the state (``interval_us``, ``epoch``,
        ``limits``) if missing."""

    def claim_later(
        self, queue: str, count: int, interval_us: int, epoch: str, *, limits: Limits = NO_LIMITS
    ) -> PendingClaim:
        """Send a claim now and read its answer later, so that its round trip overlaps the
        caller's own work (a Celery producer builds its message meanwhile). The base
        implementation simply claims at once."""
        result = self.claim(queue, count, interval_us, epoch, limits=limits)
        return PendingClaim(lambda: result)

    @abstractmethod
    def start(
        self,
        queue: str,
        ticket: int,
        epoch: str,
        *,
        task_id: str | None,
        interval_us: int,
        new_epoch: str,
        record: StartRecord | None = None,
        cost: int = 1,
        limits: Limits = NO_LIMITS,
        lease: str = "",
        token: str = "",
        begin_wait_us: int = 0,
    ) -> Decision:
        """Decide (and, if authorized, record) the start of ``ticket``. A missing state is
        created with ``new_epoch`` and ``limits`` (so the answer is RECLAIM). With ``record``, an
        authorized start is written to the ledger in the same atomic step. ``cost``: the
        slots this start takes (see :func:`siq_celery.rules.start`). With a ``task_id``,
        an authorized start counts one more start of it without a finish, and a task id
        with ``max_lost_deliveries`` of them is answered LOST. In a queue with a concurrency
        cap an authorized start takes a lease under ``lease`` (default: a new member, see
        :meth:`lease_member`), for ``lease_timeout_us``: ``Decision.lease``. ``token``: the
        asking call's (one per wait_in_line call, sent with each of its asks): a start it was
        given already, whose reply was lost, is answered again as it was and charged once
        (:func:`siq_celery.rules.own_start`), where another asker is answered RUNNING.
        ``begin_wait_us``: the start's body will report when it began (:meth:`began`); later
        starts wait for the report, that long at most (0: it will not report)."""

    def start_all(
        self,
        queues: Sequence[str],
        tickets: Sequence[int],
        epochs: Sequence[str],
        *,
        task_id: str | None,
        interval_us: Sequence[int],
        new_epoch: str,
        record: StartRecord | None = None,
        cost: int = 1,
        limits: Sequence[Limits] | None = None,
        lease: str = "",
        token: str = "",
        begin_wait_us: int = 0,
    ) -> list[Decision]:
        """One start that must pass every queue of ``queues`` (ticket ``tickets[i]`` of
        epoch ``epochs[i]`` in each): authorized and recorded in all of them in one atomic
        step, or in none (see :func:`siq_celery.rules.start_all`). ``task_id`` is checked
        against the first queue's finished tasks (and ``token`` as in :meth:`start`, there).
        On Redis Cluster the queues must share a hash slot: name them ``{group}rest`` (see keys.py)."""
        raise ConfigurationError(f"{type(self).__name__} does not support several limits on one start")

    @abstractmethod
    def restamp(self, queue: str, epoch: str, started_us: int) -> int | None:
        """Move the queue's last start from ``started_us`` to now if it is still the last
        start of ``epoch`` (see :func:`siq_celery.rules.restamp`); the new time or None."""

    def began(self, queue: str, started_us: int, task_id: str = "", *, soon: bool = False) -> int | None:
        """The body of the start authorized at ``started_us`` (of ``task_id``) begins now:
        place that start at now (store time), if it is still the queue's last, pending
        start (see :func:`siq_celery.rules.began`); its new time, or None if it is not.
        The ledger records the report's time as the start's ``began_us`` when the body
        begins: when the start still held, or, ``soon`` (:meth:`began_soon`: the body did
        not wait for the answer), in any case."""
        raise ConfigurationError(f"{type(self).__name__} does not take reports of bodies that began")

    def began_soon(self, queue: str, started_us: int, task_id: str = "") -> None:
        """:meth:`began`, sent now and not waited for: the body begins while the report
        travels, and the store places the start when the report arrives. Best effort: a
        report lost leaves later starts waiting until the start's wait expires
        (:data:`siq_celery.rules.BEGIN_WAIT_US`). The base implementation reports at once."""
        with contextlib.suppress(SiqError):
            self.began(queue, started_us, task_id, soon=True)

    #: Whether :meth:`wait_for_wake` can wake a waiter (a start held by a full cap then
    #: waits in its process longer before it goes back to the broker: gate.full_hold).
    can_wake = False

    def wait_for_wake(self, queue: str, ticket: int, after_us: int, seconds: float) -> bool | None:
        """Wait up to ``seconds`` for a wake of ``queue`` published after ``after_us`` (store
        time) that lets ``ticket`` ask again: a lease was given back under a full cap, while
        the next ticket in line was ``ticket`` or a later one (a start
        without a place in the line, :data:`~siq_celery.rules.FREE`, takes any wake). True:
        woken; False: the time passed; None: this store (or this caller, another thread of
        the process waiting already) cannot be woken, and the caller sleeps instead. False
        may come up to a millisecond early (a socket's timeout is whole milliseconds): the
        caller naps what is left."""
        return None

    def wake_done(self, queue: str) -> None:
        """The start that waited for a wake of ``queue`` in this process has stopped waiting
        (authorized, deferred, or failed): its reader may let the queue's wakes go."""
        return None

    def restamp_soon(self, queue: str, epoch: str, started_us: int) -> None:
        """:meth:`restamp`, sent now and not waited for (a green pool's body starts at once:
        the re-stamp reaches the store about when the body starts). Best effort: a failure
        leaves the start as authorized. The base implementation re-stamps at once."""
        with contextlib.suppress(SiqError):
            self.restamp(queue, epoch, started_us)

    @abstractmethod
    def finish(
        self, queue: str, task_id: str, outcome: str = "SUCCESS", *, remember: bool = True, lease: str = ""
    ) -> None:
        """Record that ``task_id`` finished, so a redelivered copy is not run again (unless
        not ``remember``: a run that ended otherwise, a retry's or a back-off's), complete
        its ledger record with the finish time and ``outcome``, clear its count of starts
        without a finish, and give back its ``lease`` (default: the one named by ``task_id``,
        which its start took: :meth:`lease_member`), all in one step."""

    def renew_leases(self, queue: str, leases: Sequence[str]) -> int:
        """The bodies holding ``leases`` still run: each of them kept expires
        ``lease_timeout_us`` from now (one that expired already is not taken again); how
        many were renewed (:func:`siq_celery.rules.renew_leases`)."""
        raise ConfigurationError(f"{type(self).__name__} does not support leases")

    @staticmethod
    def lease_member(task_id: str | None, record: StartRecord | None = None, named: str = "") -> str:
        """The lease member of one start: its task id (a copy of it is not started while the
        lease is live: rules.running_copy); without one, ``named`` or the ledger's id (for
        people) and a token of its own."""
        if task_id:
            return task_id
        return named or f"{(record.task_id if record else None) or '-'}:{secrets.token_hex(6)}"

    @abstractmethod
    def ledger(self, queue: str, since_us: int | None = None, until_us: int | None = None) -> Iterator[LedgerRow]:
        """The queue's ledger rows whose start is in ``[since_us, until_us)``, oldest
        first by finish (a row comes when its finish is read), streamed."""

    @abstractmethod
    def pause(self, queue: str, epoch: str = "") -> QueueState:
        """Stop every start of the queue until resume. A queue with no state yet is created
        paused, in ``epoch`` (empty: a new one), with no interval known until the first
        declaration (:func:`siq_celery.rules.paused_new_state`)."""

    @abstractmethod
    def resume(self, queue: str, grace_us: int = 0) -> QueueState:
        """Unpause; the line continues ``grace_us`` from now (see :func:`siq_celery.rules.resume`).
        ConfigurationError for a queue paused before any declaration that still has no
        limit known (:func:`no_interval_yet`)."""

    @abstractmethod
    def set_interval(self, queue: str, interval_us: int | None, origin: str = "") -> QueueState:
        """An operator's override of the queue's interval (``interval_us``), recorded with
        ``origin`` and the store time; None clears it, back to what the code declares
        (see :func:`siq_celery.rules.override`)."""

    @abstractmethod
    def set_limits(self, queue: str, override: LimitsOverride | None, origin: str = "") -> QueueState:
        """An operator's override of some of the queue's limits (the kinds ``override``
        sets, merged into any earlier one), recorded with ``origin`` and the store time;
        None clears every override of them, back to what the code declares (see
        :func:`siq_celery.rules.override_limits`)."""

    @abstractmethod
    def declare(
        self,
        queue: str,
        interval_us: int,
        epoch: str,
        *,
        node: str = "",
        ttl_us: int = 0,
        origin: str = "",
        announce: bool = True,
        limits: Limits = NO_LIMITS,
    ) -> Declared:
        """The code declares ``interval_us`` and ``limits`` for ``queue`` (creating its
        state with ``epoch`` if missing), atomically with recomputing the effective interval
        and limits; see :func:`siq_celery.rules.declare` for ``node``, ``ttl_us`` and
        ``announce``."""

    @abstractmethod
    def backoff(self, queue: str, hold_us: int, keep_first: bool = False) -> QueueState:
        """No start of ``queue`` before ``hold_us`` from now (see :func:`siq_celery.rules.backoff`)."""

    @abstractmethod
    def reset(
        self, queue: str, interval_us: int | None, epoch: str, origin: str = "", *, limits: Limits = NO_LIMITS
    ) -> QueueState:
        """Start the queue's state afresh (see :func:`siq_celery.rules.reset`); creates it
        when missing if ``interval_us`` is given, else raises QueueNotFoundError. A given
        interval is pinned (:func:`siq_celery.rules.pin`), recorded with ``origin``. The
        limits and the window's starts are kept (``limits``: for a state created here)."""

    @abstractmethod
    def park(self, queue: str, epoch: str, tasks: Sequence[ParkedTask]) -> bool:
        """Keep ``tasks`` (tickets of ``epoch``) in the store, ordered by ticket, until their
        slot comes within the horizon. False, with nothing kept, if the queue's state is
        of another epoch or missing (the caller then publishes them as they are)."""

    @abstractmethod
    def release(
        self, queue: str, horizon_us: int, limit: int = RELEASE_LIMIT, lease_us: int = RELEASE_LEASE_US
    ) -> Release:
        """Lease to this caller, atomically, up to ``limit`` parked tasks whose slot is within
        ``horizon_us`` (none while paused), and any whose earlier release lease expired (a
        releaser that died before publishing them). The caller publishes each, then calls
        :meth:`unpark`; a task is handed out again only if that does not happen within
        ``lease_us``."""

    @abstractmethod
    def unpark(self, queue: str, task_ids: Sequence[str]) -> None:
        """Forget released tasks once they are published."""

    @abstractmethod
    def fair_park(
        self, queue: str, key: str, weight: int, tasks: Sequence[FairTask], interval_us: int, epoch: str,
        *, limits: Limits = NO_LIMITS,
    ) -> list[str]:  # fmt: skip
        """``tasks`` of fairness key ``key`` (its weight from now on) wait in the key's line
        of ``queue``, with no ticket (:func:`siq_celery.rules.fair_push`); the state is
        created if missing, as a claim creates it. A release hands them tickets in fair
        order (:func:`siq_celery.rules.fair_promote`) and then releases them as parked
        tasks. A task already waiting in a line waits once. A task still parked under its
        id (a retry whose last run's releaser has not yet forgotten it: its unpark by id
        would drop it) does not join: its id is returned, for the caller to send it again
        later. ValueError, with nothing written, for a cost below 1 or a weight outside
        1..MAX_FAIR_WEIGHT."""

    @abstractmethod
    def fair_backlog(self, queue: str, top: int = 10) -> FairBacklog:
        """What waits in the fair lines of ``queue`` (none for a queue without state): how
        many fairness keys have tasks waiting, how many tasks, and the ``top`` keys with the
        most waiting (ties: the smaller key first), each with its weight. Read only; on
        Redis its cost grows with ``top``, not with the keys waiting. ValueError for a
        negative ``top``."""

    @abstractmethod
    def parked_tasks(self, queue: str) -> list[ParkedTask]:
        """Every parked task of ``queue`` (leased ones included), by ticket."""

    @abstractmethod
    def status(self, queue: str) -> QueueStatus | None: ...

    def statuses(self, queues: Sequence[str]) -> list[QueueStatus | SiqError | None]:
        """:meth:`status` of each of ``queues``, in order; a queue whose state cannot be
        read gives its error in its place. StoreUnavailableError if the store is down.
        (A store with round trips to save reads them together.)"""
        out: list[QueueStatus | SiqError | None] = []
        for queue in queues:
            try:
                out.append(self.status(queue))
            except StoreUnavailableError:
                raise
            except SiqError as exc:
                out.append(exc)
        return out

    def starts_since(self, since: Mapping[str, int | None]) -> dict[str, list[LedgerRow]]:
        """For each queue of ``since``, its ledger rows that started at or after the time
        given (every row for None), finishes not joined. The exporter's incremental read."""
        return {queue: list(self.ledger(queue, since_us=us)) for queue, us in since.items()}

    @abstractmethod
    def queues(self, pattern: str = "*") -> list[str]:
        """Names of the queues with state, matching a glob ``pattern``, sorted."""

    def parked_queues(self) -> list[str]:
        """Names of the queues that hold parked tasks (for workers' release loops)."""
        return [name for name in self.queues() if (status := self.status(name)) is not None and status.parked]

    @abstractmethod
    def delete(self, queue: str) -> bool:
        """Remove all state of ``queue`` (tickets, finished records). True if anything was removed."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""

    def warm(self) -> None:  # noqa: B027 - optional hook
        """Connect and prepare now (a worker process does this at start, so that its first
        task is not late)."""

    def now_us(self) -> int:
        """The store's clock, in microseconds (the clock every decision is made on)."""
        return (self.clock or system_clock_us)()


def check_top(top: int) -> None:
    """ValueError unless ``top`` (keys a fair backlog lists) is 0 or more."""
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise ValueError(f"a fair backlog lists 0 or more keys, not {top!r}")


def no_interval_yet(queue: str) -> ConfigurationError:
    """The error of resuming a queue paused before any declaration, with no limit known."""
    return ConfigurationError(
        f"queue {queue!r} was paused before any worker declared it and has no interval yet: start a worker "
        f"(or run 'celery -A app siq sync'), or set one with 'siq set-interval {queue} 250ms', then resume"
    )
