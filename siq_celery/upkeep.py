"""A worker's upkeep thread (main process), every ``siq_release_every`` seconds:

* measure this worker's clock against the store's (Celery reads ETAs by it: clock.py);
* release parked tasks that came within the horizon, of the app's fixed queues and of the
  queues found holding parked tasks (looked up every ``DISCOVER_EVERY`` rounds:
  thousands of per-key queues are never polled one by one);
* renew the node's interval declarations when due (declarations.py).

Nothing here is needed for correctness: any worker, or a producer, does the same work,
and a missed round is done by the next.
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import Any

from .clock import CLOCK
from .config import siq_state
from .declarations import app_declarations
from .parking import release_due
from .queue import IntervalQueue

logger = logging.getLogger("siq_celery")


class WorkerUpkeep(threading.Thread):
    DISCOVER_EVERY = 10

    def __init__(self, app: Any, every: float) -> None:
        super().__init__(name="siq-upkeep", daemon=True)
        self.app, self.every = app, every
        self._stop_event = threading.Event()

    def run(self) -> None:
        state = siq_state(self.app)
        parked: list[IntervalQueue] = []
        for round_ in itertools.count():
            if self._stop_event.wait(self.every):
                return
            try:  # this worker's clock against the store's: Celery reads ETAs by it (clock.py)
                CLOCK.observe(state.backend.now_us())
            except Exception as exc:  # the releases below say what is wrong with the store
                logger.debug("siq_celery: could not read the store's clock: %s", exc)
            declarations = state.node_declarations
            if declarations is not None:
                try:
                    declarations.renew_if_due()
                except Exception as exc:  # declarations expire on their own; the next round tries again
                    logger.warning("siq_celery: renewing interval declarations failed: %s", exc)
            if round_ % self.DISCOVER_EVERY == 0:
                try:
                    parked = [IntervalQueue(name, backend=state.backend) for name in state.backend.parked_queues()]
                except Exception as exc:
                    logger.debug("siq_celery: could not list queues with parked tasks: %s", exc)
            fixed = app_declarations(self.app)
            names = {q.name for q in fixed}
            for queue in [*fixed, *(q for q in parked if q.name not in names)]:
                try:
                    count = release_due(self.app, queue, state.settings.horizon_us, state.settings.countdown_margin)
                    if count:
                        logger.info("siq_celery: released %d parked task(s) of %r", count, queue.name)
                except Exception as exc:  # the next round tries again; nothing is lost
                    logger.warning("siq_celery: releasing parked tasks of %r failed: %s", queue.name, exc)

    def stop(self) -> None:
        self._stop_event.set()
