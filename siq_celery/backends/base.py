"""The state-store interface.

A backend's methods are whole atomic operations of the model (claim, start, finish,
pause, ...), never get/set primitives: two workers racing through a backend must never
see a half-applied operation. Add a backend by subclassing :class:`Backend` (or
:class:`ModelBackend`, which runs :mod:`siq_celery.rules` inside a transaction you
provide) and registering its URL scheme with :func:`siq_celery.backends.register_backend`;
then run ``tests/contract`` against it.

All times are integer microseconds on the store's clock.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import logging
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, replace
from typing import Any, ClassVar, Protocol

from .. import rules
from ..errors import ConfigurationError, CorruptStateError, QueueNotFoundError, SiqError, StoreUnavailableError
from ..keys import DEFAULT_KEY_PREFIX, QueueKeys, validate_key_prefix
from ..ledger import DEFAULT_LEDGER_MAX, LedgerRow, StartRecord
from ..logs import Throttle
from ..lru import LRUCache
from ..messages import with_fair_share
from ..types import (
    NO_LIMITS,
    ClaimResult,
    Decision,
    Declared,
    FairBacklog,
    FairTask,
    IntervalSources,
    Limits,
    LimitsOverride,
    NodeDeclaration,
    ParkedTask,
    QueueState,
    QueueStatus,
    Release,
    Verdict,
)

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


def state_from_fields(queue: str, key: str, fields: Mapping[str, Any]) -> QueueState:
    """Build a QueueState from stored fields, or raise CorruptStateError naming the field."""

    def number(name: str) -> int:
        value = fields.get(name)
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise CorruptStateError(queue, key, name, value)
        try:
            return int(value)
        except ValueError:
            raise CorruptStateError(queue, key, name, value) from None

    epoch = fields.get("epoch")
    if isinstance(epoch, bytes):
        epoch = epoch.decode("utf-8", "replace")
    if not isinstance(epoch, str) or not epoch:
        raise CorruptStateError(queue, key, "epoch", epoch)
    paused = number("paused")
    state = QueueState(
        epoch=epoch,
        interval_us=number("interval_us"),
        ticket=number("ticket"),
        current=number("current"),
        anchor_us=number("anchor_us"),
        last_start_us=number("last_start_us"),
        paused=bool(paused),
    )
    if state.interval_us <= 0:
        raise CorruptStateError(queue, key, "interval_us", state.interval_us)
    if paused not in (0, 1):
        raise CorruptStateError(queue, key, "paused", paused)
    return state


class FairMessages(Protocol):
    """The messages of a fair queue's waiting tasks, by task id."""

    def get(self, task_id: str) -> str | None: ...

    def keep(self, task_id: str, message: str) -> None: ...

    def take(self, task_id: str) -> str:
        """The message, forgotten here (it moves to the parked line with its ticket)."""


