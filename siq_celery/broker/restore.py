"""Bringing back the unacknowledged tasks of a dead worker on the Redis broker, from a
worker that runs without Celery's event loop (a green pool: ``-P gevent``, ``-P eventlet``).

The Redis broker emulates acknowledgements: a delivered message stays in an "unacked"
hash, indexed by its delivery time, until acknowledged, and ``QoS.restore_visible`` puts
the ones older than ``visibility_timeout`` back in their queue. kombu calls it from the
event loop's timer (every ``unacked_restore_interval`` s, scanning every
``unacked_restore_throttle``-th call; before kombu 5.7, every 10 s and every 10th call,
fixed), or after a poll that saw no socket at all. A green pool runs the consumer without
the event loop (it drains the broker synchronously), and there a pending BRPOP always
answers the poll (nil after ``brpop_timeout``): the sweep never runs, and a SIGKILLed
node's tasks stay unacknowledged forever (kombu #1025, celery #4976; measured: 31 of 60
tasks after 40 s, a 10 s visibility timeout).

:class:`UnackedRestore` does that sweep from the worker's upkeep (tasks/upkeep.py) at kombu's
own cadence (``unacked_restore_interval`` x ``unacked_restore_throttle``, kombu's defaults
when unset: 100 s), on a broker connection of its own, under kombu's own mutex: a worker with
the event loop (prefork, threads, solo) needs none, and none is made there.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ..clock import store_time

logger = logging.getLogger("siq_celery")

#: A sweep counts the messages due up to this many (it restores them all).
COUNT_AT_MOST = 10_000

#: kombu's cadence before 5.7 made it the transport options ``unacked_restore_interval``
#: and ``unacked_restore_throttle`` (with these defaults): its event loop's timer every 10 s,
#: a scan on every 10th call (``restore_visible``'s ``interval``).
KOMBU_RESTORE_INTERVAL_S = 10
KOMBU_RESTORE_THROTTLE = 10


def needs_restore_sweep(consumer: Any) -> bool:
    """Whether ``consumer`` (a Celery worker's consumer, the sender of ``worker_ready``)
    drains a Redis broker without the event loop, so nothing restores unacknowledged
    messages unless the worker does."""
    if getattr(consumer, "hub", None) is not None:  # the event loop's timer sweeps
        return False
    app = getattr(consumer, "app", None)
    return app is not None and redis_broker(app)


def redis_broker(app: Any) -> bool:
    """Whether ``app``'s broker is kombu's Redis transport (Sentinel included)."""
    try:
        from kombu.transport.redis import Transport as RedisTransport

        with app.connection_for_read() as conn:
            return isinstance(conn.transport, RedisTransport)
    except Exception:  # no redis-py (so no Redis broker), or a URL kombu cannot read
        return False


class BrokerSweep:
    """A sweep of the broker from a worker's upkeep, on a connection of its own: opened at
    the first sweep, dropped on any error (the next sweep opens a new one) and at close."""

    _connection: Any = None
    #: Says whose connection it was, in the log line of a failed release.
    what = "a broker sweep"

    def _default_channel(self, app: Any) -> Any:
        if self._connection is None:
            self._connection = app.connection_for_read()
        return self._connection.default_channel

    def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            try:
                connection.release()
            except Exception as exc:  # a broken connection: nothing more to give back
                logger.debug("siq_celery: closing %s's broker connection: %s", self.what, exc)


class UnackedRestore(BrokerSweep):
    """Restores the Redis broker's unacknowledged messages older than its visibility
    timeout, every ``period`` seconds at most (:meth:`maybe_sweep`)."""

    what = "the restore sweep"

    def __init__(self, app: Any, *, clock: Any = time.monotonic) -> None:
        from kombu.transport.redis import Channel

        self.app, self._clock = app, clock
        options = app.conf.broker_transport_options or {}
        default_interval = getattr(Channel, "unacked_restore_interval", KOMBU_RESTORE_INTERVAL_S)
        default_throttle = getattr(Channel, "unacked_restore_throttle", KOMBU_RESTORE_THROTTLE)
        interval = options.get("unacked_restore_interval", default_interval)
        throttle = options.get("unacked_restore_throttle", default_throttle)
        if interval <= 0:  # as kombu reads it
            interval = default_interval
        self.period = float(interval) * max(int(throttle or 1), 1)
        self._next = clock() + self.period  # the dead worker's messages are not due before a period

    def maybe_sweep(self) -> int | None:
        """Sweep if a period passed since the last sweep: the number of messages put back
        (None: not due). Raises what the broker raised (the connection is dropped first)."""
        now = self._clock()
        if now < self._next:
            return None
        self._next = now + self.period
        return self.sweep()

    def sweep(self) -> int:
        try:
            channel = self._default_channel(self.app)
            due = self._due(channel)
            if due:  # else spare the mutex and the scan
                channel.qos.restore_visible(num=channel.unacked_restore_limit, interval=1)
                return max(due - self._due(channel), 0)
            return 0
        except Exception:
            self.close()
            raise

    @staticmethod
    def _due(channel: Any) -> int:
        """Unacknowledged messages delivered longer than the visibility timeout ago (at most
        COUNT_AT_MOST), read as kombu reads them (ZRANGE: a ``global_keyprefix`` applies)."""
        with channel.conn_or_acquire() as client:
            ceil = store_time() - channel.visibility_timeout
            due = client.zrange(channel.unacked_index_key, ceil, 0, desc=True, byscore=True, offset=0,
                                num=COUNT_AT_MOST)  # fmt: skip
            return len(due or ())
