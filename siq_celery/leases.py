"""Keeping the concurrency leases of the bodies running in this process.

A start in a queue with a concurrency cap takes a lease that expires ``siq_lease_timeout``
after it (model.py: Leases): a body whose process dies gives it back that way. A body that
runs longer keeps it while its process lives: :data:`KEEPER` renews every lease held here
every third of the timeout, from one daemon thread per process (started on first use, so a
prefork pool process starts its own after the fork; the parent's leases are not the
child's). Renewing is one store operation per queue and period, whatever the number of
bodies; threads and solo pools share the one keeper.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence

from .backends import Backend

logger = logging.getLogger("siq_celery")


class LeaseKeeper:
    """The leases held by bodies running in this process, renewed until given back."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = os.getpid()
        #: (backend, queue) -> members held there
        self._held: dict[tuple[int, str], tuple[Backend, set[str]]] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def _this_process(self) -> None:
        if self._pid != os.getpid():  # a forked child: nothing of the parent's is held here
            self._pid, self._held, self._thread = os.getpid(), {}, None
            self._lock, self._wake = threading.Lock(), threading.Event()

    def hold(self, backend: Backend, queues: Sequence[str], member: str) -> None:
        """A body that took lease ``member`` (in each of ``queues``) runs: renew it."""
        if not member:
            return
        self._this_process()
        with self._lock:
            for queue in queues:
                self._held.setdefault((id(backend), queue), (backend, set()))[1].add(member)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="siq-lease-keeper", daemon=True)
                self._thread.start()
        self._wake.set()

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

    def held(self) -> list[tuple[str, str]]:
        """(queue, member) of every lease held here (for tests and people)."""
        with self._lock:
            return sorted((q, m) for (_, q), (_, members) in self._held.items() for m in members)

    def _period_s(self) -> float | None:
        with self._lock:
            if not self._held:
                return None
            return min(b.lease_timeout_us for b, _ in self._held.values()) / 3e6

    def _run(self) -> None:
        while True:
            period = self._period_s()
            if period is None:
                self._wake.wait()
                self._wake.clear()
                continue
            self._wake.clear()
            if self._wake.wait(period):
                continue  # a new hold: its lease is fresh; the period may be shorter now
            self.renew_now()

    def renew_now(self) -> None:
        """Renew every lease held here (the keeper's thread calls it each period)."""
        with self._lock:
            work = [(b, q, sorted(members)) for (_, q), (b, members) in self._held.items()]
        for backend, queue, members in work:
            try:
                backend.renew_leases(queue, members)
            except Exception as exc:  # the next period tries again; past the timeout the leases expire
                logger.warning(
                    "siq_celery: could not renew %d concurrency lease(s) of %r: %s", len(members), queue, exc
                )


#: The keeper of this process.
KEEPER = LeaseKeeper()
