"""Several limits on one start (CombinedQueue), on every store, pinned clock: authorized
in every queue at once or recorded in none; a place in line in the primary queue (the
longest interval) only, so nothing is held in another queue while the start waits."""

from __future__ import annotations

import pytest

from siq_celery import CombinedQueue, ConfigurationError, IntervalQueue, Verdict
from siq_celery.keys import QueueKeys
from siq_celery.types import Ticket
from tests.conftest import Store

FAST, SLOW = 100_000, 200_000  # 100 ms, and "10/2s"


def limits(store: Store) -> tuple[CombinedQueue, IntervalQueue, IntervalQueue]:
    backend = store.backend()
    fast = IntervalQueue("{geo}per-second", interval="100ms", backend=backend)
    slow = IntervalQueue("{geo}per-2s", interval="10/2s", backend=backend)
    fast.ensure()
    slow.ensure()
    return CombinedQueue([fast, slow]), fast, slow


def test_a_start_is_authorized_in_every_queue_or_recorded_in_none(store: Store) -> None:
    both, fast, slow = limits(store)
    t0 = fast.status().state.last_start_us
    ticket = both.claim()
    assert both.primary is slow and ticket.queue == slow.name and fast.status().state.ticket == 0
    store.clock.now_us = t0 + FAST  # the fast queue would allow it, the slow one not yet
    decisions = both.start(ticket)
    assert [d.verdict for d in decisions] == [Verdict.WAIT, Verdict.WAIT]
    assert [d.wait_us for d in decisions] == [0, SLOW - FAST]
    assert fast.status().state.current == 0, "nothing recorded in the queue that would allow it"
    store.clock.now_us = t0 + SLOW
    decisions = both.start(ticket, task_id="t1")
    assert [d.verdict for d in decisions] == [Verdict.AUTHORIZED, Verdict.AUTHORIZED]
    assert fast.status().state.last_start_us == slow.status().state.last_start_us == t0 + SLOW
    nxt = both.claim()
    store.clock.now_us = t0 + SLOW + FAST
    assert [d.verdict for d in both.start(nxt)] == [Verdict.WAIT, Verdict.WAIT]  # the slow cap holds
    store.clock.now_us = t0 + 2 * SLOW
    assert all(d.authorized for d in both.start(nxt))


def test_a_paused_queue_holds_no_slot_of_the_other(store: Store) -> None:
    both, fast, slow = limits(store)
    t0 = fast.status().state.last_start_us
    ticket = both.claim()
    slow.pause()
    store.clock.now_us = t0 + SLOW
    assert [d.verdict for d in both.start(ticket)] == [Verdict.WAIT, Verdict.PAUSED]
    for n in range(1, 6):  # a task with the fast limit only goes on at its pace meanwhile
        store.clock.now_us = t0 + n * FAST
        assert fast.start(fast.claim()).authorized
    slow.resume(grace=0)
    store.clock.now_us = t0 + 3 * SLOW
    decision = both.wait_for_turn(ticket, timeout=1)
    assert decision.authorized and decision.ticket == ticket.number


def test_a_finished_task_is_not_started_again_and_a_reclaim_goes_through(store: Store) -> None:
    both, fast, slow = limits(store)
    t0 = fast.status().state.last_start_us
    store.clock.now_us = t0 + SLOW
    with both.slot(task_id="done"):
        pass
    assert {d.verdict for d in both.start(both.claim(), task_id="done")} == {Verdict.DUPLICATE}
    store.clock.now_us = t0 + 3 * SLOW
    stale = both.claim()
    slow.reset()  # the primary's line starts a new life: the start re-claims and goes on
    assert Verdict.RECLAIM in {d.verdict for d in both.start(stale)}
    fresh = both.claim()  # what wait_for_turn does on RECLAIM: a ticket anew
    store.clock.now_us = t0 + 10 * SLOW
    assert all(d.authorized for d in both.start(fresh))


def test_costs_count_in_every_queue(store: Store) -> None:
    both, fast, slow = limits(store)
    t0 = fast.status().state.last_start_us
    store.clock.now_us = t0 + SLOW
    assert all(d.authorized for d in both.start(both.claim(cost=2), cost=2))
    assert fast.status().state.last_start_us == t0 + SLOW + FAST
    assert slow.status().state.last_start_us == t0 + 2 * SLOW


def test_a_combined_limit_takes_different_queues_of_one_store(store: Store) -> None:
    _, fast, _ = limits(store)
    with pytest.raises(ConfigurationError):
        CombinedQueue([fast])
    with pytest.raises(ConfigurationError):
        CombinedQueue([fast, fast])
    with pytest.raises(ConfigurationError):
        CombinedQueue([fast, IntervalQueue("{geo}per-2s", interval="10/2s", backend=store.backend())])


def test_names_with_their_own_hash_tag_share_a_slot_and_list_like_any_other(store: Store) -> None:
    _, fast, _ = limits(store)
    assert QueueKeys.for_queue("{geo}per-second").state == "siq:{geo}per-second:state"
    assert QueueKeys.queue_from_state_key("siq:{geo}per-second:state") == "{geo}per-second"
    assert QueueKeys.queue_from_state_key("siq:{geo}:state") == "geo"
    IntervalQueue("geo", interval="1s", backend=fast.backend).ensure()
    assert fast.backend.queues() == ["geo", "{geo}per-2s", "{geo}per-second"]
    assert fast.backend.queues("{geo}*") == ["{geo}per-2s", "{geo}per-second"]


def test_queues_in_different_cluster_slots_cannot_be_combined(store: Store) -> None:
    if store.kind != "redis-cluster":
        pytest.skip("one hash slot per script is a Redis Cluster constraint")
    backend = store.backend()
    apart = CombinedQueue([IntervalQueue(n, interval="1s", backend=backend) for n in ("geo-second", "geo-day")])
    with pytest.raises(ConfigurationError, match="hash tag"):
        apart.start(apart.claim())


def test_a_start_with_no_place_in_any_line_is_never_authorized(store: Store) -> None:
    _, fast, slow = limits(store)
    store.clock.now_us = fast.status().state.last_start_us + 10 * SLOW
    decisions = store.backend().start_all(
        [fast.name, slow.name], [0, 0], ["", ""], task_id=None, interval_us=[FAST, SLOW], new_epoch="e"
    )
    assert {d.verdict for d in decisions} == {Verdict.RECLAIM}
    assert fast.start(Ticket(fast.name, 0, fast.status().state.epoch, 0, 0)).verdict is Verdict.RECLAIM
