"""The contract every state store passes: memory, SQLite, Redis and a 3-node Redis Cluster.

Each case of docs/design.md, "Cases the tests must pin down" is a named test here. The store
clock is pinned (``store.clock``), nothing sleeps, and every figure is exact. Interval:
100 ms (``I``); ``T0`` is the pinned time at which the queue is created.
"""

from __future__ import annotations

import itertools
import time

import pytest

from siq_celery import (
    ConfigurationError,
    CorruptStateError,
    IntervalMismatchError,
    QueueExistsError,
    QueueNotFoundError,
    StoreUnavailableError,
    Verdict,
)
from siq_celery.ledger import StartRecord
from siq_celery.types import Ticket
from tests.conftest import Store

I = 100_000  # the interval in microseconds
SETTLE = 1_000_000  # after an outage the line restarts this long from now (1 s, or 10 intervals)


def at(store: Store, t_us: int) -> None:
    store.clock.now_us = t_us


def test_new_queue_waits_one_interval_before_its_first_start(store: Store) -> None:
    q = store.queue()
    t0 = q.ensure().last_start_us
    ticket = q.claim()
    assert ticket.number == 1 and ticket.estimated_start_us == t0 + I and ticket.delay == 0.1
    d = q.start(ticket)
    assert d.verdict is Verdict.WAIT and d.wait_us == I
    at(store, t0 + I)
    d = q.start(ticket)
    assert d.authorized and d.lateness == 0


def test_starts_follow_ticket_order_one_interval_apart(store: Store) -> None:
    worker_a, worker_b = store.queue(), store.queue()
    t0 = worker_a.ensure().last_start_us
    tickets = worker_a.claim_many(4)
    assert [t.estimated_start_us - t0 for t in tickets] == [I, 2 * I, 3 * I, 4 * I]
    for i, ticket in enumerate(tickets, start=1):
        at(store, t0 + i * I - 1)
        assert worker_b.start(ticket).verdict is Verdict.WAIT
        if i < 4:  # the next ticket may not jump ahead of this one
            assert worker_b.start(tickets[i]).verdict is Verdict.WAIT
        at(store, t0 + i * I)
        assert worker_a.start(ticket).authorized
    status = worker_a.status()
    assert (status.state.ticket, status.state.current, status.state.last_start_us) == (4, 4, t0 + 4 * I)


def test_claimed_ticket_that_never_starts_costs_one_slot_and_no_more(store: Store) -> None:
    q = store.queue()
    t0 = q.ensure().last_start_us
    t1, _lost, t3, t4 = q.claim_many(4)
    at(store, t0 + I)
    assert q.start(t1).authorized
    at(store, t0 + 2 * I)  # the lost ticket's slot: ticket 3 still waits for its own
    d = q.start(t3)
    assert d.verdict is Verdict.WAIT and d.wait_us == I
    at(store, t0 + 3 * I)
    assert q.start(t3).authorized
    d = q.start(t4)
    assert d.verdict is Verdict.WAIT and d.wait_us == I  # one interval after ticket 3: no more lost
    at(store, t0 + 4 * I)
    assert q.start(t4).authorized


def test_restamp_moves_only_the_callers_own_last_start(store: Store) -> None:
    q = store.queue()
    t0 = q.ensure().last_start_us
    t1, t2 = q.claim_many(2)
    at(store, t0 + I)
    started = q.start(t1).now_us
    at(store, t0 + I + 3_000)  # the reply reached the caller 3 ms late
    backend = q.backend
    assert backend.restamp("q", t1.epoch, started) == t0 + I + 3_000
    assert q.start(t2).slot_us == t0 + 2 * I + 3_000  # the next start counts from the real start
    assert backend.restamp("q", "other-epoch", t0 + I + 3_000) is None
    assert backend.restamp("q", t1.epoch, started) is None  # no longer the last start
    at(store, t0 + 2 * I + 3_000)
    assert q.start(t2).authorized
    at(store, t0 + 2 * I + 4_000)
    assert backend.restamp("q", t1.epoch, t0 + I + 3_000) is None  # someone else started since


