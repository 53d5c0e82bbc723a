"""Parked tasks, on every store: kept in ticket order, released when their slot comes
within the horizon (never while paused), leased so two releasers never get the same
task, handed out again if a releaser dies, renumbered by a reset. Pinned clock."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from siq_celery.parked import ParkedTask
from siq_celery.tasks.parking import parked_message, release_due
from siq_celery.types import Verdict
from tests.conftest import Store

I = 100_000
H = 10 * I  # the horizon: ten slots


def parked(first: int, last: int) -> list[ParkedTask]:
    return [ParkedTask(n, f"task-{n}", f'{{"n": {n}}}') for n in range(first, last + 1)]


def test_released_in_ticket_order_as_their_slots_come_within_the_horizon(store: Store) -> None:
    q = store.queue()
    t0 = q.ensure().last_start_us
    tickets = q.claim_many(30)
    backend = q.backend
    assert backend.park("q", tickets[0].epoch, list(reversed(parked(11, 30))))
    assert q.status().parked == 20
    release = backend.release("q", H)
    # ticket n is due at t0 + n*I: within the horizon (t0 + 10 I) are tickets up to 10, none parked
    assert release.tasks == []
    store.clock.now_us = t0 + 3 * I
    release = backend.release("q", H)
    assert [t.ticket for t, _ in release.tasks] == [11, 12, 13]
    assert [est for _, est in release.tasks] == [t0 + 11 * I, t0 + 12 * I, t0 + 13 * I]
    assert release.tasks[0][0].message == '{"n": 11}' and release.epoch == tickets[0].epoch
    assert backend.release("q", H).tasks == []  # leased: not handed out twice
    backend.unpark("q", [t.task_id for t, _ in release.tasks])
    assert q.status().parked == 17


def test_a_releaser_that_dies_has_its_tasks_handed_out_again_after_the_lease(store: Store) -> None:
    q = store.queue()
    t0 = q.ensure().last_start_us
    epoch = q.claim_many(20)[0].epoch
    backend = q.backend
    backend.park("q", epoch, parked(15, 20))
    store.clock.now_us = t0 + 6 * I
    first = backend.release("q", H, lease_us=5 * I)
    assert [t.ticket for t, _ in first.tasks] == [15, 16]
    store.clock.now_us = t0 + 6 * I + 5 * I - 1
    assert [t.ticket for t, _ in backend.release("q", H, lease_us=5 * I).tasks] == [17, 18, 19, 20]
    store.clock.now_us = t0 + 11 * I
    again = backend.release("q", H, lease_us=5 * I)
    assert [t.ticket for t, _ in again.tasks] == [15, 16]  # the first releaser never unparked them


def test_nothing_is_released_while_paused_and_the_line_moves_on_after(store: Store) -> None:
    q = store.queue()
    t0 = q.ensure().last_start_us
    epoch = q.claim_many(15)[0].epoch
    q.backend.park("q", epoch, parked(12, 15))
    q.pause()
    store.clock.now_us = t0 + 50 * I
    assert q.backend.release("q", H).tasks == []
    q.resume(grace=0)  # the line continues from now: ticket 12 is 12 slots out
    assert q.backend.release("q", H).tasks == []
    assert [t.ticket for t, _ in q.backend.release("q", 2 * H).tasks] == [12, 13, 14, 15]


def test_a_longer_interval_releases_fewer(store: Store) -> None:
    q = store.queue()
    t0 = q.ensure().last_start_us
    epoch = q.claim_many(30)[0].epoch
    q.backend.park("q", epoch, parked(5, 30))
    q.set_interval(0.2)  # slots twice as far apart: 5 tickets fit in the horizon
    store.clock.now_us = t0
    assert [t.ticket for t, _ in q.backend.release("q", H).tasks] == [5]


def test_tickets_of_another_epoch_are_not_parked(store: Store) -> None:
    q = store.queue()
    q.ensure()
    old = q.claim_many(3)[0].epoch
    q.reset()
    assert not q.backend.park("q", old, parked(1, 3))
    assert q.status().parked == 0
    assert not q.backend.park("missing", old, parked(1, 1))


def test_a_reset_keeps_parked_tasks_in_order_ahead_of_new_claims(store: Store) -> None:
    q = store.queue()
    q.ensure()
    tickets = q.claim_many(50)
    q.backend.park("q", tickets[0].epoch, parked(40, 50) + parked(20, 25))
    q.backend.release("q", 10**12, limit=3)  # three leased (20, 21, 22): renumbered too
    state = q.reset()
    assert state.ticket == 17 and q.status().parked == 17
    release = q.backend.release("q", 10**12, limit=100)
    assert [(t.ticket, t.task_id) for t, _ in release.tasks][:4] == [
        (1, "task-20"), (2, "task-21"), (3, "task-22"), (4, "task-23"),
    ]  # fmt: skip
    assert release.epoch == state.epoch and q.claim().number == 18


def test_parked_tasks_are_listed_by_ticket_leased_or_not(store: Store) -> None:
    """A task leased to a releaser is listed in its place by ticket, not ahead of the rest
    (the memory and SQLite stores listed the leased ones first: found by the differential
    test, tests/test_differential.py)."""
    q = store.queue()
    t0 = q.ensure().last_start_us
    epoch = q.claim_many(20)[0].epoch
    q.backend.park("q", epoch, parked(5, 5) + parked(18, 18))
    store.clock.now_us = t0
    assert [t.ticket for t, _ in q.backend.release("q", H).tasks] == [5]  # leased, not unparked
    q.backend.park("q", epoch, parked(2, 2))
    assert [(t.ticket, t.task_id) for t in q.backend.parked_tasks("q")] == [
        (2, "task-2"), (5, "task-5"), (18, "task-18"),
    ]  # fmt: skip


def test_delete_removes_parked_tasks(store: Store) -> None:
    q = store.queue()
    q.ensure()
    q.backend.park("q", q.claim_many(3)[0].epoch, parked(1, 3))
    assert q.delete()
    assert q.backend.release("q", H).tasks == []


def test_after_an_outage_release_counts_the_horizon_from_now(store: Store) -> None:
    q = store.queue()
    t0 = q.ensure().last_start_us
    epoch = q.claim_many(100)[0].epoch
    q.backend.park("q", epoch, parked(20, 100))
    store.clock.now_us = t0 + 600 * I  # a minute with no worker: the line restarts 1 s from now
    assert q.backend.release("q", H, limit=100).tasks == []  # tickets 1-19 are ahead, in the broker
    store.clock.now_us += 19 * I + 1  # they never came (lost): the line still moves on
    release = q.backend.release("q", H, limit=100)
    assert [t.ticket for t, _ in release.tasks] == [20]
    assert release.tasks[0][1] == t0 + 600 * I + 10 * I + 19 * I


def test_a_release_as_an_outage_begins_leaves_the_restart_to_the_returning_tasks(store: Store) -> None:
    """Workers stop; a release 2 s later (a stopping worker's upkeep, a producer parking)
    finds the head overdue, but by less than its horizon: it must not spend the one shift,
    or the tasks coming back a minute later would start in arrival order."""
    q = store.queue()
    t0 = q.ensure().last_start_us
    tickets = q.claim_many(30)
    q.backend.park("q", tickets[0].epoch, parked(11, 30))
    store.clock.now_us = t0 + I
    assert q.start(tickets[0]).authorized
    store.clock.now_us = t0 + I + 2_000_000
    q.backend.release("q", 50 * I)  # horizon 5 s
    back = t0 + 60_000_000
    store.clock.now_us = back
    d = q.start(tickets[4])  # ticket 5 comes back first: 2, 3 and 4 still go before it
    assert d.verdict is Verdict.WAIT and d.wait_us == 10 * I + 3 * I
    assert q.start(tickets[1]).wait_us == 10 * I
    store.clock.now_us = back + 10 * I
    assert q.start(tickets[1]).authorized


def test_a_task_parked_through_a_long_back_off_is_released_only_as_the_hold_ends(store: Store) -> None:
    """A task that backed off comes back with its passed-over ticket (a late ticket: the
    first slot after the hold is its own). Parked, it stays parked until that slot comes
    within the horizon, and is released for it; so does the line behind."""
    q = store.queue()
    t0 = q.ensure().last_start_us
    tickets = q.claim_many(5)
    store.clock.now_us = t0 + I
    assert q.backend.start("q", 1, tickets[0].epoch, task_id="first", interval_us=I, new_epoch="x").authorized
    held = q.backoff(3600, keep_first=True)  # an hour: far beyond the horizon
    hold_end = t0 + I + 3600 * 1_000_000
    assert held.last_start_us + held.interval_us == hold_end
    q.backend.park("q", held.epoch, [ParkedTask(1, "backed-off", "{}"), *parked(2, 5)])
    for now in (t0 + 2 * I, hold_end - H - 1):
        store.clock.now_us = now
        assert q.backend.release("q", H).tasks == [], now - t0  # the hold is beyond the horizon
    store.clock.now_us = hold_end - H
    release = q.backend.release("q", H)
    assert [(t.task_id, est) for t, est in release.tasks] == [("backed-off", hold_end)]
    store.clock.now_us = hold_end - H + 3 * I
    assert [(t.ticket, est) for t, est in q.backend.release("q", H).tasks] == [
        (2, hold_end + I), (3, hold_end + 2 * I), (4, hold_end + 3 * I),
    ]  # fmt: skip


class RecordingApp:
    """Stands in for a Celery app: release_due only calls send_task."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def send_task(self, name: str, args: Any = None, kwargs: Any = None, **options: Any) -> None:
        self.sent.append((name, options))


def test_an_unreadable_parked_message_is_named_and_skipped_and_the_rest_released(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    q = store.queue()
    q.ensure()
    tickets = q.claim_many(4)
    good = parked_message("geo.record", (1,), {}, {"headers": {"mine": "kept"}})
    entries = [ParkedTask(1, "ok-1", good), ParkedTask(2, "bad-json", "{not json"),
               ParkedTask(3, "bad-shape", '{"task": 5}'), ParkedTask(4, "ok-4", good)]  # fmt: skip
    assert q.backend.park("q", tickets[0].epoch, entries)
    app = RecordingApp()
    with caplog.at_level(logging.ERROR, logger="siq_celery"):
        assert release_due(app, q, H, 0.02) == 2
    assert [options["task_id"] for _, options in app.sent] == ["ok-1", "ok-4"]
    assert app.sent[0][1]["headers"]["mine"] == "kept" and app.sent[0][1]["headers"]["siq_ticket"] == 1
    assert "parked task bad-json (ticket 2)" in caplog.text and "parked task bad-shape (ticket 3)" in caplog.text
    assert q.backend.keys("q").parked_messages in caplog.text
    assert q.status().parked == 2, "left parked for an operator to read (siq export --parked)"


def test_queues_holding_parked_tasks_are_found_without_polling_each(store: Store) -> None:
    a, b, idle = store.queue("shop:a"), store.queue("shop:b"), store.queue("shop:idle")
    for q in (a, b, idle):
        q.ensure()
    for q in (a, b):
        ticket = q.claim()
        assert q.backend.park(q.name, ticket.epoch, [ParkedTask(1, f"{q.name}-1", "{}")])
    assert a.backend.parked_queues() == ["shop:a", "shop:b"]
    a.backend.unpark("shop:a", ["shop:a-1"])
    assert a.backend.parked_queues() == ["shop:b"]
