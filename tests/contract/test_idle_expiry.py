"""Idle expiry of per-key queues (Redis and Redis Cluster): every key of an idle queue
disappears after the idle time, a paused queue or one with parked tasks stays, and a
queue that comes back starts afresh without a burst. (SQLite and memory keep one small
row per queue: nothing to expire.)"""

from __future__ import annotations

import time
from typing import Any

import pytest

from siq_celery import CombinedQueue, ConfigurationError, IntervalQueue, Verdict
from siq_celery.parked import ParkedTask
from tests.conftest import Store

I = 100_000


def redis_only(store: Store) -> Any:
    return store.redis_client(f"{store.kind} keeps a row per queue: idle expiry is a Redis feature")


def keys_of(client: Any, store: Store, queue: str) -> list[str]:
    return sorted(k.decode() for k in client.scan_iter(match=f"{store.prefix}:{{{queue}}}*", count=1000))


def tagged(client: Any, store: Store, name: str) -> list[str]:
    """The keys of the queues whose name starts with ``name`` (one opening with its own tag)."""
    return sorted(k.decode() for k in client.scan_iter(match=f"{store.prefix}:{name}*", count=1000))


def idle_queue(store: Store, name: str = "shop:1") -> IntervalQueue:
    return IntervalQueue(name, interval=I / 1e6, backend=store.backend(), idle_expiry=1)


def test_an_idle_queue_leaves_no_keys_and_comes_back_in_a_new_epoch(store: Store) -> None:
    client = redis_only(store)
    q = idle_queue(store)
    t0 = q.ensure().last_start_us
    ticket = q.claim()
    store.clock.now_us = t0 + I
    assert q.start(ticket, task_id="t1").authorized
    q.finish("t1")
    assert len(keys_of(client, store, "shop:1")) == 4  # state, finished, ledger, counts
    # idle after the next free slot (one interval on): 1.1 s
    assert all(1000 < client.pttl(k) <= 1100 for k in keys_of(client, store, "shop:1"))
    time.sleep(1.3)
    assert keys_of(client, store, "shop:1") == []
    back = q.claim()  # comes back on use: a new life, whose first start waits one interval
    assert back.number == 1 and back.epoch != ticket.epoch
    assert q.start(back).verdict is Verdict.WAIT


def test_a_paused_queue_and_one_with_parked_tasks_never_expire(store: Store) -> None:
    """Nothing a paused queue needs expires: its finished ids (a redelivered copy of a
    finished task must still be skipped after a long pause), its ledger, its state. On
    resume it is idle again from then."""
    client = redis_only(store)
    paused, parking = idle_queue(store, "shop:paused"), idle_queue(store, "shop:parked")
    t0 = paused.ensure().last_start_us
    ticket = paused.claim()
    store.clock.now_us = t0 + I
    assert paused.start(ticket, task_id="done").authorized
    paused.finish("done")
    again = paused.claim()
    paused.pause()
    parking.ensure()
    ticket = parking.claim()
    assert parking.backend.park("shop:parked", ticket.epoch, [ParkedTask(1, "t1", "{}")])
    parking.claim()  # activity after parking keeps it pinned
    time.sleep(1.2)
    assert len(keys_of(client, store, "shop:paused")) == 4 and paused.status().state.paused  # and its counts
    assert parking.status().parked == 1
    assert all(client.pttl(k) == -1 for k in keys_of(client, store, "shop:parked"))
    paused.resume(grace=0)
    store.clock.now_us += 2 * I
    redelivered = paused.start(again, task_id="done")  # the finished id is still known
    assert redelivered.verdict is Verdict.DUPLICATE
    assert all(0 < client.pttl(k) <= 1_300 for k in keys_of(client, store, "shop:paused"))  # idle again


def test_queues_without_idle_expiry_never_expire(store: Store) -> None:
    client = redis_only(store)
    q = store.queue("fixed")
    q.ensure()
    q.claim()
    assert [client.pttl(k) for k in keys_of(client, store, "fixed")] == [-1]


@pytest.mark.parametrize("idle", [0, 0.5, -1, "soon"])
def test_an_idle_expiry_under_a_second_is_refused(store: Store, idle: object) -> None:
    with pytest.raises(ConfigurationError):
        IntervalQueue("q", interval="1s", backend=store.backend(), idle_expiry=idle)  # type: ignore[arg-type]


