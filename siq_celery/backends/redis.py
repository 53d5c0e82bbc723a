"""Redis state store: one Lua script per operation, time from Redis ``TIME``.

Every key a script touches is passed in ``KEYS`` and carries the queue's hash tag, so
the same scripts run on a single server, behind Sentinel, or on Redis Cluster.

URLs: ``redis://[[user]:password@]host:port/db``, ``rediss://`` (TLS), ``unix:///path.sock``,
``redis+cluster://host:port[,host:port...]`` (``rediss+cluster://`` for TLS), and
``redis+sentinel://[[user]:password@]host:port[,host:port...]/service_name[/db]``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from importlib import resources
from typing import Any, ClassVar
from urllib.parse import parse_qsl, unquote, urlsplit

from ..errors import (
    ConfigurationError,
    CorruptStateError,
    MissingDependencyError,
    QueueNotFoundError,
    SiqError,
    StoreUnavailableError,
    redacted,
    redacted_url,
)
from ..keys import QueueKeys
from ..ledger import BeganEntry, FinishEntry, LedgerRow, StartRecord, join_finishes
from ..lru import LRUCache
from ..parked import FairBacklog, FairTask, ParkedTask, Release
from ..rules import FREE, counts_from_fields, fair_check
from ..types import (
    NO_LIMITS,
    NO_OVERRIDE,
    ClaimResult,
    Decision,
    Declared,
    IntervalSources,
    Limits,
    LimitsOverride,
    NodeDeclaration,
    QueueState,
    QueueStatus,
    Verdict,
)
from .base import (
    IDLE_EXPIRY_REMEMBERED,
    RELEASE_LEASE_US,
    RELEASE_LIMIT,
    Backend,
    PendingClaim,
    check_top,
    no_interval_yet,
)
from .stored import log_unreadable_sources, match_names

try:
    import redis
    from redis.backoff import NoBackoff
    from redis.cluster import ClusterNode, RedisCluster
    from redis.exceptions import RedisClusterException  # not on the top-level module before redis-py 5.1
    from redis.retry import Retry
    from redis.sentinel import Sentinel
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingDependencyError("the Redis state store needs redis-py: pip install 'siq_celery[redis]'") from exc

logger = logging.getLogger("siq_celery")

#: The Redis ACL a siq_celery user needs (docs/stores.md, "Redis ACL"): its scripts, the commands
#: they call, SCAN/DEL for listing and deleting queues, TIME (a worker compares its clock
#: with the store's) and SELECT (a database other than 0), on its own keys only; PUBLISH and
#: SUBSCRIBE on its own channels (the queues' wakes: :class:`Wakes`; without them, starts poll).
ACL_RULES = (
    "~siq:*", "resetchannels", "&siq:*", "+publish", "+subscribe",
    "+evalsha", "+eval", "+script|load", "+ping", "+select", "+scan", "+del", "+exists", "+pexpire", "+persist",
    "+time", "+hmget", "+hset", "+zscore", "+zadd", "+zremrangebyscore", "+zremrangebyrank", "+zcard",
    "+xadd", "+xrange", "+hget", "+hgetall", "+hdel", "+zrange", "+zrangebyscore", "+zrem", "+hincrby", "+zcount",
    "+wait", "+rpush", "+lpop", "+llen", "+hexists", "+hlen",
)  # fmt: skip

SCRIPTS = (
    "claim", "start", "restamp", "finish", "ensure", "pause", "resume", "set_interval", "reset", "status",
    "park", "release", "unpark", "backoff", "start_all", "declare", "renew", "set_limits", "fair_park", "delete",
    "fair_backlog", "began",
)  # fmt: skip


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
_FORK_HOOK: list[bool] = []  # registered once a process


def _wakes_forked() -> None:
    for wakes in list(_ALL_WAKES):
        wakes._forked()


#: Errors of the conversation with the server rather than of one operation. On Redis
#: Cluster also CLUSTERDOWN (every node answers it to every key while a master is failed and
#: not yet replaced, so queues on the surviving masters stop too: nothing ran) and redis-py's
#: ClusterError after too many redirections (a slot moving).
_UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, RedisClusterException, redis.exceptions.ClusterError)
_AUTHENTICATION = (redis.AuthenticationError, redis.exceptions.AuthenticationWrongNumberOfArgsError)
#: Whatever redis-py raises (its Cluster errors are not RedisErrors).
_REDIS_ERRORS = (redis.RedisError, RedisClusterException)
#: An error reply of siq_celery's own scripts (SIQNOTFOUND, SIQCORRUPT, SIQFAIR).
_OWN_REPLY = re.compile(r"\bSIQ[A-Z]+\b")


class Unreplicated(StoreUnavailableError):
    """A write (``reply``) that fewer than ``replicas`` replicas acknowledged in time."""

    def __init__(self, queue: str, name: str, reply: Any, acked: int, replicas: int, timeout_ms: int) -> None:
        super().__init__(
            f"queue {queue!r}: the store's {name} was acknowledged by {acked} of {replicas} replica(s) within "
            f"{timeout_ms} ms (siq_store_replicas): a master cut off from its replicas, or one whose replicas are "
            "down; nothing starts on it, and siq_celery asks Sentinel for the master again"
        )
        self.reply = reply


class Overtaken(StoreUnavailableError):
    """A start whose replicas acknowledged it an interval or more after it was made, when
    another start had come after it meanwhile: not used (its slot is spent)."""

    def __init__(self, queue: str, took_us: float) -> None:
        super().__init__(
            f"queue {queue!r}: the store's replicas acknowledged the start {took_us / 1000:.0f} ms after it was made, "
            "and a later start was authorized meanwhile; this one is not used (asking again)"
        )


def store_error(exc: Exception, queue: str | None = None) -> Exception:
    """The :class:`SiqError` for what redis-py raised while talking to the store: a
    refused login, a database the server does not have, a user the ACL does not allow, no
    answer, or options the client refused. Any other error reply of the server (READONLY
    from a replica after a failover, MASTERDOWN, LOADING, BUSY, OOM, ...) is the store
    unavailable: nothing starts on it (fail closed), the caller asks again. Only
    siq_celery's own replies (``SIQ...``, from its scripts) are returned as they are."""
    where = f"queue {queue!r}: " if queue else ""
    text = str(exc).split(" script:")[0]
    if isinstance(exc, _AUTHENTICATION):  # a ConnectionError to redis-py: checked first
        return StoreUnavailableError(
            f"{where}the Redis state store refused the login: authentication failed ({text}); check the "
            f"user name and password in the store URL"
        )
    if isinstance(exc, _UNREACHABLE):
        return StoreUnavailableError(f"{where}cannot reach the Redis state store: {exc}")
    if isinstance(exc, redis.ResponseError):
        if "DB index is out of range" in text or "invalid DB index" in text:
            return ConfigurationError(
                f"{where}the Redis server has no database with the number in the store URL ({text}): use one "
                f"it has, /0 to /15 unless its 'databases' setting allows more"
            )
        if "NOPERM" in text or "no permissions" in text:
            return ConfigurationError(
                f"{where}the Redis user may not run what siq_celery needs ({text}); "
                f"grant: ACL SETUSER <user> {' '.join(ACL_RULES)}"
            )
        if _OWN_REPLY.search(text):
            return exc
        return StoreUnavailableError(f"{where}the Redis state store refused the command: {text}")
    if isinstance(exc, _REDIS_ERRORS):  # e.g. an ssl_* option redis-py refuses when it connects
        return ConfigurationError(f"{where}the Redis client refused the store URL: {exc}")
    return exc


#: The prelude every script is loaded after, in this order (under ``siq_celery/``): the store's
#: own plumbing (``backends/lua/_*.lua``), then the rules of each limit kind, each beside its
#: Python twin (``rules/<kind>.lua`` and ``rules/<kind>.py``), the start decision that combines
#: them last. Lua's local functions must be defined before a function that calls them: each
#: file calls only what it or a file before it defines (tests/test_lua_layout.py).
PRELUDE = (
    "backends/lua/_store.lua", "backends/lua/_ledger.lua", "rules/declarations.lua", "rules/spacing.lua",
    "rules/tickets.lua", "rules/window.lua", "rules/concurrency.lua", "rules/fair.lua", "rules/counters.lua",
    "rules/line.lua",
)  # fmt: skip