class Transaction(ABC):
    """One queue's state inside an atomic section of a :class:`ModelBackend`."""

    state: QueueState | None
    now_us: int

    @abstractmethod
    def window(self) -> rules.Window:
        """The queue's window: the starts a window quota counts (kept across a reset)."""

    @abstractmethod
    def leases(self) -> rules.Leases:
        """The queue's run and concurrency leases (kept across a reset)."""

    @abstractmethod
    def is_finished(self, task_id: str) -> bool: ...

    @abstractmethod
    def add_finished(self, task_id: str) -> None: ...

    @abstractmethod
    def finished_count(self) -> int: ...

    @abstractmethod
    def unfinished_starts(self, task_id: str) -> int:
        """Authorized starts of ``task_id`` since its last finish (0 once its last one is
        older than the finished records' retention)."""

    @abstractmethod
    def count_unfinished(self, task_id: str) -> None:
        """One more authorized start of ``task_id`` without a finish; older counts past
        the retention, or beyond the most records kept, are dropped."""

    @abstractmethod
    def clear_unfinished(self, task_id: str) -> None: ...

    @abstractmethod
    def record_start(self, row: LedgerRow) -> None: ...

    @abstractmethod
    def count_refusal(self, verdict: str) -> None:
        """One more start refused with ``verdict`` (``duplicate`` or ``reclaim``)."""

    @abstractmethod
    def refusals(self) -> tuple[int, int]:
        """(duplicates refused, reclaims) counted so far."""

    @abstractmethod
    def count_start(self, added: Mapping[str, int], start_us: int) -> None:
        """Add ``added`` to the queue's counters of authorized starts and set
        ``rules.LAST_COUNTED`` to ``start_us`` (see :func:`siq_celery.rules.start_counts`)."""

    @abstractmethod
    def start_counts(self) -> dict[str, int]:
        """The queue's counters of authorized starts, field -> number (none: empty)."""

    @abstractmethod
    def park(self, tasks: Sequence[ParkedTask]) -> None: ...

    @abstractmethod
    def leasable(self, cutoff: int | None, now_us: int, limit: int) -> list[ParkedTask]:
        """Parked tasks with an expired lease, then unleased ones with ticket <= cutoff, by ticket."""

    @abstractmethod
    def lease(self, task_ids: Sequence[str], until_us: int) -> None: ...

    @abstractmethod
    def unpark(self, task_ids: Sequence[str]) -> None: ...

    @abstractmethod
    def parked_count(self) -> int: ...

    @abstractmethod
    def is_parked(self, task_id: str) -> bool:
        """Whether ``task_id`` is parked under a ticket (leased to a releaser or not)."""

    @abstractmethod
    def fair_lines(self) -> rules.FairLines:
        """The queue's fair lines (kept across a reset)."""

    @abstractmethod
    def fair_messages(self) -> FairMessages:
        """The messages of the tasks waiting in the fair lines, by task id."""

    @abstractmethod
    def fair_backlog(self, top: int) -> FairBacklog:
        """What waits in the fair lines (:meth:`Backend.fair_backlog`), read only."""

    @abstractmethod
    def renumber_parked(self) -> int:
        """Number the parked tasks 1..n in their order (a reset's new life); n."""

    @abstractmethod
    def record_began(self, task_id: str, start_us: int, began_us: int) -> None:
        """Give the latest ledger row of ``task_id`` ("": a start without one) authorized at
        ``start_us`` its ``began_us``."""

    @abstractmethod
    def record_finish(self, task_id: str, outcome: str, lease: str = "", returned: bool = False) -> None:
        """Complete the ledger row of the start that took ``lease`` (if any, still
        unfinished), else the latest ledger row of ``task_id`` if unfinished; ``returned``:
        this finish gave the lease back (:func:`siq_celery.ledger.complete`)."""

    @abstractmethod
    def sources(self) -> IntervalSources:
        """Where the queue's interval comes from (declarations, override)."""

    @abstractmethod
    def save_sources(self, sources: IntervalSources) -> None: ...

    @abstractmethod
    def delete(self) -> bool: ...


