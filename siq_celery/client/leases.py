"""Keeping the leases of the bodies running in this process.

Three leases, three names (rules/concurrency.py): a start with a task id takes the **run
lease**, named by its task id, which also holds its place under a concurrency cap; a start
without a task id in a queue with a cap takes a **concurrency lease** of its own; a releaser
of parked tasks holds a **release lease** on them (``Backend.release``; not kept here). A
run or concurrency lease expires ``siq_lease_timeout`` after it: while a run lease is live a
redelivered copy of the task is not started, and a body whose process dies gives its lease
back that way. A
body that runs longer keeps it while its process lives: :data:`KEEPER` renews every lease
held here every third of the timeout, from one daemon thread per process (started on first
use, so a prefork pool process starts its own after the fork; the parent's leases are not
the child's). Renewing is one store operation per queue and period, whatever the number of
bodies; threads and solo pools share the one keeper.

A finish the store did not take (unreachable, failing over) is handed to the keeper
(:meth:`LeaseKeeper.finish_later`): it tries again every :data:`FINISH_RETRY_S` until the
store takes it, and renews the run's lease meanwhile, so a redelivered copy of the task
is answered RUNNING, and then DUPLICATE, instead of running again.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

from ..backends import Backend

logger = logging.getLogger("siq_celery")

#: How often a finish the store did not take is tried again.
FINISH_RETRY_S = 0.5
#: Finishes kept for retrying, at most (the oldest is given up beyond: its lease expires).
MAX_PENDING_FINISHES = 10_000


class PendingFinish:
    """A finish to try again: ``attempt`` records it (raises if the store does not take
    it); ``member`` is the run's lease in ``queues`` of ``backend``, held until it does."""

    def __init__(
        self, backend: Backend, queues: Sequence[str], member: str, attempt: Callable[[], None], what: str
    ) -> None:
        self.backend, self.queues, self.member, self.attempt, self.what = backend, list(queues), member, attempt, what


