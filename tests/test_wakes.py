"""Wakes: a start held by a full concurrency cap is woken when a lease is given back
(``Backend.wait_for_wake``), instead of finding out at its next poll; a start held by the
last body's report still polls. Real Redis (its finish script publishes on the queue's wake
channel) and the memory store (a condition); SQLite and Redis Cluster poll, as before."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from siq_celery import IntervalQueue
from siq_celery.backends.redis import ACL_RULES
from siq_celery.backends.redis_wakes import Wakes
from siq_celery.embedded import EmbeddedRedis
from siq_celery.rules import concurrency
from siq_celery.types import Verdict


@pytest.fixture(autouse=True)
def closed_queues(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every queue made here has its backend closed after the test (its pub/sub socket too)."""
    made: list[IntervalQueue] = []
    init = IntervalQueue.__init__

    def keep(self: IntervalQueue, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(IntervalQueue, "__init__", keep)
    yield
    for queue in made:
        queue.backend.close()


def waiter(queue: IntervalQueue, ticket: int, after_us: int, seconds: float) -> tuple[threading.Thread, dict[str, Any]]:
    """A thread waiting for a wake of ``queue``; its result and when it came (monotonic)."""
    out: dict[str, Any] = {}

    def run() -> None:
        out["woken"] = queue.backend.wait_for_wake(queue.name, ticket, after_us, seconds)
        out["at"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_report_wakes_nobody(redis_url: str) -> None:
    """A start held by the last body's report polls for it: woken at once, it would come
    before the report a process that stood still after its first sends again (which moves
    the start only while no later start came: a window of 50 then held 51 bodies)."""
    queue = IntervalQueue("wakes", url=redis_url, interval="1ms")
    first, second = queue.claim(), queue.claim()
    time.sleep(0.005)  # the first's slot came
    authorized = queue.start(first, reports=True)
    assert authorized.verdict is Verdict.AUTHORIZED
    time.sleep(0.005)  # the second's slot came; the first's body has not reported
    held = queue.start(second, reports=True)
    assert held.verdict is Verdict.WAIT and held.wait_us != held.slot_us - held.now_us, "held by the report"
    thread, out = waiter(queue, second.number, held.now_us, 0.3)
    time.sleep(0.1)
    assert queue.began(authorized, wait=True)
    thread.join(5)
    assert out["woken"] is False, "not woken by the report: its poll asks again"
    assert queue.start(second, reports=True).verdict is Verdict.AUTHORIZED


def test_a_start_held_by_a_full_cap_is_woken_when_a_lease_is_given_back(redis_url: str) -> None:
    queue = IntervalQueue("wakes-cap", url=redis_url, interval="1ms", concurrency=1)
    first, second = queue.claim(), queue.claim()
    time.sleep(0.005)  # the first's slot came
    authorized = queue.start(first, task_id="t1", reports=True)
    assert queue.began(authorized, wait=True)
    time.sleep(0.005)
    held = queue.start(second, task_id="t2", reports=True)
    assert held.verdict is Verdict.WAIT and held.full
    thread, out = waiter(queue, second.number, held.now_us, 5.0)
    time.sleep(0.2)
    finished = time.monotonic()
    queue.finish("t1", lease=authorized.lease)
    thread.join(5)
    print(f"\nwoken {1e3 * (out['at'] - finished):.2f} ms after the lease came back")
    assert out["woken"] is True and out["at"] - finished < 1.0, "woken by the finish, not by its 5 s timeout"
    assert queue.start(second, task_id="t2", reports=True).verdict is Verdict.AUTHORIZED


def test_a_user_without_channels_starts_and_reports_as_before_and_polls(
    redis_server: EmbeddedRedis, redis_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    admin = redis.Redis.from_url(redis_url)
    without = [r for r in ACL_RULES if r not in ("resetchannels", "&siq:*", "+publish", "+subscribe")]
    admin.execute_command("ACL", "SETUSER", "nochannels", "reset", "on", ">s3cret", "resetchannels", *without)
    try:
        queue = IntervalQueue("wakes-acl", url=f"redis://nochannels:s3cret@127.0.0.1:{redis_server.port}/0",
                              interval="1ms")  # fmt: skip
        first, second = queue.claim(), queue.claim()
        time.sleep(0.005)  # the first's slot came
        authorized = queue.start(first, reports=True)
        time.sleep(0.005)
        held = queue.start(second, reports=True)
        assert held.verdict is Verdict.WAIT
        monkeypatch.setattr(Wakes, "OFF_S", 0.0)  # it subscribes again at once, and is refused again
        with caplog.at_level(logging.INFO, logger="siq_celery"):
            assert queue.backend.wait_for_wake(queue.name, second.number, held.now_us, 0.1) is None, "polls"
            assert queue.backend.wait_for_wake(queue.name, second.number, held.now_us, 0.1) is None
        told = [r.getMessage() for r in caplog.records if "wakes are off" in r.getMessage()]
        assert len(told) == 1 and "&siq:* +publish +subscribe" in told[0], "said once, with what to grant"
        monkeypatch.setattr(Wakes, "OFF_S", 60.0)
        assert queue.backend.wait_for_wake(queue.name, second.number, held.now_us, 0.1) is None
        assert not queue.backend.can_wake, "a start held by a full cap goes back to the broker as before"
        assert queue.began(authorized, wait=True), "the report's wake is refused quietly, the report holds"
        time.sleep(0.005)  # an interval after the report
        assert queue.start(second, reports=True).verdict is Verdict.AUTHORIZED
    finally:
        admin.execute_command("ACL", "DELUSER", "nochannels")


def test_sqlite_has_no_wakes_and_its_starts_poll(tmp_path: Path) -> None:
    queue = IntervalQueue("wakes-sqlite", url=f"sqlite:///{tmp_path}/s.db", interval="1ms")
    assert queue.backend.wait_for_wake(queue.name, 1, 0, 0.1) is None


def test_the_wait_loop_hands_a_lease_over_at_once_not_at_its_next_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory store, real threads: the cap's poll made 2 s, a start held by the full cap
    begins its body within a fraction of that after the body before it ended."""
    monkeypatch.setattr(concurrency, "LEASE_POLL_US", 2_000_000)
    queue = IntervalQueue("handoff", url="memory://wakes-handoff", interval="1ms", concurrency=1)
    times: dict[str, float] = {}
    inside = threading.Event()

    def first() -> None:
        with queue.slot(task_id="a"):
            inside.set()
            time.sleep(0.3)
        times["a_ended"] = time.monotonic()

    def second() -> None:
        inside.wait(5)
        with queue.slot(task_id="b"):
            times["b_began"] = time.monotonic()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    handoff = times["b_began"] - times["a_ended"]
    print(f"\nthe next body began {1e3 * handoff:.2f} ms after the lease came back (poll 2 s)")
    assert handoff < 0.5, "woken by the lease given back, not by the 2 s poll"


def test_a_process_is_subscribed_only_while_one_of_its_starts_waits(redis_url: str) -> None:
    """The server keeps no wakes for a process that is not waiting: the queue's channel is
    let go when the wait ends (here: authorized when the lease came back)."""
    queue = IntervalQueue("wakes-sub", url=redis_url, interval="1ms", concurrency=1)
    admin = redis.Redis.from_url(redis_url)
    channel = queue.backend.keys(queue.name).wake

    def subscribers() -> int:
        return int(admin.pubsub_numsub(channel)[0][1])

    first, second = queue.claim(), queue.claim()
    time.sleep(0.005)
    authorized = queue.start(first, task_id="a", reports=True)
    assert queue.began(authorized, wait=True)
    out: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: out.update(d=queue.wait_for_turn(second, task_id="b", reports=True)), daemon=True
    )
    thread.start()
    deadline = time.monotonic() + 5
    while subscribers() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert subscribers() == 1, "subscribed while its start waits for the lease"
    admin.publish(channel, "not a wake")  # another publisher's message is skipped, the wakes stay on
    time.sleep(0.05)
    queue.finish("a", lease=authorized.lease)
    thread.join(5)
    assert out["d"].verdict is Verdict.AUTHORIZED and queue.backend.can_wake
    time.sleep(0.05)
    assert subscribers() == 0, "let go once the wait ended"


def test_a_wake_counts_once(redis_url: str) -> None:
    """A waiter woken asks again; a second wait with the same last answer (a store clock that
    stepped back would give an earlier one) is not woken by the same wake."""
    queue = IntervalQueue("wakes-once", url=redis_url, interval="1ms", concurrency=1)
    first, second = queue.claim(), queue.claim()
    time.sleep(0.005)
    authorized = queue.start(first, task_id="t1", reports=True)
    assert queue.began(authorized, wait=True)
    time.sleep(0.005)
    held = queue.start(second, task_id="t2", reports=True)
    assert held.full
    thread, out = waiter(queue, second.number, held.now_us, 5.0)
    time.sleep(0.2)
    queue.finish("t1", lease=authorized.lease)
    thread.join(5)
    assert out["woken"] is True
    began = time.monotonic()
    assert queue.backend.wait_for_wake(queue.name, second.number, held.now_us, 0.2) is False
    assert time.monotonic() - began >= 0.19


def test_a_wake_that_fails_is_a_nap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the store's reader raises, the start naps as it did: nothing reaches the task."""
    queue = IntervalQueue("wakes-raise", url="memory://wakes-raise", interval="1ms")
    ticket = queue.claim()

    def broken(*args: Any) -> bool:
        raise AttributeError("'NoneType' object has no attribute 'has_data'")

    monkeypatch.setattr(queue.backend, "wait_for_wake", broken)
    began = time.monotonic()
    queue._wake_nap(ticket, 0, 0.05, None)
    assert time.monotonic() - began >= 0.045
