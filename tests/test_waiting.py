"""The blocking helpers (wait_for_turn, slot, limited) on a simulated clock: sleeping
moves the store clock, so nothing really sleeps and every figure is exact."""

from __future__ import annotations

import itertools
import logging
from typing import Any

import pytest

from siq_celery import IntervalQueue, StoreUnavailableError, Verdict
from siq_celery.backends.memory import MemoryBackend
from siq_celery.client.waiting import DuplicateTaskError, SlotTimeoutError
from siq_celery.testing import PinnedClock

_names = itertools.count()


class SimulatedTime:
    """``sleep`` advances both the local monotonic clock and the store clock."""

    def __init__(self, clock: PinnedClock) -> None:
        self.clock, self.t, self.sleeps = clock, 0.0, []  # type: ignore[var-annotated]

    def monotonic(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.t += seconds
        self.clock.advance(seconds)


def make_queue(interval: str = "100ms", backend: Any = None) -> tuple[IntervalQueue, SimulatedTime]:
    clock = PinnedClock()
    sim = SimulatedTime(clock)
    backend = backend or MemoryBackend(clock=clock)
    backend.clock = clock
    q = IntervalQueue(f"w{next(_names)}", interval=interval, backend=backend, sleep=sim.sleep, monotonic=sim.monotonic)
    return q, sim


def test_slot_blocks_until_the_turn_and_sleeps_close_to_the_slot() -> None:
    q, sim = make_queue()
    t0 = q.ensure().last_start_us
    starts = []
    for _ in range(5):
        with q.slot() as decision:
            starts.append(decision.now_us)
    assert starts == [t0 + k * 100_000 for k in range(1, 6)]
    # far from the slot it sleeps to 2 ms before the time it asks (three quarters of the
    # lead, 5 ms at 100 ms, before the slot), then the rest; authorized for its slot, the
    # body is held until then: three naps per start, an interval in all
    assert sim.sleeps == pytest.approx([0.09425, 0.002, 0.00375] * 5)


def test_limited_takes_a_turn_per_call_and_keeps_the_function() -> None:
    q, _ = make_queue()
    q.ensure()
    seen = []

    @q.limited
    def call_api(x: int, *, y: int = 0) -> int:
        """Doc."""
        seen.append(q.backend.clock())  # type: ignore[misc]
        return x + y

    assert [call_api(i, y=1) for i in range(3)] == [1, 2, 3]
    assert call_api.__doc__ == "Doc." and call_api.__name__ == "call_api"
    assert [b - a for a, b in itertools.pairwise(seen)] == [100_000, 100_000]


def test_paused_queue_polls_with_backoff_and_starts_after_resume() -> None:
    q, sim = make_queue()
    q.ensure()
    q.pause()
    original_sleep = sim.sleep

    def sleep_then_resume(seconds: float) -> None:
        original_sleep(seconds)
        if sim.t > 3.0 and q.status().state.paused:
            q.resume()

    q._sleep = sleep_then_resume
    decision = q.wait_for_turn()
    assert decision.authorized
    polls = [s for s in sim.sleeps if s >= 0.05]
    assert polls[:5] == [0.05, 0.1, 0.2, 0.4, 0.8] and max(polls) == 1.0


def test_reclaim_after_a_reset_takes_a_fresh_ticket() -> None:
    q, _ = make_queue()
    q.ensure()
    old = q.claim()
    q.reset()
    decision = q.wait_for_turn(old)
    assert decision.authorized and decision.ticket == 1 and q.status().state.ticket == 1


def test_duplicate_task_is_refused() -> None:
    q, _ = make_queue()
    q.ensure()
    with q.slot(task_id="t-1"):
        pass
    with pytest.raises(DuplicateTaskError), q.slot(task_id="t-1"):
        pytest.fail("a finished task ran again")


def test_timeout_gives_up_the_ticket() -> None:
    q, _ = make_queue("10s")
    q.ensure()
    with pytest.raises(SlotTimeoutError):
        q.wait_for_turn(timeout=1.0)


class FlakyBackend(MemoryBackend):
    """The store is unreachable for the first ``failures`` calls to start."""

    def __init__(self, failures: int, **kw: Any) -> None:
        super().__init__(**kw)
        self.failures = failures

    def start(self, *args: Any, **kwargs: Any) -> Any:
        if self.failures:
            self.failures -= 1
            raise StoreUnavailableError("connection refused")
        return super().start(*args, **kwargs)


def test_unreachable_store_fails_closed_retries_with_backoff_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    q, sim = make_queue(backend=FlakyBackend(6))
    q.ensure()
    with caplog.at_level(logging.WARNING, logger="siq_celery"):
        decision = q.wait_for_turn()
    assert decision.verdict is Verdict.AUTHORIZED
    assert sim.sleeps[:6] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert sum("unreachable" in r.message for r in caplog.records) == 6
    assert q.status().state.current == 1  # authorized once, after the store came back


class SlowReplyBackend(MemoryBackend):
    """The reply to the first authorizing start takes 3 ms to reach the caller."""

    def __init__(self, sim: SimulatedTime, **kw: Any) -> None:
        super().__init__(**kw)
        self.sim, self.slow = sim, True

    def start(self, *args: Any, **kwargs: Any) -> Any:
        decision = super().start(*args, **kwargs)
        if decision.authorized and self.slow:
            self.slow = False
            self.sim.sleep(0.003)
        return decision


def test_a_slowly_delivered_authorization_is_restamped_so_the_next_start_counts_from_it() -> None:
    clock = PinnedClock()
    sim = SimulatedTime(clock)
    backend = SlowReplyBackend(sim, clock=clock)
    q = IntervalQueue("slow", interval="10ms", backend=backend, sleep=sim.sleep, monotonic=sim.monotonic)
    t0 = q.ensure().last_start_us
    bodies = []
    for _ in range(3):
        with q.slot() as d:
            bodies.append(clock.now_us)
    assert d.authorized
    # asked 1.875 ms ahead of its slot (three quarters of the 2.5 ms lead) and authorized
    # for it, the body is held 1.875 ms from the answer, which came 3 ms after the ask: it
    # ran 3 ms after its slot (a hold timed from the ask would begin it before the slot
    # whenever the ask, not the answer, was slow)...
    assert bodies[0] == t0 + 10_000 + 3_000
    assert bodies[1] - bodies[0] >= 10_000  # ...and the next still came a full interval later
    assert bodies[2] - bodies[1] == 10_000
