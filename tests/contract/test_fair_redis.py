"""Fair shares in the Redis store (and on Redis Cluster): only what waits is kept, and a
release's promotion costs the same whatever the number of keys waiting (the next head is
the first member of a sorted set). Pinned clock."""

from __future__ import annotations

import statistics
import time
from typing import Any

import pytest

from siq_celery.backends.base import Backend
from siq_celery.keys import QueueKeys
from siq_celery.parked import FairTask
from tests.conftest import Store

I = 100_000  # 100 ms: a lookahead of 4 tickets
H = 50 * I
KEYS = 10_000


def fair_keys(client: Any, store: Store, queue: str) -> list[str]:
    return [k.decode() for k in client.scan_iter(match=f"{QueueKeys(store.prefix, queue).fair}*", count=1000)]


def push(backend: Backend, queue: str, keys: int, each: int = 1) -> None:
    """``keys`` keys, ``each`` tasks each (task ids t<key>, t<key>.1, ...)."""
    for n in range(keys):
        tasks = [FairTask(f"t{n}" + (f".{i}" if i else ""), f'{{"n": {n}}}') for i in range(each)]
        backend.fair_park(queue, f"k{n}", 1, tasks, I, "e1")


def release_latency(store: Store, backend: Backend, queue: str, rounds: int = 30) -> float:
    """The median time (s) of a release that hands the next head a ticket: each round starts
    the earliest ticket handed out, which makes room for one more."""
    waiting = {p.ticket: p.task_id for p, _ in backend.release(queue, H).tasks}
    backend.unpark(queue, list(waiting.values()))
    epoch = backend.status(queue).state.epoch
    took = []
    for _ in range(rounds):
        ticket = min(waiting)
        task_id = waiting.pop(ticket)
        while not (d := backend.start(queue, ticket, epoch, task_id=task_id, interval_us=I, new_epoch="x")).authorized:
            store.clock.now_us += d.wait_us
        began = time.perf_counter()
        release = backend.release(queue, H)
        took.append(time.perf_counter() - began)
        assert len(release.tasks) == 1, release
        waiting.update({p.ticket: p.task_id for p, _ in release.tasks})
        backend.unpark(queue, [p.task_id for p, _ in release.tasks])
    return statistics.median(took)


@pytest.mark.slow  # 10,000 keys pushed one call each: 3 to 4 s
def test_ten_thousand_keys_served_leave_no_fair_keys_and_the_release_costs_the_same(store: Store) -> None:
    client = store.redis_client(f"{store.kind}: the Redis layout of the fair lines")
    backend = store.backend()
    try:
        served(store, client, backend)
    finally:
        backend.close()
        client.close()


def served(store: Store, client: Any, backend: Backend) -> None:
    backend.warm()
    push(backend, "small", 10, each=10)  # 10 keys waiting throughout
    push(backend, "big", KEYS)
    assert backend.status("big").parked == KEYS
    assert len(fair_keys(client, store, "big")) == KEYS + 4  # a line per key; the keys, weights, messages, counts
    assert "big" in backend.parked_queues()  # the workers' upkeep releases it
    small, big = release_latency(store, backend, "small"), release_latency(store, backend, "big")
    print(f"\nrelease handing one ticket, median: {small * 1e6:.0f} us with 10 keys waiting, "
          f"{big * 1e6:.0f} us with {KEYS}")  # fmt: skip
    # Hand the rest out, a lookahead a time (nothing starts: each release past the outage
    # span hands out another 64 at 1 us).
    backend.set_interval("big", 1)
    while backend.fair_backlog("big").tasks_waiting:
        store.clock.now_us += 1_000_000_000
        backend.release("big", H)
    assert fair_keys(client, store, "big") == []
    assert client.hget(QueueKeys(store.prefix, "big").state, "fair_v") is None
    status = backend.status("big")
    assert status.parked == KEYS - 30 - 4  # 30 rounds started, 4 released and published before them
    assert status.state.ticket == KEYS
    assert [(p.ticket, p.task_id) for p in backend.parked_tasks("big")][-1] == (KEYS, f"t{KEYS - 1}")
    assert backend.delete("small")
    assert client.exists(*QueueKeys(store.prefix, "small").all) == 0
    assert fair_keys(client, store, "small") == []


def test_waiting_fair_tasks_pin_an_idle_queues_keys_until_they_are_served(store: Store) -> None:
    """Idle expiry (per-key queues): tasks waiting in a fair line outlive any idle time, as
    parked tasks do; once every one is served and started, the keys expire as usual and no
    fair key is left."""
    client = store.redis_client(f"{store.kind}: the Redis layout of the fair lines")
    backend = store.backend()
    try:
        backend.expire_when_idle("shop", 1_000_000)
        keys = QueueKeys(store.prefix, "shop")
        ticket = backend.claim("shop", 1, I, "e1")
        assert client.pttl(keys.state) > 0
        push(backend, "shop", 2, each=3)
        assert fair_keys(client, store, "shop")

        def every() -> list[str]:
            return [k.decode() for k in client.scan_iter(match=f"{keys.base}*", count=1000)]

        assert all(client.pttl(k) == -1 for k in every())
        waiting = {ticket.first: "claimed"}
        started = 0
        while started < 7:
            release = backend.release("shop", H)
            waiting.update({p.ticket: p.task_id for p, _ in release.tasks})
            backend.unpark("shop", [p.task_id for p, _ in release.tasks])
            first = min(waiting)
            d = backend.start("shop", first, ticket.epoch, task_id=waiting[first], interval_us=I, new_epoch="x")
            if not d.authorized:
                store.clock.now_us += d.wait_us
                continue
            backend.finish("shop", waiting.pop(first))
            started += 1
            # a start and a finish touch the keys: persistent while a task waits in a fair line
            # (those handed a ticket were published: like parked tasks released, they pin nothing)
            pinned = [k for k in every() if client.pttl(k) == -1]
            assert bool(pinned) == bool(fair_keys(client, store, "shop")), (started, pinned)
            assert pinned or all(client.pttl(k) > 0 for k in every())
        assert fair_keys(client, store, "shop") == []
        assert every() and all(client.pttl(k) > 0 for k in every())
        assert backend.status("shop").parked == 0
    finally:
        backend.close()
        client.close()
