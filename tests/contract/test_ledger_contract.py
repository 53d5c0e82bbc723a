"""The ledger, on every store: written with the authorized start (nothing else), completed
by the finish, bounded, filtered by time, removed with the queue. Pinned clock."""

from __future__ import annotations

from typing import Any

import pytest

from siq_celery import IntervalQueue
from siq_celery.ledger import StartRecord
from siq_celery.rules import BEGIN_WAIT_US
from siq_celery.types import Verdict
from tests.conftest import Store

I = 100_000
MS = 1_000
S = 1_000_000


def rec(task_id: str, deferrals: int = 0) -> StartRecord:
    return StartRecord("geo.lookup", task_id, "node1@host", 4242, deferrals)


def test_only_authorized_starts_are_recorded_with_every_field(store: Store) -> None:
    q = store.queue()
    t0 = q.ensure().last_start_us
    first, second = q.claim_many(2)
    assert q.start(first, task_id="a", record=rec("a")).verdict is Verdict.WAIT
    store.clock.now_us = t0 + I + 7
    assert q.start(first, task_id="a", record=rec("a", deferrals=2)).authorized
    assert q.start(second, task_id="b", record=rec("b")).verdict is Verdict.WAIT
    q.pause()
    store.clock.now_us = t0 + 5 * I
    assert q.start(second, task_id="b", record=rec("b")).verdict is Verdict.PAUSED
    [row] = list(q.ledger())
    assert row.as_dict() == {
        "queue": "q", "epoch": first.epoch, "ticket": 1, "task_id": "a", "task_name": "geo.lookup",
        "slot_us": t0 + I, "start_us": t0 + I + 7, "interval_us": I, "finish_us": None, "outcome": None,
        "deferrals": 2, "host": "node1@host", "pid": 4242, "cost": 1, "burst": 0, "quota": 0, "window_us": 0,
        "concurrency": 0, "lease_us": 0, "lease_returned": None, "fair_key": "", "fair_tag": -1, "fair_weight": 0,
        "began_us": None, "v": 5,
    }  # fmt: skip


def test_a_start_records_when_its_body_began_as_the_store_placed_it(store: Store) -> None:
    """The ledger keeps the body's report beside the authorization (schema 5): the store's
    time of the last report, the time later starts count from; none without a report. A
    late report the body waited for (refused: the body does not begin) records nothing;
    one it did not wait for (the body began anyway) records its time."""
    q = store.queue()
    t0 = q.ensure().last_start_us
    first, second, third = q.claim_many(3)
    store.clock.now_us = t0 + I
    one = q.start(first, task_id="a", record=rec("a"), reports=True)
    store.clock.advance(us=30 * MS)
    assert q.began(one, wait=True, task_id="a")
    store.clock.advance(us=2 * MS)
    assert q.began(one, wait=True, task_id="a")  # sent again: the start moves again, and the ledger with it
    store.clock.now_us = t0 + 3 * I
    two = q.start(second, task_id="b", record=rec("b"), reports=True)  # its body never reports
    store.clock.advance(us=BEGIN_WAIT_US)
    three = q.start(third, task_id="c", record=rec("c"), reports=True)
    assert three.authorized  # b's wait expired
    assert not q.began(two, wait=True, task_id="b")  # refused, and b's body does not begin
    store.clock.advance(us=MS)
    assert q.began(three, wait=True, task_id="c")
    rows = {r.task_id: r for r in q.ledger()}
    assert (rows["a"].start_us, rows["a"].began_us) == (t0 + I, t0 + I + 32 * MS)
    assert rows["b"].began_us is None
    assert rows["c"].began_us == three.now_us + MS
    store.backend().began("q", two.now_us, "b", soon=True)  # not waited for: b's body began, late
    assert {r.task_id: r.began_us for r in q.ledger()}["b"] == three.now_us + MS


