"""siq_store_replicas on a real master and replica: a start the replicas acknowledged only
an interval or more after it was made (``WAIT`` slow: a replica catching up after a
failover) is moved to the moment it counts, or, if another start came after it meanwhile,
not used at all, so two bodies never start side by side (RedisBackend._start_replicated)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from siq_celery import IntervalQueue, StoreUnavailableError
from siq_celery.backends import backend_from_url
from siq_celery.backends.redis_client import Overtaken
from siq_celery.embedded import EmbeddedRedis
from siq_celery.ledger import StartRecord
from siq_celery.testing import PinnedClock
from siq_celery.types import Verdict

INTERVAL_US = 20_000


@pytest.fixture(scope="module")
def master_url() -> Iterator[str]:
    with EmbeddedRedis() as master, EmbeddedRedis(extra_args=("--replicaof", "127.0.0.1", str(master.port))):
        client = redis.Redis(port=master.port)
        deadline = time.monotonic() + 20
        while client.info("replication").get("connected_slaves", 0) < 1:
            assert time.monotonic() < deadline, "the replica did not connect"
            time.sleep(0.05)
        client.close()
        yield master.url


def queues(url: str, name: str) -> tuple[IntervalQueue, IntervalQueue, PinnedClock]:
    """The same queue through a replicated store and through a plain one, on one pinned clock."""
    clock = PinnedClock()
    replicated = IntervalQueue(name, interval="20ms", backend=backend_from_url(url, clock=clock, replicas=1))
    plain = IntervalQueue(name, interval="20ms", backend=backend_from_url(url, clock=clock))
    replicated.ensure(reset=True)
    return replicated, plain, clock


def slow_wait(queue: IntervalQueue, clock: PinnedClock, meanwhile: Callable[[], Any] = lambda: None) -> None:
    """The replicas acknowledge the next replicated write 1.5 intervals after it was made
    (on both clocks), and ``meanwhile`` runs in between."""
    backend: Any = queue.backend
    real = backend._run_replicated

    def late(*args: Any, **kwargs: Any) -> Any:
        reply = real(*args, **kwargs)
        backend._run_replicated = real
        time.sleep(1.5 * INTERVAL_US / 1e6)
        clock.advance(us=INTERVAL_US * 3 // 2)
        meanwhile()
        return reply

    backend._run_replicated = late


def record(task_id: str) -> StartRecord:
    return StartRecord("tests.task", task_id, "host", 1)


def test_a_start_acknowledged_late_counts_from_when_it_was_acknowledged(master_url: str) -> None:
    q, _, clock = queues(master_url, "late-ack")
    first, second = q.claim(), q.claim()
    clock.advance(us=INTERVAL_US)  # a new queue's first start waits one interval
    made = clock.now_us
    slow_wait(q, clock)
    decision = q.start(first, task_id="a", record=record("a"))
    assert decision.authorized
    assert decision.now_us == made + INTERVAL_US * 3 // 2, "moved to the moment the replicas had it"
    assert q.status().state.last_start_us == decision.now_us
    clock.advance(us=INTERVAL_US - 1)
    assert q.start(second, task_id="b", record=record("b")).verdict is Verdict.WAIT, "a full interval from then"
    q.delete()
    q.close()


def test_a_start_overtaken_while_its_replicas_were_slow_is_not_used(master_url: str) -> None:
    q, plain, clock = queues(master_url, "overtaken")
    first, second = q.claim(), q.claim()
    clock.advance(us=INTERVAL_US)
    other: list[Any] = []
    slow_wait(q, clock, lambda: other.append(plain.start(second, task_id="b", record=record("b"))))
    with pytest.raises(Overtaken, match="a later start was authorized meanwhile") as caught:
        q.start(first, task_id="a", record=record("a"))
    assert isinstance(caught.value, StoreUnavailableError), "retried like an unreachable store"
    assert other[0].authorized, "the other start came an interval and a half after this one"
    # Its lease was given back: the task is not "running elsewhere", and it asks again in line.
    clock.advance(us=INTERVAL_US)
    again = q.start(first, task_id="a", record=record("a"))
    assert again.verdict is not Verdict.RUNNING
    assert again.authorized
    assert again.now_us - other[0].now_us >= INTERVAL_US
    q.delete()
    q.close()
    plain.close()


def test_a_start_acknowledged_in_time_is_left_as_it_was_made(master_url: str) -> None:
    q, _, clock = queues(master_url, "in-time")
    ticket = q.claim()
    clock.advance(us=INTERVAL_US)
    decision = q.start(ticket, task_id="a", record=record("a"))
    assert decision.authorized and decision.now_us == clock.now_us
    q.delete()
    q.close()


def test_a_cost_2_start_acknowledged_late_counts_from_when_it_was_acknowledged(master_url: str) -> None:
    """A start of cost 2 records its last slot one interval after it: the re-stamp finds
    it there, and moves the start and its last slot to when the replicas had it."""
    q, _, clock = queues(master_url, "late-ack-cost-2")
    first, second = q.claim(2), q.claim()
    clock.advance(us=INTERVAL_US)
    made = clock.now_us
    answers: list[str] = []
    for _ in range(3):
        slow_wait(q, clock)
        try:
            decision = q.start(first, task_id="a", record=record("a"), cost=2)
            answers.append(decision.verdict.value)
            break
        except StoreUnavailableError as exc:
            answers.append(type(exc).__name__)
    print(f"\ncost=2: {answers}")
    assert answers == ["authorized"], "not overtaken by itself"
    assert decision.now_us == made + INTERVAL_US * 3 // 2, "moved to the moment the replicas had it"
    assert q.status().state.last_start_us == decision.now_us + INTERVAL_US, "its second slot follows it"
    clock.advance(us=2 * INTERVAL_US - 1)
    assert q.start(second, task_id="b", record=record("b")).verdict is Verdict.WAIT, "two intervals from then"
    clock.advance(us=1)
    assert q.start(second, task_id="b", record=record("b")).authorized
    q.delete()
    q.close()