class ModelBackend(Backend):
    """A backend that runs :mod:`siq_celery.rules` on state loaded inside a transaction.

    Subclasses provide :meth:`transactions` (load, yield, write back on success; several
    queues at once for a start with several limits) and :meth:`queues`; every operation
    is then implemented once, here.
    """

    def _woke(self, queue: str, next_ticket: int, now_us: int) -> None:
        """A wake of ``queue`` (:meth:`wait_for_wake`), inside the step that freed the line:
        the memory store's waiters are woken; others poll."""

    @abstractmethod
    def transactions(
        self, queues: Sequence[str], *, replace_corrupt: bool = False
    ) -> AbstractContextManager[list[Transaction]]:
        """Lock the queues' states together, yield one transaction each, and write every
        ``tx.state`` back on a clean exit (nothing on an error).

        Corrupt stored state raises CorruptStateError, unless ``replace_corrupt`` (used by
        reset, the way out of corruption) makes it load as missing."""

    @contextlib.contextmanager
    def transaction(self, queue: str, *, replace_corrupt: bool = False) -> Iterator[Transaction]:
        """:meth:`transactions` of one queue."""
        with self.transactions([queue], replace_corrupt=replace_corrupt) as (tx,):
            yield tx

    @contextlib.contextmanager
    def _following(self, queues: Sequence[str], *, replace_corrupt: bool = False) -> Iterator[list[Transaction]]:
        """:meth:`transactions` whose states' interval follows the expiry of node
        declarations (:func:`siq_celery.rules.follow_expiry`): for the operations that
        decide by the interval."""
        with self.transactions(queues, replace_corrupt=replace_corrupt) as txs:
            for tx in txs:
                if tx.state is not None:
                    followed = rules.follow_expiry(tx.state, tx.sources(), tx.now_us)
                    if followed is not None:
                        tx.save_sources(followed)
            yield txs

    @contextlib.contextmanager
    def _following_one(self, queue: str, *, replace_corrupt: bool = False) -> Iterator[Transaction]:
        with self._following([queue], replace_corrupt=replace_corrupt) as (tx,):
            yield tx

    def ensure(
        self, queue: str, interval_us: int, epoch: str, *, limits: Limits = NO_LIMITS
    ) -> tuple[QueueState, bool]:
        with self.transaction(queue) as tx:
            if tx.state is not None:
                return _copy(tx.state), False
            tx.state = _new_state(tx, interval_us, epoch, limits)
            return _copy(tx.state), True

    def _created(
        self, tx: Transaction, queue: str, interval_us: int, epoch: str, limits: Limits = NO_LIMITS
    ) -> QueueState:
        if tx.state is None:
            if interval_us <= 0:
                raise QueueNotFoundError(f"queue {queue!r} has no state in this store and no interval was given")
            tx.state = _new_state(tx, interval_us, epoch, limits)
        return tx.state

    @staticmethod
    def _window(tx: Transaction, state: QueueState) -> rules.Window | None:
        return tx.window() if state.quota else None

    def _lease_taken(
        self, states: Sequence[QueueState], task_id: str | None, member: str, now_us: int
    ) -> tuple[str, int] | None:
        """The lease a start takes if authorized: its run's, named by its task id (a copy is
        not started while it is live: rules.running_copy), or, without a task id, one only
        under a concurrency cap (in any of ``states``)."""
        taken = task_id or any(state.concurrency for state in states)
        return (member, now_us + self.lease_timeout_us) if taken else None

    @staticmethod
    def _run_token(task_id: str | None, member: str, token: str) -> str:
        """The token kept as the owner of a start's lease: only the run's (named by its task id)."""
        return token if task_id and member == task_id else ""

    def claim(self, queue: str, count: int, interval_us: int, epoch: str, *, limits: Limits = NO_LIMITS) -> ClaimResult:
        with self._following_one(queue) as tx:
            state = self._created(tx, queue, interval_us, epoch, limits)
            return rules.claim(state, count, tx.now_us, self._window(tx, state))

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
        member = self.lease_member(task_id, record, lease)
        with self._following_one(queue) as tx:
            state = self._created(tx, queue, interval_us, new_epoch, limits)
            finished = task_id is not None and tx.is_finished(task_id)
            lost = self._lost(tx, task_id)
            leases = tx.leases()
            token = self._run_token(task_id, member, token)
            own = rules.own_start(leases, task_id, token, tx.now_us)
            decision = rules.start(
                state, ticket, epoch, tx.now_us, finished=finished, cost=cost, lost=lost,
                window=self._window(tx, state), leases=leases,
                lease=self._lease_taken([state], task_id, member, tx.now_us),
                running_us=rules.running_copy(leases, task_id, tx.now_us), token=token, own=own,
                begin_wait_us=begin_wait_us,
            )  # fmt: skip
            if own is not None:  # given again: recorded and counted when it was first given
                return decision
            if task_id is not None and self.max_lost_deliveries and decision.authorized:
                tx.count_unfinished(task_id)
            if decision.verdict in REFUSALS:
                tx.count_refusal(decision.verdict.value)
            if decision.authorized:
                _count_start(tx, decision, record)
            if record is not None and self.ledger_max and decision.authorized:
                tx.record_start(self._ledger_row(queue, state, ticket, task_id, record, decision, cost))
            return decision

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
        each = list(limits) if limits is not None else [NO_LIMITS] * len(queues)
        member = self.lease_member(task_id, record, lease)
        with self._following(queues) as txs:
            states = [
                self._created(tx, q, i, new_epoch, lim)
                for tx, q, i, lim in zip(txs, queues, interval_us, each, strict=True)
            ]
            finished = task_id is not None and txs[0].is_finished(task_id)
            lost = self._lost(txs[0], task_id)
            leases = [tx.leases() for tx in txs]
            now = txs[0].now_us
            token = self._run_token(task_id, member, token)
            own = rules.own_start(leases[0], task_id, token, now)
            decisions = rules.start_all(
                states, list(tickets), list(epochs), now, finished=finished, cost=cost, lost=lost,
                windows=[self._window(tx, state) for tx, state in zip(txs, states, strict=True)], leases=leases,
                lease=self._lease_taken(states, task_id, member, now),
                running_us=rules.running_copy(leases[0], task_id, now), token=token, own=own,
                begin_wait_us=begin_wait_us,
            )  # fmt: skip
            if own is not None:  # given again: recorded and counted when it was first given
                return decisions
            if task_id is not None and self.max_lost_deliveries and decisions[0].authorized:
                txs[0].count_unfinished(task_id)
            for tx, d in zip(txs, decisions, strict=True):
                if d.verdict in REFUSALS:
                    tx.count_refusal(d.verdict.value)
                if d.authorized:  # in every queue, or in none
                    _count_start(tx, d, record)
            if record is not None and self.ledger_max and decisions[0].authorized:
                for tx, queue, state, d in zip(txs, queues, states, decisions, strict=True):
                    tx.record_start(self._ledger_row(queue, state, d.ticket, task_id, record, d, cost))
            return decisions

    def _ledger_row(
        self, queue: str, state: QueueState, ticket: int, task_id: str | None, record: StartRecord, d: Decision,
        cost: int,
    ) -> LedgerRow:  # fmt: skip
        """The ledger row of an authorized start: who started, the slot it met, and the
        limits in force (with the lease it took under a concurrency cap, if any: a run's lease
        without a cap is not the audit's business)."""
        return LedgerRow(
            queue, state.epoch, ticket, task_id or record.task_id, record.task_name, d.slot_us, d.now_us,
            state.interval_us, deferrals=record.deferrals, host=record.host, pid=record.pid, cost=cost,
            burst=state.burst, quota=state.quota, window_us=state.window_us, concurrency=state.concurrency,
            lease_us=self.lease_timeout_us if d.lease and state.concurrency else 0, fair_key=record.fair_key,
            fair_tag=record.fair_tag, fair_weight=record.fair_weight,
            lease=d.lease if d.lease and state.concurrency else None,
        )  # fmt: skip

    def _lost(self, tx: Transaction, task_id: str | None) -> bool:
        if task_id is None or not self.max_lost_deliveries:
            return False
        return rules.too_many_lost(tx.unfinished_starts(task_id), self.max_lost_deliveries)

    def restamp(self, queue: str, epoch: str, started_us: int) -> int | None:
        with self.transaction(queue) as tx:
            if tx.state is None:
                return None
            return rules.restamp(tx.state, epoch, started_us, tx.now_us, self._window(tx, tx.state))

    def began(self, queue: str, started_us: int, task_id: str = "", *, soon: bool = False) -> int | None:
        with self.transaction(queue) as tx:
            if tx.state is None:
                return None
            at = rules.began(tx.state, started_us, tx.now_us, self._window(tx, tx.state))
            if self.ledger_max and (at is not None or soon):
                tx.record_began(task_id, started_us, tx.now_us if at is None else at)
            return at

    def finish(
        self, queue: str, task_id: str, outcome: str = "SUCCESS", *, remember: bool = True, lease: str = ""
    ) -> None:
        lease = lease or task_id  # a run's lease is named by its task id (lease_member)
        with self.transaction(queue) as tx:
            returned = bool(lease) and rules.give_back(tx.state, tx.leases(), lease, tx.now_us)
            if returned and tx.state is not None and tx.state.concurrency:
                self._woke(queue, tx.state.current + 1, tx.now_us)
            tx.clear_unfinished(task_id)
            if remember:
                tx.add_finished(task_id)
            if self.ledger_max:  # the ledger names a lease taken under a cap only (_ledger_row)
                capped = tx.state is not None and tx.state.concurrency > 0
                tx.record_finish(task_id, outcome, lease if capped else "", returned and capped)

    def renew_leases(self, queue: str, leases: Sequence[str]) -> int:
        if not leases:
            return 0
        with self.transaction(queue) as tx:
            return rules.renew_leases(tx.state, tx.leases(), leases, tx.now_us, self.lease_timeout_us)

    def _existing(self, tx: Transaction, queue: str) -> QueueState:
        if tx.state is None:
            raise QueueNotFoundError(f"queue {queue!r} has no state in this store")
        return tx.state

    def pause(self, queue: str, epoch: str = "") -> QueueState:
        with self.transaction(queue) as tx:
            if tx.state is None:  # before any worker: created paused, no interval known yet
                tx.window().trim(1 << 62)
                tx.state = rules.paused_new_state(tx.now_us, epoch or secrets.token_hex(8))
            rules.pause(tx.state)
            return _copy(tx.state)

    def resume(self, queue: str, grace_us: int = 0) -> QueueState:
        with self._following_one(queue) as tx:
            state = self._existing(tx, queue)
            if state.paused and rules.no_limit_known(state):
                raise no_interval_yet(queue)
            rules.resume(state, tx.now_us, grace_us)
            return _copy(state)

    def set_interval(self, queue: str, interval_us: int | None, origin: str = "") -> QueueState:
        with self.transaction(queue) as tx:
            state = self._existing(tx, queue)
            tx.save_sources(rules.override(state, tx.sources(), tx.now_us, interval_us, origin))
            return _copy(state)

    def set_limits(self, queue: str, override: LimitsOverride | None, origin: str = "") -> QueueState:
        with self.transaction(queue) as tx:
            state = self._existing(tx, queue)
            tx.save_sources(rules.override_limits(state, tx.sources(), tx.now_us, override, origin))
            return _copy(state)

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
        with self.transaction(queue) as tx:
            created = tx.state is None
            state = self._created(tx, queue, interval_us, epoch, limits)
            sources, done = rules.declare(
                state, tx.sources(), tx.now_us, interval_us, node=node, ttl_us=ttl_us, origin=origin,
                announce=announce, limits=limits,
            )  # fmt: skip
            tx.save_sources(sources)
            if created:
                return replace(done, created=True, old_interval_us=0, old_limits=NO_LIMITS)
            return done

    def backoff(self, queue: str, hold_us: int, keep_first: bool = False) -> QueueState:
        with self._following_one(queue) as tx:
            rules.backoff(self._existing(tx, queue), tx.now_us, hold_us, keep_first)
            return _copy(self._existing(tx, queue))

    def reset(
        self, queue: str, interval_us: int | None, epoch: str, origin: str = "", *, limits: Limits = NO_LIMITS
    ) -> QueueState:
        with self._following_one(queue, replace_corrupt=True) as tx:
            if tx.state is None:
                if interval_us is None:
                    raise QueueNotFoundError(f"queue {queue!r} has no state in this store")
                tx.state = _new_state(tx, interval_us, epoch, limits)
            tx.state = rules.reset(tx.state, tx.now_us, epoch, interval_us)
            if interval_us:
                tx.save_sources(rules.pin(tx.sources(), tx.now_us, interval_us, origin))
            tx.state.ticket = tx.renumber_parked()  # parked tasks keep their order in the new life
            return _copy(tx.state)

    def status(self, queue: str) -> QueueStatus | None:
        with self._following_one(queue) as tx:
            if tx.state is None:
                return None
            state, used, slots = tx.state, 0, (0, 0)
            if state.quota:  # read only: what a status read forgot would not move the anchor
                used = rules.window_used(tx.window(), tx.now_us - state.window_us)
                slots = rules.status_window(state, tx.window(), tx.now_us)
            in_flight = tx.leases().live(tx.now_us) if state.concurrency else 0
            fair = tx.fair_backlog(0)
            return QueueStatus(
                queue, _copy(state), tx.now_us, tx.finished_count(), tx.parked_count(), tx.sources(), *tx.refusals(),
                window_used=used, counts=rules.counts_from_fields(tx.start_counts()), in_flight=in_flight,
                window_next_us=slots[0], window_last_us=slots[1], fair_keys=fair.keys_waiting,
                fair_tasks=fair.tasks_waiting,
            )  # fmt: skip

    def park(self, queue: str, epoch: str, tasks: Sequence[ParkedTask]) -> bool:
        with self.transaction(queue) as tx:
            if tx.state is None or tx.state.epoch != epoch:
                return False
            tx.park(tasks)
            return True

    def release(
        self, queue: str, horizon_us: int, limit: int = RELEASE_LIMIT, lease_us: int = RELEASE_LEASE_US
    ) -> Release:
        with self._following_one(queue) as tx:
            if tx.state is None:
                return Release("", tx.now_us, [])
            state, now = tx.state, tx.now_us
            window = self._window(tx, state)
            if not state.paused:  # see rules.release_cutoff
                units = rules.window_units(state, window, now)
                held = 0 if units is None else units.slot(state.current + 1, 1)
                rules.shift_after_outage(state, now, horizon_us, held)
            promoted = rules.fair_promote(state, tx.fair_lines(), now, window)
            if promoted:  # each parked with its fair share in its message, for the ledger
                messages = tx.fair_messages()
                tx.park([
                    ParkedTask(ticket, t.task_id, with_fair_share(messages.take(t.task_id), t.key, t.tag, t.weight))
                    for ticket, t in promoted
                ])  # fmt: skip
            units = rules.window_units(state, window, now)  # read again: the line may have shifted
            tasks = tx.leasable(rules.release_cutoff(state, now, horizon_us, units), now, limit)
            tx.lease([t.task_id for t in tasks], now + lease_us)
            return Release(state.epoch, now, [(t, rules.estimate_of(state, t.ticket, now, units)) for t in tasks])

    def unpark(self, queue: str, task_ids: Sequence[str]) -> None:
        with self.transaction(queue) as tx:
            tx.unpark(task_ids)

    def fair_park(
        self, queue: str, key: str, weight: int, tasks: Sequence[FairTask], interval_us: int, epoch: str,
        *, limits: Limits = NO_LIMITS,
    ) -> list[str]:  # fmt: skip
        rules.fair_check(key, weight, [t.cost for t in tasks])  # before anything is written
        still_parked: list[str] = []
        with self._following_one(queue) as tx:
            self._created(tx, queue, interval_us, epoch, limits)
            lines, messages = tx.fair_lines(), tx.fair_messages()
            for task in tasks:
                if tx.is_parked(task.task_id):  # its last run's releaser may be about to unpark it
                    still_parked.append(task.task_id)
                elif messages.get(task.task_id) is None:  # a publish sent again waits once
                    rules.fair_push(lines, key, task.task_id, task.cost, weight)
                    messages.keep(task.task_id, task.message)
        return still_parked

    def fair_backlog(self, queue: str, top: int = 10) -> FairBacklog:
        check_top(top)
        with self.transaction(queue, replace_corrupt=True) as tx:  # the state is not read (nor written)
            return tx.fair_backlog(top)

    def parked_tasks(self, queue: str) -> list[ParkedTask]:
        with self.transaction(queue) as tx:
            return tx.leasable(1 << 62, 1 << 62, 1 << 62)  # everything, leased or not

    def delete(self, queue: str) -> bool:
        with self.transaction(queue) as tx:
            existed = tx.delete()
            tx.state = None
            return existed


