"""ReplyClock: the store's clock read against this process's from the answers to its asks.
Whatever the delays on the way there and back, the bound it gives is never past the true
difference (a body held by it never begins before its slot on the store's clock), and
recent quick answers make it tighter than the newest answer alone."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from siq_celery.client.reply_clock import DRIFT, REPLIES_KEPT, REPLY_WINDOW_S, ReplyClock
from tests.timing import HOST_CLOCK_RERUNS, host_clock

OFFSET_S = 1234.5678  # the store's clock minus this process's


def answer(clock: ReplyClock, sent: float, there: float, back: float) -> float:
    """An ask sent at ``sent`` reaches the store ``there`` later and comes back ``back`` after."""
    store_us = round((sent + there + OFFSET_S) * 1e6)
    return clock.note(sent, sent + there + back, store_us)


@given(st.lists(st.tuples(st.floats(0, 0.01), st.floats(0, 0.01), st.floats(0, 0.02)), min_size=1, max_size=60))
def test_the_bound_never_passes_the_true_difference_whatever_the_delays(asks: list[tuple[float, float, float]]) -> None:
    clock, now = ReplyClock(), 100.0
    for there, back, pause in asks:
        low = answer(clock, now, there, back)
        assert low <= OFFSET_S + 1e-6  # the store's time is rounded to microseconds
        now += there + back + pause


def test_a_quick_answer_lately_makes_the_bound_tighter_than_a_slow_answer_alone() -> None:
    clock = ReplyClock()
    answer(clock, 100.0, 0.00002, 0.00003)  # 50 µs there and back
    low = answer(clock, 100.005, 0.0001, 0.0009)  # 1 ms: on its own, 0.9 ms short
    assert OFFSET_S - low == pytest.approx(0.00003 + DRIFT * 0.006, abs=2e-6)  # less the drift since
    later = answer(clock, 100.005 + REPLY_WINDOW_S + 0.001, 0.0001, 0.0009)  # the quick one is too old now
    assert OFFSET_S - later == pytest.approx(0.0009, abs=2e-6)


def test_no_bound_past_what_the_newest_answer_allows() -> None:
    """A clock that stepped since (the store's back by 1 ms): older answers would place it
    ahead of where the newest says it can be; the newest answer's own upper bound caps it."""
    clock = ReplyClock()
    answer(clock, 100.0, 0.00002, 0.00003)
    low = clock.note(100.01, 100.0103, round((100.01 + OFFSET_S - 0.001) * 1e6))  # stepped back 1 ms
    assert low <= OFFSET_S - 0.001 + 1e-6


def test_it_keeps_the_last_answers_only() -> None:
    clock = ReplyClock()
    answer(clock, 100.0, 0.0, 0.0)  # exact
    for n in range(REPLIES_KEPT):
        low = answer(clock, 100.001 + n * 1e-4, 0.0005, 0.0005)
    assert OFFSET_S - low == pytest.approx(0.0005, abs=2e-6)


@given(st.floats(-DRIFT, DRIFT), st.lists(st.tuples(st.floats(0, 0.002), st.floats(0, 0.002)), min_size=2, max_size=40))
def test_a_store_clock_drifting_within_the_allowance_is_never_overtaken(
    rate: float, asks: list[tuple[float, float]]
) -> None:
    """The store's clock runs ``rate`` faster than this process's (NTP's slew: 500 ppm at
    most): older answers' bounds lose the drift since, and none passes the difference now."""
    clock, now = ReplyClock(), 100.0
    for there, back in asks:

        def store(local: float) -> float:
            return local + OFFSET_S + rate * (local - 100.0)

        low = clock.note(now, now + there + back, round(store(now + there) * 1e6))
        assert low <= store(now + there + back) - (now + there + back) + 1e-6
        now += there + back + 0.001


@HOST_CLOCK_RERUNS
def test_bodies_held_by_it_never_begin_before_their_slots_on_the_stores_clock(redis_url: str) -> None:
    """Real Redis on this host (its clock is this host's wall clock): 120 starts of a 5 ms
    line in one process, each body held for its slot by the bound read from the answers;
    every body's own ``time.time()`` is at or after its slot, and the bound was used."""
    import time

    from siq_celery import IntervalQueue
    from siq_celery.client.body import begin_body
    from siq_celery.ledger import StartRecord

    q = IntervalQueue("reply-clock", interval="5ms", url=redis_url)
    q.ensure(reset=True)
    early, used = [], 0
    try:
        for n in range(120):
            record = StartRecord("t", f"id{n}", "h", 1)
            d = begin_body(q, f"id{n}", lambda n=n, record=record: q.wait_for_turn(task_id=f"id{n}", record=record,
                                                                                reports=True))  # fmt: skip
            began = time.time()
            used += d.slot_at > 0
            early += [(n, d.now_us / 1e6 - began)] if began < d.now_us / 1e6 else []  # where the store placed it
            q.backend.finish(q.name, f"id{n}", "SUCCESS", remember=True)
    finally:
        q.close()
    assert early == []
    # Held ahead of their slots (the lead), the bound read from the answers: how many were
    # answered ahead of their slot is this host's scheduling (44 of 120 on a loaded host).
    host_clock(used >= 60, f"{used} of 120 starts were answered ahead of their slots (60 or more expected)")


def test_a_queue_reads_its_answers_only_on_the_stores_own_clock_and_never_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``IntervalQueue._read_answer``: a start authorized 3 ms ahead of its slot, answered
    0.5 ms after it was asked: the slot comes on this clock no later than the answer alone
    says; nothing with a pinned clock (a test's store time is not this process's); a bound
    that cannot be read is no bound (the hold as the answer alone times it), never an error."""
    import time

    from siq_celery import IntervalQueue
    from siq_celery.backends.memory import MemoryBackend
    from siq_celery.testing import PinnedClock
    from siq_celery.types import Decision, Verdict

    t1 = time.monotonic()
    store_now = 1_000_000_000_000
    ahead = Decision(Verdict.AUTHORIZED, 1, store_now + 3_000, 3_000, store_now + 3_000)
    q = IntervalQueue("reads", interval="10ms", backend=MemoryBackend())
    slot_at = q._read_answer(ahead, t1, t1 + 0.0005)
    assert 0 < slot_at <= t1 + 0.0005 + 0.003 + 1e-9
    waiting = Decision(Verdict.WAIT, 2, store_now + 9_000, 4_000, store_now + 13_000)
    assert q._read_answer(waiting, t1 + 0.009, t1 + 0.0091) == 0.0  # noted: only a start held ahead gets a time
    pinned = IntervalQueue("reads", interval="10ms", backend=MemoryBackend(clock=PinnedClock()))
    assert pinned._read_answer(ahead, t1, t1 + 0.0005) == 0.0

    def broken(*_: object) -> float:
        raise RuntimeError("deque mutated during iteration")

    monkeypatch.setattr(ReplyClock, "note", broken)
    assert q._read_answer(ahead, t1, t1 + 0.0005) == 0.0
