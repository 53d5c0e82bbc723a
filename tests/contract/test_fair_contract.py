"""Fair shares on every store: tasks of a fair queue wait in their key's line with no
ticket; a release hands the shared queue's tickets to the keys' heads in fair order
(rules.fair_promote), a lookahead at a time, and releases them as parked tasks. Pinned
clock; the rule itself is tests/test_fair_model.py's."""

from __future__ import annotations

import itertools
import json
import random
import sqlite3
from collections import Counter
from typing import Any

import pytest

from siq_celery import IntervalQueue
from siq_celery.backends.base import Backend
from siq_celery.parked import FairTask, ParkedTask
from siq_celery.rules import DictFairLines, fair_lookahead, fair_next, fair_push
from siq_celery.tasks.parking import release_due
from tests.conftest import Store

I = 100_000  # 100 ms: a lookahead of 4 tickets
H = 50 * I  # the horizon
AHEAD = fair_lookahead(I)


def tasks(key: str, first: int, last: int, cost: int = 1) -> list[FairTask]:
    return [FairTask(f"{key}{n}", f'{{"key": "{key}", "n": {n}}}', cost) for n in range(first, last + 1)]


def hand_out_everything(store: Store, backend: Backend, queue: str = "q") -> None:
    """Hand every waiting task a ticket, whatever the lookahead: nothing starts, so each
    release past the outage span hands out another lookahead (rules.fair_room)."""
    while backend.fair_backlog(queue).tasks_waiting:
        store.clock.now_us += 1_000_000_000
        backend.release(queue, H)


def park(backend: Backend, key: str, first: int, last: int, weight: int = 1, epoch: str = "e1") -> None:
    backend.fair_park("q", key, weight, tasks(key, first, last), I, epoch)


def run(
    store: Store, backend: Backend, count: int, waiting: dict[int, str] | None = None, epoch: str = ""
) -> list[str]:
    """Release and start, one slot at a time, until ``count`` tasks started; their ids
    (``waiting``: ticket -> task id released before)."""
    started: list[str] = []
    STARTS.clear()
    waiting = dict(waiting or {})
    while len(started) < count:
        release = backend.release("q", H)
        epoch = release.epoch or epoch
        for parked, _ in release.tasks:
            waiting[parked.ticket] = parked.task_id
        backend.unpark("q", [p.task_id for p, _ in release.tasks])
        assert waiting, f"nothing handed a ticket after {started}"
        ticket = min(waiting)
        decision = backend.start("q", ticket, epoch, task_id=waiting[ticket], interval_us=I, new_epoch="x")
        if not decision.authorized:
            store.clock.now_us += decision.wait_us
            continue
        started.append(waiting.pop(ticket))
        STARTS.append(decision.now_us)
    return started


STARTS: list[int] = []  # the store times of run()'s last starts


def test_a_tenant_behind_a_backlog_is_interleaved_within_the_lookahead(store: Store) -> None:
    backend = store.backend()
    park(backend, "A", 0, 99)
    release = backend.release("q", H)
    # only the lookahead is handed tickets, in A's order; the rest wait without one
    assert [(p.ticket, p.task_id) for p, _ in release.tasks] == [(n + 1, f"A{n}") for n in range(AHEAD)]
    assert release.tasks[0][0].message == '{"fair": ["A", 0, 1], "key": "A", "n": 0}'  # its share in front
    backend.unpark("q", [p.task_id for p, _ in release.tasks])
    assert backend.status("q").parked == 100 - AHEAD
    park(backend, "B", 0, 9)
    order = run(store, backend, 40, {p.ticket: p.task_id for p, _ in release.tasks}, release.epoch)
    assert order[:AHEAD] == [f"A{n}" for n in range(AHEAD)]
    rest = order[AHEAD:]
    b_at = [i for i, t in enumerate(rest) if t.startswith("B")]
    assert b_at == list(range(0, 20, 2)), rest  # B's 10 alternate with A's from the next ticket on
    assert [t for t in order if t.startswith("A")] == [f"A{n}" for n in range(30)], "A in its order"
    assert [t for t in order if t.startswith("B")] == [f"B{n}" for n in range(10)], "B in its order"