def test_restamp_of_a_queue_with_no_start_recorded_moves_nothing(store: Store) -> None:
    """Before any start there is nothing to move: a re-stamp naming the queue's last slot (as
    a new queue holds it) leaves it where it is, rather than shifting it by the whole clock."""
    q = store.queue()
    state = q.ensure()
    at(store, state.last_start_us + 5_000)
    assert q.backend.restamp("q", state.epoch, state.last_start_us) is None
    assert q.status().state.last_start_us == state.last_start_us
    (ticket,) = q.claim_many(1)
    at(store, state.last_start_us + I)
    assert q.start(ticket).authorized  # the first slot is where it was: the line is not held


def test_redelivered_copy_of_a_finished_task_is_not_run_again(store: Store) -> None:
    q = store.queue()
    t0 = q.ensure().last_start_us
    ticket = q.claim()
    at(store, t0 + I)
    assert q.start(ticket, task_id="task-a").authorized
    q.finish("task-a")
    at(store, t0 + 5 * I)
    assert q.start(ticket, task_id="task-a").verdict is Verdict.DUPLICATE
    assert q.start(q.claim(), task_id="task-a").verdict is Verdict.DUPLICATE  # even with a new ticket
    assert q.status().state.last_start_us == t0 + I  # the copy did not count as a start
    assert q.status().finished == 1


