"""Redis state store: one Lua script per operation, time from Redis ``TIME``.

Every key a script touches is passed in ``KEYS`` and carries the queue's hash tag, so
the same scripts run on a single server, behind Sentinel, or on Redis Cluster.

URLs: ``redis://[[user]:password@]host:port/db``, ``rediss://`` (TLS), ``unix:///path.sock``,
``redis+cluster://host:port[,host:port...]`` (``rediss+cluster://`` for TLS), and
``redis+sentinel://[[user]:password@]host:port[,host:port...]/service_name[/db]``.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable, Sequence
from typing import Any, ClassVar
from urllib.parse import urlsplit

from ..errors import (
    ConfigurationError,
    StoreUnavailableError,
    redacted_url,
)
from ..ledger import StartRecord
from ..parked import FairTask, ParkedTask, Release
from ..rules import fair_check
from ..types import (
    NO_LIMITS,
    NO_OVERRIDE,
    ClaimResult,
    Decision,
    Declared,
    Limits,
    LimitsOverride,
    QueueState,
)
from .base import (
    RELEASE_LEASE_US,
    RELEASE_LIMIT,
    PendingClaim,
)
from .redis_client import (
    _REDIS_ERRORS,
    DEFAULT_REPLICA_TIMEOUT_MS,
    SENTINEL_SOCKET_TIMEOUT_S,
    RedisCluster,
    Unreplicated,
    check_database,
    redis,
    redis_client_from_url,
    store_error,
)

# What users and the docs name here: the ACL a siq_celery user needs (docs/stores.md).
from .redis_client import ACL_RULES as ACL_RULES
from .redis_reads import RedisReads
from .redis_replies import (
    STATE_REPLY,
    _bulk,
    _claim_result,
    _decision,
    _fair_args,
    _limit_args,
    _limits,
    _override,
    _resp,
    _text,
)
from .stored import log_unreadable_sources

logger = logging.getLogger("siq_celery")


class RedisBackend(RedisReads):
    schemes: ClassVar[tuple[str, ...]] = (
        "redis", "rediss", "unix", "redis+cluster", "rediss+cluster", "redis+sentinel", "rediss+sentinel",
    )  # fmt: skip

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

    # -- plumbing -------------------------------------------------------------------

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

    def wait_for_wake(self, queue: str, ticket: int, after_us: int, seconds: float) -> bool | None:
        if not self._reads_wakes():
            return None
        return self._wakes.wait(self.keys(queue).wake, ticket, after_us, seconds)

    def wake_done(self, queue: str) -> None:
        if self._wakes.subscribed:  # most starts never waited for a wake: nothing to build or send
            self._wakes.done(self.keys(queue).wake)

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

    def unpark(self, queue: str, task_ids: Sequence[str]) -> None:
        if task_ids:
            k = self.keys(queue)
            self._run("unpark", queue, [k.parked, k.parked_messages, k.releasing], list(task_ids))

    def delete(self, queue: str) -> bool:
        k = self.keys(queue)  # a script: the line of each fairness key goes in the same step
        return bool(self._run("delete", queue, [*k.all, *k.fair_keys[1:]], []))
