"""Fair shares through Celery (the declaration, the publish and the worker's top-up): an
IntervalTask with ``fair_key=`` on the plugin's store, in Celery's in-process worker, on
the pinned clock. The stores' part is tests/contract/test_fair_contract.py's."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from siq_celery import IntervalTask
from siq_celery.errors import ConfigurationError
from siq_celery.pytest_plugin import SiqStore, wired
from siq_celery.rules import FAIR_SCALE, fair_lookahead
from siq_celery.tasks import parking
from siq_celery.tasks.parking import release_fair
from siq_celery.testing import PinnedClock
from tests.conftest import Store

US = 1_000_000
#: Set by the first statement of the body of ``fair.call``.
BODY_BEGAN = threading.Event()


@pytest.fixture
def celery_app(celery_app: Any) -> Any:
    @celery_app.task(
        base=IntervalTask, interval="1s", interval_queue="api", name="fair.call", bind=True,
        fair_key=lambda args, kwargs: args[0], fair_weight={"gold": 2},
    )  # fmt: skip
    def call(self: Any, tenant: str, n: int) -> str:
        BODY_BEGAN.set()
        return f"{tenant}{n}"

    celery_app.conf.result_backend = "rpc://"
    return celery_app


def order(siq_store: SiqStore, celery_app: Any, results: list[Any]) -> list[str]:
    """The calls in the order of their tickets: the order the fair lines handed them out.
    (Celery's in-process worker on a pinned clock may start a ticket after the next one's
    slot, its head then late and overtaken, as any late head is.)"""
    done = {r.id: r.get(timeout=30) for r in results}
    return [done[row.task_id] for row in sorted(siq_store.starts("api"), key=lambda row: row.ticket)]


def test_a_tenant_behind_a_backlog_starts_within_the_lookahead(
    celery_app: Any, siq_store: SiqStore, siq_clock: PinnedClock, celery_worker: Any
) -> None:
    call = celery_app.tasks["fair.call"]
    results = [call.delay("A", n) for n in range(12)]
    queue = siq_store.queue("api")
    queue.pause()  # (so that no start hands A another ticket while B publishes)
    handed = siq_store.status("api").state.ticket  # A's lookahead (4 at 1 s), and tickets started since
    results += [call.delay("B", n) for n in range(3)]
    queue.resume(grace=0)
    release_fair(celery_app, call.siq_queue(), "test")
    started = order(siq_store, celery_app, results)
    first_b = started.index("B0")
    # B's first takes the next ticket, or the one after: A's head ties with B's (each of A's
    # first four was handed out as it was published, when A had no other work: V stayed 0),
    # and a tie goes to the smaller key
    assert first_b in (handed, handed + 1), started
    assert [t for t in started if t[0] == "B"] == ["B0", "B1", "B2"]
    assert [t for t in started if t[0] == "A"] == [f"A{n}" for n in range(12)]
    assert started[first_b : first_b + 6 : 2] == ["B0", "B1", "B2"], started  # then one in two
    rows = sorted(siq_store.starts("api"), key=lambda row: row.start_us)
    assert sorted(r.ticket for r in rows) == list(range(1, 16))
    assert all(b.start_us - a.start_us >= US for a, b in itertools.pairwise(rows))  # the spacing


def test_the_release_that_follows_a_start_is_made_after_the_body_began(
    celery_app: Any, siq_store: SiqStore, celery_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A provider counts a request when the body makes it: the start's fair release (a store
    # round trip, a publish per ticket handed out) is made beside the body, not before it.
    # Here the release waits for the body: made before it, it would wait in vain (5 s).
    seen: list[bool] = []
    real = parking.release_fair

    def release(app: Any, queue: Any, who: str) -> None:
        if threading.current_thread().name == "siq-fair-release":
            seen.append(BODY_BEGAN.wait(timeout=5))
        real(app, queue, who)

    monkeypatch.setattr(parking, "release_fair", release)
    BODY_BEGAN.clear()
    assert celery_app.tasks["fair.call"].delay("A", 1).get(timeout=30) == "A1"
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == [True], "the start's release came before its body" if seen else "no release after the start"


def test_weights_share_the_slots(celery_app: Any, siq_store: SiqStore, celery_worker: Any) -> None:
    call = celery_app.tasks["fair.call"]
    queue = siq_store.queue("api")
    queue.ensure(1.0)
    queue.pause()  # every tenant has work before the first ticket is handed out
    results = [call.delay(tenant, n) for n in range(12) for tenant in ("gold", "B", "C")]
    queue.resume(grace=0)
    release_fair(celery_app, call.siq_queue(), "test")  # (a worker's upkeep would, within a second)
    started = order(siq_store, celery_app, results)
    assert [sum(t.startswith("gold") for t in started[i : i + 4]) for i in range(0, 24, 4)] == [2] * 6, started


@pytest.mark.parametrize(
    "options, error",
    [
        ({"fair_key": "tenant"}, "fair_key= takes a callable"),
        ({"fair_key": lambda a, k: a[0], "fair_weight": {"A": 0}}, "fair_weight of 'A' is 0"),
        ({"fair_key": lambda a, k: a[0], "fair_weight": 3}, "fair_weight= takes a mapping or a callable"),
    ],
)
def test_a_bad_declaration_fails_when_the_task_is_defined(celery_app: Any, options: dict[str, Any], error: str) -> None:
    with pytest.raises(ConfigurationError, match=error):

        @celery_app.task(base=IntervalTask, interval="1s", name="fair.bad", shared=False, **options)
        def bad(tenant: str) -> None: ...

        celery_app.tasks["fair.bad"]


@pytest.mark.parametrize("key", ["", "x" * 201, "tab\there"])
def test_a_bad_key_fails_at_the_publish_with_nothing_written(celery_app: Any, siq_store: SiqStore, key: str) -> None:
    call = celery_app.tasks["fair.call"]
    with pytest.raises(ConfigurationError, match=r"a key is printable text of 1 to 200 characters"):
        call.delay(key, 1)
    assert siq_store.backend.status("api") is None


def test_a_call_with_its_own_countdown_keeps_its_time_and_joins_its_line(
    celery_app: Any, siq_store: SiqStore, siq_clock: PinnedClock, celery_worker: Any
) -> None:
    """A countdown (a caller's, a retry's) is a time, which the fair lines do not hand out:
    such a call waits in the broker with no ticket until then, then joins its key's line
    and starts in fair order."""
    call = celery_app.tasks["fair.call"]
    sent = time.monotonic()
    late = call.apply_async(("A", 99), countdown=1)
    status = siq_store.status("api")  # (the worker made the queue, announcing its interval)
    assert status is None or (status.state.ticket, status.fair_tasks) == (0, 0)  # no ticket, not in a line yet
    assert late.get(timeout=30) == "A99"
    assert time.monotonic() - sent >= 1.0  # Celery held it to its ETA (the host's clock)
    [row] = siq_store.starts("api")
    assert (row.ticket, row.fair_key, row.fair_tag) == (1, "A", 0)  # handed its ticket in fair order


@pytest.fixture
def any_store(celery_app: Any, store: Store) -> Iterator[SiqStore]:
    """``celery_app`` on each store of the contract suite, on its pinned clock."""
    with wired(celery_app, store.url, store.clock) as wired_store:
        yield wired_store


def test_one_keys_own_eta_calls_leave_the_other_keys_their_share(any_store: SiqStore, celery_app: Any) -> None:
    """100 calls of key A with their own countdown (as its retries are published) beside 20
    of key B: A's take no tickets at their publish (there they filled the lookahead, and B
    waited for all of A's); each joins A's line when it reaches the worker, so B's first
    start is within the lookahead and its 20 alternate with A's."""
    from celery.contrib.testing.worker import start_worker

    call = celery_app.tasks["fair.call"]
    ahead = fair_lookahead(US)
    with start_worker(celery_app, perform_ping_check=False, shutdown_timeout=30):
        results = [call.apply_async(("A", n), countdown=0) for n in range(100)]
        queue = any_store.queue("api")
        queue.pause()  # (so that no start hands A another ticket while B publishes)
        status = any_store.status("api")
        handed = status.state.ticket if status is not None else 0
        current = status.state.current if status is not None else 0
        assert handed - current <= ahead, f"{handed - current} tickets handed out ahead of the starts, not {ahead}"
        results += [call.delay("B", n) for n in range(20)]
        queue.resume(grace=0)
        release_fair(celery_app, call.siq_queue(), "test")
        done = {r.id: r.get(timeout=60) for r in results}
    tickets = {done[row.task_id]: row.ticket for row in any_store.starts("api")}
    assert sorted(tickets) == sorted([f"A{n}" for n in range(100)] + [f"B{n}" for n in range(20)])
    assert tickets["B0"] <= handed + 2, (handed, tickets["B0"])  # the next ticket, or the one after on a tie
    assert tickets["B19"] <= handed + 60, (handed, tickets["B19"])
    assert [tickets[f"B{n}"] for n in range(20)] == sorted(tickets[f"B{n}"] for n in range(20))


