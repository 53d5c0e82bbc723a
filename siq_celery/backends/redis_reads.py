"""What the Redis store is read for, without a write: a queue's status (one script a queue,
pipelined for many), its ledger streamed, the starts since a time, the queues kept and the
parked tasks. Times in integer microseconds on the store's clock."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ..errors import (
    CorruptStateError,
    SiqError,
    StoreUnavailableError,
)
from ..keys import QueueKeys
from ..ledger import BeganEntry, FinishEntry, LedgerRow, join_finishes
from ..parked import FairBacklog, ParkedTask
from ..rules import counts_from_fields
from ..types import (
    QueueStatus,
)
from .base import (
    check_top,
)
from .redis_client import (
    _REDIS_ERRORS,
    RedisCluster,
    redis,
    store_error,
)
from .redis_failover import RedisFailover
from .redis_replies import (
    STATE_REPLY,
    _ledger_entry,
    _sources,
    _text,
)
from .stored import match_names


class RedisReads(RedisFailover):
    """The reads of the Redis store: statuses, the ledger, the queues."""

    #: Commands sent in one pipeline by the exporter's reads of many queues.
    PIPELINE_CHUNK = 500

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

    def fair_backlog(self, queue: str, top: int = 10) -> FairBacklog:
        check_top(top)
        k = self.keys(queue)
        reply = self._run("fair_backlog", queue, [k.fair_waiting, k.fair_weight, k.fair_messages], [top])
        entries = ((_text(reply[i]), int(reply[i + 1]), int(reply[i + 2])) for i in range(2, len(reply), 3))
        return FairBacklog.ranked(int(reply[0]), int(reply[1]), entries, top)

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
