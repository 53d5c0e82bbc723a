"""One more message of credit for a green pool's consumer on the Redis broker.

A green pool (gevent, eventlet) drains the broker without Celery's event loop. On the
Redis broker, when every greenlet holds a task (unacknowledged: ``prefetch_count`` =
``-c`` x ``worker_prefetch_multiplier``, and ``acks_late``) the consumer has no credit and
kombu's synchronous poll sleeps a whole second (``MultiChannelPoller.get``: no socket to
wait on) before it looks again, twice within Celery's 2 s drain: a greenlet freed in the
meantime gets nothing. With interval tasks every greenlet is often busy (waiting for its
slot), so each node took no message for 2 s, again and again, and the line ran dry
(``-c 50``, multiplier 1, 10 ms: 37 % of the rate; 61 % with multiplier 2, everything
else equal).

:class:`GreenCredit`, a consumer bootstep added on green pools with a Redis broker, raises
the prefetch count by one. The consumer then always has a message's credit while every
greenlet is busy: it takes the next message and waits, cooperatively, in the pool's
``spawn`` until a greenlet is free, so the freed greenlet gets it at once. A node holds at
most that one message more than it runs.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps

logger = logging.getLogger("siq_celery")

#: Messages of credit beyond ``-c`` x ``worker_prefetch_multiplier``.
EXTRA_CREDIT = 1


class GreenCredit(bootsteps.StartStopStep):  # type: ignore[misc]
    """After the task consumer starts (and after each reconnection): one more message of
    prefetch, on a green pool with the Redis broker."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c: Any) -> None:
        qos = getattr(c, "qos", None)
        if qos is None or not qos.value:  # no prefetch limit: nothing to add to
            return
        if getattr(c.connection.transport, "driver_type", "") != "redis":
            return
        qos.increment_eventually(EXTRA_CREDIT)
        qos.update()
        logger.debug("siq_celery: green pool on the Redis broker: prefetch count %d", qos.value)


def add_green_credit(app: Any) -> None:
    """Add :class:`GreenCredit` to ``app``'s consumer steps (once; at ``worker_init``, before
    the consumer is built)."""
    app.steps["consumer"].add(GreenCredit)
