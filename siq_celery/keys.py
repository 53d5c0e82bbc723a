"""Queue names and the store keys derived from them.

All keys of one queue share the Redis Cluster hash tag ``{<queue>}``, so every script of
a queue runs on one cluster node: ``siq:{geocoder}:state``, ``siq:{geocoder}:finished``,
``siq:{geocoder}:ledger``.

Queues that one script must use together (several limits on one task) must share a hash
slot: a name may start with its own tag, ``{geo}per-second`` and ``{geo}per-day``, whose
keys are ``siq:{geo}per-second:state`` and ``siq:{geo}per-day:state``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

from .errors import InvalidQueueNameError

MAX_QUEUE_NAME = 200
DEFAULT_KEY_PREFIX = "siq"
# Braces would break the hash tag, whitespace and control characters break CLI use and
# logs, and glob characters would make `siq status PATTERN` ambiguous.
_FORBIDDEN = re.compile(r"[{}\s*?\[\]\\\x00-\x1f\x7f\ud800-\udfff]")
_TAGGED = re.compile(r"^\{([^{}]+)\}(.+)$", re.S)  # "{group}rest": a hash tag of its own
_PREFIX = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


def validate_queue_name(name: object) -> str:
    """Return ``name`` if it is usable as a queue name, else raise InvalidQueueNameError."""
    if not isinstance(name, str):
        raise InvalidQueueNameError(f"queue name must be a string, not {type(name).__name__}")
    if not name:
        raise InvalidQueueNameError("queue name is empty")
    if len(name) > MAX_QUEUE_NAME:
        raise InvalidQueueNameError(
            f"queue name {name[:40]!r}... is {len(name)} characters; the limit is {MAX_QUEUE_NAME}"
        )
    tagged = _TAGGED.match(name)
    if bad := _FORBIDDEN.search(tagged.group(1) + tagged.group(2) if tagged else name):
        raise InvalidQueueNameError(
            f"queue name {name!r} contains {bad.group()!r}; braces (except a leading hash tag, "
            f"'{{group}}rest'), whitespace, control and "
            f"glob characters (* ? [ ] \\) and lone surrogates (bytes that are not UTF-8) are not allowed"
        )
    return name


def validate_key_prefix(prefix: str) -> str:
    if not _PREFIX.match(prefix):
        raise InvalidQueueNameError(
            f"key prefix {prefix!r} must be 1-64 characters of letters, digits, '_', '.', ':', '-'"
        )
    return prefix


@dataclass(frozen=True)
class QueueKeys:
    """The store keys of one queue."""

    prefix: str
    queue: str

    @cached_property
    def base(self) -> str:
        """``prefix:{queue}``, or ``prefix:{group}rest`` for a name with its own tag."""
        tagged = self.queue.startswith("{")
        return f"{self.prefix}:{self.queue}" if tagged else f"{self.prefix}:{{{self.queue}}}"

    @property
    def state(self) -> str:
        return f"{self.base}:state"

    @property
    def finished(self) -> str:
        return f"{self.base}:finished"

    @property
    def wake(self) -> str:
        """The pub/sub channel of the queue's wakes (a lease given back under a cap):
        ``"<next ticket> <store time>"``, read by waiters (backends/redis.py, Wakes)."""
        return f"{self.base}:wake"

    @property
    def ledger(self) -> str:
        return f"{self.base}:ledger"

    @property
    def parked(self) -> str:
        return f"{self.base}:parked"

    @property
    def parked_messages(self) -> str:
        return f"{self.base}:parked:msg"

    @property
    def releasing(self) -> str:
        return f"{self.base}:releasing"

    @property
    def intervals(self) -> str:
        """Where the interval comes from: declarations and an override (see siq_sources)."""
        return f"{self.base}:intervals"

    @property
    def refused(self) -> str:
        """The queue's counters, for the exporter: of refused starts (duplicate, reclaim)
        and of authorized ones (rules.start_counts). (Named for the first ones it held.)"""
        return f"{self.base}:refused"

    @property
    def unfinished(self) -> str:
        """Per task id, its authorized starts without a finish (siq_unfinished in the Lua prelude)."""
        return f"{self.base}:unfinished"

    @property
    def window(self) -> str:
        """The starts a window quota counts: sorted set, score = start time (siq_units in the Lua prelude)."""
        return f"{self.base}:window"

    @property
    def leases(self) -> str:
        """The leases a concurrency cap counts: sorted set, member = lease, score = expiry
        (siq_read_leases in the Lua prelude)."""
        return f"{self.base}:leases"

    @property
    def fair(self) -> str:
        """Fair shares (rules.FairLines): the keys with waiting tasks, sorted set, member =
        fairness key, score = its head's start tag (siq_fair_* in the Lua prelude). Its
        presence pins the queue's keys (idle expiry), as parked tasks do."""
        return f"{self.base}:fair"

    @property
    def fair_finish(self) -> str:
        """Fair shares: the finish tags kept, sorted set, member = fairness key."""
        return f"{self.base}:fair:finish"

    @property
    def fair_weight(self) -> str:
        """Fair shares: hash, fairness key -> its weight (the keys with waiting tasks)."""
        return f"{self.base}:fair:weight"

    @property
    def fair_messages(self) -> str:
        """Fair shares: hash, task id -> message, of the tasks waiting in the fair lines."""
        return f"{self.base}:fair:msg"

    @property
    def fair_waiting(self) -> str:
        """Fair shares: the keys with tasks waiting, sorted set, member = fairness key, score
        = the tasks waiting in its line (who waits most: Backend.fair_backlog)."""
        return f"{self.base}:fair:waiting"

    def fair_line(self, key: str) -> str:
        """Fair shares: the line of fairness key ``key``, a list of '<cost>|<task id>'. Its
        name has a brace after the hash tag, which no queue name has there, so it never
        meets a key of another queue (scripts build it: siq_fair_line)."""
        return f"{self.fair}{{{key}}}"

    @property
    def fair_keys(self) -> tuple[str, ...]:
        """The fixed keys of the fair shares, in the order the Lua scripts take them."""
        return (self.fair, self.fair_finish, self.fair_weight, self.fair_messages, self.fair_waiting)

    @cached_property
    def all(self) -> tuple[str, ...]:
        """Every key a script of the queue may touch, in the order the Lua scripts take
        them (worked out once per QueueKeys: the backends keep one per queue name), but
        the fair shares' other keys (:attr:`fair_keys`, and a line per fairness key)."""
        return (
            self.state, self.finished, self.ledger, self.parked, self.parked_messages, self.releasing, self.intervals,
            self.refused, self.unfinished, self.window, self.leases, self.fair,
        )  # fmt: skip

    @classmethod
    def for_queue(cls, queue: str, prefix: str = DEFAULT_KEY_PREFIX) -> QueueKeys:
        return cls(validate_key_prefix(prefix), validate_queue_name(queue))

    @staticmethod
    def queue_from_state_key(key: str, suffix: str = "state") -> str | None:
        """Recover the queue name from a state key, or another key ending in ``:suffix``
        (for listing queues)."""
        start, end = key.find(":{"), len(key) - len(suffix) - 1
        if start < 0 or not key.endswith(f":{suffix}") or end <= start + 2:
            return None
        rest = key[start + 1 : end]
        if rest.count("{") == 1 and rest.endswith("}"):
            return rest[1:-1]  # prefix:{queue}:state
        return rest  # prefix:{group}rest:state
