"""A queue's shared state as a whole, for every worker at once, not one start's: created or
checked, declared (a worker's start), its interval and limits overridden, paused and
resumed, its starts held for a while (a back-off: a service answered 429), reset, deleted,
its status read; one store operation each, no wait. :class:`~siq_celery.IntervalQueue` has
these from :class:`QueueControl`. :func:`who` names the process that acted, for the record
(the ``siq`` commands and the nodes' declarations name themselves with it too).
"""

from __future__ import annotations

import getpass
import os
import secrets
import socket
from typing import TYPE_CHECKING

from ..backends import Backend
from ..errors import ConfigurationError, IntervalMismatchError, QueueExistsError, QueueNotFoundError
from ..intervals import MAX_BACKOFF_US, IntervalLike, format_interval, parse_duration, parse_interval
from ..limits import QuotaLike, format_limits, limits_override
from ..types import Declared, Limits, QueueState, QueueStatus

RESUME_GRACE_S = 1.0  # the longest paused poll of wait_for_turn
MAX_RESUME_GRACE_S = 86_400.0  # one day, like the longest interval


def new_epoch() -> str:
    return secrets.token_hex(8)


def who(node: str = "") -> str:
    """This process, for the record of who changed an interval: ``user@host pid N``, after
    the worker ``node``'s name if given."""
    try:
        user = getpass.getuser()
    except Exception:  # no user name in a container without a passwd entry
        user = str(os.getuid())
    me = f"{user}@{socket.gethostname()} pid {os.getpid()}"
    return f"{node} ({me})" if node else me