class LeaseKeeper:
    """The leases held by bodies running in this process, renewed until given back."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = os.getpid()
        #: (backend, queue) -> members held there
        self._held: dict[tuple[int, str], tuple[Backend, set[str]]] = {}
        #: The members held that are concurrency leases (the others are run leases), for the logs.
        self._concurrency: set[str] = set()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._finishes: list[PendingFinish] = []
        #: Once a lease was held, the keeper's period (the shortest a backend needed) stays
        #: while nothing is held: a renewal round of nothing costs nothing, and a later hold
        #: need not wake the thread, which would run beside the body about to begin (a
        #: thread woken then takes the GIL as the body's report is sent, and the body waits).
        self._cadence: float | None = None

    def _this_process(self) -> None:
        if self._pid != os.getpid():  # a forked child: nothing of the parent's is held here
            self._pid, self._held, self._thread, self._finishes = os.getpid(), {}, None, []
            self._concurrency = set()
            self._lock, self._wake, self._cadence = threading.Lock(), threading.Event(), None

    def hold(self, backend: Backend, queues: Sequence[str], member: str, *, run: bool = True) -> None:
        """A body that took lease ``member`` (in each of ``queues``) runs: renew it. ``run``:
        the run lease of a task id, else a concurrency lease (a start without a task id)."""
        if not member:
            return
        self._this_process()
        with self._lock:
            if not run:
                self._concurrency.add(member)
            # A period not longer than this backend's needs is already running (a fresh lease
            # has a whole timeout before it), or the thread starts now: no wake-up per start.
            wake = self._cadence is not None and backend.lease_timeout_us / 3e6 < self._cadence
            self._add_locked(backend, queues, member)
        if wake:
            self._wake.set()

    def _add_locked(self, backend: Backend, queues: Sequence[str], member: str) -> None:
        """Hold ``member`` in ``queues`` of ``backend`` (renewed), the keeper's thread running."""
        for queue in queues:
            self._held.setdefault((id(backend), queue), (backend, set()))[1].add(member)
        period = backend.lease_timeout_us / 3e6
        self._cadence = period if self._cadence is None else min(self._cadence, period)
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="siq-lease-keeper", daemon=True)
            self._thread.start()

    def finish_later(self, pending: PendingFinish) -> None:
        """The store did not take this finish: keep the run's lease (renewed) and try again
        every FINISH_RETRY_S until it does."""
        self._this_process()
        with self._lock:
            self._add_locked(pending.backend, pending.queues, pending.member)
            self._finishes.append(pending)
            if len(self._finishes) > MAX_PENDING_FINISHES:
                gone = self._finishes.pop(0)
                logger.error(
                    "siq_celery: more than %d finishes wait for the store; giving up on %s (its lease expires, "
                    "and a redelivered copy may run again)", MAX_PENDING_FINISHES, gone.what,
                )  # fmt: skip
        self._wake.set()

    def pending_finishes(self) -> int:
        with self._lock:
            return len(self._finishes)

    def retry_finishes(self) -> None:
        """Try each finish the store did not take once more (the keeper's thread calls it)."""
        with self._lock:
            work, self._finishes = self._finishes, []
        kept = []
        for pending in work:
            try:
                pending.attempt()
            except Exception as exc:  # the store still does not take it: next round
                kept.append(pending)
                logger.debug("siq_celery: %s still not recorded: %s", pending.what, exc)
                continue
            logger.warning("siq_celery: %s recorded after all", pending.what)
            self.drop(pending.backend, pending.queues, pending.member)
        if kept:
            with self._lock:
                self._finishes[:0] = kept

    def drop(self, backend: Backend, queues: Sequence[str], member: str) -> None:
        """The body holding ``member`` ended (its finish gave the lease back)."""
        if not member:
            return
        self._this_process()
        with self._lock:
            for queue in queues:
                entry = self._held.get((id(backend), queue))
                if entry is not None:
                    entry[1].discard(member)
                    if not entry[1]:
                        del self._held[(id(backend), queue)]
            if not any(member in members for _, members in self._held.values()):
                self._concurrency.discard(member)

    def held(self) -> list[tuple[str, str]]:
        """(queue, member) of every lease held here (for tests and people)."""
        with self._lock:
            return sorted((q, m) for (_, q), (_, members) in self._held.items() for m in members)

    def _period_s(self) -> float | None:
        with self._lock:
            return self._period_locked()

    def _period_locked(self) -> float | None:
        if not self._held:
            return self._cadence  # None until the first hold
        return min(b.lease_timeout_us for b, _ in self._held.values()) / 3e6

    def _run(self) -> None:
        renew_at: float | None = None  # monotonic time of the next renewal
        while True:
            period = self._period_s()
            finishing = self.pending_finishes() > 0
            if period is None and not finishing:
                renew_at = None
                self._wake.wait()
                self._wake.clear()
                continue
            self._wake.clear()
            now = time.monotonic()
            if period is not None and (renew_at is None or renew_at > now + period):
                renew_at = now + period  # the first hold, or a backend with a shorter timeout
            timeout = max(renew_at - now, 0.0) if renew_at is not None else FINISH_RETRY_S
            if self._wake.wait(min(timeout, FINISH_RETRY_S) if finishing else timeout):
                continue  # a new hold or a finish to retry: the waits are worked out again
            if finishing:
                self.retry_finishes()
            if renew_at is not None and time.monotonic() >= renew_at:
                renew_at = None
                self.renew_now()

    def renew_now(self) -> None:
        """Renew every lease held here (the keeper's thread calls it each period)."""
        with self._lock:
            work = [(b, q, sorted(members)) for (_, q), (b, members) in self._held.items()]
        for backend, queue, members in work:
            try:
                backend.renew_leases(queue, members)
            except Exception as exc:  # the next period tries again; past the timeout the leases expire
                logger.warning("siq_celery: could not renew %s of %r: %s", self.kinds(members), queue, exc)

    def kinds(self, members: Sequence[str]) -> str:
        """What ``members`` are, for a log line: "2 run leases and 1 concurrency lease"."""
        with self._lock:
            conc = sum(1 for m in members if m in self._concurrency)
        runs = len(members) - conc
        said = [f"{n} {kind} lease{'s' if n != 1 else ''}" for n, kind in ((runs, "run"), (conc, "concurrency")) if n]
        return " and ".join(said) or "no lease"


#: The keeper of this process.
KEEPER = LeaseKeeper()
