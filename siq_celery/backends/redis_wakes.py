"""Wakes on the Redis store: the scripts publish on a queue's wake channel when a lease is
given back under a cap, and :class:`Wakes`, one reader per process on a pub/sub connection
of its own, wakes the start waiting for it at once instead of at its next poll."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ..rules import FREE
from .redis_client import redis

logger = logging.getLogger("siq_celery")
_FORK_HOOK: list[bool] = []  # registered once a process


class Wakes:
    """This process's reader of its queues' wake channels (keys.py: ``wake``; the scripts
    publish ``"<next ticket> <store time>"`` when a lease is given back under a cap:
    ``siq_wake``), on a pub/sub connection of its own. A
    channel is subscribed while a start of its queue waits (its first held wait to the end
    of its wait: :meth:`done`), so the server keeps no messages for a process that is not
    waiting; one waiter reads at a time (another thread of the process polls). A wake counts
    once, for a waiter whose last answer came before it. Any error (a user whose ACL has no
    channels, a lost connection) turns the wakes off for a while: the waiters poll, as
    without them. Every wait is bounded by its ``seconds`` but for the connect of a wait
    that subscribes first (the caller naps what is left)."""

    OFF_S = 60.0  #: after a refusal (no channel permission), the waiters poll this long before subscribing again

    def __init__(self, connect: Callable[[], Any]) -> None:
        self._connect = connect
        self._forked()
        self._told = False  # the refusal was logged at INFO in this process
        if not _FORK_HOOK:  # the first one registers the hook (nothing at import; a child inherits it)
            _FORK_HOOK.append(True)
            os.register_at_fork(after_in_child=_wakes_forked)
        _ALL_WAKES.add(self)

    def _forked(self) -> None:
        """A new process (or a fresh object): never its parent's socket, lock or wakes."""
        self._lock = threading.Lock()
        self._conn: Any = None
        self._channels: set[str] = set()
        self._seen: dict[str, tuple[int, int]] = {}  # channel -> (next ticket, store time) of its last wake
        self._off_until = 0.0

    @property
    def subscribed(self) -> bool:
        """Some channel is subscribed (a start of this process waits, or just did)."""
        return bool(self._channels)

    @property
    def on(self) -> bool:
        """Not turned off by an error (in this process) for the while it lasts."""
        return time.monotonic() >= self._off_until

    def wait(self, channel: str, ticket: int, after_us: int, seconds: float) -> bool | None:
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if time.monotonic() < self._off_until:
                return None
            end = time.monotonic() + seconds
            try:
                if self._conn is None:
                    self._conn = self._connect()
                if channel not in self._channels:
                    self._conn.subscribe(channel)  # its confirmation is read below, as a message
                    self._channels.add(channel)
                while not self._woken(channel, ticket, after_us):
                    # A socket's timeout is rounded up to a whole millisecond (poll): read for
                    # the whole ones left; the caller naps the rest, precisely.
                    whole_ms = math.floor((end - time.monotonic()) * 1000)
                    if whole_ms <= 0:
                        return False
                    self._take(self._conn.get_message(timeout=whole_ms / 1000))
                del self._seen[channel]  # used: the waiter asks again, and its answer comes after it
                return True
            except Exception as exc:  # never into a start: refused (ACL): a while; anything else: 1 s
                self._off(exc)
                return None
        finally:
            self._lock.release()

    def done(self, channel: str) -> None:
        """The start that waited on ``channel`` is no longer waiting: unsubscribe (sent, its
        confirmation read with the next wait), so no message waits for this process."""
        if channel not in self._channels or not self._lock.acquire(blocking=False):
            return
        try:
            self._channels.discard(channel)
            self._seen.pop(channel, None)
            self._conn.unsubscribe(channel)
        except Exception as exc:
            self._off(exc)
        finally:
            self._lock.release()

    def close(self) -> None:
        """Let every channel go and close the connection (the backend's close)."""
        with self._lock:
            if self._conn is not None:
                with contextlib.suppress(Exception):
                    self._conn.close()
            self._conn, self._channels, self._seen = None, set(), {}

    def _off(self, exc: BaseException) -> None:
        refused = isinstance(exc, redis.ResponseError)
        off = self.OFF_S if refused else 1.0
        # Said once a process at INFO (a user without channels would hear it every minute).
        level = logging.DEBUG if refused and self._told else logging.INFO
        self._told = self._told or refused
        hint = " (grant the store's user its channels: &siq:* +publish +subscribe)" if refused else ""
        logger.log(level, "siq_celery: queue wakes are off for %.0fs, starts poll instead: %s: %s%s",
                   off, type(exc).__name__, exc, hint)  # fmt: skip
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
        self._conn, self._channels, self._seen, self._off_until = None, set(), {}, time.monotonic() + off

    def _take(self, message: Any) -> None:
        """Keep the last wake of a channel (a connection's messages come in order); skip what
        is not one (a confirmation, a message of another publisher)."""
        if not message or message.get("type") not in (b"message", "message"):
            return
        try:
            channel = message["channel"].decode() if isinstance(message["channel"], bytes) else message["channel"]
            number, at = (int(x) for x in message["data"].split())
        except (ValueError, TypeError, AttributeError, UnicodeDecodeError):
            return
        self._seen[channel] = (number, at)

    def _woken(self, channel: str, ticket: int, after_us: int) -> bool:
        wake = self._seen.get(channel)
        return wake is not None and wake[1] > after_us and (ticket == FREE or ticket <= wake[0])


#: Every Wakes of this process: a forked child starts each afresh (os.register_at_fork).
_ALL_WAKES: weakref.WeakSet[Wakes] = weakref.WeakSet()


def _wakes_forked() -> None:
    for wakes in list(_ALL_WAKES):
        wakes._forked()
