"""A worker whose wall clock is off: ETAs read on the state store's clock.

siq_celery never decides by a host's clock (the store's clock decides every start), but
Celery schedules a message's ETA by the worker's own wall clock. A worker host whose
clock jumped three minutes back would hold every ETA task three minutes too long, and
one three minutes ahead would take every task early and send it back again. So each
worker measures its clock against the store's (its release loop asks the store for the
time every ``siq_release_every``), warns once a minute while they differ by more than
a second, and reads the ETA of interval tasks corrected by the difference
(:class:`StoreClockRequest`, the ``Request`` class of :class:`~siq_celery.IntervalTask`).
The Redis broker's unacknowledged messages are stamped on the store's clock as well
(:func:`store_time`), since another worker's sweep compares those stamps with its own.
"""

from __future__ import annotations

import logging
import math
import time
from datetime import datetime, timedelta
from typing import Any

from celery.worker.request import Request

logger = logging.getLogger("siq_celery")

#: Clocks closer than this are taken as agreeing (nothing is corrected).
TOLERANCE_S = 1.0
WARN_EVERY_S = 60.0


class ClockWatch:
    """How far this process's wall clock is from the store's (seconds, + = ahead).

    Between two readings of the store, a step of the host's wall clock (NTP, an operator)
    is seen at once: the wall clock is compared with the monotonic one, which does not
    step, so the skew moves with the step rather than at the next reading."""

    def __init__(self) -> None:
        self.skew = 0.0
        self._warned_at = -math.inf
        self._wall_less_monotonic: float | None = None  # at the last reading

    def observe(self, store_now_us: int, local_now: float | None = None) -> float:
        if local_now is None:
            local = time.time()
            self._wall_less_monotonic = local - time.monotonic()
        else:  # a given reading (tests): no step is followed from it
            local, self._wall_less_monotonic = local_now, None
        self.skew = local - store_now_us / 1e6
        if abs(self.skew) > TOLERANCE_S and time.monotonic() - self._warned_at >= WARN_EVERY_S:
            self._warned_at = time.monotonic()
            logger.warning(
                "siq_celery: this host's clock is %.1f s %s the state store's; ETAs of interval tasks are "
                "read on the store's clock, but fix the host's time sync",
                abs(self.skew), "ahead of" if self.skew > 0 else "behind",
            )  # fmt: skip
        return self.skew

    def current_skew(self, now: float | None = None) -> float:
        """The skew at ``now`` (this host's wall clock, read now if not given): the last
        reading's, moved by any step of the wall clock since; 0 within the tolerance."""
        skew = self.skew
        if self._wall_less_monotonic is not None:
            wall = time.time() if now is None else now
            skew += wall - time.monotonic() - self._wall_less_monotonic
        return skew if abs(skew) > TOLERANCE_S else 0.0

    def store_time(self) -> float:
        """This host's wall clock read on the store's (``time.time()`` while they agree)."""
        now = time.time()
        return now - self.current_skew(now)

    def local_eta(self, eta: datetime | None) -> datetime | None:
        """``eta`` (meant on the store's clock) on this host's clock."""
        skew = self.current_skew()
        if eta is None or not skew:
            return eta
        return eta + timedelta(seconds=skew)


#: This process's watch: the worker's release loop keeps it up to date.
CLOCK = ClockWatch()


def store_time() -> float:
    """Now on the store's clock, as well as this process knows it. The Redis broker's
    unacknowledged messages are stamped and swept by it (broker/transit.py): a worker
    whose clock went back would otherwise stamp its messages minutes in the past, and
    another worker's restore sweep would hand them out again while they wait or run."""
    return CLOCK.store_time()


class StoreClockRequest(Request):  # type: ignore[misc]
    """Celery's task request, whose ETA is corrected for this host's clock skew."""

    @property
    def eta(self) -> Any:
        return CLOCK.local_eta(self._eta)
