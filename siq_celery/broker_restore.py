"""Bringing back the unacknowledged tasks of a dead worker on the Redis broker, from a
worker that runs without Celery's event loop (a green pool: ``-P gevent``, ``-P eventlet``).

The Redis broker emulates acknowledgements: a delivered message stays in an "unacked"
hash, indexed by its delivery time, until acknowledged, and ``QoS.restore_visible`` puts
the ones older than ``visibility_timeout`` back in their queue. kombu calls it from the
event loop's timer (every ``unacked_restore_interval`` s, scanning every
``unacked_restore_throttle``-th call), or after a poll that saw no socket at all. A green
pool runs the consumer without the event loop (it drains the broker synchronously), and
there a pending BRPOP always answers the poll (nil after ``brpop_timeout``): the sweep never
runs, and a SIGKILLed node's tasks stay unacknowledged forever (kombu #1025, celery
#4976; measured: 31 of 60 tasks after 40 s, a 10 s visibility timeout).

:class:`UnackedRestore` does that sweep from the worker's upkeep (upkeep.py) at kombu's
own cadence (``unacked_restore_interval`` x ``unacked_restore_throttle``, its defaults
when unset), on a broker connection of its own, under kombu's own mutex: a worker with
the event loop (prefork, threads, solo) needs none, and none is made there.
"""

from __future__ import annotations

import logging
import time
from typing import Any

logger = logging.getLogger("siq_celery")

#: A sweep counts the messages due up to this many (it restores them all).
COUNT_AT_MOST = 10_000


def needs_restore_sweep(consumer: Any) -> bool:
    """Whether ``consumer`` (a Celery worker's consumer, the sender of ``worker_ready``)
    drains a Redis broker without the event loop, so nothing restores unacknowledged
    messages unless the worker does."""
    if getattr(consumer, "hub", None) is not None:  # the event loop's timer sweeps
        return False
    app = getattr(consumer, "app", None)
    if app is None:
        return False
    try:
        from kombu.transport.redis import Transport as RedisTransport

        with app.connection_for_read() as conn:
            return isinstance(conn.transport, RedisTransport)
    except Exception:  # no redis-py (so no Redis broker), or a URL kombu cannot read
        return False


class UnackedRestore:
    """Restores the Redis broker's unacknowledged messages older than its visibility
    timeout, every ``period`` seconds at most (:meth:`maybe_sweep`)."""

    def __init__(self, app: Any, *, clock: Any = time.monotonic) -> None:
        from kombu.transport.redis import Channel

        self.app, self._clock = app, clock
        options = app.conf.broker_transport_options or {}
        interval = options.get("unacked_restore_interval", Channel.unacked_restore_interval)
        throttle = options.get("unacked_restore_throttle", Channel.unacked_restore_throttle)
        if interval <= 0:  # as kombu reads it
            interval = Channel.unacked_restore_interval
        self.period = float(interval) * max(int(throttle or 1), 1)
        self._next = clock() + self.period  # the dead worker's messages are not due before a period
        self._connection: Any = None

    def maybe_sweep(self) -> int | None:
        """Sweep if a period passed since the last sweep: the number of messages put back
        (None: not due). Raises what the broker raised (the connection is dropped first)."""
        now = self._clock()
        if now < self._next:
            return None
        self._next = now + self.period
        return self.sweep()

    def sweep(self) -> int:
        if self._connection is None:
            self._connection = self.app.connection_for_read()
        try:
            channel = self._connection.default_channel
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
            ceil = time.time() - channel.visibility_timeout
            due = client.zrange(channel.unacked_index_key, ceil, 0, desc=True, byscore=True, offset=0,
                                num=COUNT_AT_MOST)  # fmt: skip
            return len(due or ())

    def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            try:
                connection.release()
            except Exception as exc:  # a broken connection: nothing more to give back
                logger.debug("siq_celery: closing the restore sweep's broker connection: %s", exc)
