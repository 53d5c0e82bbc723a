"""Where a command of the Redis store goes, and what counts as written: behind Sentinel,
the master the sentinels stand behind now (checked before a start or a finish, at most every
:data:`~siq_celery.backends.redis_client.MASTER_CHECK_S`), with ``siq_store_replicas`` a
write only once that many replicas took it; on Redis Cluster, the slot map asked again after
a command failed unreachable."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

from ..errors import SiqError, StoreUnavailableError
from ..types import Verdict
from .redis_base import RedisBase
from .redis_client import (
    _REDIS_ERRORS,
    MASTER_CHECK_S,
    Overtaken,
    RedisCluster,
    Unreplicated,
    redis,
    store_error,
)
from .redis_replies import _decision

logger = logging.getLogger("siq_celery")


class RedisFailover(RedisBase):
    """Sentinel and Cluster policy: the master checked, a write replicated, the slots refreshed."""

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

    def _finish(self, queue: str, task_id: str, outcome: str, *, remember: bool, lease: str, replicated: bool) -> None:
        """The finish script (:class:`~siq_celery.backends.redis.RedisBackend`), which gives
        back the lease of an authorization a replicated start does not use."""
        raise NotImplementedError