def test_copy_of_a_task_whose_worker_died_mid_run_runs_again_once_its_lease_expired(store: Store) -> None:
    q = store.queue()
    lease = q.backend.lease_timeout_us
    t0 = q.ensure().last_start_us
    first, second = q.claim_many(2)
    at(store, t0 + I)
    assert q.start(first, task_id="task-a").authorized  # ... and the worker dies: no finish, no renewal
    at(store, t0 + I + I // 4)
    d = q.start(first, task_id="task-a")  # the broker redelivers it while its lease is live
    assert (d.verdict, d.wait_us) == (Verdict.RUNNING, lease - I // 4)
    assert q.status().state.current == 1, "no slot taken"
    at(store, t0 + I + lease)  # the lease expired: its holder is dead
    assert q.start(first, task_id="task-a").authorized  # a new start
    assert q.start(second, task_id="task-b").verdict is Verdict.WAIT  # and it counted
    at(store, t0 + 2 * I + lease)
    assert q.start(second, task_id="task-b").authorized


def test_a_copy_of_a_running_task_waits_for_its_finish_and_is_then_refused(store: Store) -> None:
    """A redelivered copy while the first runs (waiting or running past a broker's
    visibility timeout): RUNNING until the first finishes, then DUPLICATE; a run that
    ended in a retry (not remembered) lets the copy run. Tasks without an id, and other
    task ids, are not held by it."""
    q = store.queue()
    t0 = q.ensure().last_start_us
    one, two, three = q.claim_many(3)
    at(store, t0 + I)
    assert q.start(one, task_id="a").authorized
    at(store, t0 + 2 * I)
    assert q.start(one, task_id="a").verdict is Verdict.RUNNING
    assert q.start(two, task_id="b").authorized, "another task is not held"
    q.finish("a")
    assert q.start(one, task_id="a").verdict is Verdict.DUPLICATE
    at(store, t0 + 3 * I)
    assert q.start(three, task_id="c").authorized
    at(store, t0 + 4 * I)
    retry = q.claim()
    assert q.start(retry, task_id="c").verdict is Verdict.RUNNING
    q.finish("c", "RETRY", remember=False)
    assert q.start(retry, task_id="c").authorized, "a retry's run ended: the retry runs"
    at(store, t0 + 5 * I)
    assert q.start(q.claim()).authorized and q.start(q.claim()).verdict is Verdict.WAIT, "no id: no lease"


def test_ticket_arriving_after_current_passed_it_takes_the_next_free_slot(store: Store) -> None:
    q = store.queue()
    t0 = q.ensure().last_start_us
    t1, t2, t3, t4, t5 = q.claim_many(5)
    at(store, t0 + I)
    assert q.start(t1).authorized
    at(store, t0 + 3 * I)
    assert q.start(t3).authorized  # ticket 2 is late; 3 goes at its own slot
    at(store, t0 + 3 * I + 10_000)
    d = q.start(t2)
    assert d.verdict is Verdict.WAIT and d.wait_us == I - 10_000  # the next free slot...
    at(store, t0 + 4 * I)
    assert q.start(t2).authorized  # ...not the back of the line
    d = q.start(t4)
    assert d.verdict is Verdict.WAIT and d.wait_us == I  # the line behind shifted one slot
    assert q.start(t5).slot_us == t0 + 6 * I  # all of it, not just its head
    at(store, t0 + 5 * I)
    assert q.start(t4).authorized


def test_saturated_workers_start_at_their_capacity_without_ticket_churn(store: Store) -> None:
    q = store.queue()
    t0 = q.ensure().last_start_us
    tickets = q.claim_many(10)
    capacity_period = 3 * I // 2  # the workers can only start one task every 150 ms
    for k, ticket in enumerate(tickets):
        at(store, t0 + I + k * capacity_period)
        assert q.start(ticket).authorized  # overdue: starts the moment a worker is free
    state = q.status().state
    assert (state.ticket, state.current) == (10, 10)  # no ticket re-claimed, none skipped
    assert state.last_start_us == t0 + I + 9 * capacity_period


def test_idle_queue_then_a_burst_starts_the_first_at_once_and_keeps_order(store: Store) -> None:
    q = store.queue()
    t0 = q.ensure().last_start_us
    at(store, t0 + I)
    assert q.start(q.claim()).authorized
    idle_end = t0 + 3_600_000_000  # an hour later
    at(store, idle_end)
    burst = q.claim_many(5)
    assert [t.estimated_start_us - idle_end for t in burst] == [0, I, 2 * I, 3 * I, 4 * I]
    d = q.start(burst[0])
    assert d.authorized and d.lateness == 0
    for later in burst[1:]:
        assert q.start(later).verdict is Verdict.WAIT  # nobody overtakes the head
    at(store, idle_end + I)
    assert q.start(burst[2]).verdict is Verdict.WAIT
    assert q.start(burst[1]).authorized


def test_interval_changed_at_runtime_applies_from_the_next_start(store: Store) -> None:
    q, operator = store.queue(), store.queue()
    t0 = q.ensure().last_start_us
    t1, t2, t3 = q.claim_many(3)
    at(store, t0 + I)
    assert q.start(t1).authorized
    operator.set_interval("300ms")
    at(store, t0 + 2 * I)
    d = q.start(t2)
    assert d.verdict is Verdict.WAIT and d.slot_us == t0 + I + 300_000
    assert d.interval_us == 300_000  # answers carry the stored interval, not the caller's
    at(store, t0 + I + 300_000)
    assert q.start(t2).authorized
    operator.set_interval("50ms")
    d = q.start(t3)
    assert d.verdict is Verdict.WAIT and d.wait_us == 50_000
    at(store, t0 + I + 350_000)
    assert q.start(t3).authorized
    assert q.status().state.interval_us == 50_000


def test_producer_and_worker_clock_skew_changes_nothing(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Clients never read their own wall clock: a producer 5 s ahead gets the same tickets
    and the same answers (waits are relative, times come from the store)."""
    reference, skewed = store.queue("ref"), store.queue("skewed")
    reference.ensure()
    skewed.ensure()
    plain = [reference.claim() for _ in range(3)]
    monkeypatch.setattr(time, "time", lambda: 1e9 + 5)
    monkeypatch.setattr(time, "time_ns", lambda: int((1e9 + 5) * 1e9))
    ahead = [skewed.claim() for _ in range(3)]
    assert [(t.number, t.delay) for t in ahead] == [(t.number, t.delay) for t in plain]
    assert [skewed.start(t).wait_us for t in ahead] == [reference.start(t).wait_us for t in plain]


def test_state_lost_mid_run_gives_a_new_epoch_and_no_burst(store: Store) -> None:
    q = store.queue()
    t0 = q.ensure().last_start_us
    t1, *waiting = q.claim_many(5)
    at(store, t0 + I)
    assert q.start(t1).authorized
    at(store, t0 + I + 1_000)
    store.backend().delete("q")  # the store lost everything (say, Redis restarted empty)
    verdicts = {q.start(t).verdict for t in waiting}
    assert verdicts == {Verdict.RECLAIM}
    new_epoch = q.status().state.epoch
    assert new_epoch != t1.epoch
    fresh = q.claim_many(4)
    assert {t.epoch for t in fresh} == {new_epoch}
    starts = []
    for step in range(0, 6 * I, I // 10):  # everyone asks every 10 ms for 600 ms
        at(store, t0 + I + 1_000 + step)
        starts += [store.clock.now_us for t in fresh if q.start(t).authorized]
    assert starts[0] >= t0 + I + 1_000 + I  # the new state waits one interval: no burst
    assert all(b - a >= I for a, b in itertools.pairwise(starts))
    assert len(starts) >= 4  # ... and everything still starts (re-asks of a started ticket run again)


def test_store_unreachable_nothing_starts(store: Store) -> None:
    q = store.queue()
    q.ensure()
    ticket = q.claim()
    down = store.unreachable_backend()
    with pytest.raises(StoreUnavailableError):
        down.start("q", ticket.number, ticket.epoch, task_id=None, interval_us=I, new_epoch="x")
    with pytest.raises(StoreUnavailableError):
        down.claim("q", 1, I, "x")
    assert q.status().state.current == 0  # nothing was authorized anywhere


def test_pause_stops_every_start_and_resume_continues_in_ticket_order(store: Store) -> None:
    q, operator = store.queue(), store.queue()
    t0 = q.ensure().last_start_us
    t1, t2, t3 = q.claim_many(3)
    assert operator.pause().paused
    at(store, t0 + 10 * I)
    paused = [q.start(t) for t in (t1, t2, t3)]
    assert {d.verdict for d in paused} == {Verdict.PAUSED}
    assert [d.wait_us for d in paused] == [0, I, 2 * I]  # each ticket's distance behind the head
    t4 = q.claim()  # claiming while paused is fine
    operator.resume(grace=0)
    assert q.start(t2).verdict is Verdict.WAIT
    assert q.start(t1).authorized  # at once, not after the old slots
    at(store, t0 + 11 * I)
    assert q.start(t3).verdict is Verdict.WAIT
    assert q.start(t2).authorized
    at(store, t0 + 12 * I)
    assert q.start(t3).authorized
    at(store, t0 + 13 * I)
    assert q.start(t4).authorized


def test_resume_with_a_grace_restarts_the_line_after_it(store: Store) -> None:
    q = store.queue()
    t0 = q.ensure().last_start_us
    t1, t2 = q.claim_many(2)
    q.pause()
    at(store, t0 + 10 * I)
    q.resume(grace=0.5)  # waiters poll every 0.5 s: give them that long to come back
    d = q.start(t1)
    assert d.verdict is Verdict.WAIT and d.slot_us == t0 + 10 * I + 500_000
    assert q.start(t2).slot_us == t0 + 10 * I + 500_000 + I
    at(store, t0 + 11 * I)
    q.resume(grace=0.5)  # not paused any more: a second resume changes nothing
    assert q.start(t1).slot_us == t0 + 10 * I + 500_000


def test_reset_gives_a_new_epoch_and_keeps_the_rate_cap(store: Store) -> None:
    q = store.queue()
    t0 = q.ensure().last_start_us
    t1, t2 = q.claim_many(2)
    at(store, t0 + I)
    assert q.start(t1, task_id="done").authorized
    q.finish("done")
    at(store, t0 + I + 1_000)
    state = q.reset()
    assert state.epoch != t1.epoch and (state.ticket, state.current, state.paused) == (0, 0, False)
    assert q.start(t2).verdict is Verdict.RECLAIM
    fresh = q.claim()
    assert fresh.number == 1
    d = q.start(fresh)
    assert d.verdict is Verdict.WAIT and d.slot_us == t0 + 2 * I  # the cap survived the reset
    assert q.start(fresh, task_id="done").verdict is Verdict.DUPLICATE  # and so did the records


def test_ensure_creates_checks_and_never_overrides_the_stored_interval(store: Store) -> None:
    q = store.queue(interval="100ms")
    created = q.ensure()
    assert q.ensure().epoch == created.epoch  # idempotent
    with pytest.raises(QueueExistsError):
        q.ensure(fail_if_exists=True)
    other = store.queue(interval="250ms")
    with pytest.raises(IntervalMismatchError, match=r"100ms.*250ms"):
        other.ensure()
    assert q.status().state.interval_us == I  # nothing changed
    replaced = other.ensure(reset=True)
    assert replaced.interval_us == 250_000 and replaced.epoch != created.epoch


def test_operations_on_a_missing_queue_say_so(store: Store) -> None:
    q = store.queue("missing", interval=None)
    for op in (q.resume, q.status, q.claim, q.reset):  # a pause creates it paused (test_declarations_contract)
        with pytest.raises(QueueNotFoundError, match="missing"):
            op()
    with pytest.raises(QueueNotFoundError):
        q.set_interval("1s")
    assert store.backend().queues() == []  # nothing was half-created


def test_tampered_tickets_are_never_authorized(store: Store) -> None:
    q = store.queue()
    t0 = q.ensure().last_start_us
    real = q.claim()
    at(store, t0 + 10 * I)
    for number, epoch in [(2, real.epoch), (0, real.epoch), (-3, real.epoch), (10**12, real.epoch), (1, "forged")]:
        bogus = Ticket("q", number, epoch, 0, 0)
        assert q.start(bogus).verdict is Verdict.RECLAIM, (number, epoch)
    assert q.status().state.current == 0
    assert q.start(real).authorized


def test_corrupt_state_is_reported_with_its_key_and_reset_repairs_it(store: Store) -> None:
    q = store.queue("geo")
    q.ensure()
    key = store.corrupt("geo", "ticket", "not-a-number")
    for op in (q.claim, q.status):
        with pytest.raises(CorruptStateError) as info:
            op()
        message = str(info.value)
        assert "'geo'" in message and key in message and "ticket" in message and "reset" in message
    q.reset()
    assert q.claim().number == 1


def test_queues_are_listed_by_pattern_and_deleted(store: Store) -> None:
    for name in ("shop:a", "shop:b", "geo"):
        store.queue(name).ensure()
    backend = store.backend()
    assert backend.queues() == ["geo", "shop:a", "shop:b"]
    assert backend.queues("shop:*") == ["shop:a", "shop:b"]
    assert backend.delete("shop:a") and not backend.delete("shop:a")
    assert backend.queues("shop:*") == ["shop:b"]


def test_finished_records_are_kept_for_the_retention_and_capped(store: Store) -> None:
    q = store.queue(finished_retention_us=10 * I, finished_max=3)
    q.ensure()
    for name in ("a", "b", "c", "d"):
        q.finish(name)
    assert q.status().finished == 3  # "a", the oldest, made room
    assert q.start(q.claim(), task_id="a").verdict is not Verdict.DUPLICATE
    store.clock.advance(us=11 * I)
    q.finish("e")  # every older record is past the retention now
    assert q.status().finished == 1


def test_claim_many_is_one_consecutive_block(store: Store) -> None:
    q = store.queue()
    t0 = q.ensure().last_start_us
    a = q.claim_many(1000)
    b = q.claim_many(3)
    assert [t.number for t in a] == list(range(1, 1001)) and [t.number for t in b] == [1001, 1002, 1003]
    assert a[-1].estimated_start_us == t0 + 1000 * I and b[0].estimated_start_us == t0 + 1001 * I


def test_after_an_outage_the_backlog_shifts_and_keeps_ticket_order(store: Store) -> None:
    """Workers down for a minute: whichever task comes back first, the head goes first."""
    q = store.queue()
    t0 = q.ensure().last_start_us
    tickets = q.claim_many(5)
    at(store, t0 + I)
    assert q.start(tickets[0]).authorized
    back = t0 + 60_000_000  # a minute later: ticket 2's slot is long past
    at(store, back)
    d = q.start(tickets[3])  # ticket 4 arrives first: the line restarts 1 s from now, 2 and 3 first
    assert d.verdict is Verdict.WAIT and d.wait_us == SETTLE + 2 * I
    assert q.start(tickets[1]).wait_us == SETTLE
    at(store, back + SETTLE)
    d = q.start(tickets[1])
    assert d.authorized and d.slot_us == back + SETTLE
    at(store, back + SETTLE + I - 1)
    assert q.start(tickets[3]).verdict is Verdict.WAIT  # still behind ticket 3
    at(store, back + SETTLE + I)
    assert q.start(tickets[2]).authorized


def test_a_head_late_by_less_than_the_outage_threshold_is_overtaken_as_before(store: Store) -> None:
    q = store.queue()
    t0 = q.ensure().last_start_us
    tickets = q.claim_many(3)
    at(store, t0 + 3 * I)  # ticket 1 is 2 intervals late: ticket 3's slot has come
    assert q.start(tickets[2]).authorized


def test_after_an_outage_a_lost_head_costs_one_slot_not_a_stall(store: Store) -> None:
    q = store.queue()
    t0 = q.ensure().last_start_us
    tickets = q.claim_many(12)
    at(store, t0 + I)
    assert q.start(tickets[0]).authorized
    outage_end = t0 + 60_000_000
    at(store, outage_end)
    d = q.start(tickets[11])  # tickets 2-11 never come back
    assert d.verdict is Verdict.WAIT and d.wait_us == SETTLE + 10 * I
    at(store, outage_end + SETTLE + 10 * I)  # the head is 10 intervals late again: no second shift
    assert q.start(tickets[11]).authorized


def test_a_start_of_cost_3_keeps_the_next_start_three_intervals_away(store: Store) -> None:
    q = store.queue()
    t0 = q.ensure().last_start_us
    heavy = q.claim(cost=3)
    light = q.claim()
    assert (heavy.number, light.number) == (1, 4)
    assert (heavy.estimated_start_us, light.estimated_start_us) == (t0 + I, t0 + 4 * I)
    at(store, t0 + I)
    assert q.start(heavy, cost=3).authorized
    at(store, t0 + 4 * I - 1)
    assert q.start(light).verdict is Verdict.WAIT
    late = Ticket("q", 1, heavy.epoch, 0, 0)  # a late ticket takes the next free slot: also 3 I away
    assert q.start(late).verdict is Verdict.WAIT
    at(store, t0 + 4 * I)
    d = q.start(light)
    assert d.authorized and d.now_us - (t0 + I) == 3 * I
    assert q.status().state.current == 4


def test_a_cost_beyond_the_tickets_claimed_is_not_authorized(store: Store) -> None:
    q = store.queue()
    t0 = q.ensure().last_start_us
    ticket = q.claim(cost=2)
    at(store, t0 + 10 * I)
    assert q.start(ticket, cost=3).verdict is Verdict.RECLAIM  # tickets 1..3, but only 1..2 were claimed
    assert q.start(ticket, cost=2).authorized


@pytest.mark.parametrize("cost", [0, -1, 1.5, "3", True, None, 10_001])
def test_costs_are_whole_numbers_of_slots(store: Store, cost: object) -> None:
    q = store.queue()
    q.ensure()
    with pytest.raises(ConfigurationError, match="cost"):
        q.claim(cost=cost)  # type: ignore[arg-type]
    assert q.status().state.ticket == 0


def test_a_backoff_holds_every_start_then_the_line_continues_in_order(store: Store) -> None:
    q = store.queue()
    t0 = q.ensure().last_start_us
    tickets = q.claim_many(3)
    at(store, t0 + I)
    assert q.start(tickets[0]).authorized
    q.backoff(1.0)  # at t0 + I: nothing before t0 + I + 1 s
    hold_end = t0 + I + 1_000_000
    at(store, hold_end - 1)
    assert q.start(tickets[1]).verdict is Verdict.WAIT and q.start(tickets[2]).wait_us == I + 1
    at(store, hold_end)
    assert q.start(tickets[2]).verdict is Verdict.WAIT  # ticket 3 still waits for ticket 2
    assert q.start(tickets[1]).authorized
    at(store, hold_end + I)
    assert q.start(tickets[2]).authorized
    q.backoff(0)  # a back-off never brings a start closer
    assert q.start(q.claim()).wait_us == I


def test_a_backoff_never_shortens_a_longer_one(store: Store) -> None:
    q = store.queue()
    t0 = q.ensure().last_start_us
    q.backoff("5s")
    q.backoff("1s")
    assert q.start(q.claim()).wait_us == 5_000_000
    with pytest.raises(ConfigurationError):
        q.backoff("2d")
    assert q.status().state.last_start_us == t0 + 5_000_000 - I


def test_a_backoff_can_keep_the_first_slot_for_the_task_that_backed_off(store: Store) -> None:
    q = store.queue()
    t0 = q.ensure().last_start_us
    first, second = q.claim_many(2)
    at(store, t0 + I)
    assert q.start(first).authorized  # its call answered 429: it backs off and comes back
    q.backoff(1.0, keep_first=True)
    hold_end = t0 + I + 1_000_000
    at(store, hold_end)
    assert q.start(second).verdict is Verdict.WAIT  # the line follows one slot on
    assert q.start(first).authorized  # the passed-over ticket takes the first slot
    at(store, hold_end + I)
    assert q.start(second).authorized


def test_a_hold_that_ends_during_an_outage_still_restarts_the_line_in_order(store: Store) -> None:
    """The workers are gone when a kept-first back-off ends, and come back a minute later:
    the line shifts as after any outage (the kept first slot is not a shift already
    made), the task that backed off first, the rest in ticket order."""
    q = store.queue()
    t0 = q.ensure().last_start_us
    first, second, third = q.claim_many(3)
    at(store, t0 + I)
    assert q.start(first).authorized
    q.backoff(1.0, keep_first=True)
    back = t0 + I + 60_000_000
    at(store, back)
    d = q.start(third)  # comes back first: second still goes before it
    assert d.verdict is Verdict.WAIT and d.wait_us == SETTLE + I
    assert q.start(first).authorized  # the passed-over ticket: its slot came long ago
    assert q.start(second).wait_us == SETTLE


def test_status_shows_a_weighted_starts_real_time_and_no_hold(store: Store) -> None:
    """A start of cost 10 holds the next start 10 intervals away (the cap), but the status
    says when it started, as the ledger does, and that no back-off holds the queue."""
    q = store.queue()
    t0 = q.ensure().last_start_us
    assert q.status().state.started_us == 0  # no start yet
    at(store, t0 + I)
    tickets = q.claim_costs([10])
    assert q.start(tickets[0], cost=10, record=StartRecord("search", "t1", "h", 1)).authorized
    status = q.status()
    assert status.state.started_us == t0 + I == next(iter(q.ledger())).start_us
    assert status.state.last_start_us == t0 + I + 9 * I  # the cap is kept
    assert status.next_start_us == t0 + 11 * I and status.held_until_us == 0
    assert status.as_dict()["last_start"] == (t0 + I) / 1e6 and status.as_dict()["held_until"] is None
    at(store, t0 + 3 * I)
    q.backoff(2.0)
    held = q.status()
    assert held.held_until_us == t0 + 3 * I + 2_000_000 == held.next_start_us
    assert held.state.started_us == t0 + I
    q.reset()
    assert q.status().state.started_us == t0 + I and q.status().held_until_us == held.held_until_us
    at(store, t0 + 3 * I + 2_000_000)
    assert q.status().held_until_us == 0  # the hold is over


def test_an_idle_queues_next_start_is_now_not_in_the_past(store: Store) -> None:
    q = store.queue()
    t0 = q.ensure().last_start_us
    at(store, t0 + 10_000_000)
    status = q.status()
    assert status.next_start_us == status.now_us == t0 + 10_000_000
