"""Poison messages, on every store, pinned clock: a task id whose authorized starts never
finished (its worker process died each time: out of memory, a segfault, ``os._exit``) is
refused once ``max_lost_deliveries`` of them were lost, without taking a slot, instead
of being redelivered and started for ever. A finish of any kind (a retry's, a back-off's)
clears the count; a deferral is no start and counts nothing. A dead worker's run stops
renewing its lease, so its copy starts once the lease expired: the stores here keep
leases half an interval (LEASE), and the copies come an interval apart."""

from __future__ import annotations

import pytest

from siq_celery import CombinedQueue, IntervalQueue, SiqError, Verdict
from tests.conftest import Store

I = 100_000
LEASE = I // 2  # a dead worker's lease has expired by the next copy's start


def lose(q: IntervalQueue, task_id: str, times: int) -> int:
    """Start ``task_id`` ``times`` times, one interval apart, never finishing it (each
    copy's worker dies); returns the store time of the last start."""
    now = q.status().state.last_start_us
    for _ in range(times):
        now += I
        q.backend.clock.now_us = now  # type: ignore[union-attr]
        assert q.start(q.claim(), task_id=task_id).authorized
    return now


def test_a_task_lost_with_its_worker_max_times_is_refused_without_taking_a_slot(store: Store) -> None:
    q = store.queue(max_lost_deliveries=3, lease_timeout_us=LEASE)
    q.ensure()
    last = lose(q, "poison", 3)
    store.clock.now_us = last + I
    ticket = q.claim()
    refused = q.start(ticket, task_id="poison")
    print(f"\nafter 3 lost deliveries the 4th copy is {refused.verdict.value!r}")
    assert refused.verdict is Verdict.LOST
    assert q.status().state.last_start_us == last, "the refused copy took no slot"
    assert q.start(q.claim(), task_id="poison").verdict is Verdict.LOST, "and it stays refused"
    assert q.start(ticket, task_id="healthy").authorized, "the slot went to the next task"


def test_wait_for_turn_raises_a_clear_error_for_a_poison_task(store: Store) -> None:
    q = store.queue(max_lost_deliveries=2, lease_timeout_us=LEASE)
    q.ensure()
    lose(q, "poison", 2)
    store.clock.advance(us=I)
    with pytest.raises(SiqError) as refused:
        q.wait_for_turn(task_id="poison", timeout=1)
    message = str(refused.value)
    assert type(refused.value).__name__ == "LostDeliveriesError", "a task lost twice started again"
    assert "poison" in message and "2" in message and "\n" not in message


def test_a_finish_of_any_kind_clears_the_count(store: Store) -> None:
    q = store.queue(max_lost_deliveries=2, lease_timeout_us=LEASE)
    q.ensure()
    lose(q, "retried", 1)
    q.backend.finish(q.name, "retried", "RETRY", remember=False)  # a run that ended in self.retry()
    last = lose(q, "retried", 1)
    q.backend.finish(q.name, "retried", "BACKOFF", remember=False)
    store.clock.now_us = last + I
    assert q.start(q.claim(), task_id="retried").authorized, "runs that ended are no lost deliveries"


def test_waits_and_refusals_count_nothing(store: Store) -> None:
    q = store.queue(max_lost_deliveries=1, lease_timeout_us=LEASE)
    t0 = q.ensure().last_start_us
    ticket = q.claim()
    for _ in range(3):  # deferred: asked, told to wait, never started
        assert q.start(ticket, task_id="patient").verdict is Verdict.WAIT
    store.clock.now_us = t0 + I
    assert q.start(ticket, task_id="patient").authorized


def test_zero_turns_the_limit_off_and_the_default_store_has_none(store: Store) -> None:
    for q in (
        store.queue("off", max_lost_deliveries=0, lease_timeout_us=LEASE),
        store.queue("default", lease_timeout_us=LEASE),
    ):
        q.ensure()
        last = lose(q, "crashes", 5)
        store.clock.now_us = last + I
        assert q.start(q.claim(), task_id="crashes").authorized


def test_lost_counts_are_kept_for_the_finished_retention_and_go_with_the_queue(store: Store) -> None:
    q = store.queue(max_lost_deliveries=1, finished_retention_us=10 * I, lease_timeout_us=LEASE)
    q.ensure()
    last = lose(q, "old", 1)
    store.clock.now_us = last + 5 * I
    assert q.start(q.claim(), task_id="old").verdict is Verdict.LOST
    store.clock.now_us = last + 12 * I
    assert q.start(q.claim(), task_id="old").authorized, "a count older than the retention is forgotten"
    store.clock.advance(us=I)
    assert q.start(q.claim(), task_id="old").verdict is Verdict.LOST
    q.delete()
    q.ensure()
    store.clock.advance(us=2 * I)
    assert q.start(q.claim(), task_id="old").authorized, "deleting a queue forgets its counts"


def test_several_limits_count_the_task_once_and_refuse_it_in_every_queue(store: Store) -> None:
    backend = store.backend(max_lost_deliveries=2, lease_timeout_us=LEASE)
    fast = IntervalQueue("{geo}per-second", interval="100ms", backend=backend)
    slow = IntervalQueue("{geo}per-2s", interval="200ms", backend=backend)
    fast.ensure()
    t0 = slow.ensure().last_start_us
    both = CombinedQueue([fast, slow])
    for n in (1, 2):
        store.clock.now_us = t0 + n * 2 * I
        assert all(d.authorized for d in both.start(both.claim(), task_id="poison"))
    store.clock.now_us = t0 + 6 * I
    ticket = both.claim()
    assert [d.verdict for d in both.start(ticket, task_id="poison")] == [Verdict.LOST, Verdict.LOST]
    assert slow.status().state.last_start_us == t0 + 4 * I, "nothing recorded"
    both.finish("poison", "RETRY", remember=False)
    assert all(d.authorized for d in both.start(ticket, task_id="poison"))