def test_weights_share_the_tickets(store: Store) -> None:
    backend = store.backend()
    park(backend, "A", 0, 199, weight=2)
    park(backend, "B", 0, 199)
    park(backend, "C", 0, 199)
    shares = Counter(t[0] for t in run(store, backend, 200))
    assert shares == {"A": 100, "B": 50, "C": 50}


def test_the_spacing_of_the_shared_queue_holds(store: Store) -> None:
    backend = store.backend()
    park(backend, "A", 0, 19)
    park(backend, "B", 0, 19)
    run(store, backend, 20)
    assert len(STARTS) == 20
    assert min(b - a for a, b in itertools.pairwise(STARTS)) == I


def test_nothing_is_handed_a_ticket_while_paused(store: Store) -> None:
    backend = store.backend()
    park(backend, "A", 0, 9)
    backend.pause("q")
    assert backend.release("q", H).tasks == []
    assert backend.status("q").state.ticket == 0
    park(backend, "B", 0, 0)
    backend.resume("q", 0)
    got = [p.task_id for p, _ in backend.release("q", H).tasks]
    assert got == ["A0", "B0", "A1", "A2", "A3", "A4"][:AHEAD]  # B, arrived during the pause, at once


def test_bad_weight_or_cost_writes_nothing(store: Store) -> None:
    backend = store.backend()
    for weight, cost in ((0, 1), (1001, 1), (1, 0)):
        with pytest.raises(ValueError, match="fair share of 'A'"):
            backend.fair_park("q", "A", weight, [*tasks("A", 0, 2), FairTask("Ax", "{}", cost)], I, "e1")
    status = backend.status("q")
    assert status is None or status.parked == 0


def test_a_task_sent_twice_waits_once(store: Store) -> None:
    backend = store.backend()
    park(backend, "A", 0, 2)
    park(backend, "A", 1, 1)
    assert backend.status("q").parked == 3
    assert run(store, backend, 3) == ["A0", "A1", "A2"]
    assert backend.release("q", H).tasks == []


def test_delete_forgets_the_lines(store: Store) -> None:
    backend = store.backend()
    park(backend, "A", 0, 9)
    park(backend, "B", 0, 9)
    assert backend.delete("q")
    park(backend, "C", 0, 1)
    assert [p.task_id for p, _ in backend.release("q", H).tasks] == ["C0", "C1"]


def test_a_promoted_task_carries_its_key_tag_and_weight_to_its_release(store: Store) -> None:
    """The promotion puts each task's fair share in front of its parked message, the rest
    unchanged: its key (any text, JSON-escaped), the tag the fair order served it at and
    its key's weight, as the reference lines serve them; the release publishes them as
    headers, for the ledger (parking.release_due), and a malformed one is not released."""
    backend = store.backend()
    odd = 'x"y\\/é {}'  # quotes, a backslash, a slash and braces: escaped in the message
    wide = 1  # 1 µs: one release hands the whole lookahead (64) a ticket
    calls = [("A", 2, 2, 6), (odd, 3, 1, 4), ("B", 1, 1, 5)]  # key, weight, cost, tasks
    reference = DictFairLines()
    sent: dict[str, str] = {}
    for key, weight, cost, count in calls:
        batch = []
        for n in range(count):
            task_id = f"{calls.index((key, weight, cost, count))}-{n}"
            message = "{}" if n == 0 else json.dumps({"task": "t", "args": [n], "kwargs": {}, "options": {}})
            sent[task_id] = message
            batch.append(FairTask(task_id, message, cost))
            fair_push(reference, key, task_id, cost, weight)
        backend.fair_park("q", key, weight, batch, wide, "e1")
    expected, ticket = [], 1
    while (turn := fair_next(reference)) is not None:
        expected.append((ticket, turn.task_id, [turn.key, turn.tag, turn.weight]))
        ticket += turn.cost
    release = backend.release("q", H)
    got = []
    for parked, _ in release.tasks:
        message = json.loads(parked.message)
        got.append((parked.ticket, parked.task_id, message.pop("fair")))
        assert message == json.loads(sent[parked.task_id]), "the rest of the message unchanged"
    assert got == expected
    assert {tag for _, _, (_, tag, _) in got} > {0} and {w for _, _, (_, _, w) in got} == {1, 2, 3}

    app = RecordingApp()
    epoch = release.epoch
    backend.unpark("q", [p.task_id for p, _ in release.tasks])
    good = json.dumps({"fair": [odd, 5, 3], "task": "t", "args": [], "kwargs": {}, "options": {"headers": {"a": 1}}})
    bad = good.replace("5, 3", "5, 0")  # weight 0
    assert backend.park("q", epoch, [ParkedTask(ticket, "good", good), ParkedTask(ticket + 1, "bad", bad)])
    assert release_due(app, IntervalQueue("q", interval=I / 1e6, backend=backend), H, 0.0) == 1
    [(_, options)] = app.sent
    assert options["task_id"] == "good" and options["headers"] == {
        "a": 1, "siq_queue": "q", "siq_ticket": ticket, "siq_epoch": epoch,
        "siq_fair_key": odd, "siq_fair_tag": 5, "siq_fair_weight": 3,
    }  # fmt: skip
    assert backend.status("q").parked == 1, "the malformed one left parked"