def check_top(top: int) -> None:
    """ValueError unless ``top`` (keys a fair backlog lists) is 0 or more."""
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise ValueError(f"a fair backlog lists 0 or more keys, not {top!r}")


def _count_start(tx: Transaction, decision: Decision, record: StartRecord | None) -> None:
    """Count an authorized start in its queue's counters (rules.start_counts), in the
    start's own transaction."""
    last = tx.start_counts().get(rules.LAST_COUNTED)
    deferrals = record.deferrals if record is not None else 0
    added = rules.start_counts(last, decision.now_us, decision.slot_us, decision.interval_us, deferrals)
    tx.count_start(added, decision.now_us)


def no_interval_yet(queue: str) -> ConfigurationError:
    """The error of resuming a queue paused before any declaration, with no limit known."""
    return ConfigurationError(
        f"queue {queue!r} was paused before any worker declared it and has no interval yet: start a worker "
        f"(or run 'celery -A app siq sync'), or set one with 'siq set-interval {queue} 250ms', then resume"
    )


def _new_state(tx: Transaction, interval_us: int, epoch: str, limits: Limits) -> QueueState:
    """A state created from nothing, with an empty window: a lost state forgets its window's
    starts as it forgets its last start (docs/design.md, "The guarantees": the window across a lost state)."""
    tx.window().trim(1 << 62)
    return rules.new_state(tx.now_us, interval_us, epoch, limits)


