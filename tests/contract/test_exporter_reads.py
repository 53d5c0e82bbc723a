"""The two reads the exporter makes of many queues at once (``statuses`` and
``starts_since``) give what the one-queue reads give, on every store: missing queues as
None, a corrupt one as its error in its place, and ledger rows from a time on."""

from __future__ import annotations

import pytest

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
