"""The values of parked tasks: a task kept in the store under its ticket until its slot comes
within the horizon (:class:`ParkedTask`), a fair queue's task waiting for its share with no
ticket yet (:class:`FairTask`), what waits in a fair queue's lines (:class:`FairBacklog`),
and the tasks handed to one releaser (:class:`Release`). Times in integer microseconds on the
store's clock."""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class ParkedTask:
    """A task kept in the store until its slot comes within the horizon."""

    ticket: int
    task_id: str
    message: str  #: JSON: everything needed to publish the task again unchanged


@dataclass(frozen=True)
class FairTask:
    """A task of a fair queue waiting in its key's line, with no ticket yet (see
    Backend.fair_park)."""

    task_id: str
    message: str  #: as a parked task's
    cost: int = 1


@dataclass(frozen=True)
class FairBacklog:
    """What waits in a fair queue's lines (Backend.fair_backlog): how many fairness keys
    have tasks waiting, how many tasks, and the keys with the most waiting as (key, tasks
    waiting, weight), most first (ties: the smaller key first), as many as asked for."""

    keys_waiting: int = 0
    tasks_waiting: int = 0
    top: tuple[tuple[str, int, int], ...] = ()

    @classmethod
    def ranked(
        cls, keys_waiting: int, tasks_waiting: int, entries: Iterable[tuple[str, int, int]], top: int
    ) -> FairBacklog:
        """The counts, and the ``top`` of ``entries`` (key, waiting, weight) in order."""
        most = heapq.nsmallest(top, entries, key=lambda e: (-e[1], e[0])) if top else []
        return cls(keys_waiting, tasks_waiting, tuple(most))

    def as_dict(self) -> dict[str, object]:
        return {
            "keys_waiting": self.keys_waiting,
            "tasks_waiting": self.tasks_waiting,
            "most_waiting": [{"key": k, "waiting": n, "weight": w} for k, n, w in self.top],
        }


@dataclass(frozen=True)
class Release:
    """Parked tasks handed to one releaser (leased: see Backend.release)."""

    epoch: str
    now_us: int
    tasks: list[tuple[ParkedTask, int]]  #: with each one's estimated start (store clock, µs)
