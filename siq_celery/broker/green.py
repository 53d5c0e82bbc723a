"""What a worker process on a green pool (``-P gevent``, ``-P eventlet``) does differently
in the wait for a slot: :data:`GREEN` is set at worker start (tasks/worker_hooks.py). The others:
broker/admission.py (its waiting tasks take their turn in ticket order), broker/green_credit.py (its
consumer's credit on the Redis broker), broker/restore.py (a dead worker's tasks on the
Redis broker), and queue.IntervalQueue.settle (a late reply re-stamped without waiting).

Sleeping to a slot precisely.

A gevent or eventlet hub wakes a sleeping greenlet from its event loop, which waits on
epoll in whole milliseconds rounded up: ``time.sleep(0.0004)`` (patched) returns after
about a millisecond (measured: 0.54 ms late at the median, 0.95 ms p90), and the last nap
of a wait, the one that ends at the slot, ended that late: at a 10 ms interval, a
twentieth of the rate at least. Prefork's ``time.sleep`` is exact to tens of microseconds.
(gevent's ``linux_iouring`` backend, ``GEVENT_BACKEND=linux_iouring``, is: 0.07 ms.)

:func:`nap`, when :data:`GREEN` is set (a green pool's worker process, tasks/worker_hooks.py),
sleeps a short nap (up to :data:`PRECISE_BELOW_S`, the last one before a slot: see
waiting._sleep_before_asking) with the hub's timer until :data:`SPIN_S` before its end, then
yields (``time.sleep(0)``: other greenlets run, the hub polls its sockets) until the end;
longer naps end a few milliseconds before the slot anyway, and only the hub's timer is
used. Elsewhere it is ``time.sleep``. Only the tasks let in to ask for their slot (two per
queue and process: broker/admission.py) nap, so the yielding costs well under a millisecond of
CPU per start.
"""

from __future__ import annotations

import time

#: Whether this process runs on a green pool (set at worker start).
GREEN = False
#: Naps up to this long end precisely on a green pool (queue.COARSE_WAIT_S).
PRECISE_BELOW_S = 0.005
#: ... their last this long spent yielding, not on the hub's timer (which may fire up to a
#: millisecond late).
SPIN_S = 0.0012


def nap(seconds: float) -> None:
    """Sleep ``seconds`` (a short nap precisely on a green pool too)."""
    if not GREEN or seconds > PRECISE_BELOW_S:
        time.sleep(seconds)  # looked up at call time: a patched module's, if patched
        return
    end = time.monotonic() + seconds
    if seconds > SPIN_S:
        time.sleep(seconds - SPIN_S)
    while time.monotonic() < end:
        time.sleep(0)  # yield to the hub and the other greenlets
