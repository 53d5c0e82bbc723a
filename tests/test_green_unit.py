"""The pieces of a green pool's wait for a slot, without a worker: admission in ticket
order (broker/admission.py), precise naps (broker/green.py), the re-stamp sent without waiting
(queue.IntervalQueue.settle, RedisBackend.restamp_soon), the extra credit of the consumer
(broker/green_credit.py) and siq_green_max_sleep."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery

from siq_celery import IntervalQueue
from siq_celery.backends.memory import MemoryBackend
from siq_celery.backends.redis import RedisBackend
from siq_celery.broker import green as green_module
from siq_celery.broker.admission import Admission
from siq_celery.broker.green import nap
from siq_celery.broker.green_credit import GreenCredit
from siq_celery.client.waiting import _sleep_before_asking
from siq_celery.tasks.settings import SiqSettings
from siq_celery.testing import PinnedClock
from tests.test_waiting import SimulatedTime, SlowReplyBackend
from tests.timing import HOST_CLOCK_RERUNS, host_clock

# -- admission -------------------------------------------------------------------------


def wait_in(admission: Admission, queue: str, ticket: int, order: list[int], release: threading.Event) -> None:
    with admission.turn(queue, ticket):
        order.append(ticket)
        release.wait(5)


def until(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + 5
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def test_only_the_lowest_tickets_are_let_in_and_the_rest_follow_in_ticket_order() -> None:
    admission = Admission(width=2)
    order: list[int] = []
    releases = {t: threading.Event() for t in (7, 3, 9, 5, 4)}
    first = [threading.Thread(target=wait_in, args=(admission, "q", t, order, releases[t])) for t in (7, 3)]
    for t in first:
        t.start()
    until(lambda: admission.waiting("q") == (2, 0), "the first two let in")
    rest = [threading.Thread(target=wait_in, args=(admission, "q", t, order, releases[t])) for t in (9, 5, 4)]
    for t in rest:
        t.start()
    until(lambda: admission.waiting("q") == (2, 3), "three more waiting")
    assert sorted(order) == [3, 7]
    for ticket, expected in ((3, [4]), (7, [4, 5]), (4, [4, 5, 9])):  # each one leaving lets the lowest in
        releases[ticket].set()
        until(lambda e=expected: sorted(order[2:]) == e, f"let in {expected}")
    for event in releases.values():
        event.set()
    for t in first + rest:
        t.join(5)
    assert admission.waiting("q") == (0, 0)


def test_queues_are_let_in_apart() -> None:
    admission = Admission(width=1)
    with admission.turn("a", 10), admission.turn("b", 20):  # the other queue's turn does not wait
        assert admission.waiting("a") == (1, 0) and admission.waiting("b") == (1, 0)
    assert admission.waiting("a") == (0, 0)


def test_a_waiter_that_ends_before_its_turn_leaves_the_line(monkeypatch: pytest.MonkeyPatch) -> None:
    admission = Admission(width=1)
    with admission.turn("q", 1):

        def thrown_in(self: threading.Event, timeout: float | None = None) -> bool:
            raise KeyboardInterrupt  # as gevent's GreenletExit thrown into a waiting greenlet (a revoke)

        monkeypatch.setattr(threading.Event, "wait", thrown_in)
        with pytest.raises(KeyboardInterrupt), admission.turn("q", 2):
            pass
        monkeypatch.undo()
        assert admission.waiting("q") == (1, 0)
    assert admission.waiting("q") == (0, 0)


# -- naps ------------------------------------------------------------------------------


@pytest.fixture
def green_process() -> Iterator[None]:
    green_module.GREEN = True
    yield
    green_module.GREEN = False


@HOST_CLOCK_RERUNS
def test_a_green_nap_ends_at_its_end_not_a_timer_tick_later(green_process: None) -> None:
    late = []
    for seconds in (0.0004, 0.002, 0.0045):
        began = time.perf_counter()
        nap(seconds)
        took = time.perf_counter() - began
        assert took >= seconds
        late.append(took - seconds)
    host_clock(min(late) < 0.0005, f"naps ended {[round(x * 1e3, 2) for x in late]} ms late")


def test_a_long_green_nap_is_the_hubs_timer(green_process: None, monkeypatch: pytest.MonkeyPatch) -> None:
    sleeps: list[float] = []
    monkeypatch.setattr(time, "sleep", sleeps.append)
    nap(0.2)
    assert sleeps == [0.2]  # one timer, no yielding: it ends before the slot anyway


# -- the wait loop ---------------------------------------------------------------------


def test_a_late_reply_does_not_make_the_sleep_before_the_slot_end_late(monkeypatch: pytest.MonkeyPatch) -> None:
    # the store said 20 ms; the reply took 7 ms to be read: 20 - 7, in one nap (a sleep ends on time) ...
    assert _sleep_before_asking(0.020, 0.007) == pytest.approx(0.013)
    assert _sleep_before_asking(0.080, 0.001) == pytest.approx(0.077)  # longer: a step, then ask again
    # ... on a green pool, 20 - 2 (near the slot: the hub's timer may end a millisecond late) - 7
    monkeypatch.setattr(green_module, "GREEN", True)
    assert _sleep_before_asking(0.020, 0.007) == pytest.approx(0.011)
    assert _sleep_before_asking(0.006, 0.005) == 0.0
    assert _sleep_before_asking(0.004, 0.001) == pytest.approx(0.003)


class CountingRestamps(SlowReplyBackend):
    def __init__(self, sim: SimulatedTime, **kw: Any) -> None:
        super().__init__(sim, **kw)
        self.soon: list[int] = []

    def restamp_soon(self, queue: str, epoch: str, started_us: int) -> None:
        self.soon.append(started_us)
        super().restamp_soon(queue, epoch, started_us)


def test_on_a_green_pool_a_late_reply_is_restamped_once_without_waiting(green_process: None) -> None:
    clock = PinnedClock()
    sim = SimulatedTime(clock)
    backend = CountingRestamps(sim, clock=clock)
    q = IntervalQueue("green-slow", interval="10ms", backend=backend, sleep=sim.sleep, monotonic=sim.monotonic)
    t0 = q.ensure().last_start_us
    first = q.wait_for_turn()
    assert backend.soon == [first.now_us] and first.now_us == t0 + 10_000  # the reply took 3 ms: re-stamped
    assert q.status().state.last_start_us == first.now_us + 3_000  # to when the body starts
    second = q.wait_for_turn()
    assert second.now_us - (first.now_us + 3_000) >= 10_000
    assert backend.soon == [first.now_us]  # a quick reply is not re-stamped


def test_restamp_soon_on_redis_moves_the_start_and_reads_its_reply_before_the_next(redis_url: str) -> None:
    backend = RedisBackend.from_url(redis_url)
    q = IntervalQueue("soon", interval="10ms", backend=backend)
    epoch = q.ensure().epoch
    decision = q.wait_for_turn()
    backend.restamp_soon("soon", epoch, decision.now_us)
    assert backend._restamps_unread == 1
    moved = last_start_after(q, decision.now_us)
    backend.restamp_soon("soon", epoch, decision.now_us)  # no longer the last start: nothing
    assert backend._restamps_unread == 1  # the first reply was read before the second was sent
    backend.client.script_flush()  # a restart lost the scripts: the next re-stamp loads it again
    for _ in range(3):
        backend.restamp_soon("soon", epoch, moved)
    last_start_after(q, moved)
    backend.close()


def last_start_after(q: IntervalQueue, after_us: int) -> int:
    """The queue's last start once a re-stamp sent on another connection moved it past ``after_us``."""
    deadline = time.monotonic() + 2
    while (last := q.status().state.last_start_us) <= after_us:
        assert time.monotonic() < deadline, "the re-stamp never reached the store"
        time.sleep(0.005)
    return last