def test_a_report_without_a_task_id_completes_its_start(store: Store) -> None:
    q = store.queue()
    t0 = q.ensure().last_start_us
    store.clock.now_us = t0 + I
    one = q.start(q.claim(), record=StartRecord("slot"), reports=True)
    store.clock.advance(us=MS)
    assert q.began(one, wait=True)
    store.clock.advance(us=I)
    assert q.start(q.claim(), record=StartRecord("slot")).authorized
    assert [(r.task_id, r.began_us) for r in q.ledger()] == [(None, one.now_us + MS), (None, None)]


def two_limits(store: Store) -> tuple[Any, Any, Any]:
    """Two queues, 100 ms and 200 ms, in one hash slot, and their combined limit."""
    from siq_celery import CombinedQueue

    backend = store.backend()
    fast = IntervalQueue("{geo}fast", interval="100ms", backend=backend)
    slow = IntervalQueue("{geo}slow", interval="200ms", backend=backend)
    fast.ensure()
    slow.ensure()
    return fast, slow, CombinedQueue([fast, slow])


def test_a_weighted_start_records_its_cost_and_a_combined_one_its_place_in_each_queue(store: Store) -> None:
    """The audit counts the tickets and slots a start used from the ledger: a start of cost
    c records c (its tickets are ticket .. ticket + c - 1), in every queue of a combined limit,
    where the queues that do not hold its place in line record ticket 0."""
    q = store.queue()
    t0 = q.ensure().last_start_us
    first = q.claim(3)
    store.clock.now_us = t0 + I
    assert q.start(first, task_id="a", record=rec("a"), cost=3).authorized
    fast, slow, both = two_limits(store)
    ticket = both.claim(2)
    store.clock.now_us = t0 + 10 * I
    assert all(d.authorized for d in both.start(ticket, task_id="b", record=rec("b"), cost=2))
    assert [(r.ticket, r.cost) for r in q.ledger()] == [(1, 3)]
    assert [(r.ticket, r.cost) for r in slow.ledger()] == [(1, 2)]
    assert [(r.ticket, r.cost) for r in fast.ledger()] == [(0, 2)]


def test_a_fair_start_records_its_key_tag_and_weight_alone_or_combined(store: Store) -> None:
    """A fair task's share (ledger schema 4), from the start record, in every queue it
    starts in; a start without one records none."""
    from dataclasses import replace

    q = store.queue()
    t0 = q.ensure().last_start_us
    fair, plain = q.claim_many(2)
    store.clock.now_us = t0 + I
    share = replace(rec("a"), fair_key='tenant "7" é', fair_tag=3 * 720_720, fair_weight=1000)
    assert q.start(fair, task_id="a", record=share).authorized
    store.clock.now_us = t0 + 2 * I
    assert q.start(plain, task_id="b", record=rec("b")).authorized
    fast, slow, both = two_limits(store)
    ticket = both.claim()
    store.clock.now_us = t0 + 10 * I
    assert all(d.authorized for d in both.start(ticket, task_id="c", record=replace(share, task_id="c")))
    got = [(r.task_id, r.fair_key, r.fair_tag, r.fair_weight) for r in [*q.ledger(), *fast.ledger(), *slow.ledger()]]
    assert got == [
        ("a", 'tenant "7" é', 3 * 720_720, 1000), ("b", "", -1, 0),
        ("c", 'tenant "7" é', 3 * 720_720, 1000), ("c", 'tenant "7" é', 3 * 720_720, 1000),
    ]  # fmt: skip