def load_script_source(name: str) -> str:
    """The prelude (:data:`PRELUDE`, in its order) followed by the script ``name``, as one
    chunk (all shipped in the wheel)."""
    package = resources.files("siq_celery")
    parts = [package.joinpath(*path.split("/")) for path in (*PRELUDE, f"backends/lua/{name}.lua")]
    return "\n".join(part.read_text("utf-8") for part in parts)


#: How long a start or a finish waits for siq_store_replicas replicas to acknowledge it.
DEFAULT_REPLICA_TIMEOUT_MS = 1000
MAX_REPLICAS = 16

#: Seconds a store command may take before it counts as unreachable (a hung server or a
#: dropped network must not hold a worker forever), and to open a connection.
SOCKET_TIMEOUT_S = 5.0
SOCKET_CONNECT_TIMEOUT_S = 2.0
#: On a Sentinel URL, a master that hangs (stopped, or cut off by a partition) must be
#: given up soon enough for the retries to reach the replica Sentinel promotes: a command
#: may take this long (plus ``siq_store_replica_timeout`` when a start waits for replicas).
#: The store's commands are single scripts and bounded batches (ledger pages of 10,000 entries).
SENTINEL_SOCKET_TIMEOUT_S = 1.0
#: A Sentinel client asks a sentinel where the master is before a start or a finish, at
#: most this often (:meth:`RedisBackend._check_master`).
MASTER_CHECK_S = 0.5


def client_defaults() -> dict[str, Any]:
    """Options siq_celery gives its Redis clients unless the caller (or the URL) says
    otherwise: bounded timeouts, and no retry inside redis-py. A script whose reply was
    lost may have run: re-sending it blindly could claim a second ticket. siq_celery's
    own loops retry instead, knowing what each operation means (queue.wait_for_turn)."""
    return {
        "socket_timeout": SOCKET_TIMEOUT_S,
        "socket_connect_timeout": SOCKET_CONNECT_TIMEOUT_S,
        "retry": Retry(NoBackoff(), 0),
    }


def redis_client_from_url(url: str, **options: Any) -> Any:
    """A redis-py client (plain, Cluster or Sentinel master) for ``url``. Query options
    of the URL (``?socket_timeout=10``, ``?ssl_ca_certs=/path/ca.pem``) win over
    ``options``, which win over :func:`client_defaults`."""
    check_database(url)
    parts = urlsplit(url)
    scheme = parts.scheme
    options = {**client_defaults(), **options}
    if scheme in ("redis", "rediss", "unix"):
        return redis.Redis.from_url(url, **options)
    tls = scheme.startswith("rediss")
    hosts = _hosts(parts.netloc.rpartition("@")[2], url)
    username = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password else None
    query = dict(parse_qsl(parts.query))
    options.update(_connection_query(query, url))
    if scheme.endswith("+cluster"):
        cluster = RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in hosts],
            username=username,
            password=password,
            ssl=tls,
            **options,
        )
        # Around every command the cluster client has a retry loop of its own: after a
        # ConnectionError or a TimeoutError (the slot's master died or hung with the reply
        # unread) it refreshes the slot map and sends the command again. Since redis-py 6.0
        # ``retry`` rules it (none, above); before, ``cluster_error_retry_attempts`` did
        # (3, whatever ``retry`` said), and a claim whose reply was lost was claimed twice.
        if hasattr(cluster, "cluster_error_retry_attempts"):
            cluster.cluster_error_retry_attempts = 0
        return cluster
    if scheme.endswith("+sentinel"):
        path = [p for p in parts.path.split("/") if p]
        if not path:
            raise ConfigurationError(f"sentinel URL {redacted(url)!r} needs the service name: .../mymaster[/db]")
        db = int(path[1]) if len(path) > 1 else 0
        timeouts = {k: v for k, v in options.items() if k in ("socket_timeout", "socket_connect_timeout")}
        sentinel = Sentinel(hosts, sentinel_kwargs={"password": query.get("sentinel_password"), **timeouts})
        return sentinel.master_for(path[0], db=db, username=username, password=password, ssl=tls, **options)
    raise ConfigurationError(f"not a Redis URL: {redacted(url)!r}")


#: Values of siq_reply (the state, the store time, the status-only times, the limits).
STATE_REPLY = 15


def _claim_result(reply: Sequence[Any]) -> ClaimResult:
    first, n, epoch, base, floor, interval, now = reply[:7]
    window = tuple(int(v) for v in reply[7:])
    return ClaimResult(int(first), int(n), epoch.decode(), int(base), int(floor), int(interval), int(now), window)


def _bulk(value: str | int | bytes) -> bytes:
    """One argument as RESP writes it (a bulk string)."""
    data = value if isinstance(value, bytes) else str(value).encode()
    return b"$%d\r\n%s\r\n" % (len(data), data)


def _resp(*args: str | int | bytes, count: int | None = -1) -> bytes:
    """A command as RESP writes it: ``*<count>`` (``count``: the number of arguments of the
    whole command when ``args`` is only its start; None: no header, ``args`` are its end)
    and each argument as a bulk string."""
    head = b"" if count is None else b"*%d\r\n" % (len(args) if count == -1 else count)
    return head + b"".join(_bulk(a) for a in args)


def _limit_args(limits: Limits) -> list[int]:
    return [limits.burst, limits.quota, limits.window_us, limits.concurrency, limits.margin_us]


def _decision(reply: Sequence[Any]) -> Decision:
    """{verdict, ticket, now_us, wait_us, slot_us, interval_us, lease, full} (start.lua)."""
    verdict, number, now, wait, slot, interval, lease, full = reply
    return Decision(
        Verdict(verdict.decode()), int(number), int(now), int(wait), int(slot), int(interval), _text(lease),
        bool(int(full)),
    )  # fmt: skip


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _limits(values: Sequence[Any]) -> Limits | None:
    """siq_limits_reply: five values, -1 each for none."""
    burst, quota, window, conc, margin = (int(v) for v in values)
    return None if burst < 0 else Limits(burst, quota, window, conc, margin)


def _override(values: Sequence[Any]) -> LimitsOverride:
    """siq_override_reply: burst, quota, window, concurrency, margin; -1: that kind not overridden."""
    burst, quota, window, conc, margin = (int(v) for v in values)
    return LimitsOverride(
        None if burst < 0 else burst, None if quota < 0 else quota, window if quota >= 0 else 0,
        None if conc < 0 else conc, None if margin < 0 else margin,
    )  # fmt: skip


#: Values of siq_sources_reply before its nodes, and per node.
_SOURCES_FIXED, _SOURCES_PER_NODE = 18, 8


def _sources(reply: Sequence[Any]) -> IntervalSources:
    """siq_sources_reply: six interval fields, the declared limits, the limits override, its
    origin and time; then (node, interval, expires, five limits) per live node."""
    text = [v.decode() if isinstance(v, bytes) else str(v) for v in reply]
    nodes = tuple(
        sorted(
            (
                NodeDeclaration(text[i], int(text[i + 1]), int(text[i + 2]), _limits(text[i + 3 : i + 8]))
                for i in range(_SOURCES_FIXED, len(text), _SOURCES_PER_NODE)
            ),
            key=lambda n: n.node,
        )
    )
    return IntervalSources(
        int(text[0]), text[1], int(text[2]), int(text[3]), text[4], int(text[5]), nodes, _limits(text[6:11]),
        _override(text[11:16]), text[16], int(text[17]),
    )  # fmt: skip


