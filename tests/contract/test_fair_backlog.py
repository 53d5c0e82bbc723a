"""Who waits in a fair queue's lines, on every store (Backend.fair_backlog, and the counts in
the status): what siq status, siq top and the exporter show. The counts follow each push,
each promotion and a delete; the keys with the most waiting come first, ties by the smaller
key, as many as asked for. Pinned clock."""

from __future__ import annotations

import random
import sqlite3

import pytest

from siq_celery.backends.base import Backend
from siq_celery.parked import FairBacklog, FairTask
from siq_celery.rules import DictFairLines, fair_next, fair_push
from tests.conftest import Store
from tests.contract.test_fair_contract import AHEAD, H, I, park, tasks


def backlog_of(lines: DictFairLines, top: int) -> FairBacklog:
    """The reference: the lines' keys ranked in Python."""
    entries = [(key, len(line), lines.weights[key]) for key, line in lines.lines.items()]
    ranked = sorted(entries, key=lambda e: (-e[1], e[0]))[:top]
    return FairBacklog(len(entries), sum(len(line) for line in lines.lines.values()), tuple(ranked))


def start(store: Store, backend: Backend, held: dict[int, str], most: int) -> int:
    """Release (the heads are handed tickets up to the lookahead), then start up to ``most``
    of the tickets handed out, in order; how many started."""
    release = backend.release("q", H)
    held.update({p.ticket: p.task_id for p, _ in release.tasks})
    backend.unpark("q", [p.task_id for p, _ in release.tasks])
    started = 0
    while held and started < most:
        ticket = min(held)
        d = backend.start("q", ticket, release.epoch, task_id=held[ticket], interval_us=I, new_epoch="x")
        if d.authorized:
            del held[ticket]
            started += 1
        else:
            store.clock.now_us += d.wait_us
    return started


def counts(backend: Backend, queue: str = "q") -> tuple[int, int]:
    status = backend.status(queue)
    assert status is not None
    return status.fair_keys, status.fair_tasks


def test_the_counts_and_the_keys_with_most_waiting_after_pushes(store: Store) -> None:
    backend = store.backend()
    assert backend.fair_backlog("q") == FairBacklog()  # no state: nothing waits
    park(backend, "A", 0, 8)
    park(backend, "C", 0, 2)
    park(backend, "B", 0, 2, weight=2)
    park(backend, "D", 0, 0)
    park(backend, "A", 8, 9)  # A8 again (waits once), and A9
    expected = FairBacklog(4, 17, (("A", 10, 1), ("B", 3, 2), ("C", 3, 1), ("D", 1, 1)))
    assert backend.fair_backlog("q") == expected
    assert backend.fair_backlog("q", top=2) == FairBacklog(4, 17, expected.top[:2])
    assert backend.fair_backlog("q", top=0) == FairBacklog(4, 17)
    assert counts(backend) == (4, 17)
    assert backend.status("q").parked == 17  # the waiting tasks are parked without a ticket
    park(backend, "B", 3, 3, weight=3)  # a key's weight is its last push's
    assert backend.fair_backlog("q", top=2).top == (("A", 10, 1), ("B", 4, 3))
    with pytest.raises(ValueError, match="0 or more keys"):
        backend.fair_backlog("q", top=-1)


def test_ties_at_the_last_place_listed_go_to_the_smaller_keys(store: Store) -> None:
    """Redis lists members of equal score by member: the last ``top`` of its sorted set would
    hold the larger keys of a tie, which must not be the ones shown."""
    backend = store.backend()
    park(backend, "A", 0, 5)
    for key in ("F", "B", "E", "C"):
        park(backend, key, 0, 2)
    park(backend, "G", 0, 0)
    assert backend.fair_backlog("q", top=3).top == (("A", 6, 1), ("B", 3, 1), ("C", 3, 1))
    assert backend.fair_backlog("q", top=1).top == (("A", 6, 1),)
    assert [k for k, _, _ in backend.fair_backlog("q", top=5).top] == ["A", "B", "C", "E", "F"]
    assert [k for k, _, _ in backend.fair_backlog("q", top=100).top] == ["A", "B", "C", "E", "F", "G"]


