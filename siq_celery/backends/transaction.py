"""One queue's state inside an atomic section of a store that runs the rules itself
(:class:`Transaction`; the memory and SQLite stores implement it): the state, and beside it
the window, the leases, the finished and unfinished task ids, the ledger, the counters, the
parked tasks and the fair lines. Times in integer microseconds on the store's clock."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Protocol

from .. import rules
from ..ledger import LedgerRow
from ..parked import FairBacklog, ParkedTask
from ..types import IntervalSources, QueueState


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
        ``start_us`` its ``began_us``, unless that row is finished (a report that reaches the
        store after the finish is dropped, as Redis's ledger.join_finishes drops it)."""

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
