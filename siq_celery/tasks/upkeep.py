"""A worker's upkeep thread (main process), every ``siq_release_every`` seconds:

* measure this worker's clock against the store's (Celery reads ETAs by it: clock.py);
* release parked tasks that came within the horizon, of the app's fixed queues and of the
  queues found holding parked tasks (looked up every ``DISCOVER_EVERY`` rounds:
  thousands of per-key queues are never polled one by one);
* renew the node's interval declarations when due (tasks/declarations.py);
* on a worker without Celery's event loop (a green pool) and a Redis broker, put back
  the unacknowledged tasks of dead workers once their visibility timeout passed, as the
  event loop's timer does elsewhere (broker/restore.py);
* on a Redis broker, put back the messages of interval tasks lost between the list and a
  consumer's unacknowledged hash (broker/transit.py).

Nothing here is needed for correctness: any worker, or a producer, does the same work,
and a missed round is done by the next. While the store is unreachable a round stops at
its first timeout, and the outage is logged once, with its reason, and once when it ends.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Hashable
from typing import Any

from ..broker.restore import UnackedRestore
from ..broker.transit import TransitSweep
from ..client.queue import IntervalQueue
from ..clock import CLOCK
from ..errors import StoreUnavailableError
from ..logs import Outage, Throttle
from .app_state import siq_state
from .declarations import app_declarations
from .parking import release_due

logger = logging.getLogger("siq_celery")


class WorkerUpkeep(threading.Thread):
    DISCOVER_EVERY = 10

    def __init__(
        self, app: Any, every: float, restore: UnackedRestore | None = None, transit: TransitSweep | None = None
    ) -> None:
        super().__init__(name="siq-upkeep", daemon=True)
        self.app, self.every, self.restore, self.transit = app, every, restore, transit
        self._stop_event = threading.Event()
        self._parked: list[IntervalQueue] = []
        #: The store unreachable: one line when it goes, one when it is back (not one per round and queue).
        self.outage = Outage("releasing parked tasks and renewing this worker's declarations")
        self._failures = Throttle(60.0)

    def run(self) -> None:
        try:
            for round_ in itertools.count():
                if self._stop_event.wait(self.every):
                    return
                self.run_round(round_)
        finally:
            for sweep in (self.restore, self.transit):
                if sweep is not None:
                    sweep.close()

    def run_round(self, round_: int) -> None:
        """One round; it stops at the first timeout of an unreachable store (a frozen one
        would cost a timeout per queue), and the next round tries again. The broker's
        sweeps do not depend on the store: they come first."""
        if self.restore is not None:
            self.restore_unacked()
        if self.transit is not None:
            self.restore_lost_in_transit()
        try:
            self._round(round_)
        except StoreUnavailableError as exc:
            self.outage.failed(exc)
        else:
            self.outage.ok()

    def _round(self, round_: int) -> None:
        state = siq_state(self.app)
        try:  # this worker's clock against the store's: Celery reads ETAs by it (clock.py)
            if state.clock is None:  # a clock given to the app is this process's own (a test's): no skew
                CLOCK.observe(state.backend.now_us())
        except StoreUnavailableError:
            raise
        except Exception as exc:  # the releases below say what is wrong with the store
            logger.debug("siq_celery: could not read the store's clock: %s", exc)
        declarations = state.node_declarations
        if declarations is not None:
            try:
                declarations.renew_if_due()
            except StoreUnavailableError:
                raise
            except Exception as exc:  # declarations expire on their own; the next round tries again
                self._warn("renew", "siq_celery: renewing interval declarations failed: %s", exc)
        if round_ % self.DISCOVER_EVERY == 0:
            try:
                self._parked = [IntervalQueue(name, backend=state.backend) for name in state.backend.parked_queues()]
            except StoreUnavailableError:
                raise
            except Exception as exc:
                self._warn("discover", "siq_celery: could not list the queues with parked tasks: %s", exc)
        fixed = app_declarations(self.app)
        names = {q.name for q in fixed}
        for queue in [*fixed, *(q for q in self._parked if q.name not in names)]:
            try:
                count = release_due(self.app, queue, state.settings.horizon_us, state.settings.countdown_margin)
            except StoreUnavailableError:
                raise
            except Exception as exc:  # the next round tries again; nothing is lost
                self._warn(("release", queue.name), "siq_celery: releasing parked tasks of queue %r failed: %s",
                           queue.name, exc)  # fmt: skip
                continue
            if count:
                logger.info("siq_celery: released %d parked task(s) of %r", count, queue.name)

    def restore_unacked(self) -> None:
        assert self.restore is not None
        try:
            count = self.restore.maybe_sweep()
        except Exception as exc:  # the broker is the consumer's concern; the next period tries again
            self._warn("restore", "siq_celery: could not put back the broker's unacknowledged tasks: %s", exc)
            return
        if count:
            logger.info("siq_celery: put back %d unacknowledged task(s) of a worker gone for longer than the "
                        "broker's visibility timeout", count)  # fmt: skip

    def restore_lost_in_transit(self) -> None:
        assert self.transit is not None
        try:
            count = self.transit.sweep()
        except Exception as exc:  # the next round tries again; the records stay
            self._warn("transit", "siq_celery: could not look for tasks lost on their way to a worker: %s", exc)
            return
        if count:
            logger.warning("siq_celery: put back %d task message(s) a worker took from the broker and died "
                           "before holding (see broker/transit.py)", count)  # fmt: skip

    def _warn(self, key: Hashable, message: str, *args: Any) -> None:
        """A failure other than an unreachable store: at most once a minute per kind."""
        if (left_out := self._failures.due(key)) is not None:
            more = f" ({left_out} more like it in the last minute)" if left_out else ""
            logger.warning(message + more, *args)

    def stop(self) -> None:
        self._stop_event.set()