class RecordingApp:
    """Stands in for a Celery app: release_due only calls send_task."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def send_task(self, name: str, args: Any = None, kwargs: Any = None, **options: Any) -> None:
        self.sent.append((name, options))


def test_a_malformed_fair_share_is_named() -> None:
    from siq_celery.tasks.parking import _readable

    base = {"task": "t", "args": [], "kwargs": {}, "options": {}}
    assert _readable(json.dumps({"fair": ["A", 0, 1000], **base}))["fair"] == ("A", 0, 1000)
    for share in (["A", 0], ["", 0, 1], ["A", -1, 1], ["A", 0, 1001], ["A", True, 1], ["A", 1.5, 1], "A"):
        with pytest.raises(ValueError, match="malformed fair share"):
            _readable(json.dumps({"fair": share, **base}))


# SQLite's lines in tables (backends/sqlite_kept.py): the same rule as the reference's, the
# smallest head and the finish tags found by index, and nothing kept of a key once served.


def sqlite_rows(store: Store) -> dict[str, int]:
    """The fair rows of this test's prefix, by table."""
    with sqlite3.connect(store.url.removeprefix("sqlite:///")) as conn:
        return {
            table: conn.execute(f"SELECT COUNT(*) FROM {table} WHERE prefix=?", (store.prefix,)).fetchone()[0]
            for table in ("siq_fair_vtime", "siq_fair_keys", "siq_fair_tasks")
        }


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
def test_sqlite_one_task_keys_leave_no_rows_once_served(store: Store) -> None:
    from siq_celery.backends import sqlite_kept as sqlite_store

    backend, keys = store.backend(), 10_000
    wide = 1  # 1 µs: the longest lookahead, 64 tickets
    for n in range(keys):
        backend.fair_park("q", f"k{n:05}", 1 + n % 3, [FairTask(f"t{n}", "{}", 1 + n % 2)], wide, "e1")
    assert sqlite_rows(store) == {"siq_fair_vtime": 0, "siq_fair_keys": keys, "siq_fair_tasks": keys}
    assert backend.status("q").parked == keys
    with sqlite3.connect(store.url.removeprefix("sqlite:///")) as conn:
        for sql in (sqlite_store.FAIR_SMALLEST, sqlite_store.FAIR_LARGEST_FINISH):
            plan = " ".join(row[-1] for row in conn.execute(f"EXPLAIN QUERY PLAN {sql}", ("p", "q")))
            assert "SEARCH siq_fair_keys USING COVERING INDEX siq_fair_keys_by_" in plan and "SCAN" not in plan
        for sql in (sqlite_store.FAIR_FORGET, sqlite_store.FAIR_FORGET_TAGS):
            plan = " ".join(row[-1] for row in conn.execute(f"EXPLAIN QUERY PLAN {sql}", ("p", "q", 0)))
            assert "SEARCH siq_fair_keys USING INDEX siq_fair_keys_by_finish" in plan and "SCAN" not in plan
    release = backend.release("q", H)
    assert [p.task_id for p, _ in release.tasks[:3]] == ["t0", "t1", "t2"]  # equal tags: by key
    hand_out_everything(store, backend)
    assert sqlite_rows(store) == {"siq_fair_vtime": 0, "siq_fair_keys": 0, "siq_fair_tasks": 0}
    status = backend.status("q")
    assert status.parked == keys and status.state.ticket == sum(1 + n % 2 for n in range(keys))


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
def test_sqlite_lines_follow_the_reference(store: Store) -> None:
    rng, reference = random.Random(7), DictFairLines()
    backend = store.backend()
    backend.fair_park("q", "x", 1, [], I, "e1")  # the state
    for step in range(60):
        with backend.transaction("q") as tx:
            lines = tx.fair_lines()
            for n in range(rng.randrange(4)):
                key, cost, weight = rng.choice("ABCDE"), rng.randint(1, 3), rng.randint(1, 4)
                for got in (reference, lines):
                    fair_push(got, key, f"{key}{step}-{n}", cost, weight)
            for _ in range(rng.randrange(4)):
                assert fair_next(lines) == fair_next(reference)
            assert (lines.vtime(), lines.smallest(), lines.largest_finish_tag()) == (
                reference.vtime(),
                reference.smallest(),
                reference.largest_finish_tag(),
            )
            for key in "ABCDE":
                assert (lines.head_tag(key), lines.finish_tag(key), lines.waiting(key)) == (
                    reference.head_tag(key),
                    reference.finish_tag(key),
                    reference.waiting(key),
                ), key
    while fair_next(reference) is not None:
        with backend.transaction("q") as tx:
            assert fair_next(tx.fair_lines()) is not None
    assert sqlite_rows(store) == {"siq_fair_vtime": 0, "siq_fair_keys": 0, "siq_fair_tasks": 0}


