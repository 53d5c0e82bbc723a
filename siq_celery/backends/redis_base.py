"""The Redis store's base: its client (made on first use), its scripts (loaded once), the
replies of its scripts turned into siq_celery's values and errors, and where its wakes go."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import (
    ConfigurationError,
    CorruptStateError,
    QueueNotFoundError,
    SiqError,
)
from ..keys import QueueKeys
from ..lru import LRUCache
from ..types import (
    QueueState,
)
from .base import (
    IDLE_EXPIRY_REMEMBERED,
    Backend,
    no_interval_yet,
)
from .redis_client import (
    _AUTHENTICATION,
    _REDIS_ERRORS,
    _UNREACHABLE,
    ACL_RULES,
    DEFAULT_REPLICA_TIMEOUT_MS,
    MASTER_CHECK_S,
    MAX_REPLICAS,
    RedisCluster,
    redis,
    store_error,
)
from .redis_replies import (
    SCRIPTS,
    STATE_REPLY,
    _text,
    load_script_source,
)
from .redis_wakes import Wakes


class RedisBase(Backend):
    """The plumbing every operation of :class:`~siq_celery.backends.redis.RedisBackend` runs on."""

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

    def _now_arg(self) -> int | str:
        return self.clock() if self.clock else ""

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

    def _lost_args(self, task_id: str | None) -> list[int]:
        """The limit on starts without a finish (none without a task id of the caller's),
        their retention and the most kept: three arguments of the start scripts, before
        the limits (start.lua: ARGV[14..16]; start_all.lua: after the per-queue ones)."""
        limit = self.max_lost_deliveries if task_id is not None else 0
        return [limit, self.finished_retention_us, self.finished_max]

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

    def _wake_channel(self, k: QueueKeys) -> str:
        """Where the scripts publish the queue's wakes: none on a cluster (nobody reads them
        there, and a cluster's PUBLISH goes to every node)."""
        return "" if isinstance(self.client, RedisCluster) else k.wake

    def _wake_connection(self) -> Any:
        """A pub/sub reader of the client's (its own connection, kept subscribed: :class:`Wakes`)."""
        return self.client.pubsub()

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
