"""Log lines that repeat for as long as their cause lasts, written once per cause.

* :class:`Throttle` - at most one line per key per period, saying how many were left out.
* :class:`Outage` - one line when the state store becomes unreachable (with the reason),
  one when it is back (with how long it was away).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable

from .lru import LRUCache

logger = logging.getLogger("siq_celery")

#: Keys a throttle remembers (per-key queues may be many): a forgotten key logs again.
THROTTLE_REMEMBERED = 1_000


class Throttle:
    """``if (left_out := throttle.due(key)) is not None: log(..., left_out)``: the first
    call for ``key`` and then one per ``period`` seconds are due; the others are counted and
    the next due call returns their number."""

    def __init__(self, period: float, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.period, self._monotonic = period, monotonic
        self._seen: LRUCache[Hashable, tuple[float, int]] = LRUCache(THROTTLE_REMEMBERED)
        self._lock = threading.Lock()

    def due(self, key: Hashable) -> int | None:
        now = self._monotonic()
        with self._lock:
            seen = self._seen.get(key)
            if seen is not None and now - seen[0] < self.period:
                self._seen[key] = (seen[0], seen[1] + 1)
                return None
            self._seen[key] = (now, 0)
            return 0 if seen is None else seen[1]


class Outage:
    """The state of the store as one thread of a worker sees it: :meth:`failed` with each
    failure, :meth:`ok` with each success; each logs only when the state changes."""

    def __init__(self, what: str, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.what, self._monotonic = what, monotonic
        self.since: float | None = None

    def failed(self, exc: BaseException) -> None:
        if self.since is None:
            self.since = self._monotonic()
            logger.warning("siq_celery: the state store is unreachable; %s waits until it is back "
                           "(logged once per outage): %s", self.what, exc)  # fmt: skip

    def ok(self) -> None:
        if self.since is not None:
            logger.warning("siq_celery: the state store is reachable again after %.1fs; %s goes on",
                           self._monotonic() - self.since, self.what)  # fmt: skip
            self.since = None