def test_a_task_still_parked_under_its_id_does_not_join_a_line(store: Store) -> None:
    """A task that comes back under its id (a retry, a call with its own ETA reaching a
    worker) while the releaser of its last run has not yet forgotten that run: a release
    would park it under that id, and the releaser's unpark by id would drop it. It does not
    join, and the caller is told (it sends it again later); once forgotten, it joins."""
    backend = store.backend()
    park(backend, "A", 0, 0)
    [(released, _)] = backend.release("q", H).tasks  # published, not yet forgotten
    refused = backend.fair_park("q", "A", 1, tasks("A", 0, 0), I, "e1")
    backend.release("q", H)  # another worker's release meanwhile
    backend.unpark("q", [released.task_id])  # the first releaser forgets what it published
    kept = backend.fair_backlog("q").tasks_waiting + len(backend.parked_tasks("q"))
    assert (refused, kept) == (["A0"], 0), f"refused {refused}, {kept} kept: lost unless the caller was told"
    assert backend.fair_park("q", "A", 1, tasks("A", 0, 0), I, "e1") == []
    assert [p.task_id for p, _ in backend.release("q", H).tasks] == ["A0"]


def test_tickets_that_never_start_do_not_hold_the_lookahead(store: Store) -> None:
    """A ticket handed out whose task never starts (revoked, expired, lost, a duplicate)
    keeps its place in the lookahead only until the newest ticket's slot is more than the
    outage span past (1 s here) with no start since; then the next lookahead goes out."""
    backend = store.backend()
    park(backend, "A", 0, AHEAD - 1)
    assert len(backend.release("q", H).tasks) == AHEAD  # handed out, then never started
    park(backend, "B", 0, 2)
    assert backend.release("q", H).tasks == []  # the lookahead is full
    store.clock.now_us += AHEAD * I + 900_000
    assert backend.release("q", H).tasks == []  # within the outage span: they may still come
    store.clock.now_us += 200_000
    assert [p.task_id for p, _ in backend.release("q", H).tasks] == ["B0", "B1", "B2"]


@pytest.mark.parametrize("limits, ahead", [({}, 64), ({"concurrency": 3}, 7)])
def test_the_lookahead_of_a_queue_without_spacing_is_bounded(store: Store, limits: dict[str, Any], ahead: int) -> None:
    """A queue with a concurrency cap or a quota and no interval spaces its slots 1 µs
    apart: it hands out at most 64 tickets ahead (with a cap, the cap and 4 more), not a
    quarter of a second of 1 µs slots, in fair order."""
    from siq_celery.types import Limits

    backend = store.backend()
    for key in "AB":
        backend.fair_park("q", key, 1, tasks(key, 0, 99), 1, "e1", limits=Limits(**limits))
    got = [p.task_id for p, _ in backend.release("q", H).tasks]
    assert len(got) == ahead and got[:4] == ["A0", "B0", "A1", "B1"]