def test_keys_outlive_every_commitment_of_the_queue_then_the_idle_time(store: Store) -> None:
    """An idle time shorter than the queue's own waits must not end its life early: the
    last issued ticket's slot, a cost's hold and a back-off all count as busy."""
    client = redis_only(store)
    store.clock.now_us = int(time.time() * 1e6)  # PEXPIRE runs on Redis' real clock
    q = IntervalQueue("shop:slow", interval="3s", backend=store.backend(), idle_expiry=1)
    ticket = q.claim(cost=3)  # due 3 s from now
    assert all(client.pttl(k) > 3_900 for k in keys_of(client, store, "shop:slow"))
    store.clock.advance(us=3_000_000)
    assert q.start(ticket, cost=3).authorized  # the next start may come 9 s from now
    assert all(client.pttl(k) > 9_900 for k in keys_of(client, store, "shop:slow"))
    q.backoff("20s")
    assert all(client.pttl(k) > 20_900 for k in keys_of(client, store, "shop:slow"))


def test_an_operators_override_or_reset_keeps_a_per_key_queues_idle_expiry(store: Store) -> None:
    """`siq set-interval` and `siq reset` run in a process that does not know the queue is
    per-key: the queue's own idle expiry, kept in its state, still applies to every key."""
    client = redis_only(store)
    idle_queue(store).claim()
    operator = IntervalQueue("shop:1", backend=store.backend())  # knows no idle expiry
    operator.set_interval("200ms")  # creates the interval sources
    assert all(0 < client.pttl(k) <= 1_300 for k in keys_of(client, store, "shop:1"))
    operator.backend.reset("shop:1", None, "e2")
    keys = keys_of(client, store, "shop:1")
    assert len(keys) == 2 and all(0 < client.pttl(k) <= 1_300 for k in keys), [client.pttl(k) for k in keys]
    operator.backend.reset("shop:1", 300_000, "e3", "alice")  # a reset that pins an interval
    assert all(0 < client.pttl(k) <= 1_300 for k in keys_of(client, store, "shop:1"))
    time.sleep(1.4)
    assert keys_of(client, store, "shop:1") == []


def test_a_combined_start_keeps_every_queues_keys_for_its_commitments(store: Store) -> None:
    """Several limits on one start (one script over every queue) count as the queues' use:
    each queue's keys, those the start created included, outlive its new commitments."""
    client = redis_only(store)
    store.clock.now_us = int(time.time() * 1e6)  # PEXPIRE runs on Redis' real clock
    backend = store.backend()
    fast = IntervalQueue("{shop:1}fast", interval="1s", backend=backend, idle_expiry=1)
    slow = IntervalQueue("{shop:1}slow", interval="3s", backend=backend, idle_expiry=1)
    both = CombinedQueue([fast, slow])
    ticket = both.claim(cost=3)  # in the slow queue (the primary); the fast one has no state yet
    store.clock.advance(us=3_000_000)
    waiting = both.start(ticket, task_id="t1", cost=3)  # creates the fast queue: its first start waits 1 s
    assert [d.verdict for d in waiting] == [Verdict.WAIT, Verdict.WAIT]
    fast_keys = tagged(client, store, "{shop:1}fast")
    assert fast_keys and all(0 < client.pttl(k) <= 2_100 for k in fast_keys), {k: client.pttl(k) for k in fast_keys}
    store.clock.advance(us=1_000_000)
    assert all(d.authorized for d in both.start(ticket, task_id="t1", cost=3))
    slow_keys, fast_keys = tagged(client, store, "{shop:1}slow"), tagged(client, store, "{shop:1}fast")
    # the next start may come 9 s from now in the slow queue, 3 s in the fast one; then the idle time
    assert all(client.pttl(k) > 9_900 for k in slow_keys), {k: client.pttl(k) for k in slow_keys}
    assert all(client.pttl(k) > 3_900 for k in fast_keys), {k: client.pttl(k) for k in fast_keys}
    both.finish("t1")
    store.clock.advance(us=9_000_000)
    assert {d.verdict for d in both.start(both.claim(), task_id="t1")} == {Verdict.DUPLICATE}
    every = tagged(client, store, "{shop:1}")
    assert every and all(client.pttl(k) > 0 for k in every), {k: client.pttl(k) for k in every}