def test_the_finish_completes_the_latest_start_of_its_task(store: Store) -> None:
    q = store.queue(lease_timeout_us=I // 2)  # the dead worker's lease has expired by the copy's start
    t0 = q.ensure().last_start_us
    one, two = q.claim_many(2)
    store.clock.now_us = t0 + I
    assert q.start(one, task_id="a", record=rec("a")).authorized
    store.clock.now_us = t0 + 2 * I  # the worker died mid-run: the copy starts again
    assert q.start(two, task_id="a", record=rec("a")).authorized
    store.clock.now_us = t0 + 2 * I + 500
    q.finish("a", "FAILURE")
    rows = sorted(q.ledger(), key=lambda r: r.start_us)
    assert [(r.ticket, r.finish_us, r.outcome) for r in rows] == [(1, None, None), (2, t0 + 2 * I + 500, "FAILURE")]


def test_no_ledger_when_turned_off(store: Store) -> None:
    q = store.queue(ledger_max=0)
    t0 = q.ensure().last_start_us
    store.clock.now_us = t0 + I
    assert q.start(q.claim(), task_id="a", record=rec("a")).authorized
    q.finish("a")
    assert list(q.ledger()) == []


def test_since_until_select_by_authorized_start(store: Store) -> None:
    q = store.queue()
    t0 = q.ensure().last_start_us
    tickets = q.claim_many(5)
    for i, ticket in enumerate(tickets, start=1):
        store.clock.now_us = t0 + i * I
        assert q.start(ticket, task_id=f"t{i}", record=rec(f"t{i}")).authorized
        q.finish(f"t{i}")
    picked = q.ledger(since=(t0 + 2 * I) / 1e6, until=(t0 + 4 * I) / 1e6)
    assert sorted(r.ticket for r in picked) == [2, 3]
    assert all(r.outcome == "SUCCESS" for r in q.ledger())


def test_the_ledger_is_bounded(store: Store) -> None:
    q = store.queue(ledger_max=50)
    t0 = q.ensure().last_start_us
    for i in range(1, 601):
        ticket = q.claim()
        store.clock.now_us = t0 + i * I
        assert q.start(ticket, task_id=f"t{i}", record=rec(f"t{i}")).authorized
        q.finish(f"t{i}")
    rows = list(q.ledger())
    # memory keeps exactly 50; SQLite trims every 200 finishes; Redis trims whole stream nodes
    assert 50 <= len(rows) <= 350, len(rows)
    assert max(r.ticket for r in rows) == 600 and all(r.outcome == "SUCCESS" for r in rows)


def test_slot_users_are_recorded_with_their_outcome(store: Store) -> None:
    q = store.queue()
    t0 = q.ensure().last_start_us
    store.clock.now_us = t0 + I
    with q.slot(name="nightly-sync"):
        pass
    store.clock.now_us = t0 + 2 * I
    with pytest.raises(ZeroDivisionError), q.slot(task_id="job-2", name="nightly-sync"):
        1 / 0  # noqa: B018
    rows = sorted(q.ledger(), key=lambda r: r.start_us)
    assert [(r.task_name, r.outcome) for r in rows] == [("nightly-sync", "SUCCESS"), ("nightly-sync", "FAILURE")]
    assert rows[1].task_id == "job-2" and rows[0].task_id and rows[0].pid > 0 and rows[0].host
    assert q.status().finished == 1  # only the caller's own id is remembered as finished


def test_delete_removes_the_ledger(store: Store) -> None:
    q = store.queue()
    t0 = q.ensure().last_start_us
    store.clock.now_us = t0 + I
    assert q.start(q.claim(), task_id="a", record=rec("a")).authorized
    assert q.delete()
    assert list(q.ledger()) == []


def test_a_start_records_the_limits_in_force_and_the_finish_the_lease_it_gave_back(store: Store) -> None:
    """What the audit needs (ledger schema 3 and on): burst, quota, window and cap at the start, the
    lease's time to live, and whether the finish gave it back, in the step that recorded
    ``finish_us``: the lease counts until exactly then on the store's clock."""
    backend = store.backend(lease_timeout_us=3 * S)
    q = IntervalQueue("q", interval="100ms", quota="5/2s", burst=2, concurrency=2, backend=backend)
    t0 = q.ensure().last_start_us
    first, second = q.claim_many(2)
    store.clock.now_us = t0 + I
    a = q.start(first, task_id="a", record=rec("a"))
    b = q.start(second, task_id="b", record=rec("b"))
    assert a.authorized and b.authorized and a.lease and b.lease
    store.clock.now_us = t0 + I + 700
    q.finish("a", lease=a.lease)
    assert q.status().in_flight == 1  # given back at t0 + I + 700, the finish's own time
    rows = {r.task_id: r for r in q.ledger()}
    assert {k: v for k, v in rows["a"].as_dict().items() if k in LIMIT_FIELDS} == {
        "burst": 2, "quota": 5, "window_us": 2 * S, "concurrency": 2, "lease_us": 3 * S, "finish_us": t0 + I + 700,
        "lease_returned": True, "v": 5,
    }  # fmt: skip
    assert (rows["b"].finish_us, rows["b"].lease_us, rows["b"].lease_returned) == (None, 3 * S, None)


LIMIT_FIELDS = ("burst", "quota", "window_us", "concurrency", "lease_us", "finish_us", "lease_returned", "v")


def test_a_finish_after_its_lease_expired_records_that_it_gave_none_back(store: Store) -> None:
    q = IntervalQueue("q", interval="100ms", concurrency=1, backend=store.backend(lease_timeout_us=S))
    t0 = q.ensure().last_start_us
    store.clock.now_us = t0 + I
    d = q.start(q.claim(), task_id="a", record=rec("a"))
    store.clock.now_us = t0 + I + S  # not renewed: expired at start + 1 s
    q.finish("a", lease=d.lease)
    [row] = q.ledger()
    assert (row.finish_us, row.lease_us, row.lease_returned) == (t0 + I + S, S, False)


def test_a_copy_of_a_running_task_starts_only_once_the_first_holder_died(store: Store) -> None:
    """A redelivered copy while the first still runs (a broker's visibility timeout) is
    answered RUNNING: no second start, no second lease, no second row; a renewal keeps the
    first alive. Once its lease expired unrenewed (its process died) the copy starts, and
    its finish completes its own start (the first's row keeps no finish)."""
    q = IntervalQueue("q", interval="100ms", concurrency=3, backend=store.backend(lease_timeout_us=10 * S))
    t0 = q.ensure().last_start_us
    (one,) = q.claim_many(1)
    store.clock.now_us = t0 + I
    first = q.start(one, task_id="a", record=rec("a"))
    assert first.authorized and first.lease == "a"
    store.clock.now_us = t0 + 2 * I
    copy = q.start(one, task_id="a", record=rec("a"))
    assert (copy.verdict, copy.wait_us, copy.lease) == (Verdict.RUNNING, 10 * S - I, "")
    store.clock.now_us = t0 + 5 * S
    assert q.renew_leases(["a"]) == 1
    store.clock.now_us = t0 + 14 * S
    assert q.start(one, task_id="a", record=rec("a")).verdict is Verdict.RUNNING, "the renewal kept it"
    store.clock.now_us = t0 + 15 * S
    copy = q.start(one, task_id="a", record=rec("a"))
    assert copy.authorized and copy.lease == "a" and q.status().in_flight == 1
    store.clock.now_us = t0 + 15 * S + 500
    q.finish("a", "SUCCESS", lease=copy.lease)
    rows = sorted(q.ledger(), key=lambda r: r.start_us)
    assert [(r.start_us, r.finish_us, r.outcome, r.lease_returned) for r in rows] == [
        (t0 + I, None, None, None),
        (t0 + 15 * S, t0 + 15 * S + 500, "SUCCESS", True),
    ]
    assert q.status().in_flight == 0


def test_a_combined_start_records_its_lease_only_where_a_cap_took_one(store: Store) -> None:
    from siq_celery import CombinedQueue, Limit

    backend = store.backend(lease_timeout_us=3 * S)
    pace = IntervalQueue("{api}pace", interval="100ms", backend=backend)
    cap = IntervalQueue("{api}cap", interval=Limit(concurrency=1), backend=backend)
    pace.ensure()
    t0 = cap.ensure().last_start_us
    both = CombinedQueue([pace, cap])
    ticket = both.claim()
    store.clock.now_us = t0 + I
    lease = next(d.lease for d in both.start(ticket, task_id="a", record=rec("a")) if d.lease)
    store.clock.now_us = t0 + I + 300
    both.finish("a", lease=lease)
    [paced], [capped] = pace.ledger(), cap.ledger()
    assert (paced.concurrency, paced.lease_us, paced.finish_us, paced.lease_returned) == (0, 0, t0 + I + 300, None)
    assert (capped.concurrency, capped.lease_us, capped.finish_us, capped.lease_returned) == (
        1,
        3 * S,
        t0 + I + 300,
        True,
    )
