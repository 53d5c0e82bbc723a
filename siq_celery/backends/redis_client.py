"""The Redis store's connection: a client made from a store URL (a server, TLS, a socket,
Sentinel or Cluster) with bounded timeouts and no retry inside redis-py, the check of a
database, and the translation of redis-py's errors into siq_celery's (an unreachable store,
a refused login, a missing ACL grant, a write fewer replicas took than asked)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from ..errors import (
    ConfigurationError,
    MissingDependencyError,
    StoreUnavailableError,
    redacted,
)

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

# redis-py, imported here once for every module of the Redis store (they import it from here).
try:
    import redis as redis
    from redis.backoff import NoBackoff
    from redis.cluster import ClusterNode
    from redis.cluster import RedisCluster as RedisCluster
    from redis.exceptions import RedisClusterException  # not on the top-level module before redis-py 5.1
    from redis.retry import Retry
    from redis.sentinel import Sentinel
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingDependencyError("the Redis state store needs redis-py: pip install 'siq_celery[redis]'") from exc


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