@pytest.mark.celery(task_always_eager=True)
def test_eager_apply_many_of_a_fair_task_runs_each_call_here(celery_app: Any, siq_store: SiqStore) -> None:
    results = celery_app.tasks["fair.call"].apply_many([("A", n) for n in range(3)])
    assert [r.get() for r in results] == ["A0", "A1", "A2"]
    assert siq_store.backend.fair_backlog("api").tasks_waiting == 0


def test_apply_many_puts_each_call_in_its_keys_line(
    celery_app: Any, siq_store: SiqStore, siq_clock: PinnedClock, celery_worker: Any
) -> None:
    call = celery_app.tasks["fair.call"]
    results = call.apply_many([("A", n) for n in range(12)], chunk_size=5)
    queue = siq_store.queue("api")
    queue.pause()  # (so that no start hands A another ticket while B publishes)
    handed = siq_store.status("api").state.ticket
    results += call.apply_many([("B", n) for n in range(3)])
    queue.resume(grace=0)
    release_fair(celery_app, call.siq_queue(), "test")
    started = order(siq_store, celery_app, results)
    assert started.index("B0") <= handed + 1, started
    assert [t for t in started if t[0] == "A"] == [f"A{n}" for n in range(12)]
    assert [t for t in started if t[0] == "B"] == ["B0", "B1", "B2"]