def _ledger_entry(queue: str, raw: Mapping[bytes, bytes]) -> LedgerRow | FinishEntry | BeganEntry:
    f = {k.decode(): v.decode() for k, v in raw.items()}
    if f.get("e") == "f":
        return FinishEntry(f["id"], int(f["ft"]), f["o"], f.get("l"), f.get("x") != "1")
    if f.get("e") == "b":
        return BeganEntry(f["id"] or None, int(f["st"]), int(f["bt"]))
    return LedgerRow(
        queue, f["ep"], int(f["t"]), f["id"] or None, f["n"], int(f["sl"]), int(f["st"]), int(f["iv"]),
        deferrals=int(f["d"]), host=f["h"], pid=int(f["p"]), cost=int(f.get("c", 1)), burst=int(f.get("b", 0)),
        quota=int(f.get("q", 0)), window_us=int(f.get("w", 0)), concurrency=int(f.get("k", 0)),
        lease_us=int(f.get("lt", 0)), lease=f.get("l"), fair_key=f.get("fk", ""), fair_tag=int(f.get("ft", -1)),
        fair_weight=int(f.get("fw", 0)),
    )  # fmt: skip


def _fair_args(record: StartRecord | None) -> list[Any]:
    """A start's fair share for its ledger entry (start.lua: ARGV[23..25]; start_all.lua: the
    last three): key ('' none), tag, weight."""
    if record is None or not record.fair_key:
        return ["", -1, 0]
    return [record.fair_key, record.fair_tag, record.fair_weight]


def _connection_query(query: Mapping[str, str], url: str) -> dict[str, Any]:
    """TLS files and timeouts from a Cluster or Sentinel URL's query (a plain URL's query
    is read by redis-py itself)."""
    options: dict[str, Any] = {k: v for k, v in query.items() if k.startswith("ssl_")}
    for name in ("socket_timeout", "socket_connect_timeout"):
        if name in query:
            try:
                options[name] = float(query[name])
            except ValueError:
                raise ConfigurationError(
                    f"{name}={query[name]!r} in {redacted(url)!r} is not a number of seconds"
                ) from None
    return options