class QueueControl:
    """What an :class:`~siq_celery.IntervalQueue` does to its queue's shared state, for
    every worker at once (its ``name`` in its ``backend``, with the ``interval_us`` and
    ``limits`` it was built with)."""

    if TYPE_CHECKING:  # set by IntervalQueue.__init__
        name: str
        backend: Backend
        interval_us: int | None
        limits: Limits

    def ensure(
        self, interval: IntervalLike | None = None, *, reset: bool = False, fail_if_exists: bool = False
    ) -> QueueState:
        """Create the queue's shared state, or check the existing one.

        An existing queue keeps its stored interval: a different ``interval`` here raises
        IntervalMismatchError (nothing is changed) because the stored one may have been set
        on purpose by an operator; use :meth:`set_interval` to change it, or
        ``reset=True`` to start the queue afresh with this interval. An ``interval`` given
        here acts on the store; this object keeps its own (:meth:`_adopt`).
        """
        interval_us = self._adopt(interval, "ensure")
        if reset:
            return self.backend.reset(self.name, interval_us, new_epoch(), who(), limits=self.limits)
        state, created = self.backend.ensure(self.name, interval_us, new_epoch(), limits=self.limits)
        if not created:
            if fail_if_exists:
                raise QueueExistsError(f"queue {self.name!r} already exists (fail_if_exists=True)")
            if state.limits != self.limits:
                raise IntervalMismatchError(
                    f"queue {self.name!r} is stored with {format_limits(state.limits)}, not "
                    f"{format_limits(self.limits)}; the stored ones stay in force. A worker start with this "
                    f"code (or declare()) makes them the queue's"
                )
            if state.declared_interval_us != interval_us:
                raise IntervalMismatchError(
                    f"queue {self.name!r} is stored with interval {format_interval(state.declared_interval_us)}, "
                    f"not {format_interval(interval_us)}; the stored one stays in force. Change it "
                    f"for every worker with set_interval({format_interval(interval_us)!r}) or "
                    f"`celery siq set-interval {self.name} {format_interval(interval_us)}`"
                )
        return state

    def _adopt(self, interval: IntervalLike | None, caller: str) -> int:
        """The interval an ``ensure`` or ``declare`` call acts with: the one given, else this
        object's. An object built without an interval takes the first one it is given (its
        claims then create a lost state with it); one with its own keeps it, since the app
        caches one object per declaration and a worker's renewals declare its interval."""
        interval_us = parse_interval(interval) if interval is not None else self.interval_us
        if interval_us is None:
            raise ConfigurationError(f"queue {self.name!r}: {caller}() needs an interval")
        if self.interval_us is None:
            self.interval_us = interval_us
        return interval_us

    def status(self) -> QueueStatus:
        """Ticket, current, backlog, interval, paused, epoch, last and next start."""
        status = self.backend.status(self.name)
        if status is None:
            raise QueueNotFoundError(f"queue {self.name!r} has no state in this store")
        return status

    def pause(self) -> QueueState:
        """Stop all starts of this queue, for every worker, until :meth:`resume`."""
        return self.backend.pause(self.name)

    def resume(self, grace: float = RESUME_GRACE_S) -> QueueState:
        """Continue in ticket order, the first start ``grace`` seconds from now.

        Waiters of a paused queue poll it (in-process waiters at most every second, Celery
        tasks every ``siq_paused_poll``); the grace lets each of them come back before its
        slot, so the line resumes in ticket order. ``grace=0`` restarts at once."""
        if not grace <= MAX_RESUME_GRACE_S:  # also NaN
            raise ConfigurationError(f"queue {self.name!r}: a resume grace of {grace!r} s is over one day")
        return self.backend.resume(self.name, round(max(grace, 0.0) * 1e6))

    def set_interval(self, interval: IntervalLike | None, *, origin: str | None = None) -> QueueState:
        """Override the shared interval at runtime, for every worker, from the next start
        (recorded with ``origin``, by default this user, host and process). The override
        holds across worker restarts whose code declares the same interval; a deploy that
        declares a different one replaces it. ``None`` clears it: back to the declaration."""
        interval_us = parse_interval(interval) if interval is not None else None
        return self.backend.set_interval(self.name, interval_us, origin or who())

    def set_limits(
        self, *, burst: int | str | None = None, quota: QuotaLike | None = None, concurrency: int | str | None = None,
        margin: IntervalLike | None = None, clear: bool = False, origin: str | None = None,
    ) -> QueueState:  # fmt: skip
        """Override some of the shared limits at runtime, for every worker, from the next
        start (recorded with ``origin``, by default this user, host and process): the kinds
        given (``burst``; ``quota`` ``"100/1m"``, or ``"none"``; ``concurrency`` N, or
        ``"none"``; ``margin`` ``"5ms"``, or ``"none"``) replace the declared ones, the
        others keep theirs (an earlier override of them stays). Each kind's override holds
        across worker restarts whose code declares the same value for it; a deploy that
        declares another replaces it.
        ``clear=True`` removes every override of the limits: back to the declarations."""
        override = limits_override(burst, quota, concurrency, margin)
        if clear == bool(override):
            raise ConfigurationError(
                f"queue {self.name!r}: set_limits() takes burst=, quota=, concurrency= or margin=, or clear=True "
                f"(not both)"
            )
        return self.backend.set_limits(self.name, None if clear else override, origin or who())

    def declare(
        self, interval: IntervalLike | None = None, *, node: str = "", ttl: float = 0.0, announce: bool = True,
        origin: str | None = None,
    ) -> Declared:  # fmt: skip
        """Declare the interval the code wants (default: this object's), creating the
        queue's state if missing. A declaration that differs from the last one becomes the
        declaration and the effective interval at once, replacing an operator's override
        (a deploy that changed ``interval=``): what a worker does at start, and ``siq
        sync`` for scripts. ``node`` registers it as a live worker's for ``ttl`` seconds
        (the queue never runs faster than its slowest live declaration); ``announce=False``
        only renews it. This object's limits (burst, quota, concurrency) are declared with
        it, by the same rules: the strictest live declaration holds, and an announcement
        that changes a kind replaces that kind's override. An ``interval`` given here acts
        on the store; this object keeps its own (:meth:`_adopt`)."""
        interval_us = self._adopt(interval, "declare")
        return self.backend.declare(
            self.name, interval_us, new_epoch(), node=node, ttl_us=round(ttl * 1e6), origin=origin or who(node),
            announce=announce, limits=self.limits,
        )  # fmt: skip

    def reset(self) -> QueueState:
        """Start afresh: new epoch (outstanding tickets re-claim), pause cleared; the last
        start and finished-task records are kept, so no burst and no re-run follow."""
        return self.backend.reset(self.name, self.interval_us, new_epoch(), who(), limits=self.limits)

    def delete(self) -> bool:
        """Remove the queue's state entirely. True if there was any."""
        return self.backend.delete(self.name)

    def backoff(self, seconds: IntervalLike, *, keep_first: bool = False) -> QueueState:
        """Hold every start of this queue, on every worker, for ``seconds`` from now (a
        service answered 429 with Retry-After). The line keeps its order; a back-off
        never brings a start closer than the interval. ``keep_first``: the first slot
        after the hold is kept for a passed-over ticket (the task that backed off)."""
        hold = parse_duration(seconds)
        if hold > MAX_BACKOFF_US:
            raise ConfigurationError(f"queue {self.name!r}: a back-off is at most a day, not {seconds!r}")
        return self.backend.backoff(self.name, hold, keep_first)