def test_each_start_records_its_key_tag_and_weight(celery_app: Any, siq_store: SiqStore, celery_worker: Any) -> None:
    """The release gives each task its fair share in headers (the promotion's: the tag the
    fair order served it at, its key's weight), and the worker's start writes them to the
    ledger: in ticket order the tags never go down while keys have work (the audit's
    check), and each key's own go up by at least its share of a slot."""
    call = celery_app.tasks["fair.call"]
    queue = siq_store.queue("api")
    queue.pause()  # every call waits in its key's line first (published one by one on a loaded
    # host, each could be served before the next came: the lines empty, and every tag is 0)
    results = [call.delay(tenant, n) for n in range(6) for tenant in ("gold", "B")]
    queue.resume(grace=0)
    release_fair(celery_app, call.siq_queue(), "test")
    done = {r.id: r.get(timeout=30) for r in results}
    rows = siq_store.starts("api")
    assert sorted(done[r.task_id] for r in rows) == sorted(done.values())
    assert [(r.fair_key, r.fair_weight) for r in rows] == [
        (done[r.task_id].rstrip("0123456789"), 2 if done[r.task_id].startswith("gold") else 1) for r in rows
    ]
    assert rows[0].fair_tag == 0 and max(r.fair_tag for r in rows) > 0, "served at virtual times"
    assert [r.ticket for r in rows] == list(range(1, 13))
    for a, b in itertools.pairwise(rows):
        assert b.fair_tag >= a.fair_tag or b.fair_tag == 0, rows  # 0: the lines emptied, time starts over
    for key, weight in (("gold", 2), ("B", 1)):
        tags = [r.fair_tag for r in rows if r.fair_key == key]
        assert all(b - a >= FAIR_SCALE // weight or b == 0 for a, b in itertools.pairwise(tags)), (key, tags)


def test_a_call_still_parked_from_its_last_run_joins_once_its_releaser_forgot_it(
    celery_app: Any, siq_store: SiqStore, celery_worker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A call that comes back under its id (a retry) while its last run is still parked
    (published, its releaser not yet done: its unpark by id would drop the new entry) does
    not join then: the worker sends it again a moment later, and it joins and runs once."""
    from siq_celery.parked import ParkedTask

    call = celery_app.tasks["fair.call"]
    queue = siq_store.queue("api")
    queue.ensure(1.0)
    epoch = siq_store.status("api").state.epoch
    assert siq_store.backend.park("api", epoch, [ParkedTask(1, "again", "{}")])  # its last run, being released
    caplog.set_level(logging.DEBUG, logger="siq_celery")
    result = call.apply_async(("A", 7), task_id="again", countdown=0)
    deadline = time.monotonic() + 10
    while "still parked from its last run" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.05)  # the worker finds it parked: sent again, a second later
    assert "still parked from its last run" in caplog.text
    assert siq_store.backend.fair_backlog("api").tasks_waiting == 0 and not siq_store.starts("api")
    siq_store.backend.unpark("api", ["again"])  # the releaser forgets its last run
    assert result.get(timeout=30) == "A7"
    [row] = siq_store.starts("api")
    assert (row.task_id, row.fair_key) == ("again", "A")


def test_apply_many_with_a_countdown_puts_each_call_in_its_line_at_its_time(
    celery_app: Any, siq_store: SiqStore, celery_worker: Any
) -> None:
    """``apply_many`` with a countdown of its own, as ``apply_async``: no tickets at the
    publish; each call joins its key's line when it reaches the worker."""
    call = celery_app.tasks["fair.call"]
    results = call.apply_many([("A", n) for n in range(3)], countdown=0)
    assert [r.get(timeout=30) for r in results] == ["A0", "A1", "A2"]
    rows = sorted(siq_store.starts("api"), key=lambda row: row.ticket)
    assert [(row.ticket, row.fair_key) for row in rows] == [(1, "A"), (2, "A"), (3, "A")]  # handed out by the line