def check_database(url: str) -> None:
    """ConfigurationError unless ``url`` names its database by number, or not at all (0).
    redis-py reads ``redis://host/abc`` as database 0 without a word; a Cluster has only
    database 0."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    query = dict(parse_qsl(parts.query))
    where = f"in the store URL {redacted(url)!r}"
    if "db" in query and not query["db"].isdigit():
        raise ConfigurationError(f"the Redis database ?db={query['db']!r} {where} is not a number (0, 1, ...)")
    if scheme in ("redis", "rediss"):
        db = unquote(parts.path).strip("/")
        if db and not db.isdigit():
            raise ConfigurationError(f"the Redis database /{db} {where} is not a number: redis://host:6379/0")
    elif scheme.endswith("+cluster"):
        db = unquote(parts.path).strip("/")
        if db not in ("", "0"):
            raise ConfigurationError(f"a Redis Cluster has only database 0, not /{db} {where}")
    elif scheme.endswith("+sentinel"):
        path = [p for p in parts.path.split("/") if p]
        if len(path) > 1 and not path[1].isdigit():
            raise ConfigurationError(f"the Redis database /{path[1]} {where} is not a number: .../mymaster/0")


def _hosts(netloc: str, url: str) -> list[tuple[str, int]]:
    hosts = []
    for item in netloc.split(","):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigurationError(f"cannot read host:port {item!r} in {redacted(url)!r}")
        hosts.append((host.strip("[]"), int(port)))
    return hosts


class RedisBackend(Backend):
    schemes: ClassVar[tuple[str, ...]] = (
        "redis", "rediss", "unix", "redis+cluster", "rediss+cluster", "redis+sentinel", "rediss+sentinel",
    )  # fmt: skip

    def __init__(
        self, client: Any = None, *, connect: Callable[[], Any] | None = None, replicas: int = 0,
        replica_timeout_ms: int = DEFAULT_REPLICA_TIMEOUT_MS, **options: Any,
    ) -> None:  # fmt: skip
        """``client``: a redis-py client; or ``connect``, called on first use (a Cluster
        or Sentinel client connects when built, and a worker must be able to import its
        app while the store is down). ``replicas`` (``siq_store_replicas``): a start or a
        finish counts only once that many replicas acknowledged it (``WAIT``, at most
        ``replica_timeout_ms``), so a failover to one of them keeps it, and a master cut
        off from its replicas authorizes nothing (:meth:`_run_replicated`)."""
        super().__init__(**options)
        if isinstance(replicas, bool) or not isinstance(replicas, int) or not 0 <= replicas <= MAX_REPLICAS:
            raise ConfigurationError(
                f"siq_store_replicas takes a whole number from 0 to {MAX_REPLICAS}, not {replicas!r}"
            )
        self.replicas, self.replica_timeout_ms = replicas, max(int(replica_timeout_ms), 1)
        if (client is None) == (connect is None):
            raise ConfigurationError("RedisBackend takes exactly one of client= and connect=")
        self._client, self._connect = client, connect
        self._scripts: dict[str, Any] = {}
        self._spare: list[Any] = []  # connections for claims (_claim_connection), of this process
        self._spare_pid = os.getpid()
        self._master_checked = -MASTER_CHECK_S  # time.monotonic() of the last _check_master
        #: restamp_soon's connection (of this process), and the replies not read on it yet
        self._restamps: Any = None
        self._restamps_unread, self._restamps_pid = 0, os.getpid()
        self._restamps_lock = threading.Lock()
        self._soon_loaded: set[str] = set()  # the scripts loaded for that connection
        self._claim_parts: LRUCache[tuple[Any, ...], tuple[bytes, bytes]] = LRUCache(IDLE_EXPIRY_REMEMBERED)
        self._stale_slots = False  # Redis Cluster: a command failed unreachable (_refresh_slots)
        self._wakes = Wakes(self._wake_connection)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisBackend:
        check_database(url)  # now: the client connects on first use
        client_options = dict(options.pop("client_options", {}))
        if urlsplit(url).scheme.endswith("+cluster") and options.get("replicas"):
            # A cluster node's WAIT covers only the keys of that node, and a failover within the
            # cluster is not Sentinel's: the setting would be accepted and ignored.
            raise ConfigurationError(
                f"siq_store_replicas = {options['replicas']!r}: replica acknowledgement is for a Redis master "
                f"with replicas (redis:// or redis+sentinel://), not on a Redis Cluster ({redacted_url(url)}): "
                "set siq_store_replicas = 0"
            )
        if urlsplit(url).scheme.endswith("+sentinel") and "socket_timeout" not in client_options:
            wait_ms = options.get("replica_timeout_ms", DEFAULT_REPLICA_TIMEOUT_MS) if options.get("replicas") else 0
            client_options["socket_timeout"] = SENTINEL_SOCKET_TIMEOUT_S + wait_ms / 1000
        return cls(connect=lambda: redis_client_from_url(url, **client_options), **options)

    @property
    def client(self) -> Any:
        if self._client is None:
            assert self._connect is not None
            try:
                self._client = self._connect()
            except (*_AUTHENTICATION, *_UNREACHABLE) as exc:
                raise store_error(exc) from None
            except (ValueError, redis.RedisError) as exc:  # the URL itself (redis-py reads it here)
                raise ConfigurationError(f"the Redis state store URL is not usable: {exc}") from None
        return self._client

    def _script(self, name: str) -> Any:
        script = self._scripts.get(name)
        if script is None:
            script = self._scripts[name] = self.client.register_script(load_script_source(name))
        return script

    # -- plumbing -------------------------------------------------------------------

    def _now_arg(self) -> int | str:
        return self.clock() if self.clock else ""

    def _run_replicated(self, name: str, queue: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """:meth:`_run`, and then, with ``replicas``, ``WAIT`` for that many replicas to have
        it, in the same round trip (a pipeline on one connection). Fewer in time: the write
        stands on this master alone, which a failover may lose, or which may be an old master
        cut off by a partition, still taking writes until Sentinel demotes it. Then the
        connections are dropped (the next ones ask Sentinel for the master anew) and
        StoreUnavailableError is raised: ``unreplicated`` says what to undo first."""
        self._check_master()
        if not self.replicas or isinstance(self.client, RedisCluster):
            return self._run(name, queue, keys, args)
        script = self._script(name)
        for attempt in (1, 2):
            pipe = self.client.pipeline(transaction=False)
            pipe.evalsha(script.sha, len(keys), *keys, self._now_arg(), *args)
            pipe.execute_command("WAIT", self.replicas, self.replica_timeout_ms)
            try:
                reply, acked = pipe.execute()
            except redis.exceptions.NoScriptError:
                if attempt == 2:
                    raise StoreUnavailableError(f"queue {queue!r}: the store lost the {name} script twice") from None
                script.sha = self.client.script_load(script.script)  # flushed: the failed call did nothing
                continue
            except redis.ResponseError as exc:
                error = self._translate(exc, queue, keys[0])
                raise (store_error(exc, queue) if error is exc else error) from None
            except _REDIS_ERRORS as exc:
                raise store_error(exc, queue) from None
            if int(acked) < self.replicas:
                raise Unreplicated(queue, name, reply, int(acked), self.replicas, self.replica_timeout_ms)
            return reply
        raise AssertionError("unreachable")  # pragma: no cover

    def _check_master(self) -> None:
        """On a Sentinel URL: is the master this client's connections reach still the one
        the sentinels stand behind? A master stopped or cut off by a partition comes back a
        writable master, and stays one for about 10 s until Sentinel demotes it, while
        redis-py asks Sentinel only when it opens a connection (and believes the first
        sentinel that answers, which may not have heard of the failover yet): a process
        whose connection survived the partition would be authorized by the old master
        beside the new one. So before a start or a finish, at most every
        :data:`MASTER_CHECK_S`, every sentinel is asked (``SENTINEL MASTER``, about 0.1 ms
        each), and the views of the latest failover (the highest ``config-epoch``) decide:
        one that names another master drops every connection (the next ones ask that
        sentinel first); one that finds this master objectively down or being failed over
        refuses the write (StoreUnavailableError: the caller retries, as for a master that
        does not answer). No sentinel answers: the write goes on (fail open here;
        ``siq_store_replicas`` also fences a master cut off with its clients)."""
        pool: Any = getattr(self._client, "connection_pool", None)
        manager = getattr(pool, "sentinel_manager", None)
        if manager is None:  # not a Sentinel client (or not built yet)
            return
        now = time.monotonic()
        if now - self._master_checked < MASTER_CHECK_S:
            return
        known = getattr(getattr(pool, "proxy", pool), "master_address", None)  # redis-py >= 5.1 keeps it in a proxy
        if known is None:
            return  # no connection yet: the first one asks Sentinel
        known = (str(known[0]), int(known[1]))
        views = []
        for sentinel in manager.sentinels:
            try:
                state = sentinel.sentinel_master(pool.service_name)
                address = (str(state["ip"]), int(state["port"]))
                views.append((int(state.get("config-epoch", 0)), address, str(state.get("flags", "")), sentinel))
            except (*_REDIS_ERRORS, OSError, KeyError, TypeError, ValueError):
                continue
        latest = max((v[0] for v in views), default=0)
        views = [v for v in views if v[0] == latest]
        moved = next((v for v in views if v[1] != known), None)
        if moved is not None:
            logger.warning("siq_celery: Sentinel names %s:%s the master of %r, not %s:%s any more; reconnecting",
                           moved[1][0], moved[1][1], pool.service_name, *known)  # fmt: skip
            manager.sentinels.remove(moved[3])
            manager.sentinels.insert(0, moved[3])  # discover_master asks it first
            self._forget_master()
            return
        if any("o_down" in v[2] or "failover_in_progress" in v[2] for v in views):
            self._forget_master()
            raise StoreUnavailableError(
                f"Sentinel is failing over {pool.service_name!r} (its master {known[0]}:{known[1]} is down): "
                f"nothing starts until it names the new one"
            )
        self._master_checked = now

    def _forget_master(self) -> None:
        """Drop every connection, so the next command asks Sentinel where the master is."""
        with contextlib.suppress(Exception):
            self.client.connection_pool.disconnect()
        for conn in self._spare if self._spare_pid == os.getpid() else ():
            conn.disconnect()
        with self._restamps_lock:
            if self._restamps is not None and self._restamps_pid == os.getpid():
                self._restamps.disconnect()
            self._restamps, self._restamps_unread = None, 0

    def _refresh_slots(self) -> None:
        """Redis Cluster, before the first command after one failed unreachable: ask the
        cluster where the slots are now. redis-py refreshes its slot map right after the
        failure, which, just after a master died, still names the dead master; without a
        second look the first command after the replica's promotion fails too, and the
        waiters, backing off, start up to a second later than behind Sentinel (whose client
        asks Sentinel on every new connection)."""
        with contextlib.suppress(*_REDIS_ERRORS, OSError):  # no answer: the command says so
            self.client.nodes_manager.initialize()
            self._stale_slots = False

    def _run(self, name: str, queue: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        if self._stale_slots:
            self._refresh_slots()
        try:
            return self._script(name)(keys=list(keys), args=[self._now_arg(), *args])
        except redis.ResponseError as exc:
            error = self._translate(exc, queue, keys[0])
            raise (self._failed(exc, queue) if error is exc else error) from None
        except _REDIS_ERRORS as exc:
            raise self._failed(exc, queue) from None

    def _failed(self, exc: Exception, queue: str) -> Exception:
        """:func:`store_error`, noting on Cluster that the slot map may be out of date."""
        error = store_error(exc, queue)
        if isinstance(error, StoreUnavailableError) and isinstance(self._client, RedisCluster):
            self._stale_slots = True
        return error

    @staticmethod
    def _translate(exc: Exception, queue: str, key: str) -> Exception:
        text = str(exc)
        if "SIQNOTFOUND" in text:
            return QueueNotFoundError(f"queue {queue!r} has no state in this store (key {key!r})")
        if "SIQNOINTERVAL" in text:
            return no_interval_yet(queue)
        if "SIQCORRUPT" in text:
            _, _, rest = text.partition("SIQCORRUPT ")
            field, _, value = rest.partition(" ")
            return CorruptStateError(queue, key, field, value.split(" script:")[0])
        if "NOPERM" in text or "can't run this command" in text or "no permissions" in text:
            return ConfigurationError(
                f"queue {queue!r}: the Redis user may not run what siq_celery needs ({text.split(' script:')[0]}); "
                f"grant: ACL SETUSER <user> {' '.join(ACL_RULES)}"
            )
        if "non deterministic commands" in text or "Unknown Redis command called from Lua script" in text:
            # Redis before 5.0 replicates scripts whole, so it refuses a write after TIME.
            return ConfigurationError(
                f"queue {queue!r}: this Redis server is older than siq_celery needs: its scripts read the "
                f"server clock (TIME) before writing, which Redis allows from 5.0 on. Upgrade to Redis 5.0 "
                f"or newer ({text.split(' script:')[0]})"
            )
        if "WRONGTYPE" in text:
            return CorruptStateError(queue, key, "(key type)", "not a siq_celery value")
        return exc

    @staticmethod
    def _state(reply: Sequence[Any]) -> tuple[QueueState, int]:
        epoch = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
        numbers = [int(v) for v in reply[1:STATE_REPLY]]
        (interval, ticket, current, anchor, last_start, paused, now, started, held, burst, quota, window, conc,
         margin) = numbers  # fmt: skip
        state = QueueState(
            epoch, interval, ticket, current, anchor, last_start, bool(paused), started, held, burst, quota, window,
            conc, margin,
        )  # fmt: skip
        return state, now

    # -- operations -----------------------------------------------------------------

    def ensure(
        self, queue: str, interval_us: int, epoch: str, *, limits: Limits = NO_LIMITS
    ) -> tuple[QueueState, bool]:
        k = self.keys(queue)
        reply = self._run("ensure", queue, [k.state, k.window], [interval_us, epoch, *_limit_args(limits)])
        return self._state(reply[1:])[0], bool(reply[0])

    def claim(self, queue: str, count: int, interval_us: int, epoch: str, *, limits: Limits = NO_LIMITS) -> ClaimResult:
        k = self.keys(queue)
        args = [count, interval_us, epoch, self.idle_expiry_us(queue), *_limit_args(limits)]
        reply = self._run("claim", queue, k.all, args)
        return _claim_result(reply)

    def claim_later(
        self, queue: str, count: int, interval_us: int, epoch: str, *, limits: Limits = NO_LIMITS
    ) -> PendingClaim:
        """Write the claim's EVALSHA on a connection of its own and return; the reply is read
        by :meth:`PendingClaim.result` (a plain server only; Cluster claims at once)."""
        if isinstance(self.client, RedisCluster):
            return super().claim_later(queue, count, interval_us, epoch, limits=limits)
        try:
            conn, give_back = self._claim_connection()
        except _REDIS_ERRORS as exc:
            raise store_error(exc, queue) from None
        try:
            conn.send_packed_command([self._claim_command(queue, count, interval_us, epoch, limits)])
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            conn.disconnect()
            give_back(conn)
            raise StoreUnavailableError(f"queue {queue!r}: cannot reach the Redis state store: {exc}") from exc

        def fetch() -> ClaimResult:
            try:
                reply = conn.read_response()
            except redis.exceptions.NoScriptError:
                give_back(conn)  # the script was flushed: the failed call claimed nothing
                return self.claim(queue, count, interval_us, epoch, limits=limits)
            except redis.ResponseError as exc:
                give_back(conn)
                error = self._translate(exc, queue, self.keys(queue).all[0])
                raise (store_error(exc, queue) if error is exc else error) from None
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                conn.disconnect()
                give_back(conn)
                raise StoreUnavailableError(f"queue {queue!r}: cannot reach the Redis state store: {exc}") from exc
            give_back(conn)
            return _claim_result(reply)

        return PendingClaim(fetch)

    def _claim_connection(self) -> tuple[Any, Callable[[Any], None]]:
        """A connection for one claim sent now and read later, and what gives it back.

        Claims keep connections of their own, outside redis-py's pool: its checkout and
        return cost a publish as much as the claim's own send and receive (BENCHMARKS.md,
        "Publish cost with a window quota"). A list's ``pop`` and ``append`` are atomic, so
        threads and greenlets each take a different one, and a claim sent while another is
        unread (a publish inside a publish) opens a second; a forked child never uses its
        parent's sockets."""
        if self._spare_pid != os.getpid():
            self._spare, self._spare_pid = [], os.getpid()
        try:
            conn = self._spare.pop()
        except IndexError:
            pool = self.client.connection_pool
            conn = pool.connection_class(**pool.connection_kwargs)
        try:  # as the pool checks what it hands out: connected, and nothing unread on it
            conn.connect()
            if conn.can_read():  # closed by the server (its idle timeout, a failover)
                raise redis.ConnectionError("connection not ready")
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            conn.disconnect()
            try:
                conn.connect()
            except BaseException:
                self._spare.append(conn)
                raise
        return conn, self._spare.append

    def _claim_command(self, queue: str, count: int, interval_us: int, epoch: str, limits: Limits) -> bytes:
        """The claim's EVALSHA as it goes on the wire. With the store's clock everything but
        the epoch is the same from one claim of a queue to the next, so the rest is encoded
        once per queue and kept (redis-py's encoding of the 20 arguments is a third of a
        publish's own cost: BENCHMARKS.md, "Publish cost with a window quota")."""
        if self.clock:  # a pinned clock: a new time every claim
            keys = self.keys(queue).all
            args = (self._now_arg(), count, interval_us, epoch, self.idle_expiry_us(queue), *_limit_args(limits))
            return _resp("EVALSHA", self._script("claim").sha, len(keys), *keys, *args)
        idle = self.idle_expiry_us(queue)
        parts = self._claim_parts.get((queue, count, interval_us, idle, limits))
        if parts is None:
            keys = self.keys(queue).all
            head = ("EVALSHA", self._script("claim").sha, len(keys), *keys, "", count, interval_us)
            tail = (idle, *_limit_args(limits))
            parts = (_resp(*head, count=len(head) + 1 + len(tail)), _resp(*tail, count=None))
            self._claim_parts[(queue, count, interval_us, idle, limits)] = parts
        return parts[0] + _bulk(epoch) + parts[1]

    def start(
        self,
        queue: str,
        ticket: int,
        epoch: str,
        *,
        task_id: str | None,
        interval_us: int,
        new_epoch: str,
        record: StartRecord | None = None,
        cost: int = 1,
        limits: Limits = NO_LIMITS,
        lease: str = "",
        token: str = "",
        begin_wait_us: int = 0,
    ) -> Decision:
        k = self.keys(queue)
        lost = self._lost_args(task_id)
        member = self.lease_member(task_id, record, lease)  # the run's: the caller's task id
        if record is not None and self.ledger_max:
            ledger = [3 * self.ledger_max, record.task_name, record.host, record.pid, record.deferrals]
            task_id = task_id or record.task_id
        else:
            ledger = [0, "", "", 0, record.deferrals if record is not None else 0]  # deferrals: counted anyway
        reply = self._start_replicated(
            "start",
            queue,
            [(queue, epoch, limits.burst > 0)],
            k.all,
            [
                ticket,
                epoch,
                task_id or "",
                interval_us,
                new_epoch,
                *ledger,
                cost,
                self.idle_expiry_us(queue),
                *lost,
                *_limit_args(limits),
                member,
                self.lease_timeout_us,
                *_fair_args(record),
                token,
                begin_wait_us,
            ],
            cost,
        )
        return _decision(reply)

    def _start_replicated(
        self, name: str, queue: str, restamps: Sequence[tuple[str, str, bool]], keys: Sequence[str],
        args: Sequence[Any], cost: int = 1,
    ) -> Any:  # fmt: skip
        """A start script's reply, replicated (:meth:`_run_replicated`). An authorization too
        few replicas acknowledged is not used: its leases are given back (best effort: the
        slot is spent, a gap and never a second start) before StoreUnavailableError.

        One the replicas acknowledged only after an interval or more (a replica catching up
        after a failover: ``WAIT`` took up to ``siq_store_replica_timeout``) may have been
        followed by another start meanwhile, whose body would start beside this one's: each
        queue's start (``restamps``: queue, epoch, has a burst) is moved to now if it is
        still the last (restamp.lua), and if one is not, the authorization is not used
        either (:class:`Overtaken`)."""
        sent = time.monotonic() if self.replicas else 0.0  # the start path is hot: no clock without replicas
        try:
            reply = self._run_replicated(name, queue, keys, args)
        except Unreplicated as exc:
            self._forget_master()
            unused = exc.reply if name == "start_all" else [exc.reply]
            if all(_decision(r).verdict is not Verdict.AUTHORIZED for r in unused):
                return exc.reply  # nothing was authorized: a wait, a refusal, stands as it is
            self._give_back(unused, [q for q, _, _ in restamps])
            raise
        if not self.replicas:
            return reply
        took_us = (time.monotonic() - sent) * 1e6
        replies = reply if name == "start_all" else [reply]
        for r, (q, epoch, burst) in zip(replies, restamps, strict=True):
            decision = _decision(r)
            if decision.verdict is not Verdict.AUTHORIZED or burst or took_us < decision.interval_us:
                continue
            # Found by its last slot: a start of cost c recorded c - 1 intervals after it.
            now = self.restamp(q, epoch, decision.now_us + (cost - 1) * decision.interval_us)
            if now is None:
                self._give_back(replies, [q for q, _, _ in restamps])
                raise Overtaken(q, took_us)
            r[2] = now  # {verdict, ticket, now_us, ...}: the body starts now
        return reply

    def _give_back(self, replies: Sequence[Any], queues: Sequence[str]) -> None:
        """The leases of authorizations that are not used (best effort)."""
        for r, queue in zip(replies, queues, strict=True):
            decision = _decision(r)
            if decision.verdict is Verdict.AUTHORIZED and decision.lease:
                with contextlib.suppress(*_REDIS_ERRORS, SiqError):
                    self._finish(queue, decision.lease, "UNREPLICATED", remember=False, lease=decision.lease,
                                 replicated=False)  # fmt: skip

    def start_all(
        self,
        queues: Sequence[str],
        tickets: Sequence[int],
        epochs: Sequence[str],
        *,
        task_id: str | None,
        interval_us: Sequence[int],
        new_epoch: str,
        record: StartRecord | None = None,
        cost: int = 1,
        limits: Sequence[Limits] | None = None,
        lease: str = "",
        token: str = "",
        begin_wait_us: int = 0,
    ) -> list[Decision]:
        keys = [key for q in queues for key in self.keys(q).all]  # every key: idle expiry (siq_touch)
        each = list(limits) if limits is not None else [NO_LIMITS] * len(queues)
        lost = self._lost_args(task_id)
        member = self.lease_member(task_id, record, lease)  # the run's: the caller's task id
        if record is not None and self.ledger_max:
            ledger = [3 * self.ledger_max, record.task_name, record.host, record.pid, record.deferrals]
            task_id = task_id or record.task_id
        else:
            ledger = [0, "", "", 0, record.deferrals if record is not None else 0]  # deferrals: counted anyway
        per_queue = [
            v for q, t, e, i in zip(queues, tickets, epochs, interval_us, strict=True)
            for v in (t, e, i, self.idle_expiry_us(q))
        ]  # fmt: skip
        if isinstance(self.client, RedisCluster) and len({self.client.keyslot(k) for k in keys}) > 1:
            raise ConfigurationError(
                f"queues {list(queues)!r} are in different Redis Cluster hash slots, so one script cannot "
                f"start them together: name them with a shared hash tag, like '{{geo}}per-second' and "
                f"'{{geo}}per-day'"
            )
        per_limits = [v for lim in each for v in _limit_args(lim)]
        args = [task_id or "", *ledger, cost, new_epoch, *per_queue, *lost, *per_limits, member, self.lease_timeout_us,
                *_fair_args(record), token, begin_wait_us]  # fmt: skip
        restamps = [(q, e, lim.burst > 0) for q, e, lim in zip(queues, epochs, each, strict=True)]
        replies = self._start_replicated("start_all", queues[0], restamps, keys, args, cost)
        return [_decision(r) for r in replies]

    def _lost_args(self, task_id: str | None) -> list[int]:
        """The limit on starts without a finish (none without a task id of the caller's),
        their retention and the most kept: three arguments of the start scripts, before
        the limits (start.lua: ARGV[14..16]; start_all.lua: after the per-queue ones)."""
        limit = self.max_lost_deliveries if task_id is not None else 0
        return [limit, self.finished_retention_us, self.finished_max]

    def restamp(self, queue: str, epoch: str, started_us: int) -> int | None:
        k = self.keys(queue)
        now = int(self._run("restamp", queue, [k.state, k.window], [epoch, started_us]))
        return now or None

    def restamp_soon(self, queue: str, epoch: str, started_us: int) -> None:
        if isinstance(self.client, RedisCluster):
            super().restamp_soon(queue, epoch, started_us)
            return
        k = self.keys(queue)
        self._soon("restamp", [k.state, k.window], [epoch, started_us])

    @property
    def can_wake(self) -> bool:  # type: ignore[override]
        """Not with a pinned clock (tests), nor on a cluster (it polls), nor while the wakes
        are off (a user without channels, a lost connection: :class:`Wakes`)."""
        try:
            return self._reads_wakes() and self._wakes.on
        except SiqError:  # the store unreachable: no wake now
            return False

    def _reads_wakes(self) -> bool:
        """Not with a pinned clock (tests), nor on a cluster (it polls)."""
        return self.clock is None and not isinstance(self.client, RedisCluster)

    def wait_for_wake(self, queue: str, ticket: int, after_us: int, seconds: float) -> bool | None:
        if not self._reads_wakes():
            return None
        return self._wakes.wait(self.keys(queue).wake, ticket, after_us, seconds)

    def wake_done(self, queue: str) -> None:
        if self._wakes.subscribed:  # most starts never waited for a wake: nothing to build or send
            self._wakes.done(self.keys(queue).wake)

    def _wake_channel(self, k: QueueKeys) -> str:
        """Where the scripts publish the queue's wakes: none on a cluster (nobody reads them
        there, and a cluster's PUBLISH goes to every node)."""
        return "" if isinstance(self.client, RedisCluster) else k.wake

    def _wake_connection(self) -> Any:
        """A pub/sub reader of the client's (its own connection, kept subscribed: :class:`Wakes`)."""
        return self.client.pubsub()

    def began(self, queue: str, started_us: int, task_id: str = "", *, soon: bool = False) -> int | None:
        k = self.keys(queue)
        args = [started_us, 3 * self.ledger_max, task_id, int(soon)]
        at = int(self._run("began", queue, [k.state, k.window, k.ledger], args))
        return at or None

    def began_soon(self, queue: str, started_us: int, task_id: str = "") -> None:
        if isinstance(self.client, RedisCluster):
            super().began_soon(queue, started_us, task_id)
            return
        k = self.keys(queue)
        self._soon("began", [k.state, k.window, k.ledger], [started_us, 3 * self.ledger_max, task_id, 1])

    def _soon(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> None:
        """Write script ``name`` on a connection of this process's own and return (a
        re-stamp, a body's report: :meth:`restamp_soon`, :meth:`began_soon`); its reply is
        read (and dropped) before the next one is written there, by then long arrived. Best
        effort: an error drops the connection, and the next one reconnects. A Cluster client
        runs them at once."""
        with self._restamps_lock:
            if self._restamps_pid != os.getpid():  # a forked child never uses its parent's socket
                self._restamps, self._restamps_unread, self._restamps_pid = None, 0, os.getpid()
            try:
                if self._restamps is None:
                    self._restamps = self._claim_connection()[0]  # kept: never given back to the spares
                    self._restamps_unread, self._soon_loaded = 0, set()
                conn = self._restamps
                while self._restamps_unread:
                    self._restamps_unread -= 1
                    try:
                        conn.read_response()
                    except redis.exceptions.NoScriptError:  # flushed (a restart, a failover): load them again
                        self._soon_loaded.clear()
                    except redis.ResponseError:  # a corrupt state: the starts say so
                        pass
                if name not in self._soon_loaded:  # loaded first: a NOSCRIPT would only be read at the next one
                    script = self._script(name)
                    script.sha = self.client.script_load(script.script)
                    self._soon_loaded.add(name)
                sha = self._script(name).sha
                conn.send_packed_command([_resp("EVALSHA", sha, len(keys), *keys, self._now_arg(), *args)])
                self._restamps_unread += 1
            except (*_REDIS_ERRORS, OSError):  # the start stands as authorized; the next one reconnects
                if self._restamps is not None:
                    self._restamps.disconnect()
                self._restamps, self._restamps_unread = None, 0

    def finish(
        self, queue: str, task_id: str, outcome: str = "SUCCESS", *, remember: bool = True, lease: str = ""
    ) -> None:
        try:
            self._finish(queue, task_id, outcome, remember=remember, lease=lease, replicated=True)
        except Unreplicated:
            self._forget_master()
            raise

    def _finish(self, queue: str, task_id: str, outcome: str, *, remember: bool, lease: str, replicated: bool) -> None:
        k = self.keys(queue)
        (self._run_replicated if replicated else self._run)(
            "finish", queue,
            [k.finished, k.ledger, k.state, k.parked, k.parked_messages, k.releasing, k.intervals, k.unfinished,
             k.refused, k.window, k.leases, k.fair],
            [task_id, self.finished_retention_us, self.finished_max, 3 * self.ledger_max, outcome, int(remember),
             self.idle_expiry_us(queue), lease or task_id, self._wake_channel(k)],  # a lease: named by its task id
        )  # fmt: skip

    def renew_leases(self, queue: str, leases: Sequence[str]) -> int:
        if not leases:
            return 0
        return int(self._run("renew", queue, self.keys(queue).all, [self.lease_timeout_us, *leases]))

    def ledger(self, queue: str, since_us: int | None = None, until_us: int | None = None) -> Iterator[LedgerRow]:
        # Stream ids are the Redis clock's milliseconds: start reading at since's, and read
        # on to the end, where the finishes of the last starts in range are.
        k = self.keys(queue)
        low, high = since_us if since_us is not None else -1, until_us if until_us is not None else 1 << 62
        first = f"{max(low, 0) // 1000}-0" if self.clock is None else "-"  # a pinned clock is not the ids' clock
        return join_finishes(
            entry
            for entry in self._stream(queue, k.ledger, first)
            if not isinstance(entry, LedgerRow) or low <= entry.start_us < high
        )

    def _stream(
        self, queue: str, key: str, first: str, batch: int = 10_000
    ) -> Iterator[LedgerRow | FinishEntry | BeganEntry]:
        while True:
            try:
                entries = self.client.xrange(key, min=first, max="+", count=batch)
            except _REDIS_ERRORS as exc:
                raise store_error(exc, queue) from None
            for _, fields in entries:
                yield _ledger_entry(queue, fields)
            if len(entries) < batch:
                return
            ms, _, seq = entries[-1][0].decode().partition("-")
            first = f"{ms}-{int(seq) + 1}"

    def pause(self, queue: str, epoch: str = "") -> QueueState:
        return self._state(self._run("pause", queue, self.keys(queue).all, [epoch or secrets.token_hex(8)]))[0]

    def resume(self, queue: str, grace_us: int = 0) -> QueueState:
        args = [grace_us, self.idle_expiry_us(queue)]
        return self._state(self._run("resume", queue, self.keys(queue).all, args))[0]

    def set_interval(self, queue: str, interval_us: int | None, origin: str = "") -> QueueState:
        args = [interval_us or 0, origin, self.idle_expiry_us(queue)]
        reply = self._run("set_interval", queue, self.keys(queue).all, args)
        log_unreadable_sources(queue, self.keys(queue).intervals, [_text(v) for v in reply[STATE_REPLY:]])
        return self._state(reply)[0]

    def set_limits(self, queue: str, override: LimitsOverride | None, origin: str = "") -> QueueState:
        o = override or NO_OVERRIDE
        args = [
            -1 if o.burst is None else o.burst, -1 if o.quota is None else o.quota, o.window_us,
            -1 if o.concurrency is None else o.concurrency, origin, self.idle_expiry_us(queue),
            -1 if o.margin_us is None else o.margin_us,
        ]  # fmt: skip
        reply = self._run("set_limits", queue, self.keys(queue).all, args)
        log_unreadable_sources(queue, self.keys(queue).intervals, [_text(v) for v in reply[STATE_REPLY:]])
        return self._state(reply)[0]

    def declare(
        self,
        queue: str,
        interval_us: int,
        epoch: str,
        *,
        node: str = "",
        ttl_us: int = 0,
        origin: str = "",
        announce: bool = True,
        limits: Limits = NO_LIMITS,
    ) -> Declared:
        args = [interval_us, epoch, node, ttl_us, origin, int(announce), self.idle_expiry_us(queue),
                *_limit_args(limits)]  # fmt: skip
        reply = self._run("declare", queue, self.keys(queue).all, args)
        created, old_declared, declared, old, interval, replaced, by = reply[:7]
        log_unreadable_sources(queue, self.keys(queue).intervals, [_text(v) for v in reply[33:]])
        old_limits = _limits(reply[17:22]) if not created else NO_LIMITS
        return Declared(
            bool(created), int(old_declared), int(declared), int(old), int(interval), int(replaced), _text(by),
            _limits(reply[7:12]), _limits(reply[12:17]), old_limits or NO_LIMITS, _limits(reply[22:27]) or NO_LIMITS,
            _override(reply[27:32]), _text(reply[32]),
        )  # fmt: skip

    def backoff(self, queue: str, hold_us: int, keep_first: bool = False) -> QueueState:
        args = [hold_us, int(keep_first), self.idle_expiry_us(queue)]
        return self._state(self._run("backoff", queue, self.keys(queue).all, args))[0]

    def reset(
        self, queue: str, interval_us: int | None, epoch: str, origin: str = "", *, limits: Limits = NO_LIMITS
    ) -> QueueState:
        args = [interval_us or 0, epoch, origin, self.idle_expiry_us(queue), *_limit_args(limits)]
        reply = self._run("reset", queue, self.keys(queue).all, args)
        log_unreadable_sources(queue, self.keys(queue).intervals, [_text(v) for v in reply[STATE_REPLY:]])
        return self._state(reply)[0]

    def park(self, queue: str, epoch: str, tasks: Sequence[ParkedTask]) -> bool:
        k = self.keys(queue)
        args: list[Any] = [epoch]
        for t in tasks:
            args += [t.ticket, t.task_id, t.message]
        return bool(self._run("park", queue, [k.state, k.parked, k.parked_messages], args))

    def release(
        self, queue: str, horizon_us: int, limit: int = RELEASE_LIMIT, lease_us: int = RELEASE_LEASE_US
    ) -> Release:
        k = self.keys(queue)
        reply = self._run(
            "release", queue, [k.state, k.parked, k.parked_messages, k.releasing, k.intervals, k.window, *k.fair_keys],
            [horizon_us, limit, lease_us],
        )  # fmt: skip
        epoch = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
        tasks = [
            (ParkedTask(int(reply[i + 1]), reply[i].decode(), reply[i + 3].decode()), int(reply[i + 2]))
            for i in range(2, len(reply), 4)
        ]
        return Release(epoch, int(reply[1]), tasks)

    def parked_tasks(self, queue: str) -> list[ParkedTask]:
        k = self.keys(queue)
        try:
            ids = [i.decode() for key in (k.releasing, k.parked) for i in self.client.zrange(key, 0, -1)]
            tasks = []
            for start in range(0, len(ids), 1000):
                chunk = ids[start : start + 1000]
                for task_id, value in zip(chunk, self.client.hmget(k.parked_messages, chunk), strict=True):
                    if value is not None:
                        ticket, _, message = value.decode().partition("|")
                        tasks.append(ParkedTask(int(ticket), task_id, message))
        except _REDIS_ERRORS as exc:
            raise store_error(exc, queue) from None
        return sorted(tasks, key=lambda t: t.ticket)

    def fair_park(
        self, queue: str, key: str, weight: int, tasks: Sequence[FairTask], interval_us: int, epoch: str,
        *, limits: Limits = NO_LIMITS,
    ) -> list[str]:  # fmt: skip
        fair_check(key, weight, [t.cost for t in tasks])  # before anything is written
        k = self.keys(queue)
        args: list[Any] = [interval_us, epoch, self.idle_expiry_us(queue), *_limit_args(limits), key, weight]
        for t in tasks:
            args += [t.task_id, t.cost, t.message]
        reply = self._run("fair_park", queue, [*k.all, *k.fair_keys[1:]], args)
        return [_text(task_id) for task_id in reply[1:]]

    def fair_backlog(self, queue: str, top: int = 10) -> FairBacklog:
        check_top(top)
        k = self.keys(queue)
        reply = self._run("fair_backlog", queue, [k.fair_waiting, k.fair_weight, k.fair_messages], [top])
        entries = ((_text(reply[i]), int(reply[i + 1]), int(reply[i + 2])) for i in range(2, len(reply), 3))
        return FairBacklog.ranked(int(reply[0]), int(reply[1]), entries, top)

    def unpark(self, queue: str, task_ids: Sequence[str]) -> None:
        if task_ids:
            k = self.keys(queue)
            self._run("unpark", queue, [k.parked, k.parked_messages, k.releasing], list(task_ids))

    def status(self, queue: str) -> QueueStatus | None:
        return self._status(queue, self._run("status", queue, self._status_keys(queue), []))

    def _status_keys(self, queue: str) -> list[str]:
        k = self.keys(queue)
        return [
            k.state, k.finished, k.parked, k.releasing, k.intervals, k.refused, k.window, k.leases, k.fair_messages,
            k.fair,
        ]  # fmt: skip

    def _status(self, queue: str, reply: Sequence[Any]) -> QueueStatus | None:
        if not reply:
            return None
        state, now = self._state(reply)
        finished, parked, duplicates, reclaims, used, live, head, last, fair_keys, fair_tasks = (
            int(v) for v in reply[STATE_REPLY : STATE_REPLY + 10]
        )
        raw = reply[STATE_REPLY + 10]
        counts = counts_from_fields({raw[i].decode(): int(raw[i + 1]) for i in range(0, len(raw), 2)})
        sources = _sources(reply[STATE_REPLY + 11 :])
        return QueueStatus(
            queue, state, now, finished, parked, sources, duplicates, reclaims, window_used=used, counts=counts,
            in_flight=live, window_next_us=head, window_last_us=last, fair_keys=fair_keys, fair_tasks=fair_tasks,
        )  # fmt: skip

    #: Commands sent in one pipeline by the exporter's reads of many queues.
    PIPELINE_CHUNK = 500

    def statuses(self, queues: Sequence[str]) -> list[QueueStatus | SiqError | None]:
        if isinstance(self.client, RedisCluster):
            return super().statuses(queues)  # a pipeline of scripts does not span cluster nodes
        out: list[QueueStatus | SiqError | None] = []
        for at in range(0, len(queues), self.PIPELINE_CHUNK):
            chunk = queues[at : at + self.PIPELINE_CHUNK]
            for queue, reply in zip(chunk, self._status_replies(chunk), strict=True):
                if isinstance(reply, redis.ConnectionError | redis.TimeoutError):
                    raise StoreUnavailableError(f"cannot reach the Redis state store: {reply}")
                if isinstance(reply, Exception):
                    error = self._translate(reply, queue, self.keys(queue).state)
                    out.append(error if isinstance(error, SiqError) else CorruptStateError(queue, "", "", str(reply)))
                else:
                    out.append(self._status(queue, reply))
        return out

    def _status_replies(self, queues: Sequence[str]) -> list[Any]:
        """The status script's reply (or error) for each of ``queues``, in one pipeline of
        EVALSHA. redis-py's pipelined Script objects send SCRIPT EXISTS first, which the
        documented ACL does not grant; a script the server does not hold (a restart, a
        SCRIPT FLUSH) is loaded by SCRIPT LOAD, which it grants, and the pipeline re-sent
        (it only reads)."""
        script = self._script("status")
        replies = self._status_pipeline(script.sha, queues)
        if any(isinstance(r, redis.exceptions.NoScriptError) for r in replies):
            try:
                script.sha = self.client.script_load(script.script)
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                raise StoreUnavailableError(f"cannot reach the Redis state store: {exc}") from exc
            except redis.ResponseError as exc:
                translated = self._translate(exc, queues[0], self.keys(queues[0]).state)
                raise (store_error(exc) if translated is exc else translated) from None
            replies = self._status_pipeline(script.sha, queues)
        return replies

    def _status_pipeline(self, sha: str, queues: Sequence[str]) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        for queue in queues:
            keys = self._status_keys(queue)
            pipe.evalsha(sha, len(keys), *keys, self._now_arg())
        try:
            return list(pipe.execute(raise_on_error=False))
        except _REDIS_ERRORS as exc:  # a database the server lacks, a user the ACL refuses: one line
            raise store_error(exc) from None

    def starts_since(self, since: Mapping[str, int | None]) -> dict[str, list[LedgerRow]]:
        if isinstance(self.client, RedisCluster) or self.clock is not None:
            return super().starts_since(since)  # one node per pipeline; a pinned clock is not the ids' clock
        batch = 10_000
        names = list(since)
        out: dict[str, list[LedgerRow]] = {}
        for at in range(0, len(names), self.PIPELINE_CHUNK):
            chunk = names[at : at + self.PIPELINE_CHUNK]
            pipe = self.client.pipeline(transaction=False)
            for queue in chunk:
                low = since[queue]
                pipe.xrange(self.keys(queue).ledger, min=f"{max(low or 0, 0) // 1000}-0", max="+", count=batch)
            try:
                replies = pipe.execute()
            except _REDIS_ERRORS as exc:
                raise store_error(exc) from None
            for queue, entries in zip(chunk, replies, strict=True):
                if len(entries) == batch:  # more than one batch behind: read the rest in turn
                    out[queue] = list(self.ledger(queue, since_us=since[queue]))
                    continue
                low = since[queue]
                rows = (_ledger_entry(queue, fields) for _, fields in entries)
                out[queue] = [r for r in rows if isinstance(r, LedgerRow) and (low is None or r.start_us >= low)]
        return out

    def queues(self, pattern: str = "*") -> list[str]:
        # SCAN (never KEYS: it would block Redis), narrowed on the server to the pattern's
        # plain-name keys, plus the keys of names with their own tag ("{group}rest").
        matches = [f"{self.key_prefix}:{{{pattern}}}:state"]
        if pattern[:1] in ("{", "*", "?", "["):
            matches.append(f"{self.key_prefix}:{{*}}?*:state")
        try:
            names = {
                QueueKeys.queue_from_state_key(key.decode())
                for match in matches
                for key in self.client.scan_iter(match=match, count=1000)
            }
        except _REDIS_ERRORS as exc:
            raise store_error(exc) from None
        return match_names([n for n in names if n], pattern)

    def parked_queues(self) -> list[str]:
        names = set()
        try:
            for suffix in ("parked", "releasing", "fair"):  # "fair": tasks waiting in fair lines
                for key in self.client.scan_iter(match=f"{self.key_prefix}:{{*}}*:{suffix}", count=1000):
                    name = QueueKeys.queue_from_state_key(key.decode(), suffix)
                    if name:
                        names.add(name)
        except _REDIS_ERRORS as exc:
            raise store_error(exc) from None
        return sorted(names)

    def delete(self, queue: str) -> bool:
        k = self.keys(queue)  # a script: the line of each fairness key goes in the same step
        return bool(self._run("delete", queue, [*k.all, *k.fair_keys[1:]], []))

    def now_us(self) -> int:
        if self.clock:
            return self.clock()
        try:
            seconds, micros = self.client.time()
        except _REDIS_ERRORS as exc:
            raise store_error(exc) from None
        return int(seconds) * 1_000_000 + int(micros)

    def eviction_policy(self) -> str:
        """The server's ``maxmemory-policy`` (on a cluster, the first primary's that is not
        ``noeviction``): anything but ``noeviction`` may evict a queue's keys, and a queue
        whose keys are gone forgets its starts. Raises what redis-py raised (a user whose ACL
        forbids CONFIG: NoPermissionError)."""
        client: Any = self.client
        if isinstance(client, RedisCluster):
            reply: Any = client.config_get("maxmemory-policy", target_nodes=RedisCluster.PRIMARIES)
            each = reply and all(isinstance(value, dict) for value in reply.values())  # one answer per node
            replies: list[Any] = list(reply.values()) if each else [reply]
        else:
            replies = [client.config_get("maxmemory-policy")]
        policies = [
            _text(value) for reply in replies for key, value in reply.items() if _text(key) == "maxmemory-policy"
        ]
        return next((p for p in policies if p != "noeviction"), policies[0] if policies else "unknown")

    def warm(self) -> None:
        try:
            for name in SCRIPTS:
                script = self._script(name)
                script.sha = self.client.script_load(script.script)
        except _REDIS_ERRORS as exc:
            raise store_error(exc) from None

    def close(self) -> None:
        self._wakes.close()
        for conn in self._spare if self._spare_pid == os.getpid() else ():
            conn.disconnect()
        if self._restamps is not None and self._restamps_pid == os.getpid():
            self._restamps.disconnect()
            self._restamps = None
        if self._client is not None:
            self._client.close()