def test_the_base_restamp_soon_restamps_at_once_and_never_raises() -> None:
    clock = PinnedClock()
    backend = MemoryBackend(clock=clock)
    q = IntervalQueue("base-soon", interval="10ms", backend=backend)
    state = q.ensure()
    clock.advance(0.001)
    backend.restamp_soon("base-soon", "not-the-epoch", state.last_start_us)  # nothing, quietly
    backend.restamp_soon("no-such-queue", state.epoch, 0)


# -- the consumer's credit, the setting ------------------------------------------------


class FakeQoS:
    def __init__(self, value: int) -> None:
        self.value, self.updated = value, 0

    def increment_eventually(self, n: int) -> None:
        self.value += n

    def update(self) -> None:
        self.updated += 1


@pytest.mark.parametrize(("driver", "value", "after"), [("redis", 50, 51), ("amqp", 50, 50), ("redis", 0, 0)])
def test_a_green_consumer_on_redis_gets_one_message_of_credit_more(driver: str, value: int, after: int) -> None:
    consumer = SimpleNamespace(
        qos=FakeQoS(value), connection=SimpleNamespace(transport=SimpleNamespace(driver_type=driver))
    )
    GreenCredit(consumer).start(consumer)
    assert consumer.qos.value == after


def test_siq_green_max_sleep_defaults_to_5s_and_is_never_below_siq_max_sleep() -> None:
    app = Celery("g", broker="redis://localhost/0", set_as_current=False)
    assert SiqSettings.from_app(app).green_max_sleep == 5.0
    app.conf.siq_green_max_sleep = 1.5
    assert SiqSettings.from_app(app).green_max_sleep == 1.5
    app.conf.siq_max_sleep = 3.0
    assert SiqSettings.from_app(app).green_max_sleep == 3.0