def _copy(state: QueueState) -> QueueState:
    return QueueState(**vars(state))


def sources_to_json(sources: IntervalSources) -> str:
    return json.dumps(asdict(sources), separators=(",", ":"))


#: Unreadable interval sources are logged at most once a minute per queue (a status read
#: finds them each time until a declaration or an override writes the sources again).
_UNREADABLE_SOURCES = Throttle(60.0)


def log_unreadable_sources(queue: str, where: str, unreadable: Sequence[str]) -> None:
    """Say that the queue's interval sources held what siq_celery did not write, and read
    as none: an override there is dropped (the next write of the sources drops it for good)."""
    if unreadable and _UNREADABLE_SOURCES.due((where, queue)) is not None:
        logger.warning(
            "siq_celery: queue %r: the interval sources in %s hold what siq_celery did not write (%s); read as "
            "none, so an override or declaration kept there is dropped and the queue runs at what the live "
            "workers declare. If an override was meant, set it again: `siq set-interval %s INTERVAL`",
            queue, where, "; ".join(unreadable)[:500], queue,
        )  # fmt: skip


def sources_from_json(text: str | None, queue: str = "", where: str = "") -> IntervalSources:
    """Stored sources, or none (an unreadable record only loses the override and the
    declarations, which the next worker start writes again), logged naming ``queue``
    and ``where`` it is stored."""
    if not text:
        return IntervalSources()
    try:
        raw = json.loads(text)
        override = raw.get("limits_override") or {}
        return IntervalSources(
            int(raw["declared_us"]), str(raw["declared_by"]), int(raw["declared_at_us"]),
            int(raw["override_us"]), str(raw["override_by"]), int(raw["override_at_us"]),
            tuple(
                NodeDeclaration(str(n["node"]), int(n["interval_us"]), int(n["expires_us"]), _limits(n.get("limits")))
                for n in raw["nodes"]
            ),
            _limits(raw.get("declared_limits")),
            LimitsOverride(
                _maybe_int(override.get("burst")), _maybe_int(override.get("quota")),
                int(override.get("window_us") or 0), _maybe_int(override.get("concurrency")),
                _maybe_int(override.get("margin_us")),
            ),
            str(raw.get("limits_override_by") or ""), int(raw.get("limits_override_at_us") or 0),
        )  # fmt: skip
    except (ValueError, TypeError, KeyError, AttributeError):
        log_unreadable_sources(queue, where or "the store", [repr(text[:200])])
        return IntervalSources()


def _maybe_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _limits(raw: Any) -> Limits | None:
    """Stored limits (None: none stored, as a record of an earlier version has)."""
    if raw is None:
        return None
    return Limits(int(raw["burst"]), int(raw["quota"]), int(raw["window_us"]), int(raw["concurrency"]),
                  int(raw.get("margin_us") or 0))  # fmt: skip


def match_names(names: Iterator[str] | list[str], pattern: str) -> list[str]:
    return sorted(n for n in names if fnmatch.fnmatchcase(n, pattern))
