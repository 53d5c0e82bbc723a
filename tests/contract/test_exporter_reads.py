"""The two reads the exporter and ``siq top`` make of many queues at once (``statuses``
and ``starts_since``) give what the one-queue reads give, on every store: missing queues
as None, a corrupt one as its error in its place, and ledger rows from a time on; and the
counters the store keeps of each queue's starts."""

from __future__ import annotations

import pytest

from siq_celery import CombinedQueue, IntervalQueue
from siq_celery.errors import CorruptStateError, SiqError
from siq_celery.ledger import StartRecord
from tests.conftest import Store

I = 100_000


def test_statuses_read_many_queues_in_order_with_errors_in_place(store: Store) -> None:
    backend = store.backend()
    for name in ("a", "b", "c"):
        store.queue(name, I / 1e6).ensure()
    store.queue("a", I / 1e6).pause()
    try:
        store.corrupt("b", "interval_us", "fast")
        corrupted = True
    except pytest.skip.Exception:
        corrupted = False  # the memory store cannot be corrupted from outside
    got = backend.statuses(["a", "b", "missing", "c"])
    assert len(got) == 4 and got[2] is None
    a, b, c = got[0], got[1], got[3]
    assert not isinstance(a, SiqError) and a is not None and a.queue == "a" and a.state.paused
    assert not isinstance(c, SiqError) and c is not None and c.queue == "c" and c.state.interval_us == I
    assert c == backend.status("c")
    if corrupted:
        assert isinstance(b, CorruptStateError)
    assert backend.statuses([]) == []


def test_starts_since_reads_each_queue_from_a_time_on(store: Store) -> None:
    backend = store.backend()
    record = StartRecord("call", host="h", pid=1)
    times = {}
    for name in ("a", "b"):
        q = store.queue(name, I / 1e6)
        state = q.ensure()
        for n in range(3):
            store.clock.now_us = state.last_start_us + (n + 1) * I * 2
            ticket = q.claim()
            backend.start(name, ticket.number, ticket.epoch, task_id=f"{name}{n}", interval_us=I, new_epoch="x",
                          record=record)  # fmt: skip
        times[name] = [r.start_us for r in backend.ledger(name)]
    assert [len(t) for t in times.values()] == [3, 3]
    got = backend.starts_since({"a": None, "b": times["b"][1], "missing": None})
    assert [r.task_id for r in got["a"]] == ["a0", "a1", "a2"]
    assert [r.task_id for r in got["b"]] == ["b1", "b2"]
    assert got["missing"] == []


def test_the_store_counts_the_starts_it_refuses(store: Store) -> None:
    backend = store.backend()
    q = store.queue("a", I / 1e6)
    q.ensure()
    ticket = q.claim()
    store.clock.now_us += I
    assert backend.start("a", ticket.number, ticket.epoch, task_id="t1", interval_us=I, new_epoch="x").authorized
    backend.finish("a", "t1")
    again = q.claim()
    store.clock.now_us += I
    for _ in range(2):  # a redelivered copy of the finished task, twice
        refused = backend.start("a", again.number, again.epoch, task_id="t1", interval_us=I, new_epoch="x")
        assert refused.verdict.value == "duplicate"
    stale = backend.start("a", again.number, "an-old-epoch", task_id="t2", interval_us=I, new_epoch="x")
    assert stale.verdict.value == "reclaim"
    st = backend.status("a")
    assert st is not None and (st.duplicates_refused, st.reclaims) == (2, 1)
    [read] = backend.statuses(["a"])
    assert read == st
    store.queue("b", I / 1e6).ensure()
    fresh = backend.status("b")
    assert fresh is not None and (fresh.duplicates_refused, fresh.reclaims) == (0, 0)


def test_the_store_counts_authorized_starts_in_the_start_itself(store: Store) -> None:
    """The exporter's counters come from the store: counted in the start's own atomic step,
    the same for every reader, kept with no ledger at all, and never lowered by a reset."""
    backend = store.backend(ledger_max=0)  # no ledger: the counts do not read it
    q = store.queue("a", I / 1e6, ledger_max=0)
    t0 = q.ensure().last_start_us
    tickets = q.claim_many(3)
    for ticket, late_us, deferrals in zip(tickets, (3_000, 0, 500_000), (2, 0, 0), strict=True):
        store.clock.now_us = max(store.clock.now_us, t0) + I + late_us
        t0 = store.clock.now_us - late_us
        record = StartRecord("call", host="h", pid=1, deferrals=deferrals)
        d = backend.start("a", ticket.number, ticket.epoch, task_id=f"t{ticket.number}", interval_us=I,
                          new_epoch="x", record=record)  # fmt: skip
        assert d.authorized and d.now_us - d.slot_us == late_us
    assert list(backend.ledger("a")) == []
    st = backend.status("a")
    assert st is not None
    counts = st.counts
    assert (counts.starts, counts.deferrals, counts.gaps_below_interval) == (3, 2, 0)
    assert counts.lateness_sum_us == 503_000
    # 0 late: the first bucket (up to 0.5 ms); 3 ms: the fourth (up to 5 ms); 500 ms: the tenth
    assert counts.lateness_buckets == (1, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0)
    assert store.backend().status("a") == st and backend.statuses(["a"]) == [st]  # any reader, the same
    store.clock.now_us += I
    backend.reset("a", None, "e2")
    after = backend.status("a")
    assert after is not None and after.counts == counts  # a new epoch, the same counters


def test_a_start_closer_than_the_interval_is_counted_as_a_gap(store: Store) -> None:
    q = store.queue("a", I / 1e6)
    t0 = q.ensure().last_start_us
    store.clock.now_us = t0 + I
    assert q.start(q.claim()).authorized
    # The state forgets its last start (written behind the store's back): the next start
    # is authorized 20 ms later, and the counters, which remember it, see the gap.
    store.corrupt("a", "last_start_us", str(t0 - 10 * I))
    store.corrupt("a", "anchor_us", str(t0 - 10 * I))
    store.clock.now_us = t0 + I + 20_000
    assert q.start(q.claim()).authorized
    st = q.status()
    assert (st.counts.starts, st.counts.gaps_below_interval) == (2, 1)


def test_a_start_with_several_limits_is_counted_in_each_queue(store: Store) -> None:
    backend = store.backend()
    fast = IntervalQueue("{geo}per-second", interval="100ms", backend=backend)
    slow = IntervalQueue("{geo}per-2s", interval="10/2s", backend=backend)
    t0 = fast.ensure().last_start_us
    slow.ensure()
    both = CombinedQueue([fast, slow])
    ticket = both.claim()
    store.clock.now_us = t0 + 100_000  # the slow queue says wait: counted nowhere
    assert not any(d.authorized for d in both.start(ticket))
    assert (fast.status().counts.starts, slow.status().counts.starts) == (0, 0)
    store.clock.now_us = t0 + 200_000
    assert all(d.authorized for d in both.start(ticket, task_id="t1"))
    assert (fast.status().counts.starts, slow.status().counts.starts) == (1, 1)