def test_many_keys_rank_as_the_reference_does(store: Store) -> None:
    backend, reference, rng = store.backend(), DictFairLines(), random.Random(3)
    for n in range(300):
        key, weight = f"k{rng.randrange(120):03}", rng.randint(1, 5)
        backend.fair_park("q", key, weight, [FairTask(f"t{n}", "{}")], I, "e1")
        fair_push(reference, key, f"t{n}", 1, weight)
    for top in (0, 1, 7, 10, 50, 500):
        assert backend.fair_backlog("q", top=top) == backlog_of(reference, top), top


def test_promotions_take_their_tasks_off_the_counts(store: Store) -> None:
    """A release hands the heads tickets in fair order (a lookahead at a time): those tasks
    no longer wait in a line (they are parked under their tickets); a key whose line empties
    is no longer listed."""
    backend, reference, rng = store.backend(), DictFairLines(), random.Random(11)
    pushed = started = promoted_all = 0
    held: dict[int, str] = {}  # tickets handed out (released and published), not yet started
    for step in range(12):
        for _ in range(rng.randrange(3)):
            key, weight, n = rng.choice("ABCDE"), rng.randint(1, 3), rng.randint(1, 6)
            batch = tasks(f"{key}.", pushed, pushed + n - 1)
            backend.fair_park("q", key, weight, batch, I, "e1")
            for task in batch:
                fair_push(reference, key, task.task_id, 1, weight)
            pushed += n
        started += start(store, backend, held, 2)
        _, waiting = counts(backend)
        promoted = sum(len(line) for line in reference.lines.values()) - waiting
        for _ in range(promoted):  # the same fair order: the store's lines are the reference's
            assert fair_next(reference) is not None
        promoted_all += promoted
        assert backend.fair_backlog("q", top=3) == backlog_of(reference, 3), step
        assert counts(backend) == (len(reference.lines), waiting)
    assert promoted_all >= 20 and reference.lines, (promoted_all, pushed)  # promoted, and some still wait


def test_a_release_empties_the_lines_and_a_delete_forgets_them(store: Store) -> None:
    backend = store.backend()
    park(backend, "A", 0, 1)
    park(backend, "B", 0, 0)
    release = backend.release("q", H)
    assert len(release.tasks) == 3 <= AHEAD
    assert backend.fair_backlog("q") == FairBacklog()
    assert counts(backend) == (0, 0) and backend.status("q").parked == 3  # parked under their tickets
    park(backend, "C", 0, 9)
    assert backend.fair_backlog("q").keys_waiting == 1
    assert backend.delete("q")
    assert backend.fair_backlog("q") == FairBacklog()
    park(backend, "D", 0, 1)  # a new life starts with nothing but its own
    assert backend.fair_backlog("q") == FairBacklog(1, 2, (("D", 2, 1),))


def test_another_queue_and_a_reset_keep_their_own(store: Store) -> None:
    backend = store.backend()
    park(backend, "A", 0, 2)
    backend.fair_park("other", "Z", 4, tasks("Z", 0, 0), I, "e1")
    assert backend.fair_backlog("other") == FairBacklog(1, 1, (("Z", 1, 4),))
    backend.reset("q", None, "e2")  # a reset keeps the lines
    assert backend.fair_backlog("q") == FairBacklog(1, 3, (("A", 3, 1),))
    assert [st.fair_tasks for st in backend.statuses(["q", "other"])] == [3, 1]  # type: ignore[union-attr]


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
def test_sqlite_reads_the_most_waiting_in_one_index(store: Store) -> None:
    from siq_celery.backends import sqlite_kept as sqlite_store

    store.backend().fair_backlog("q")  # the schema
    with sqlite3.connect(store.url.removeprefix("sqlite:///")) as conn:
        for sql, args in ((sqlite_store.FAIR_WAITING, ("p", "q")), (sqlite_store.FAIR_MOST_WAITING, ("p", "q", 5))):
            plan = " ".join(row[-1] for row in conn.execute(f"EXPLAIN QUERY PLAN {sql}", args))
            assert "INDEX siq_fair_keys_by_waiting" in plan and "SCAN" not in plan and "B-TREE" not in plan, plan
